"""Which kernel runs each layer, chosen once per layer from what this machine can do.

What can run is fixed per machine (the CPU's instruction sets, what our C++ kernels were
built with, torch's thread count: `Capabilities`) and per layer (dtype, bits, shape), so
each layer's kernel is chosen once, when the layer is built, from an ordered list of
candidates, each saying whether it can run the layer (vLLM's `choose_mp_linear_kernel`).
What depends on the step (its row count, whether it carries prompt tokens) stays a cheap
per-step choice among what the chosen kernel holds (`LinearKernel.step_kernel`).

    quantized linear  (choose_linear_kernel):
        AMX tiles > linear_bf16 + linear_i16 > linear_i16 > int8 GEMV | our int4 | torch's int4
    prefill spans     (choose_span_attention):
        torch's fused attention (AMX) > span_attention (AVX512-BF16) > rows of decode attention

Each threshold keeps its reason in one line; the measurements behind them are in
docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from tokenyard import platforms
from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.kernels.cpu.constants import (
    KERNEL_AMX,
    KERNEL_I8,
    KERNEL_I16,
    KERNEL_PAIRS,
    SPAN_HEAD_DIMS,
    SPAN_MAX_GROUP,
)


@dataclass(frozen=True)
class Capabilities:
    """What the kernel choice looks at: the CPU, what our C++ kernels were built with ("ops":
    built at all; "i16", "vnni", "amx", "pairs", "span": their availability flags; empty
    where they are not built), and torch's intra-op threads."""

    cpu: platforms.CpuInfo
    built: frozenset[str]
    threads: int

    @property
    def kernels(self) -> bool:
        return "ops" in self.built


@functools.cache
def _built(ops: ModuleType | None) -> frozenset[str]:
    if ops is None:
        return frozenset()
    flags = {
        "i16": ops.i16_available,
        "vnni": ops.i16_vnni,
        "amx": ops.amx_available,  # built with AMX and the tiles granted by the kernel
        "pairs": ops.pairs_available,
        "span": ops.span_available,
    }
    return frozenset({"ops"} | {name for name, available in flags.items() if available()})


def capabilities() -> Capabilities:
    """This machine's, now (the thread count is read at each call)."""
    return Capabilities(platforms.cpu(), _built(cpu_kernels.ops()), torch.get_num_threads())


# --- what each kernel family needs of the machine --------------------------------------


def i16_kernel(dtype: torch.dtype, caps: Capabilities) -> bool:
    """Whether layers of this dtype can run linear_i16 (int16 activations): fp32 on x86 CPUs
    with AVX2 but neither AVX-512 nor native bf16 (15-bit activations through vpmaddwd beat
    the fp32 paths at every row count); bf16 on AVX512-BF16 CPUs without AMX whose kernels
    have the AVX512-VNNI tile (a Zen 4), for small steps. fp32 layers on AVX-512 CPUs keep
    their own paths: unmeasured against this one."""
    if not caps.kernels:
        return False
    if dtype == torch.bfloat16:
        return caps.cpu.avx512_bf16 and not caps.cpu.amx and "vnni" in caps.built
    return (
        dtype == torch.float32
        and not caps.cpu.avx512
        and not caps.cpu.native_bf16
        and "i16" in caps.built
    )


def amx_kernel(dtype: torch.dtype, caps: Capabilities) -> bool:
    """Whether layers of this dtype can run linear_amx: bf16 on CPUs with AMX where our
    kernels are built with it and Linux grants the tiles (and the VNNI tile, for the few
    decode rows that take linear_i16)."""
    return dtype == torch.bfloat16 and caps.cpu.amx and "amx" in caps.built and "vnni" in caps.built


def pairs_kernel(dtype: torch.dtype, caps: Capabilities) -> bool:
    """Whether bf16 layers can keep their dense copy in pack_pairs' layout for linear_bf16
    (vdpbf16ps over register tiles): where i16_kernel takes bf16 layers and it is built."""
    return dtype == torch.bfloat16 and i16_kernel(dtype, caps) and "pairs" in caps.built


def own_int4_kernel(caps: Capabilities) -> bool:
    """Whether int4 layers take our int4 kernel's layout (Q4_1 nibbles, fp32 scales and
    zeros) rather than torch's: without native bf16 (torch's kernel converts activations to
    bf16 in software) and on AVX512-BF16 without AMX (ours has bf16 dot products); AMX CPUs
    and Arm keep torch's, faster there or without a bf16 path of ours."""
    cpu = caps.cpu
    fits = not cpu.native_bf16 or (cpu.avx512_bf16 and not cpu.amx)
    return fits and caps.kernels


def int4_activation_bits() -> int:
    """What int4 layers on linear_i16's layout quantize their activations to: 16 bits, one
    scale per row (the default), or 8 bits per group of 32 (linear_i8, llama.cpp's Q8_1)
    where TOKENYARD_INT4_ACTIVATIONS=int8: faster, but coarser (docs/precision.md)."""
    choice = os.environ.get("TOKENYARD_INT4_ACTIVATIONS", "int16")
    if choice not in ("int8", "int16"):
        raise ValueError(f"TOKENYARD_INT4_ACTIVATIONS must be int8 or int16, got {choice!r}")
    return 8 if choice == "int8" else 16


# --- thresholds: rows per step above which a layer's dense copy wins ----------------------

# By bits, for the dense copy's dtype, the kernel it beats, and torch's thread count: each
# is where the two crossed over SmolLM2's projection shapes (docs/benchmarks.md).
DENSE_ABOVE_ROWS = {
    "bf16_native": {8: 8, 4: 12},  # bf16 dense against torch's int4 (Arm with bf16)
    "bf16_native_one_thread": {8: 8, 4: 6},
    "bf16_own_int4": {8: 8, 4: 12},  # against our int4 kernel's bf16 path (AVX512-BF16)
    "bf16_own_int4_one_thread": {8: 8, 4: 8},
    "bf16_i16": {8: 16, 4: 24},  # oneDNN's bf16 against linear_i16's VNNI tile (Zen 4)
    "bf16_i16_one_thread": {8: 12, 4: 14},
    "bf16_pairs": {8: 7, 4: 7},  # linear_bf16 against linear_i16 (Zen 4)
    "bf16_pairs_one_thread": {8: 5, 4: 5},
    "bf16_amx": {8: 3, 4: 4},  # oneDNN's AMX matmul against torch's int4 / int8 GEMV
    "bf16_amx_one_thread": {8: 3, 4: 7},
    "fp32": {8: 8, 4: 14},  # fp32 dense against the weight-only kernels (AVX-512)
    "fp32_avx2": {8: 32, 4: 32},  # against our int8 and int4 kernels (AVX2 only)
    "bf16_emulated": {8: 64, 4: 64},  # emulated bf16 loses at every decode batch: prefill only
}

# AMX CPUs' bf16 layers: decode steps of up to this many rows run linear_i16, bigger ones
# linear_amx, whose widening of the weights costs more than a few rows' arithmetic
# (docs/benchmarks.md).
AMX_I16_ROWS = {8: 2, 4: 4}


def dense_above_rows(bits: int, dense_dtype: torch.dtype, pairs: bool, caps: Capabilities) -> int:
    """The row count above which a layer uses its dense copy; `pairs`: the copy is in
    pack_pairs' layout for linear_bf16."""
    one_thread = "_one_thread" if caps.threads == 1 else ""
    if pairs:
        return DENSE_ABOVE_ROWS["bf16_pairs" + one_thread][bits]
    if dense_dtype == torch.float32:
        return DENSE_ABOVE_ROWS["fp32" if caps.cpu.avx512 else "fp32_avx2"][bits]
    if not caps.cpu.native_bf16:
        return DENSE_ABOVE_ROWS["bf16_emulated"][bits]
    if caps.cpu.amx:
        kernel = "bf16_amx"
    elif i16_kernel(torch.bfloat16, caps):
        kernel = "bf16_i16"
    else:
        kernel = "bf16_own_int4" if own_int4_kernel(caps) else "bf16_native"
    return DENSE_ABOVE_ROWS[kernel + one_thread][bits]


# --- the linear layers' choice -----------------------------------------------------------


@dataclass(frozen=True)
class LinearSpec:
    """What the choice needs to know of a layer."""

    dtype: torch.dtype  # the weights' and activations' dtype
    bits: int  # 8 or 4
    blocks: bool  # in_features whole groups of 32 and out_features blocks of 16 (int4_fits)
    keep_dense: bool  # a dense copy may be kept for big steps (not in deterministic mode)


@dataclass(frozen=True)
class LinearKernel:
    """What one quantized layer runs, chosen once (choose_linear_kernel)."""

    name: str  # the candidate that took the layer
    # How the quantized weight is stored: "i16" (pack_i16), "i8" (pack_i8: int4 against 8-bit
    # activations), "q4_1" (our int4 kernel's), "torch_int4" (torch's), "int8" ([out, in]).
    layout: str
    # The dense copy kept for big steps: "plain" (torch's or oneDNN's matmul), "pairs"
    # (pack_pairs' layout, linear_bf16), or None (the quantized kernel runs every step).
    dense: str | None
    dense_above: int  # steps of more rows (or any prompt step) take the dense copy
    # AMX layers: decode steps of more rows than this (and prompt steps) run linear_amx, the
    # others linear_i16; None: not an AMX layer.
    amx_above: int | None = None

    @property
    def blocked(self) -> bool:
        """The weights are in linear_i16's (or linear_i8's) blocked layout."""
        return self.layout in ("i16", "i8")

    def dense_step(self, rows: int, prompt: bool) -> bool:
        """Whether a step of `rows` rows takes the dense copy. A prompt step always does: a
        prompt's rows then take the same path whether they come as one cold prefill or as
        the short tail after a prefix-cache hit (with bf16 activations the two paths'
        roundings flipped a near-tied greedy answer)."""
        return self.dense is not None and (rows > self.dense_above or prompt)

    def weight_kernel(self, rows: int, prompt: bool) -> int | None:
        """The C++ kernel (a KERNEL_* code) a step on the quantized weights runs; None for
        layouts that take the int8 GEMV, our int4 kernel or torch's."""
        if not self.blocked:
            return None
        if self.amx_above is not None and (rows > self.amx_above or prompt):
            return KERNEL_AMX
        return KERNEL_I8 if self.layout == "i8" else KERNEL_I16

    def step_kernel(self, rows: int, prompt: bool) -> int | None:
        """The C++ kernel a step runs (a KERNEL_* code), or None where torch's matmul (the
        plain dense copy) or the layout's own path runs it."""
        if self.dense_step(rows, prompt):
            return KERNEL_PAIRS if self.dense == "pairs" else None
        return self.weight_kernel(rows, prompt)


def _blocked_layout(layer: LinearSpec) -> str:
    """linear_i16's layout, or linear_i8's for int4 where 8-bit activations are asked for."""
    return "i8" if layer.bits == 4 and int4_activation_bits() == 8 else "i16"


def _plain(layer: LinearSpec) -> str | None:
    return "plain" if layer.keep_dense else None


def amx_linear(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """linear_amx for every step but a few decode rows (linear_i16), no dense copy: oneDNN's
    bf16 matmul on the same tiles reads two bytes a weight and lost at decode sizes, tied at
    prompt sizes. Without a dense copy allowed (deterministic mode) every step takes
    linear_amx: a row's result then never depends on the step's size."""
    if not (layer.blocks and amx_kernel(layer.dtype, caps)):
        return None
    above = AMX_I16_ROWS[layer.bits] if layer.keep_dense else 0
    dense_above = dense_above_rows(layer.bits, layer.dtype, False, caps)
    return LinearKernel("amx", "i16", None, dense_above, amx_above=above)


def pairs_linear(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """linear_i16 for small steps, the dense copy in pack_pairs' layout through linear_bf16
    above (it beat oneDNN's bf16 matmul at every size measured)."""
    if not (layer.keep_dense and layer.blocks and pairs_kernel(layer.dtype, caps)):
        return None
    dense_above = dense_above_rows(layer.bits, layer.dtype, True, caps)
    return LinearKernel("pairs", _blocked_layout(layer), "pairs", dense_above)


def i16_linear(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """linear_i16: fp32 layers at every row count with no dense copy (a nibble per int4
    weight where the fp32 copy took four bytes); bf16 layers up to the dense threshold,
    oneDNN's matmul on their dense copy above."""
    if not (layer.blocks and i16_kernel(layer.dtype, caps)):
        return None
    dense = _plain(layer) if layer.dtype == torch.bfloat16 else None
    dense_above = dense_above_rows(layer.bits, layer.dtype, False, caps)
    return LinearKernel("i16", _blocked_layout(layer), dense, dense_above)


def int8_gemv(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """int8 weights [out, in]: our GEMV (16 rows a call) where built, torch's int8 kernel
    elsewhere; the dense copy above the threshold."""
    if layer.bits != 8:
        return None
    dense_above = dense_above_rows(8, layer.dtype, False, caps)
    return LinearKernel("int8_gemv", "int8", _plain(layer), dense_above)


def own_int4(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """Our int4 kernel, in Q4_1's layout (see own_int4_kernel)."""
    if layer.bits != 4 or not own_int4_kernel(caps):
        return None
    dense_above = dense_above_rows(4, layer.dtype, False, caps)
    return LinearKernel("own_int4", "q4_1", _plain(layer), dense_above)


def torch_int4(layer: LinearSpec, caps: Capabilities) -> LinearKernel | None:
    """torch's CPU int4 kernel (fast with bf16 activations only: rows are cast to bf16)."""
    if layer.bits != 4:
        return None
    dense_above = dense_above_rows(4, layer.dtype, False, caps)
    return LinearKernel("torch_int4", "torch_int4", _plain(layer), dense_above)


# In order of preference: the first that can run a layer takes it.
LINEAR_KERNELS = (amx_linear, pairs_linear, i16_linear, int8_gemv, own_int4, torch_int4)


def choose_linear_kernel(layer: LinearSpec, caps: Capabilities | None = None) -> LinearKernel:
    """The first of LINEAR_KERNELS that can run `layer` on this machine (or on `caps`')."""
    if layer.bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {layer.bits}")
    caps = capabilities() if caps is None else caps
    for candidate in LINEAR_KERNELS:
        kernel = candidate(layer, caps)
        if kernel is not None:
            return kernel
    raise AssertionError("torch's kernels take every int4 and int8 layer")


# --- prefill spans' attention --------------------------------------------------------------

SDPA = "sdpa"  # torch's fused attention (F.scaled_dot_product_attention), on AMX tiles
SPAN_ATTENTION = "span_attention"  # our kernel for spans (AVX512-BF16 without AMX)

# Prefill spans of at least this many rows (prompt spans at any length, so that a prompt's
# tail after a prefix-cache hit attends as its cold prefill did) leave decode attention for
# the span kernel chosen; shorter spans of a draft's tokens to verify stay, faster there
# (docs/benchmarks.md).
SDPA_MIN_ROWS = 16


def span_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether span_attention takes a model of these heads (the C++ checks the same
    constants)."""
    return (
        head_dim in SPAN_HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads <= SPAN_MAX_GROUP
    )


def sdpa_spans(pool_dtype: torch.dtype, heads: tuple[int, int, int], caps: Capabilities) -> bool:
    """torch's fused attention: on AMX tiles, beside a bf16 pool or an fp8 one whose keys and
    values are widened to bf16 for it."""
    return pool_dtype in (torch.bfloat16, torch.float8_e4m3fn) and caps.cpu.amx


def span_attention_spans(
    pool_dtype: torch.dtype, heads: tuple[int, int, int], caps: Capabilities
) -> bool:
    """span_attention: a bf16 pool on AVX512-BF16 without AMX (where torch's fused attention
    runs far slower in bf16), for the models it takes."""
    return (
        pool_dtype == torch.bfloat16
        and not caps.cpu.amx
        and "span" in caps.built
        and span_fits(*heads)
    )


# In order of preference; where none can, a span's rows attend as rows of decode attention.
SPAN_KERNELS = ((SDPA, sdpa_spans), (SPAN_ATTENTION, span_attention_spans))


@functools.cache
def choose_span_attention(
    pool_dtype: torch.dtype, heads: tuple[int, int, int], caps: Capabilities
) -> str | None:
    """Where a CPU step's prefill spans attend beside a pool of `pool_dtype`, for a model of
    `heads` (query heads, KV heads, head_dim): SDPA, SPAN_ATTENTION, or None (as rows)."""
    for name, can_run in SPAN_KERNELS:
        if can_run(pool_dtype, heads, caps):
            return name
    return None
