"""Weight-only quantization: each path of a quantized layer computes what its weights say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenyard import platforms
from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.models import kernel_choice as kc
from tokenyard.models import quantize as q
from tokenyard.models.quantize import QuantizedLinear, dequantized, quantize


@pytest.fixture(autouse=True)
def no_i16(request, monkeypatch):
    """The tests below pin the paths of CPUs other than AVX2-only ones, where fp32 layers
    would take the int16-activation kernel, and other than AMX ones, where bf16 layers would
    take linear_amx; the `i16` and `amx` tests at the end turn them on."""
    if not {"i16", "i16_policy"} & set(request.fixturenames):
        monkeypatch.setattr(kc, "i16_kernel", lambda dtype, caps: False)
    if "amx" not in request.fixturenames:
        monkeypatch.setattr(kc, "amx_kernel", lambda dtype, caps: False)


def _cpu(monkeypatch, flags=None, add=(), remove=()) -> None:
    """This process's CPU as one with `flags` (by default its own), plus `add`, less `remove`."""
    base = platforms.cpu().flags if flags is None else frozenset(flags)
    cpu = platforms.CpuInfo((base | set(add)) - set(remove))
    monkeypatch.setattr(platforms, "cpu", lambda: cpu)


def _caps(flags) -> kc.Capabilities:
    """This machine's kernels and threads on a CPU of `flags`."""
    return kc.Capabilities(
        platforms.CpuInfo(frozenset(flags)), kc.capabilities().built, torch.get_num_threads()
    )


def _linear(out_features=48, in_features=64, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("bits, max_rel", [(8, 0.01), (4, 0.1)])
def test_quantized_linear_matches_float_within_quantization_error(bits, max_rel):
    linear = _linear()
    layer = QuantizedLinear(linear, bits)
    x = torch.randn(5, 64)
    exact = linear(x)
    small = layer(x)  # 5 rows: the weight-only kernel
    assert small.dtype == x.dtype
    assert (small - exact).norm() / exact.norm() < max_rel
    # the kernel computes exactly its dequantized weight times x (up to bf16 activations)
    assert torch.allclose(small, x @ dequantized(layer).T + linear.bias, atol=2e-2)
    # a step of many rows takes the dense weight: the float result, bit for bit
    big = torch.randn(layer.kernel.dense_above + 1, 64)
    assert torch.equal(layer(big), linear(big))


def test_int4_reproduces_weights_already_on_its_grid():
    """A Q4_1-style weight (scale * q + offset per 32) comes back exactly."""
    torch.manual_seed(1)
    levels = torch.randint(0, 16, (16, 64)).float()
    levels[:, ::32] = 0  # every group spans the full 0..15 range
    levels[:, 1::32] = 15
    scale = torch.rand(16, 2, 1) * 0.01 + 0.001
    offset = -torch.rand(16, 2, 1) * 0.05
    w = (levels.view(16, 2, 32) * scale + offset).view(16, 64)
    linear = nn.Linear(64, 16, bias=False)
    linear.weight.data = w.to(torch.bfloat16).float()  # what bf16 scales can represent
    on_grid = (dequantized(QuantizedLinear(linear, 4)) - w).abs().max()
    assert on_grid < 0.01 * w.abs().max()  # bf16 rounding of scale, offset and output only
    linear.weight.data = linear.weight.data + torch.rand(16, 64) * 0.004  # off the grid
    off_grid = (dequantized(QuantizedLinear(linear, 4)) - linear.weight).abs().max()
    assert off_grid > 2 * on_grid


def test_int8_kernel_and_torch_fallback_agree(monkeypatch):
    if cpu_kernels.ops() is None:
        pytest.skip("CPU kernels not built here")
    layer = QuantizedLinear(_linear(bias=False), 8)
    x = torch.randn(3, 64)
    with_kernel = layer(x)
    monkeypatch.setattr(q.cpu_kernels, "ops", lambda: None)
    assert (layer(x) - with_kernel).abs().max() < 2e-2  # torch's kernel takes bf16 activations


def test_without_dense_copy_big_steps_stay_quantized():
    linear = _linear(bias=False)
    layer = QuantizedLinear(linear, 8, keep_dense=False)
    assert layer.dense is None
    x = torch.randn(40, 64)
    assert torch.allclose(layer(x), x @ dequantized(layer).T, atol=2e-2)


def test_quantize_swaps_every_linear_and_keeps_lm_head_int8():
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.ReLU(), nn.Linear(32, 40)))
    model.lm_head = nn.Linear(32, 64, bias=False)
    quantize(model, "int4")
    assert isinstance(model[0], QuantizedLinear) and model[0].bits == 4
    assert (
        isinstance(model[1][1], QuantizedLinear) and model[1][1].bits == 8
    )  # 40 rows: not int4-packable
    assert model.lm_head.bits == 8
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="divisible"):
        QuantizedLinear(nn.Linear(48, 8), 4)


def test_quantized_output_projection_keeps_fp32_logits():
    """bf16 activations in, fp32 logits out: the int8 accumulators are not rounded to bf16."""
    linear = _linear(out_features=64, in_features=64, bias=False).to(torch.bfloat16)
    layer = QuantizedLinear(linear, 8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    logits = q.fp32_linear(layer, x)
    assert logits.dtype == torch.float32
    exact = x.float() @ (layer.qweight.float() * layer.scales[:, None]).T
    if cpu_kernels.ops() is not None:
        assert torch.allclose(logits, exact, atol=1e-4)
        assert not torch.equal(logits, logits.bfloat16().float())  # more than bf16's 8 bits
    # a dense output projection gives its result upcast
    assert q.fp32_linear(linear, x).dtype == torch.float32


def test_fp8_stores_e4m3_with_per_channel_scales():
    linear = _linear(out_features=48, in_features=64)
    with torch.no_grad():
        linear.weight[0] *= 100  # one loud channel must not cost the others their precision
    model = quantize(nn.Sequential(linear), "fp8")
    layer = model[0]
    assert isinstance(layer, q.Fp8Linear)
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scales.shape == (48,)
    # every channel uses e4m3's full range: its largest weight maps to 448
    assert torch.allclose(layer.qweight.float().abs().amax(dim=1), torch.full((48,), 448.0))
    w = linear.weight.detach()
    rel = ((dequantized(layer) - w).abs().amax(dim=1) / w.abs().amax(dim=1)).max()
    assert rel <= 2**-4  # e4m3: 3 mantissa bits, half a step of relative error at most
    x = torch.randn(5, 64)
    assert torch.allclose(layer(x), x @ dequantized(layer).T + linear.bias, atol=1e-5)
    assert layer.quantized_bytes() == 48 * 64 + 48 * 4  # one byte a weight, no dense copy


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(nn.Sequential(_linear()), "fp4")


@pytest.mark.parametrize("bits", [8, 4])
def test_without_dense_copy_each_row_is_computed_on_its_own(bits):
    """Deterministic mode's premise: with no dense copy a quantized layer runs one kernel at
    every row count, and a row's result does not depend on the other rows (bit for bit)."""
    linear = _linear(out_features=64, in_features=64).to(torch.bfloat16)
    layer = QuantizedLinear(linear, bits, keep_dense=False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    batch = layer(x)
    for i in range(40):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1]), i
    for rows in (1, 7, 17, 33):
        assert torch.equal(layer(x[:rows]), batch[:rows])
    if bits == 8:
        logits = q.fp32_linear(layer, x)
        assert all(
            torch.equal(q.fp32_linear(layer, x[i : i + 1]), logits[i : i + 1]) for i in range(40)
        )


def test_deterministic_mode_needs_a_row_wise_kernel():
    from tokenyard.engine.config import EngineConfig

    EngineConfig(dtype="bfloat16", quantization="int4", deterministic=True)
    for quantization in (None, "fp8"):
        with pytest.raises(ValueError, match="deterministic mode needs"):
            EngineConfig(dtype="bfloat16", quantization=quantization, deterministic=True)


@pytest.mark.parametrize(
    ("kernel", "flags", "own"),
    [
        ("bf16_native", {"bf16"}, False),  # Arm: torch's int4 kernel
        ("bf16_own_int4", {"avx512_bf16"}, True),  # AVX512-BF16: ours
        ("bf16_amx", {"avx512_bf16", "amx_bf16"}, False),  # AMX: torch's int4, AMX dense
    ],
)
def test_the_int4_dense_switch_follows_the_thread_count_and_the_cpu(
    monkeypatch, kernel, flags, own
):
    _cpu(monkeypatch, flags)
    assert platforms.cpu().native_bf16
    monkeypatch.setattr(kc, "own_int4_kernel", lambda caps: own)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = QuantizedLinear(_linear().to(torch.bfloat16), 4)
        torch.set_num_threads(2)
        two = QuantizedLinear(_linear().to(torch.bfloat16), 4)
    finally:
        torch.set_num_threads(before)
    one_above, two_above = one.kernel.dense_above, two.kernel.dense_above
    assert one_above == kc.DENSE_ABOVE_ROWS[kernel + "_one_thread"][4]
    assert two_above == kc.DENSE_ABOVE_ROWS[kernel][4]
    # without AMX a second thread speeds the dense matmul less than the int4 kernel; with
    # AMX the other way round (the 30 layers at 1 row: dense 19 -> 10 ms, int4 5.8 -> 3.5)
    if kernel == "bf16_amx":
        assert one_above > two_above
    else:
        assert one_above < two_above
    assert one.own_int4 == two.own_int4 == own


def test_our_int4_kernel_is_chosen_by_the_cpus_bf16_instructions():
    if cpu_kernels.ops() is None:
        pytest.skip("the CPU kernels are not built here")
    for flags, ours in [
        (set(), True),  # no native bf16: ours in fp32
        ({"avx512_bf16"}, True),
        ({"avx512_bf16", "amx_bf16"}, False),
        ({"bf16"}, False),
    ]:
        assert platforms.CpuInfo(frozenset(flags)).native_bf16 is bool(flags)
        assert kc.own_int4_kernel(_caps(flags)) is ours, flags


def test_the_dense_switch_follows_the_dense_copys_dtype_and_the_cpu(monkeypatch):
    _cpu(monkeypatch, add={"avx512f"})
    fp32 = QuantizedLinear(_linear().float(), 4)
    assert fp32.kernel.dense_above == kc.DENSE_ABOVE_ROWS["fp32"][4]
    _cpu(monkeypatch, remove={"avx512f"})
    # AVX2: our int8 kernel beats the fp32 matmul up to 32 rows (the output projection)
    int8 = QuantizedLinear(_linear().float(), 8)
    assert int8.kernel.dense_above == 32 > kc.DENSE_ABOVE_ROWS["fp32"][8]
    _cpu(monkeypatch, remove={"avx512f"} | platforms.NATIVE_BF16_FLAGS)
    emulated = QuantizedLinear(_linear().to(torch.bfloat16), 4)
    # an emulated bf16 matmul loses to int4 at every decode batch: only prefill steps use it
    above = emulated.kernel.dense_above
    assert above > fp32.kernel.dense_above
    x = torch.randn(above, emulated.in_features, dtype=torch.bfloat16)
    # at the threshold itself the int4 kernel still runs; one row more takes the dense copy
    assert torch.equal(emulated(x), emulated._quantized_mm(x) + emulated.bias)
    more = torch.randn(above + 1, emulated.in_features, dtype=torch.bfloat16)
    assert torch.equal(emulated(more), F.linear(more, emulated.dense, emulated.bias))


def test_auto_dtype_follows_the_device_and_the_cpu(monkeypatch):
    import tokenyard.engine.config as config

    _cpu(monkeypatch, {"avx2", "avx512f"})
    assert config.EngineConfig(dtype="auto").dtype == "float32"
    assert config.auto_dtype("cuda") == "bfloat16"
    _cpu(monkeypatch, {"avx2", "avx512f", "avx512_bf16"})
    assert config.EngineConfig(dtype="auto").dtype == "bfloat16"


def test_native_bf16_is_read_from_the_cpu_flags():
    for flags, native in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True)):
        assert platforms.native_bf16_in(f"processor\t: 0\nflags\t\t: {flags}\n") is native
    text = "processor\t: 0\nflags\t\t: fpu avx2 fma\n"
    assert platforms.flags_in(text) == {"fpu", "avx2", "fma"}
    assert platforms.flags_in("no flags here") == set()


needs_bf16_packing = pytest.mark.skipif(
    not q.mkldnn_packs_bf16(), reason="oneDNN has no bf16 linear on this CPU (AVX2 only)"
)


@needs_bf16_packing
@pytest.mark.parametrize("bits", [4, 8])
def test_a_prepacked_dense_copy_gives_the_same_results_to_the_bit(bits):
    linear = _linear(bias=False).to(torch.bfloat16)
    plain = QuantizedLinear(linear, bits)
    packed = QuantizedLinear(linear, bits)
    assert packed.prepack() and packed.dense.is_mkldnn
    assert not packed.prepack()  # once is enough
    above = plain.kernel.dense_above
    for rows in (1, above, above + 1, 32, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(x), plain(x)), rows
    x3 = torch.randn(2, 20, 64, dtype=torch.bfloat16)  # a batch of sequences: any leading dims
    assert torch.equal(packed(x3), plain(x3))
    assert torch.equal(q.fp32_linear(packed, x3[0]), q.fp32_linear(plain, x3[0]))


def test_an_fp32_dense_copy_is_packed_only_on_avx2_cpus(monkeypatch):
    _cpu(monkeypatch, add={"avx512f"})
    assert not QuantizedLinear(_linear(bias=False), 4).prepack()  # MKL's fp32 is kept there
    _cpu(monkeypatch, remove={"avx512f"})
    plain = QuantizedLinear(_linear(bias=False), 4)
    packed = QuantizedLinear(_linear(bias=False), 4)
    assert packed.prepack() and packed.dense.is_mkldnn
    for rows in (plain.kernel.dense_above + 1, 32, 300):  # the dense path; fewer run int4
        x = torch.randn(rows, 64)
        y = packed(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 48)
        torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64)
    assert torch.equal(packed(x), plain(x))  # the int4 kernel: the packed copy is not read


def test_nothing_is_packed_where_onednn_has_no_bf16_linear(monkeypatch):
    monkeypatch.setattr(q, "mkldnn_packs_bf16", lambda: False)
    layer = QuantizedLinear(_linear(bias=False).to(torch.bfloat16), 4)
    assert not layer.prepack() and not layer.dense.is_mkldnn
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), QuantizedLinear(_linear(bias=False).to(torch.bfloat16), 4)(x))


@needs_bf16_packing
def test_only_a_bf16_dense_copy_on_the_cpu_is_packed():
    assert not QuantizedLinear(_linear(bias=False), 8).prepack()  # fp32: left as it is
    assert not QuantizedLinear(_linear().to(torch.bfloat16), 8).prepack()  # a bias
    no_dense = QuantizedLinear(_linear(bias=False).to(torch.bfloat16), 8, keep_dense=False)
    assert not no_dense.prepack()
    model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 64, bias=False))
    model.to(torch.bfloat16)
    model.lm_head = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    quantize(model, "int4")
    assert q.prepack(model) == 3


@pytest.fixture
def own_int4(monkeypatch):
    """int4 layers built in our kernel's layout, whatever this CPU would choose."""
    if cpu_kernels.ops() is None:
        pytest.skip("CPU kernels not built here")
    monkeypatch.setattr(kc, "own_int4_kernel", lambda caps: True)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_our_int4_kernel_and_its_torch_twin_agree(own_int4, monkeypatch, dtype, tol):
    layer = QuantizedLinear(_linear(out_features=48, in_features=96, bias=False), 4, False)
    assert layer.own_int4 and layer.qweight.dtype == torch.uint8
    # 19: two chunks of 8 rows and three more; 1 and 2: the bf16 path's two-chain loop, over
    # 3 groups (an odd count: a tail group)
    xs = [torch.randn(rows, 96).to(dtype) for rows in (19, 2, 1)]
    with_kernel = [layer(x) for x in xs]
    assert all(y.dtype == dtype for y in with_kernel)
    monkeypatch.setattr(q.cpu_kernels, "ops", lambda: None)
    for x, y in zip(xs, with_kernel, strict=True):
        twin = layer(x)
        assert (twin.float() - y.float()).abs().max().item() < tol
        assert torch.allclose(twin.float(), x.float() @ layer.int4_weight().T, atol=tol)


def test_our_int4_layout_keeps_a_q4_1_weight_exactly(own_int4):
    """Our layout keeps fp32 scales and zeros: a weight already on a Q4_1 grid comes back
    to fp32 rounding, and each row's result does not depend on the other rows."""
    torch.manual_seed(2)
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every group spans 0..15
    scale, offset = torch.rand(32, 2, 1) * 0.01 + 0.001, -torch.rand(32, 2, 1) * 0.05
    w = (levels.view(32, 2, 32) * scale + offset).view(32, 64)
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data = w
    layer = QuantizedLinear(linear, 4, keep_dense=False)
    assert (layer.int4_weight() - w).abs().max() < 1e-6
    for x in (torch.randn(20, 64), torch.randn(20, 64).bfloat16()):  # both activation paths
        batch = layer(x)
        assert all(torch.equal(layer(x[i : i + 1]), batch[i : i + 1]) for i in range(20))
        assert torch.equal(layer(x[3:5]), batch[3:5])  # a chunk of two: the two-chain loop


def test_our_int4_kernel_refuses_a_malformed_layout(own_int4):
    ops = cpu_kernels.ops()
    qweight = torch.zeros(16, 32, dtype=torch.uint8)  # K = 64: two groups
    scales, zeros = torch.ones(16, 2), torch.zeros(16, 2)
    assert ops.int4_linear(torch.ones(3, 64), qweight, scales, zeros).shape == (3, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.int4_linear(torch.ones(3, 63), qweight, scales, zeros)
    with pytest.raises(RuntimeError, match="scale and zero"):
        ops.int4_linear(torch.ones(3, 64), qweight, scales[:, :1].contiguous(), zeros)
    with pytest.raises(RuntimeError, match="qweight must be"):
        ops.int4_linear(torch.ones(3, 64), qweight.to(torch.int8), scales, zeros)


def _built(kernel: str, reason: str) -> pytest.MarkDecorator:
    """Skip unless our kernels are built here and `kernel()` (an availability flag) says so."""
    ops = cpu_kernels.ops()
    return pytest.mark.skipif(ops is None or not getattr(ops, kernel)(), reason=reason)


def _i16_for(monkeypatch, dtype: torch.dtype) -> None:
    """Layers of `dtype`, and only those, take the int16-activation kernel."""
    monkeypatch.setattr(kc, "i16_kernel", lambda d, caps: d == dtype)


needs_i16 = _built("i16_available", "the int16-activation kernel needs our kernels built with AVX2")


@pytest.fixture
def i16(monkeypatch):
    _i16_for(monkeypatch, torch.float32)


@pytest.fixture
def i16_policy():
    """The CPU's own choice of the int16-activation kernel, not pinned."""


@needs_i16
@pytest.mark.parametrize("bits", [4, 8])
def test_the_int16_activation_kernel_computes_its_dequantized_weight(i16, bits):
    """Every row count (one 4-row tile, its 1-3-row tails, a second 64-row panel) gives the
    dequantized weight times x to int16 rounding of the activations, with no dense copy."""
    linear = _linear(out_features=96, in_features=128, bias=True)
    layer = QuantizedLinear(linear, bits)
    # int4 a nibble per weight, int8 a byte: [blocks of 16 outputs, groups, pairs, bytes]
    assert layer.kernel.blocked and layer.dense is None
    assert layer.qweight.shape == (6, 4, 16, 16 if bits == 4 else 32)
    w = dequantized(layer)
    assert (w - linear.weight).abs().max() < (0.02 if bits == 8 else 0.15)  # its own grid
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 37, 70):  # tiles of 4 (AVX2), 16 (VNNI)
        x = torch.randn(rows, 128) * 3
        y = layer(x)
        exact = x.double() @ w.double().T + linear.bias.double()
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        err = ((y - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item()
        assert err < 2e-4, (rows, err)  # 15-bit activations: ~1e-5 per product
    # the dense float layer agrees to quantization error only
    x = torch.randn(8, 128)
    assert (layer(x) - linear(x)).norm() / linear(x).norm() < (0.01 if bits == 8 else 0.1)


@needs_i16
@pytest.mark.parametrize("bits", [4, 8])
def test_the_int16_activation_kernel_computes_each_row_on_its_own(i16, bits):
    """Deterministic mode's premise, and prompt rows that come as a cold prefill or as the
    tail after a prefix hit: a row's result does not depend on the other rows, bit for bit."""
    layer = QuantizedLinear(_linear(out_features=48, in_features=64, bias=False), bits)
    x = torch.randn(70, 64)
    x[5] *= 100  # a loud row must not change its neighbours' scales
    batch = layer(x)
    for i in range(70):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1]), i
    for lo, hi in ((0, 3), (3, 9), (60, 70)):
        assert torch.equal(layer(x[lo:hi]), batch[lo:hi])
    if bits == 8:  # the output projection's logits: the same fp32 values, not rounded
        assert torch.equal(q.fp32_linear(layer, x), batch)


@needs_i16
def test_the_int16_layout_keeps_a_q4_1_weight_and_round_trips(i16):
    torch.manual_seed(3)
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15
    scale, offset = torch.rand(32, 2, 1) * 0.01 + 0.001, -torch.rand(32, 2, 1) * 0.05
    w = (levels.view(32, 2, 32) * scale + offset).view(32, 64)
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data = w
    layer = QuantizedLinear(linear, 4)
    assert (layer.int4_weight() - w).abs().max() < 1e-6
    assert torch.equal(q.unpack_i16(layer.qweight).float(), levels)
    # a nibble per weight, fp32 scale and zero per group of 32: what a small step reads
    assert layer.quantized_bytes() == 32 * 64 // 2 + 2 * 32 * 2 * 4
    packed, scales, zeros = q.pack_i16(levels.to(torch.uint8), scale[..., 0], offset[..., 0])
    assert torch.equal(packed, layer.qweight) and zeros is not None
    assert torch.equal(q.unpack_i16_params(scales), scale[..., 0])


@needs_i16
def test_the_int16_activation_kernel_refuses_a_malformed_layout(i16):
    ops = cpu_kernels.ops()
    w4 = torch.zeros(2, 2, 16, 16, dtype=torch.uint8)  # N = 32, K = 64, int4 nibbles
    scales, zeros = torch.ones(2, 2, 16), torch.zeros(2, 2, 16)
    assert torch.equal(ops.linear_i16(torch.ones(3, 64), w4, scales, zeros), torch.zeros(3, 32))
    with pytest.raises(RuntimeError, match="x must be"):
        ops.linear_i16(torch.ones(3, 63), w4, scales, zeros)
    with pytest.raises(RuntimeError, match="scale and zero"):
        ops.linear_i16(torch.ones(3, 64), w4, scales[:, :1].contiguous(), zeros)
    with pytest.raises(RuntimeError, match="take a zero"):
        ops.linear_i16(torch.ones(3, 64), w4, scales, None)
    w8 = torch.zeros(2, 2, 16, 32, dtype=torch.int8)  # int8: a byte per weight
    assert torch.equal(ops.linear_i16(torch.ones(3, 64), w8, scales, None), torch.zeros(3, 32))
    with pytest.raises(RuntimeError, match="take a zero"):
        ops.linear_i16(torch.ones(3, 64), w8, scales, zeros)
    with pytest.raises(RuntimeError, match="qweight must be"):
        ops.linear_i16(torch.ones(3, 64), w4.view(2, 2, 8, 32), scales, zeros)
    with pytest.raises(RuntimeError, match="qweight must be"):  # int8 takes a byte a weight
        ops.linear_i16(torch.ones(3, 64), w4.to(torch.int8), scales, None)


def test_the_int16_activation_kernel_is_chosen_on_avx2_only_cpus(i16_policy, monkeypatch):
    if cpu_kernels.ops() is None or not cpu_kernels.ops().i16_available():
        pytest.skip("the int16-activation kernel needs our kernels built with AVX2")
    for avx512, bf16, chosen in [
        (False, False, True),  # AVX2 only: fp32 activations
        (True, False, False),  # AVX-512 without bf16: its own fp32 paths (unmeasured)
        (True, True, False),
    ]:
        flags = {"avx2"} | ({"avx512f"} if avx512 else set()) | ({"avx512_bf16"} if bf16 else set())
        assert kc.i16_kernel(torch.float32, _caps(flags)) is chosen, (avx512, bf16)
    vnni = bool(cpu_kernels.ops().i16_vnni())
    for flags, chosen in [
        ({"avx512f", "avx512_bf16"}, vnni),  # bf16 layers: where the VNNI tile is built
        ({"avx512f", "avx512_bf16", "amx_bf16"}, False),  # AMX: oneDNN's tiles and torch's int4
        ({"avx512f"}, False),  # no native bf16: bf16 layers are emulated, fp32 runs
    ]:
        assert kc.i16_kernel(torch.bfloat16, _caps(flags)) is chosen, flags
    _cpu(monkeypatch, {"avx2"})
    assert QuantizedLinear(_linear(bias=False), 4).kernel.blocked
    bf16 = QuantizedLinear(_linear(bias=False).to(torch.bfloat16), 4)
    assert not bf16.kernel.blocked  # no native bf16
    odd = QuantizedLinear(_linear(out_features=40, bias=False), 8)
    assert not odd.kernel.blocked  # not 16 outputs a block


needs_vnni = _built(
    "i16_vnni", "bf16 layers take the int16-activation kernel where it is built with AVX512-VNNI"
)


@pytest.fixture
def i16_bf16(monkeypatch):
    """A Zen 4's policy: bf16 layers take the int16 kernel for small steps (no AMX)."""
    _i16_for(monkeypatch, torch.bfloat16)
    _cpu(monkeypatch, remove={"amx_bf16"})


needs_pairs = _built("pairs_available", "linear_bf16 needs our kernels built with AVX512-BF16")


@needs_pairs
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 7])
def test_linear_bf16_sums_each_row_in_fp32(blocks):
    """linear_bf16 against float64 on the same bf16 operands, for every remainder of blocks a
    thread's run of three can leave and row counts across tiles and panels: fp32 sums (the
    bf16 output is exactly their rounding), and a row's result never depends on its
    neighbours."""
    ops = cpu_kernels.ops()
    torch.manual_seed(blocks)
    n, k = 16 * blocks, 96
    w = (torch.randn(n, k) * 0.2).to(torch.bfloat16)
    packed = q.pack_pairs(w)
    assert packed.shape == (blocks, k // 2, 16, 2) and torch.equal(q.unpack_pairs(packed), w)
    assert torch.equal(packed[0, 3, 5], w[5, 6:8])  # lane 5 of pair 3: output 5's inputs 6, 7
    x = (torch.randn(200, k) * 3).to(torch.bfloat16)  # 200: past a panel of 192 rows
    full = ops.linear_bf16(x, packed, True)
    exact = x.double() @ w.double().T
    assert full.dtype == torch.float32
    torch.testing.assert_close(
        full.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item()
    )
    assert torch.equal(ops.linear_bf16(x, packed, False), full.to(torch.bfloat16))
    for rows in (1, 5, 8, 9, 20, 37):
        assert torch.equal(ops.linear_bf16(x[:rows], packed, True), full[:rows]), rows
        assert torch.equal(ops.linear_bf16(x[-rows:], packed, True), full[-rows:]), rows


@needs_pairs
def test_linear_bf16_refuses_what_it_cannot_read():
    ops = cpu_kernels.ops()
    w = q.pack_pairs(torch.randn(32, 64).to(torch.bfloat16))
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.linear_bf16(x, w.float(), False)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.linear_bf16(x, w.view(2, 32, 8, 4), False)
    with pytest.raises(RuntimeError, match="bf16 activations"):
        ops.linear_bf16(x.float(), w, False)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.linear_bf16(x[:, :32], w, False)


@needs_vnni
@needs_pairs
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_layers_run_linear_i16_for_small_steps_and_linear_bf16_above(i16_bf16, bits):
    """A Zen 4's bf16 layer (the output projection's int8 too) keeps its dense copy in
    pack_pairs' layout, no second copy, and runs linear_bf16 on it above its threshold and for
    every prompt step, linear_i16 below; each row's result is its own, bit for bit."""
    linear = _linear(out_features=96, in_features=128, bias=False).to(torch.bfloat16)
    layer = QuantizedLinear(linear, bits)
    assert layer.kernel.blocked and layer.dense is None and layer.pairs is not None
    assert torch.equal(q.unpack_pairs(layer.pairs), linear.weight)
    table = "bf16_pairs" + ("_one_thread" if torch.get_num_threads() == 1 else "")
    above = layer.kernel.dense_above
    assert above == kc.DENSE_ABOVE_ROWS[table][bits]  # earlier tests may pin 1
    x = (torch.randn(above + 9, 128) * 3).to(torch.bfloat16)
    big = layer(x)
    ops = cpu_kernels.ops()
    assert torch.equal(big, ops.linear_bf16(x, layer.pairs, False))  # above: linear_bf16
    small = x[:above]
    y = layer(small)
    zeros = layer.zeros if bits == 4 else None
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ops.linear_i16(small, layer.qweight, layer.scales, zeros))  # below
    exact = small.double() @ dequantized(layer).double().T
    err = ((y.double() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item()
    assert err < 1e-2, err  # bf16 output rounding; the products are int16-exact
    for i in range(small.shape[0]):
        assert torch.equal(layer(small[i : i + 1]), y[i : i + 1]), i
    assert torch.equal(layer(small[:2], prompt=True), big[:2])  # prompt rows: the dense copy
    if bits == 8:  # the output projection's logits: the kernels' fp32 sums, either side
        assert torch.equal(q.fp32_linear(layer, x), ops.linear_bf16(x, layer.pairs, True))
        logits = q.fp32_linear(layer, small)
        assert logits.dtype == torch.float32
        assert torch.allclose(logits.double(), exact, rtol=1e-4, atol=1e-3 * exact.abs().max())


@needs_i16
def test_int4_against_8_bit_activations_is_a_choice(i16, monkeypatch):
    """TOKENYARD_INT4_ACTIVATIONS=int8: int4 layers round each group of 32 inputs to 8 bits
    (linear_i8). The result is q * scale times those rounded inputs plus zero times the exact
    inputs' sums (the zero term needs no rounding), and each row is computed on its own."""
    linear = _linear(out_features=96, in_features=128, bias=False)
    monkeypatch.setenv("TOKENYARD_INT4_ACTIVATIONS", "int16")
    layer16 = QuantizedLinear(linear, 4)
    monkeypatch.setenv("TOKENYARD_INT4_ACTIVATIONS", "int8")
    layer = QuantizedLinear(linear, 4)
    assert layer16.kernel.layout == "i16" and layer.kernel.layout == "i8"
    assert layer.qweight.shape == (6, 4, 8, 64)
    levels = q.unpack_i8(layer.qweight)
    assert torch.equal(levels, q.unpack_i16(layer16.qweight))  # the same grid, re-laid
    scale, zero = (q.unpack_i16_params(t) for t in (layer.scales, layer.zeros))
    x = torch.randn(70, 128)
    y = layer(x)
    groups = x.view(70, 4, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(groups / step) * step).view(70, 128).double()
    spread = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731  [N, G] -> [N, K]
    expected = rounded @ (levels.double() * spread(scale)).T + x.double() @ spread(zero).T
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    exact = x.double() @ dequantized(layer).double().T
    rel = ((y - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
    assert 1e-4 < rel < 0.03, rel  # coarser than the int16 path's ~1e-5
    for i in (0, 3, 4, 69):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1]), i
    with pytest.raises(RuntimeError, match="qweight must be"):
        cpu_kernels.ops().linear_i8(x, layer.qweight.view(6, 4, 16, 32), layer.scales, layer.zeros)
    monkeypatch.setenv("TOKENYARD_INT4_ACTIVATIONS", "int12")
    with pytest.raises(ValueError, match="int8 or int16"):
        QuantizedLinear(linear, 4)


needs_amx = _built(
    "amx_available", "linear_amx needs our kernels built with AMX and the tiles granted"
)


@pytest.fixture
def amx():
    """The CPU's own choice of linear_amx (bf16 layers on AMX CPUs), not pinned."""


def _amx_layer(bits: int, out_features: int = 48, keep_dense: bool = True) -> QuantizedLinear:
    linear = _linear(out_features=out_features, in_features=128, bias=False).to(torch.bfloat16)
    return QuantizedLinear(linear, bits, keep_dense=keep_dense)


def _amx_weight(layer: QuantizedLinear) -> torch.Tensor:
    """The weight AMX multiplies: int4 as q * scale + zero rounded to bf16 (the tile's
    dtype), int8 as q itself (exact in bf16), its scale applied to the sums."""
    w = dequantized(layer)
    return w.bfloat16().double() if layer.bits == 4 else w.double()


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_layers_compute_their_widened_weight(amx, bits):
    """Every row count (one 16-row tile and its tails, two tiles a pass, passes of 32 rows
    over blocks of outputs paired, an odd block count: 48 outputs) gives x times the weight
    AMX multiplies, with no dense copy; small decode steps take linear_i16."""
    layer = _amx_layer(bits)
    assert layer.kernel.name == "amx" and layer.kernel.blocked and layer.dense is None
    assert layer.kernel.amx_above == kc.AMX_I16_ROWS[bits]
    w = _amx_weight(layer)
    for rows in (1, 3, 5, 15, 16, 17, 31, 32, 33, 48, 70):
        x = (torch.randn(rows, 128) * 3).to(torch.bfloat16)
        exact = x.double() @ w.T
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
        err = ((y.double() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item()
        assert err < 8e-3, (rows, err)  # bf16 output rounding
        # prompt rows take AMX at any count: the same sums in fp32
        sums = layer._quantized_mm(x, fp32_out=True, prompt=True)
        err = ((sums.double() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item()
        assert sums.dtype == torch.float32 and err < 1e-5, (rows, err)
        if rows > layer.kernel.amx_above:
            assert torch.equal(y, sums.bfloat16())


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_prompt_steps_of_many_blocks_and_passes(amx, bits, threads):
    """With 9 blocks of outputs (4 pairs and one alone in steps of more than 32 rows) and 8
    groups, a thread runs several units and fetches the next one's weights ahead, at every
    pass count, on one thread and two: the sums stay x times the weight."""
    linear = _linear(out_features=144, in_features=256, bias=False).to(torch.bfloat16)
    layer = QuantizedLinear(linear, bits, keep_dense=False)
    assert layer.kernel.name == "amx"
    w = _amx_weight(layer)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (8, 32, 33, 64, 65, 100, 174):
            x = (torch.randn(rows, 256) * 3).to(torch.bfloat16)
            exact = x.double() @ w.T
            sums = layer._quantized_mm(x, fp32_out=True)
            err = ((sums.double() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max()
            assert err.item() < 1e-5, (rows, err.item())
            assert torch.equal(layer(x), sums.bfloat16())
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_layers_compute_each_row_on_its_own(amx, bits):
    """Deterministic mode (no dense copy asked for): every step takes linear_amx, and a row's
    result does not depend on the other rows, bit for bit; prompt steps of a few rows take
    it too, so a prompt's tail after a prefix hit rounds as a cold prefill does."""
    layer = _amx_layer(bits, keep_dense=False)
    assert layer.kernel.name == "amx" and layer.kernel.amx_above == 0
    x = (torch.randn(70, 128) * 3).to(torch.bfloat16)
    x[5] *= 100
    batch = layer(x)
    for i in (0, 5, 15, 16, 31, 32, 33, 69):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1]), i
    for lo, hi in ((0, 3), (3, 40), (60, 70)):
        assert torch.equal(layer(x[lo:hi]), batch[lo:hi])
    shipped = _amx_layer(bits)  # the same weights, linear_i16 for a few decode rows
    assert torch.equal(shipped(x[:3], prompt=True), batch[:3])
    if bits == 8:  # the output projection's logits: the fp32 sums, not rounded to bf16
        logits = q.fp32_linear(layer, x)
        assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), batch)
        assert not torch.equal(logits, batch.float())
        few = q.fp32_linear(shipped, x[:2])  # linear_i16's fp32 sums
        assert few.dtype == torch.float32 and torch.allclose(few, logits[:2], rtol=1e-3, atol=1e-3)


@needs_amx
def test_amx_is_chosen_for_bf16_layers_on_amx_cpus(amx):
    caps = kc.capabilities()
    assert kc.amx_kernel(torch.bfloat16, caps)
    chosen = kc.choose_linear_kernel(kc.LinearSpec(torch.bfloat16, 4, True, True), caps)
    assert chosen.name == "amx" and chosen.dense is None  # no dense copy
    assert not kc.amx_kernel(torch.float32, caps)
    fp32 = QuantizedLinear(_linear(bias=False), 4)
    assert fp32.kernel.name != "amx"
    odd = QuantizedLinear(_linear(out_features=40, bias=False).to(torch.bfloat16), 8)
    assert odd.kernel.name != "amx"  # not 16 outputs a block: the int8 GEMV, with a dense copy
    assert not kc.amx_kernel(torch.bfloat16, _caps(caps.cpu.flags - {"amx_bf16"}))


@needs_amx
def test_linear_amx_refuses_a_malformed_call(amx):
    ops = cpu_kernels.ops()
    w4 = torch.zeros(2, 2, 16, 16, dtype=torch.uint8)  # N = 32, K = 64, int4 nibbles
    scales, zeros = torch.ones(2, 2, 16), torch.zeros(2, 2, 16)
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    assert torch.equal(
        ops.linear_amx(x, w4, scales, zeros, False), torch.zeros(3, 32, dtype=torch.bfloat16)
    )
    with pytest.raises(RuntimeError, match="bf16 activations"):
        ops.linear_amx(x.float(), w4, scales, zeros, False)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.linear_amx(torch.ones(3, 63, dtype=torch.bfloat16), w4, scales, zeros, False)
    with pytest.raises(RuntimeError, match="take a zero"):
        ops.linear_amx(x, w4, scales, None, False)
    with pytest.raises(RuntimeError, match="qweight must be"):
        ops.linear_amx(x, w4.view(2, 2, 8, 32), scales, zeros, False)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_gate_up_silu_equals_the_two_kernels(amx, bits, threads):
    """linear_amx_silu gives silu_and_mul(linear_amx(x)) to the bit: 10 blocks of gate
    outputs and 10 of up (a thread pairs gate block b with up block b + 10, and fetches the
    next pair ahead), at every pass count, a single row included; gate_up_silu takes it only
    for AMX steps of more than SILU_FUSED_ABOVE rows."""
    ops = cpu_kernels.ops()
    linear = _linear(out_features=320, in_features=256, bias=False).to(torch.bfloat16)
    layer = QuantizedLinear(linear, bits)
    assert layer.kernel.name == "amx"
    qw, scales, zeros = layer.qweight, layer.scales, layer.zeros if bits == 4 else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 7, 32, 33, 64, 65, 100, 174):
            x = (torch.randn(rows, 256) * 3).to(torch.bfloat16)
            x[0] *= 40  # large gates: silu's saturation and the exp's range
            separate = ops.silu_and_mul(ops.linear_amx(x, qw, scales, zeros, False))
            fused = ops.linear_amx_silu(x, qw, scales, zeros)
            assert fused.shape == (rows, 160) and fused.dtype == torch.bfloat16
            assert torch.equal(fused, separate), rows
            chosen = q.gate_up_silu(layer, x, False)
            if rows > q.SILU_FUSED_ABOVE:
                assert chosen is not None and torch.equal(chosen, separate), rows
            else:
                assert chosen is None  # the projection, then silu_and_mul
    finally:
        torch.set_num_threads(before)
    fp32 = QuantizedLinear(_linear(out_features=320, in_features=256, bias=False), bits)
    assert q.gate_up_silu(fp32, torch.randn(40, 256), False) is None  # not an AMX layer
    assert q.gate_up_silu(linear, torch.randn(40, 256).bfloat16(), False) is None  # a float one
    with pytest.raises(RuntimeError, match="as many up blocks"):
        odd = QuantizedLinear(_linear(out_features=48, in_features=256, bias=False).bfloat16(), 4)
        ops.linear_amx_silu(x, odd.qweight, odd.scales, odd.zeros)
