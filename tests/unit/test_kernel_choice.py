"""The kernel each layer gets, on each kind of CPU given as data: the choices the quantized
layers and the attention made before the choice had one home (checked then against the old
functions over every combination of CPU kind, dtype, bits, shape and thread count)."""

from __future__ import annotations

import pytest
import torch

from tokenyard import platforms
from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.kernels.cpu import constants
from tokenyard.kernels.cpu.constants import KERNEL_AMX, KERNEL_I8, KERNEL_I16, KERNEL_PAIRS
from tokenyard.models import kernel_choice as kc
from tokenyard.models.kernel_choice import SDPA, SPAN_ATTENTION, LinearSpec

ALL_BUILT = {"ops", "i16", "vnni", "amx", "pairs", "span"}
# name: (CPU flags, what our kernels are built with there)
MACHINES = {
    "amx": (
        {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"},
        ALL_BUILT,
    ),
    "amx_tiles_refused": (
        {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"},
        ALL_BUILT - {"amx"},
    ),
    "zen4": ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, ALL_BUILT - {"amx"}),
    "avx512": ({"avx2", "avx512f"}, {"ops", "i16"}),
    "avx2": ({"avx2", "fma", "f16c"}, {"ops", "i16"}),
    "avx2_no_kernels": ({"avx2", "fma", "f16c"}, set()),
    "arm_bf16": ({"asimd", "bf16"}, {"ops"}),
}


def _caps(machine: str, threads: int = 2) -> kc.Capabilities:
    flags, built = MACHINES[machine]
    return kc.Capabilities(platforms.CpuInfo(frozenset(flags)), frozenset(built), threads)


BF16, FP32 = torch.bfloat16, torch.float32
QKV = dict(bits=4, blocks=True)  # a projection of SmolLM2: whole groups and blocks
LM_HEAD = dict(bits=8, blocks=True)  # the output projection: int8
ODD = dict(bits=8, blocks=False)  # out_features not a multiple of 16

# (machine, dtype, layer, keep_dense, threads) -> (name, layout, dense, dense_above, amx_above)
CHOICES = [
    ("amx", BF16, QKV, True, 2, ("amx", "i16", None, 4, 4)),
    ("amx", BF16, QKV, True, 1, ("amx", "i16", None, 7, 4)),
    ("amx", BF16, QKV, False, 2, ("amx", "i16", None, 4, 0)),  # deterministic: AMX always
    ("amx", BF16, LM_HEAD, True, 2, ("amx", "i16", None, 3, 2)),
    ("amx", BF16, ODD, True, 2, ("int8_gemv", "int8", "plain", 3, None)),
    ("amx", FP32, QKV, True, 2, ("torch_int4", "torch_int4", "plain", 14, None)),
    ("amx_tiles_refused", BF16, QKV, True, 2, ("torch_int4", "torch_int4", "plain", 4, None)),
    ("zen4", BF16, QKV, True, 2, ("pairs", "i16", "pairs", 7, None)),
    ("zen4", BF16, QKV, True, 1, ("pairs", "i16", "pairs", 5, None)),
    ("zen4", BF16, LM_HEAD, True, 2, ("pairs", "i16", "pairs", 7, None)),
    ("zen4", BF16, QKV, False, 2, ("i16", "i16", None, 24, None)),
    ("zen4", BF16, ODD, True, 2, ("int8_gemv", "int8", "plain", 16, None)),
    ("zen4", FP32, QKV, True, 2, ("own_int4", "q4_1", "plain", 14, None)),
    ("avx512", FP32, QKV, True, 2, ("own_int4", "q4_1", "plain", 14, None)),
    ("avx512", BF16, QKV, True, 2, ("own_int4", "q4_1", "plain", 64, None)),  # emulated bf16
    ("avx2", FP32, QKV, True, 2, ("i16", "i16", None, 32, None)),
    ("avx2", FP32, LM_HEAD, True, 2, ("i16", "i16", None, 32, None)),
    ("avx2", FP32, ODD, True, 2, ("int8_gemv", "int8", "plain", 32, None)),
    ("avx2", BF16, QKV, True, 2, ("own_int4", "q4_1", "plain", 64, None)),
    ("avx2_no_kernels", FP32, QKV, True, 2, ("torch_int4", "torch_int4", "plain", 32, None)),
    ("arm_bf16", BF16, QKV, True, 2, ("torch_int4", "torch_int4", "plain", 12, None)),
    ("arm_bf16", BF16, QKV, True, 1, ("torch_int4", "torch_int4", "plain", 6, None)),
]


@pytest.mark.parametrize("machine, dtype, layer, keep_dense, threads, expected", CHOICES)
def test_each_cpu_kind_chooses_the_kernel_it_chose_before(
    machine, dtype, layer, keep_dense, threads, expected
):
    spec = LinearSpec(dtype, layer["bits"], layer["blocks"], keep_dense)
    k = kc.choose_linear_kernel(spec, _caps(machine, threads))
    assert (k.name, k.layout, k.dense, k.dense_above, k.amx_above) == expected


# (machine, dtype, layer) -> the kernel of each (rows, prompt) step
STEPS = [
    # AMX: linear_i16 for up to 4 decode rows, linear_amx above and for any prompt step
    ("amx", BF16, QKV, {(1, False): KERNEL_I16, (4, False): KERNEL_I16, (5, False): KERNEL_AMX,
                        (1, True): KERNEL_AMX, (512, False): KERNEL_AMX}),
    ("amx", BF16, LM_HEAD, {(2, False): KERNEL_I16, (3, False): KERNEL_AMX}),
    # Zen 4: linear_i16 up to 7 rows, linear_bf16 on the dense copy above and for prompts
    ("zen4", BF16, QKV, {(7, False): KERNEL_I16, (8, False): KERNEL_PAIRS,
                         (1, True): KERNEL_PAIRS, (512, True): KERNEL_PAIRS}),
    # AVX2 only: linear_i16 at every size, prompt or not
    ("avx2", FP32, QKV, {(1, False): KERNEL_I16, (512, False): KERNEL_I16, (3, True): KERNEL_I16}),
    # torch's or our own kernels' paths and the dense copy: no C++ step kernel
    ("avx512", FP32, QKV, {(1, False): None, (100, False): None, (1, True): None}),
    ("amx", BF16, ODD, {(1, False): None, (4, False): None}),
]  # fmt: skip


@pytest.mark.parametrize("machine, dtype, layer, steps", STEPS)
def test_steps_take_the_chosen_kernels_by_rows_and_phase(machine, dtype, layer, steps):
    k = kc.choose_linear_kernel(
        LinearSpec(dtype, layer["bits"], layer["blocks"], True), _caps(machine)
    )
    assert {step: k.step_kernel(*step) for step in steps} == steps


def test_dense_steps_follow_the_threshold_and_the_prompt():
    k = kc.choose_linear_kernel(LinearSpec(FP32, 4, True, True), _caps("avx512"))
    assert not k.dense_step(14, False) and k.dense_step(15, False) and k.dense_step(1, True)
    gone = kc.choose_linear_kernel(LinearSpec(FP32, 4, True, False), _caps("avx512"))
    assert not gone.dense_step(1000, True)  # no dense copy kept: never


def test_int4_against_8_bit_activations_takes_linear_i8(monkeypatch):
    monkeypatch.setenv("TOKENYARD_INT4_ACTIVATIONS", "int8")
    k = kc.choose_linear_kernel(LinearSpec(FP32, 4, True, True), _caps("avx2"))
    assert k.layout == "i8" and k.step_kernel(1, False) == KERNEL_I8
    amx = kc.choose_linear_kernel(LinearSpec(BF16, 4, True, True), _caps("amx"))
    assert amx.layout == "i16"  # AMX layers keep int16 activations
    int8 = kc.choose_linear_kernel(LinearSpec(FP32, 8, True, True), _caps("avx2"))
    assert int8.layout == "i16"  # int8 weights too
    monkeypatch.setenv("TOKENYARD_INT4_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="int8 or int16"):
        kc.choose_linear_kernel(LinearSpec(FP32, 4, True, True), _caps("avx2"))


def test_only_int4_and_int8_are_chosen_for():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        kc.choose_linear_kernel(LinearSpec(FP32, 2, True, True), _caps("avx2"))


@pytest.mark.parametrize(
    "machine, pool, heads, expected",
    [
        ("amx", BF16, (9, 3, 64), SDPA),
        ("amx", torch.float8_e4m3fn, (9, 3, 64), SDPA),  # widened to bf16 for it
        ("amx", BF16, (9, 3, 32), SDPA),  # torch's kernel takes any heads
        ("amx", FP32, (9, 3, 64), None),
        ("zen4", BF16, (9, 3, 64), SPAN_ATTENTION),
        ("zen4", BF16, (8, 2, 128), SPAN_ATTENTION),
        ("zen4", BF16, (9, 3, 32), None),  # a head size span_attention does not take
        ("zen4", BF16, (27, 3, 64), None),  # 9 query heads per KV head: more than 8
        ("zen4", torch.float8_e4m3fn, (9, 3, 64), None),
        ("avx512", BF16, (9, 3, 64), None),  # not built without AVX512-BF16
        ("avx2", FP32, (9, 3, 64), None),
    ],
)
def test_prefill_spans_attend_where_each_cpu_kind_sent_them(machine, pool, heads, expected):
    assert kc.choose_span_attention(pool, heads, _caps(machine)) == expected


@pytest.mark.parametrize(
    "flags, kind",
    [
        (MACHINES["amx"][0], "amx"),
        (MACHINES["zen4"][0], "avx512_bf16"),
        (MACHINES["avx512"][0], "avx512"),
        (MACHINES["avx2"][0], "avx2"),
        (MACHINES["arm_bf16"][0], "other"),
    ],
)
def test_the_cpu_kind_and_its_tag_come_from_the_flags(flags, kind):
    cpu = platforms.CpuInfo(frozenset(flags))
    assert cpu.kind == kind
    assert cpu.tag() == platforms.CpuInfo(frozenset(flags)).tag()
    assert cpu.tag() != platforms.CpuInfo(frozenset(flags) | {"avx512_fp16"}).tag()


def test_this_machines_capabilities_are_read_from_the_cpu_and_the_build():
    caps = kc.capabilities()
    assert caps.cpu == platforms.cpu() and caps.threads == torch.get_num_threads()
    assert caps.kernels == (cpu_kernels.ops() is not None)


def test_the_constants_reach_the_header_and_the_build_name(monkeypatch):
    header = constants.header()
    assert f"constexpr int64_t kSiluFusedAbove = {constants.SILU_FUSED_ABOVE};" in header
    assert f"constexpr int64_t kKernelPairs = {KERNEL_PAIRS};" in header
    assert "head_dim == 64 || head_dim == 128" in header
    name = cpu_kernels._name(cpu_kernels._sources())
    monkeypatch.setattr(constants, "SILU_FUSED_ABOVE", constants.SILU_FUSED_ABOVE + 1)
    assert cpu_kernels._name(cpu_kernels._sources()) != name  # a changed number builds anew
    sources = cpu_kernels._sources()
    for header_file in cpu_kernels._HERE.glob("*.h"):
        assert header_file.read_text() in sources
