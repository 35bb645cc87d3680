"""Weight-only quantization, applied to a loaded model by swapping its Linear layers.

The model code stays plain single-device torch; `quantize(model, mode)` replaces each
projection with a quantized copy:

- "int8": int8 weights with one scale per output channel (symmetric, absmax / 127);
- "fp8": float8 e4m3 weights with one fp32 scale per output channel (absmax / 448, e4m3's
  largest finite value). A CPU has no fp8 matmul: each step upcasts the weight to the
  activations' dtype, so fp8 here is storage (half of bf16's bytes, no dense copy kept), not
  speed; on a GPU with fp8 tensor cores the same layout would feed them directly.
- "int4": int4 weights in groups of 32 input channels, each group with a scale and an
  offset (asymmetric). A GGUF Q4_1 tensor (the default model's format) is exactly this
  shape, so its weights come through unchanged but for bf16 rounding of scale and offset.
  The output projection (lm_head) stays int8: it is shared with the embeddings, which GGUF
  files keep at 8 bits or more.

Decoding is bound by the bytes of weights read per step, and torch's weight-only kernels
read fewer bytes, but on a CPU they are slower than a dense bf16 matmul once a step carries
more than a handful of rows. A quantized layer therefore keeps its dense weight too
(`keep_dense`, the default) and uses it for steps of more rows than `DENSE_ABOVE_ROWS`:
decode of a few sequences gets the bandwidth, prefill and big batches get the FLOPs. That
costs memory: the report counts both copies, and the tied lm_head reuses the embeddings.
CPUs with AVX2 but neither AVX-512 nor native bf16 are the exception (`i16_kernel`): there
int4 and int8 layers run an integer kernel at every row count and keep no dense copy. On
AVX512-VNNI CPUs without AMX, bf16 layers run that kernel for small steps instead of the
weight-only kernels, and keep their dense copy in the layout of our own bf16 GEMM
(`linear_bf16`, `pairs_kernel`), which runs every bigger step. On AMX CPUs bf16 layers keep
no dense copy either (`amx_kernel`): steps of a few decode rows run the same int16 kernel,
every other step `linear_amx`, which widens the int4 or int8 weights to bf16 tiles for AMX
to multiply.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.models.module import LeanModule

GROUP_SIZE = 32
MODES = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# Rows per step above which a layer's dense copy beats the weight-only kernel, by bits, for
# the dense copy's dtype and torch's thread count. Measured over SmolLM2's four projection
# shapes (a 30-layer model's weights, cold in cache) on 2-core AVX-512 machines:
# - bf16 dense against torch's int4 kernel where the CPU multiplies bf16 natively (measured
#   on avx512_bf16, before our kernel had a bf16 path; now the case of Arm): 12 rows on two
#   threads; on one thread (each worker of a two-worker stack) the int4 kernel loses from
#   about 8 rows (2.1 ms dense against 2.4 ms int4 at 8 rows, 1.4 against 1.2 at 4);
# - bf16 dense against our int4 kernel's bf16 path (AVX512-BF16, own_int4_kernel): int4
#   took 14.8 ms at 12 rows against 16.1 dense on two threads and tied at 16 (17.5 against
#   17.8), but in the engine a 16-sequence step ran 30-33 ms with the dense copy and 32-43
#   with int4, so 12; on one thread 17.3 against 19.5 at 8 rows, 26.5 against 22.4 at 12;
# - fp32 dense (`dtype="auto"` on CPUs without native bf16): int4 took 0.70x fp32's time at
#   14 rows and 1.03x at 16, on one thread; on a 2-core AVX2-only EPYC, int8 (the output
#   projection, 576 x 49,152) took 11.8 ms per 16 rows in our kernel against 40 ms for the
#   fp32 matmul at 16 rows and 51 ms at 32, and int4 in our kernel (own_int4_kernel) 34 ms
#   for the 30 layers at 16 rows and 66 ms at 32 against 50 and 72 ms for the packed fp32
#   matmul, so both keep their kernels up to 32 rows there;
# - bf16 dense on AMX (a 2-core Xeon with amx_bf16) against torch's int4 kernel: oneDNN's
#   AMX matmul took 9.8-10.2 ms for the 30 layers at 1-8 rows (a weight read) and 53 ms at
#   512; int4 3.5 ms at 1 row, 5.8 at 4, 10.3 at 5-8 on two threads; on one thread 5.8 at 1
#   row, 16.6 at 6, 19.7 at 8 against 19-20 dense. The output projection's int8 GEMV: 0.7 ms
#   at 1 row, 1.1 at 3, 1.4-1.8 at 4 against 1.2 dense; on one thread tied at 4 (2.4 ms);
# - bf16 dense against linear_i16's AVX512-VNNI tile (i16_kernel for bf16, a 2-core Zen 4
#   EPYC): int4 18.7 against 19.3 ms at 24 rows and tied at 32 (24.0 against 23.6); the output
#   projection's int8 2.9 against 3.2 ms at 16 rows, 5.7 against 5.4 at 32. On one thread int4
#   19.2 against 22.0 at 12 rows, tied at 16 (25.1 against 25.0); int8 tied at 16 (5.8 / 5.9);
# - linear_bf16 (our kernel on the dense copy in pack_pairs' layout, pairs_kernel) against
#   linear_i16's AVX512-VNNI tile, on a 2-core Zen 4 EPYC, int4: 7.1 against 6.5 ms at 6
#   rows, 7.2 against 7.9 at 8, 10.0 against 13.1 at 16, 17.4 against 23.8 at 32; on one
#   thread 9.6 against 7.7 at 4 rows, 8.8 against 9.9 at 6, 9.7 against 12.8 at 8. The
#   output projection (int8): 1.43 against 1.55 ms at 8 rows, 4.4 against 5.3 at 32;
# - bf16 dense emulated (no native bf16): slower than int4 at every decode batch measured
#   (9.2 ms against 3.3 ms at 32 rows), so only prefill-sized steps use it.
DENSE_ABOVE_ROWS = {
    "bf16_native": {8: 8, 4: 12},
    "bf16_native_one_thread": {8: 8, 4: 6},
    "bf16_own_int4": {8: 8, 4: 12},
    "bf16_own_int4_one_thread": {8: 8, 4: 8},
    "bf16_i16": {8: 16, 4: 24},
    "bf16_i16_one_thread": {8: 12, 4: 14},
    "bf16_pairs": {8: 7, 4: 7},
    "bf16_pairs_one_thread": {8: 5, 4: 5},
    "bf16_amx": {8: 3, 4: 4},
    "bf16_amx_one_thread": {8: 3, 4: 7},
    "fp32": {8: 8, 4: 14},
    "fp32_avx2": {8: 32, 4: 32},
    "bf16_emulated": {8: 64, 4: 64},
}


def dense_above_rows(
    bits: int, dense_dtype: torch.dtype = torch.bfloat16, pairs: bool = False
) -> int:
    """The row count above which a layer uses its dense copy, for torch's thread count now;
    `pairs`: the copy is in pack_pairs' layout for linear_bf16 (see pairs_kernel)."""
    from tokenyard.engine.config import cpu_has_amx, cpu_has_avx512, cpu_has_native_bf16

    one_thread = "_one_thread" if torch.get_num_threads() == 1 else ""
    if pairs:
        return DENSE_ABOVE_ROWS["bf16_pairs" + one_thread][bits]
    if dense_dtype == torch.float32:
        return DENSE_ABOVE_ROWS["fp32" if cpu_has_avx512() else "fp32_avx2"][bits]

    if not cpu_has_native_bf16():
        return DENSE_ABOVE_ROWS["bf16_emulated"][bits]
    if cpu_has_amx():
        kernel = "bf16_amx"
    elif i16_kernel(torch.bfloat16):
        kernel = "bf16_i16"
    else:
        kernel = "bf16_own_int4" if own_int4_kernel() else "bf16_native"
    return DENSE_ABOVE_ROWS[kernel + one_thread][bits]


# Rows per decode step up to which an AMX CPU's bf16 layers run linear_i16 (int16 activations,
# AVX512-VNNI) rather than linear_amx, by bits. On a 2-core Xeon with AMX, SmolLM2's four
# projection shapes as 120 distinct int4 layers: linear_i16 4.3 ms at 1 row, 5.9 at 4, 10.4 at
# 8; linear_amx 6.8-7.1 ms at 1 to 16 rows (widening the weights is most of it), 8.1 at 32,
# 11.0 at 64, 23 at 174 and 60 at 512, against 11.5-13.6 ms for oneDNN's AMX matmul of the
# dense bf16 weights at 1 to 32 rows, 15.0 at 64, 22.6 at 174 and 55 at 512. The output
# projection (int8, 576 x 49,152): linear_i16 1.7 ms at 1 row, 2.0 at 4, 2.5 at 8; linear_amx
# 1.9-2.0 at 1 to 16 rows, 3.4 at 32, 3.9 at 64; dense 2.7 at 1 to 16, 3.3 at 32, 3.6 at 64.
AMX_I16_ROWS = {8: 2, 4: 4}


# The row count oneDNN picks a packed layout for: a mid-size decode batch (any count runs).
PREPACK_ROWS = 32

_step = threading.local()


def prompt_step_active() -> bool:
    """Whether this thread's current step holds prompt tokens (see prompt_step)."""
    return getattr(_step, "prompt", False)


@contextlib.contextmanager
def prompt_step(active: bool) -> Iterator[None]:
    """Within: the step carries prompt tokens, and every quantized layer with a dense copy
    uses it whatever the row count. A prompt's rows then take the same path whether they
    come as one cold prefill or as the short tail after a prefix-cache hit (which the row
    count alone would send through the weight-only kernel): with bf16 activations the two
    paths' roundings flipped a near-tied greedy answer. Costs a dense read of the weights
    on the rare prompt step of a few rows. Per thread: each engine steps on its own."""
    before = prompt_step_active()
    _step.prompt = active
    try:
        yield
    finally:
        _step.prompt = before


# The C++ kernels a quantized layer's step can run (QuantizedLinear.step_kernel), by the codes
# that the kernels' decoder_layers takes.
KERNEL_AMX, KERNEL_I16, KERNEL_I8, KERNEL_PAIRS = range(4)
_NONE = torch.empty(0)  # an absent weight tensor (no zeros for int8)


def run_kernel(
    kind: int, weights: list[torch.Tensor], x: torch.Tensor, fp32_out: bool
) -> torch.Tensor:
    """x [M, in] through a step kernel of QuantizedLinear.step_kernel: [M, out] in x's dtype
    (linear_amx and linear_bf16: bf16), or the fp32 sums where fp32_out."""
    ops = cpu_kernels.ops()
    q, scales, zeros = weights
    if kind == KERNEL_AMX:
        z = zeros if zeros.numel() else None
        return ops.linear_amx(x.to(torch.bfloat16).contiguous(), q, scales, z, fp32_out)
    if kind == KERNEL_PAIRS:
        return ops.linear_bf16(x, q, fp32_out)
    if fp32_out:  # the integer kernels return x's dtype
        x = x.float()
    if kind == KERNEL_I8:
        return ops.linear_i8(x, q, scales, zeros)
    return ops.linear_i16(x, q, scales, zeros if zeros.numel() else None)


# Steps of more rows than this run a gate/up projection on AMX tiles and silu_and_mul in one
# kernel call (gate_up_silu); the kernels' decoder_layers chooses the same (kSiluFusedAbove).
# A 170-token prompt of SmolLM2, 30 layers, on a 2-core Xeon with AMX: 41.1 against 42.3 ms
# (medians of eight alternating rounds, each faster fused). Decode steps of 8 or 16 rows ran
# faster fused too with the weights in cache, 24 and 32 slower; the model's were not measured.
SILU_FUSED_ABOVE = 32


def gate_up_silu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul(layer(x)) in one kernel call (linear_amx_silu, equal to the bit), where
    `layer` is a gate/up projection that a step of x's rows (more than SILU_FUSED_ABOVE) runs
    on AMX tiles; None elsewhere."""
    if not isinstance(layer, QuantizedLinear) or layer.bias is not None:
        return None
    if x.dim() != 2 or x.shape[0] <= SILU_FUSED_ABOVE:
        return None
    kernel = layer.step_kernel(x.shape[0])
    if kernel is None or kernel[0] != KERNEL_AMX:
        return None
    q, scales, zeros = kernel[1]
    z = zeros if zeros.numel() else None
    return cpu_kernels.ops().linear_amx_silu(x.to(torch.bfloat16).contiguous(), q, scales, z)


class QuantizedLinear(LeanModule):
    """A Linear whose weight is kept int8 (per channel) or int4 (per group of 32).

    fp32 layers on AVX2-only CPUs (`i16_kernel`) run `linear_i16` (int16 activations; int4
    with `TOKENYARD_INT4_ACTIVATIONS=int8`: `linear_i8`) at every row count, with no dense
    copy; bf16 layers on AVX512-VNNI CPUs without AMX run it up to the dense threshold and
    their dense copy, kept in pack_pairs' layout, through `linear_bf16` above it.
    Elsewhere int8 runs our C++ GEMV (tokenyard.kernels.cpu) for up to 16 rows a
    call; int4 runs our C++ kernel on x86 CPUs (`own_int4_kernel`, Q4_1's layout: fp32 activations without
    native bf16, bf16 dot products with AVX512-BF16). Elsewhere (int4 on Arm with bf16,
    either without our kernels) torch's CPU weight-only kernels run, which are fast only
    with bf16 activations: rows are cast to bf16 and the result back to the input's dtype.
    """

    def __init__(self, linear: nn.Linear, bits: int, keep_dense: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.bits = bits
        self.out_features, self.in_features = w.shape
        self.bias = linear.bias
        self.dense = linear.weight if keep_dense else None
        # bf16 layers where linear_bf16 runs (pairs_kernel): the dense copy in its layout. The
        # output projection's is a second copy of a tied embeddings' weight (as oneDNN's packed
        # one was in a worker with private weights), for 1.0 ms of a 32-row step (4.4 against
        # 5.4 ms in oneDNN's matmul).
        pairs = keep_dense and int4_fits(linear) and pairs_kernel(linear.weight.dtype)
        self.register_buffer("pairs", pack_pairs(linear.weight.detach()) if pairs else None)
        if pairs:
            self.dense = None
        self.dense_above = dense_above_rows(bits, linear.weight.dtype, self.pairs is not None)
        self.own_int4 = False  # int4 in our kernel's layout (own_int4_kernel)
        self.act8 = False  # int4 against 8-bit activations (linear_i8, int4_activation_bits)
        # The int16-activation kernel (see i16_kernel): fp32 layers on CPUs without AVX-512 or
        # native bf16 take it at every row count and need no dense copy; bf16 layers on
        # AVX512-VNNI take it up to the dense threshold.
        self.i16 = int4_fits(linear) and i16_kernel(linear.weight.dtype)
        # AMX CPUs (bf16 layers): the same layout, linear_i16 for a few decode rows and
        # linear_amx for every other step. Without a dense copy (deterministic mode), every
        # step takes linear_amx: a row's result then never depends on the step's size.
        self.amx = int4_fits(linear) and amx_kernel(linear.weight.dtype)
        self.i16_rows = (
            AMX_I16_ROWS[bits] if self.amx and keep_dense and bits in AMX_I16_ROWS else 0
        )
        self.i16 = self.i16 or self.amx
        if self.i16 and integer_only(linear.weight.dtype):
            self.dense = None
        if bits == 8:
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
            q8 = torch.round(w / scale[:, None]).to(torch.int8)
            if self.i16:
                per_group = scale[:, None].expand(-1, self.in_features // GROUP_SIZE)
                packed8, scales8, _ = pack_i16(q8, per_group, None)
                self.register_buffer("qweight", packed8)  # int8 [out / 16, in / 32, 16, 32]
                self.register_buffer("scales", scales8)  # fp32 [out / 16, in / 32, 16]
            else:
                self.register_buffer("qweight", q8)  # [out, in]
                self.register_buffer("scales", scale)  # fp32
        elif bits == 4:
            if not int4_fits(linear):
                raise ValueError(
                    f"int4 needs in_features divisible by {GROUP_SIZE} and out_features by 16, "
                    f"got {self.in_features} -> {self.out_features}"
                )
            groups = w.view(self.out_features, -1, GROUP_SIZE)
            lo, hi = groups.amin(-1), groups.amax(-1)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            q = (
                torch.round((groups - lo[..., None]) / scale[..., None])
                .clamp(0, 15)
                .to(torch.int32)
            )
            self.own_int4 = self.i16 or own_int4_kernel()
            self.act8 = self.i16 and not self.amx and int4_activation_bits() == 8
            if self.i16:
                pack = pack_i8 if self.act8 else pack_i16
                packed4, scales4, zeros4 = pack(q.to(torch.uint8).view_as(w), scale, lo)
                self.register_buffer("qweight", packed4)  # uint8, see pack_i16 and pack_i8
                self.register_buffer("scales", scales4)  # fp32 [out / 16, in / 32, 16]
                self.register_buffer("zeros", zeros4)
            elif self.own_int4:
                # GGUF Q4_1's layout: w = q * scale + zero; byte j of a group holds weight j
                # in its low nibble and weight j + 16 in its high one. uint8 [out, in / 2].
                nibbles = q.to(torch.uint8)
                packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
                self.register_buffer("qweight", packed.reshape(self.out_features, -1))
                self.register_buffer("scales", scale.contiguous())  # fp32 [out, in / 32]
                self.register_buffer("zeros", lo.contiguous())
            else:
                # torch's layout: w = (q - 8) * scale + zero, scales_and_zeros [in / group, out, 2]
                zero = lo + 8 * scale
                self.register_buffer(
                    "qweight", torch._convert_weight_to_int4pack_for_cpu(q.view_as(w), 2)
                )
                self.register_buffer(
                    "scales",
                    torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16),
                )
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits}")

    def _dense_step(self, rows: int) -> bool:
        """Whether a step of `rows` rows takes the dense copy (either layout)."""
        if self.dense is None and self.pairs is None:
            return False
        return rows > self.dense_above or prompt_step_active()

    def step_kernel(self, rows: int) -> tuple[int, list[torch.Tensor]] | None:
        """The C++ kernel that a step of `rows` rows runs this layer through (a KERNEL_* code)
        and its weights as three tensors (an absent one empty), or None where torch's
        kernels or the twin run it. forward() and the fused decoder (`decoder_layers`) both
        take it from here; the bias is added apart."""
        if self._dense_step(rows):  # the dense copy: in pack_pairs' layout, or torch's
            return (KERNEL_PAIRS, [self.pairs, _NONE, _NONE]) if self.pairs is not None else None
        return self._weight_kernel(rows)

    def _weight_kernel(self, rows: int) -> tuple[int, list[torch.Tensor]] | None:
        """step_kernel's choice among the weight-only kernels that take pack_i16's (or
        pack_i8's) layout, dense copy or not; None for layers in other layouts."""
        if not self.i16:
            return None
        weights = [self.qweight, self.scales, self.zeros if self.bits == 4 else _NONE]
        if self.amx and (rows > self.i16_rows or prompt_step_active()):
            return KERNEL_AMX, weights
        return (KERNEL_I8 if self.act8 else KERNEL_I16), weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        kernel = self.step_kernel(rows.shape[0])
        if kernel is not None:
            y = run_kernel(*kernel, rows, False).reshape(*shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        if self.dense is not None and self._dense_step(rows.shape[0]):
            if self.dense.is_mkldnn:  # prepack(): the same oneDNN kernel, no reorder per call
                return torch.ops.mkldnn._linear_pointwise(x, self.dense, None, "none", [], "")
            return F.linear(x, self.dense, self.bias)
        y = self._quantized_mm(rows).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def prepack(self) -> bool:
        """Keep the bf16 dense copy in oneDNN's blocked layout. torch's CPU bf16 linear
        reorders a plain weight into that layout on every call; packed once, a 32-row step's
        projections measured 1.13x faster and the output projection 1.55x (2-core
        AVX512-BF16), with results equal to the bit. The packed weight is opaque: it cannot
        be viewed, saved or shared between processes, so only private weights are packed.
        An fp32 dense copy is packed on AVX2-only CPUs, where torch's fp32 linear runs MKL:
        on a 2-core AVX2 EPYC, oneDNN's packed fp32 matmul took 0.75x MKL's time at 32 rows
        and 0.60x at 128 (30 layers' gate/up projections, cold in cache); its sums are
        ordered otherwise than MKL's, so results differ in the last bits.
        False where there is nothing to pack (no dense copy, not on the CPU, a dtype not
        named above), with a bias (oneDNN adds it with other rounding than torch's addmm;
        Llama has none), and for bf16 where oneDNN has no bf16 path (an AVX2-only CPU: its
        reorder raises there)."""
        dense = self.dense
        if (
            dense is None
            or self.bias is not None
            or dense.is_mkldnn
            or dense.device.type != "cpu"
            or not packs(dense.dtype)
        ):
            return False
        packed = torch.ops.mkldnn._reorder_linear_weight(dense.detach(), PREPACK_ROWS)
        del self.dense  # a parameter (the output projection's is the tied embedding's)
        self.register_buffer("dense", packed)
        return True

    def _quantized_mm(self, x: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype (fp32 where fp32_out, for AMX layers), through
        the weight-only kernel."""
        kernel = self._weight_kernel(x.shape[0])
        if kernel is not None:
            return run_kernel(*kernel, x, fp32_out)
        if fp32_out:  # the other kernels return x's dtype
            x = x.float()
        if self.bits == 8:
            kernels = cpu_kernels.ops_for(x)
            if kernels is not None:  # 16 rows a call; each row's sums never depend on the others
                rows = x.contiguous().split(16)
                return torch.cat([kernels.int8_linear(r, self.qweight, self.scales) for r in rows])
            xb = x.to(torch.bfloat16).contiguous()
            return torch._weight_int8pack_mm(xb, self.qweight, self.scales.to(torch.bfloat16)).to(
                x.dtype
            )
        if self.own_int4:
            kernels = cpu_kernels.ops_for(x)
            if kernels is not None:
                return kernels.int4_linear(x.contiguous(), self.qweight, self.scales, self.zeros)
            return (x.float() @ self.int4_weight().T).to(x.dtype)  # the twin: slow, exact
        xb = x.to(torch.bfloat16).contiguous()
        return torch._weight_int4pack_mm_for_cpu(xb, self.qweight, GROUP_SIZE, self.scales).to(
            x.dtype
        )

    def int4_weight(self) -> torch.Tensor:
        """The fp32 weight [out, in] our int4 layout stands for: q * scale + zero."""
        if self.i16:
            unpack = unpack_i8 if self.act8 else unpack_i16
            q = unpack(self.qweight).float().view(self.out_features, -1, GROUP_SIZE)
            scale, zero = (unpack_i16_params(t) for t in (self.scales, self.zeros))
            return (q * scale[..., None] + zero[..., None]).view(self.out_features, -1)
        packed = self.qweight.view(self.out_features, -1, GROUP_SIZE // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [out, groups, 32]
        return (q * self.scales[..., None] + self.zeros[..., None]).view(self.out_features, -1)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> fp32 [M, out], never rounded to x's dtype (the output projection's logits).

        int8 runs the C++ GEMV, whose fp32 accumulators are returned as they are, up to the
        dense threshold (at any row count without a dense copy); bigger steps take the dense
        matmul's result upcast.
        """
        kernels = cpu_kernels.ops_for(x)
        if (
            self.bits != 8
            or (kernels is None and not self.i16)
            or (self.dense is not None and x.shape[0] > self.dense_above)
        ):
            return self(x).float()
        kernel = self.step_kernel(x.shape[0])
        if kernel is not None:
            y = run_kernel(*kernel, x, True)
            return y + self.bias if self.bias is not None else y
        y = self._quantized_mm(x, fp32_out=True)
        return y + self.bias if self.bias is not None else y

    def quantized_bytes(self) -> int:
        """What one small-batch step reads of this layer's weights."""
        parts = [self.qweight, self.scales] + ([self.zeros] if self.own_int4 else [])
        return sum(t.numel() * t.element_size() for t in parts)


class Fp8Linear(LeanModule):
    """A Linear whose weight is stored float8 e4m3 with one fp32 scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.bias = linear.bias
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        self.register_buffer("qweight", (w / scale[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("scales", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the per-channel scale is applied to the output: x @ (q * s)^T == (x @ q^T) * s
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def quantized_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def fp32_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) in fp32. NOTE: bf16 logits of the top candidates tie often enough (8 bits of
    mantissa at magnitudes near 20 is a step of 0.125) that greedy answers flipped with the
    step's shape; a quantized output projection returns its fp32 accumulators instead."""
    if isinstance(layer, QuantizedLinear):
        return layer.forward_fp32(x)
    return layer(x).float()


def own_int4_kernel() -> bool:
    """Whether int4 layers take our C++ kernel's layout (Q4_1 nibbles, fp32 scales and zeros)
    rather than torch's, where our kernels are built:
    - on CPUs without native bf16, where torch's int4 kernel converts its activations to
      bf16 in software and unpacks its weights once per four rows (on a 2-core AVX2 EPYC,
      SmolLM2's 30 layers at 8 rows: 27 ms in torch's kernel, 18 ms in ours);
    - on AVX512-BF16 without AMX, where ours multiplies with bf16 dot products (the same
      layers on a 2-core EPYC: 1 row 4.4 against 4.7 ms in torch's, 8 rows 12.1 against 15.5).
    CPUs with AMX keep torch's kernel: on a 2-core Xeon with amx_bf16 ours took 5.6 ms at 1
    row and 14.4 at 8 against 3.5 and 10.4 in torch's. Other CPUs with native bf16 (Arm)
    keep torch's kernel too: ours has no bf16 path there."""
    from tokenyard.engine.config import cpu_flags, cpu_has_amx, cpu_has_native_bf16

    fits = not cpu_has_native_bf16() or ("avx512_bf16" in cpu_flags() and not cpu_has_amx())
    return fits and cpu_kernels.ops() is not None


def i16_kernel(dtype: torch.dtype = torch.float32) -> bool:
    """Whether quantized layers of this dtype run the int16-activation kernel (`linear_i16`).

    bf16 layers: on AVX512-BF16 CPUs without AMX whose kernels are built with AVX512-VNNI
    (`i16_vnni`: a Zen 4 EPYC), for steps of up to `DENSE_ABOVE_ROWS["bf16_i16"]` rows; the
    dense bf16 copy stays for prefill and bigger batches, where oneDNN's matmul wins (512
    rows: 250-270 ms against 340-420). vpdpwssd does 32 int16 multiply-adds an instruction,
    as many as vdpbf16ps, but needs no bf16 rounding of the weights, so the int4 weights
    feed it at the cost of widening nibbles. SmolLM2's four projection shapes as 120
    distinct int4 layers (cold), 2 threads, against our kernel's bf16 path (int4) and the
    dense copy: 1 row 3.1-3.6 against 3.8-4.0 ms, 8 rows 6.8-8.2 against 9.1, 16 rows
    11.6-13.1 against 14.7-15.5 (dense), 32 rows 21.5-24 against 22.4-23.6 (dense; in the
    engine the dense copy wins 32-row steps); the output projection (int8, 576 x 49,152) at
    8 rows 1.7 ms against 3.0 in the int8 GEMV and 2.6 dense. Where AMX multiplies bf16
    tiles, oneDNN's matmul and torch's int4 kernel stay (unmeasured against this one).

    fp32 layers: on x86 CPUs with AVX2 but neither AVX-512 nor native bf16, where our
    kernels are built. There each row is scaled into int16 (15 bits, finer than bf16) and
    vpmaddwd does 16 multiply-adds an instruction against an fp32 FMA's 8. On a 2-core AVX2 EPYC (Zen 3),
    SmolLM2's four projection shapes as 120 distinct int4 layers (30 layers' worth, cold in
    cache), against the path before it (our fp32 int4 kernel up to 32 rows, the packed fp32
    matmul above): 1 row 6.2 against 11.1 ms, 32 rows 40.8 against 70.2, 64 rows 83 against
    119, 174 rows 232 against 282, 512 rows 715 against 773. So such layers keep no dense
    copy: one kernel for every row count, a nibble per int4 weight (a byte per int8 one)
    where the fp32 copy took four bytes. fp32 layers on AVX-512 CPUs (without native bf16)
    keep their own paths: unmeasured against this kernel."""
    from tokenyard.engine.config import cpu_flags, cpu_has_amx, cpu_has_avx512, cpu_has_native_bf16

    kernels = cpu_kernels.ops()
    if kernels is None:
        return False
    if dtype == torch.bfloat16:
        return "avx512_bf16" in cpu_flags() and not cpu_has_amx() and bool(kernels.i16_vnni())
    return (
        dtype == torch.float32
        and not cpu_has_avx512()
        and not cpu_has_native_bf16()
        and bool(kernels.i16_available())
    )


def pairs_kernel(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether bf16 layers keep their dense copy in pack_pairs' layout and run it through
    `linear_bf16` (vdpbf16ps over register tiles of 8 rows by 48 outputs) instead of oneDNN's
    matmul: where `i16_kernel` runs bf16 layers (AVX512-BF16 and VNNI, no AMX: a Zen 4 EPYC)
    and the kernel is built. SmolLM2's projection shapes as 210 distinct layers (cold), 2
    threads, against oneDNN's packed bf16 matmul: 8 rows 6.9 against 13.6 ms, 32 rows 17.1
    against 25.0, 150 rows (a chat prompt) 71.6 against 81.1, 512 rows 238 against 254. Steps
    of a few rows keep linear_i16 (`DENSE_ABOVE_ROWS["bf16_pairs"]`): it reads a nibble a
    weight where this reads two bytes."""
    if dtype != torch.bfloat16 or not i16_kernel(dtype):
        return False
    kernels = cpu_kernels.ops()
    return kernels is not None and bool(kernels.pairs_available())


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] -> linear_bf16's layout [N / 16, K / 2, 16, 2]: per block of 16
    outputs and pair of inputs, each output's two weights side by side."""
    n, k = w.shape
    return w.to(torch.bfloat16).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """pack_pairs' weight back to [N, K]."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)


def amx_kernel(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether quantized layers of this dtype run `linear_amx` (AMX tiles of bf16 widened from
    the int4 or int8 weights), with `linear_i16` for steps of a few decode rows: bf16 layers on
    CPUs with AMX where our kernels are built with it and Linux lets the process use the tiles.
    oneDNN's bf16 matmul runs on the same tiles but reads two bytes a weight: at the decode
    steps of 8 to 32 rows that the stack runs under load it took 11.5-13.6 ms for SmolLM2's 30
    layers against 6.5-8.1 (`AMX_I16_ROWS` has the figures), and at prompt sizes the two tie,
    so such layers keep no dense copy."""
    from tokenyard.engine.config import cpu_has_amx

    if dtype != torch.bfloat16 or not cpu_has_amx():
        return False
    kernels = cpu_kernels.ops()
    return kernels is not None and bool(kernels.amx_available()) and bool(kernels.i16_vnni())


def integer_only(dtype: torch.dtype) -> bool:
    """Whether quantized layers of this dtype run our integer-weight kernels at every row count
    and keep no dense copy: fp32 where `i16_kernel` holds, bf16 where `amx_kernel` does. Other
    bf16 layers that take linear_i16 keep theirs (oneDNN's bf16 matmul wins above a few rows)."""
    if dtype == torch.bfloat16:
        return amx_kernel(dtype)
    return dtype == torch.float32 and i16_kernel(dtype)


def int4_activation_bits() -> int:
    """What int4 layers on the integer path (i16_kernel) quantize their activations to: 16
    bits with one scale per row (linear_i16, the default), or 8 bits with one scale per group
    of 32 inputs (linear_i8, as llama.cpp pairs Q4_1 weights with Q8_1 activations) where
    TOKENYARD_INT4_ACTIVATIONS=int8. On a 2-core AVX2 EPYC, SmolLM2's 30 layers (distinct,
    cold in cache): 8 bits took 0.78-0.83x the time of 16 at 32 to 512 rows (39.4 against
    49.4 ms at 32, 228 against 292 at 174) and 1.24x at 1 row (a byte per weight against a
    nibble), but against fp32 on the same weights perplexity rose 24.44 -> 25.30 (16 bits:
    24.46), top-1 agreement fell to 92.8% (16 bits: 98.1%) and one chat answer in eight
    stayed identical (16 bits: seven); docs/precision.md. So 8 bits is a choice, not the
    default."""
    choice = os.environ.get("TOKENYARD_INT4_ACTIVATIONS", "int16")
    if choice not in ("int8", "int16"):
        raise ValueError(f"TOKENYARD_INT4_ACTIVATIONS must be int8 or int16, got {choice!r}")
    return 8 if choice == "int8" else 16


def pack_i16(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [N, K] (int4: uint8 in [0, 16); int8), scale and zero [N, K / 32] -> linear_i16's
    layout: per block of 16 outputs, group of 32 inputs and pair of inputs, two operands of
    16 words (outputs 0-7, then 8-15, each output's two inputs side by side). int8 keeps a
    byte per weight, [N / 16, K / 32, 16, 32] (the first operand's 16 bytes, then the
    second's); int4 a nibble, [N / 16, K / 32, 16, 16] (byte j: word j of the first operand
    in its low nibble, of the second in its high one). scale and zero as [N / 16, K / 32, 16]."""
    n, k = q.shape
    groups = k // GROUP_SIZE
    pairs = q.view(n // 16, 2, 8, groups, 16, 2).permute(0, 3, 4, 1, 2, 5)  # [.., p, half, i, t]
    if q.dtype == torch.int8:
        packed = pairs.reshape(n // 16, groups, 16, 32).contiguous()
    else:
        halves = pairs.reshape(n // 16, groups, 16, 2, 16)
        packed = (halves[..., 0, :] | (halves[..., 1, :] << 4)).contiguous()
    return packed, _per_block(scale), None if zero is None else _per_block(zero)


def unpack_i16(packed: torch.Tensor) -> torch.Tensor:
    """pack_i16's q back to [N, K]."""
    blocks, groups = packed.shape[:2]
    if packed.dtype != torch.int8:  # nibbles: the two operands from one byte
        packed = torch.stack([packed & 15, packed >> 4], dim=3)
    q = packed.reshape(blocks, groups, 16, 2, 8, 2).permute(0, 3, 4, 1, 2, 5)
    return q.reshape(blocks * 16, groups * GROUP_SIZE)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """[N, G] scales or zeros -> [N / 16, G, 16]: one block's 16 outputs side by side."""
    n, groups = t.shape
    return t.float().reshape(n // 16, 16, groups).transpose(1, 2).contiguous()


def pack_i8(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 q [N, K] (uint8 in [0, 16)), scale and zero [N, K / 32] -> linear_i8's layout:
    q as [N / 16, K / 32, 8 quads of inputs, 64]: the quad's first 32 bytes hold outputs 0-7,
    each output's four inputs side by side, the second 32 outputs 8-15; scale and zero as
    pack_i16 lays them out."""
    n, k = q.shape
    groups = k // GROUP_SIZE
    quads = q.view(n // 16, 2, 8, groups, 8, 4).permute(0, 3, 4, 1, 2, 5)
    return quads.reshape(n // 16, groups, 8, 64).contiguous(), _per_block(scale), _per_block(zero)


def unpack_i8(packed: torch.Tensor) -> torch.Tensor:
    """pack_i8's q back to [N, K]."""
    blocks, groups = packed.shape[:2]
    q = packed.view(blocks, groups, 8, 2, 8, 4).permute(0, 3, 4, 1, 2, 5)
    return q.reshape(blocks * 16, groups * GROUP_SIZE)


def unpack_i16_params(t: torch.Tensor) -> torch.Tensor:
    """pack_i16's scale or zero back to [N, K / 32]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def int4_fits(linear: nn.Linear) -> bool:
    """torch's int4 packing, and our integer kernels' layout (i16_kernel), want whole groups
    of 32 along in_features and blocks of 16 along out_features."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


def packs(dtype: torch.dtype) -> bool:
    """Whether prepack() packs a dense copy of this dtype on this CPU."""
    if dtype == torch.bfloat16:
        return mkldnn_packs_bf16()
    from tokenyard.engine.config import cpu_has_avx512

    return dtype == torch.float32 and not cpu_has_avx512()


@functools.cache
def mkldnn_packs_bf16() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(model: nn.Module) -> int:
    """QuantizedLinear.prepack() on every quantized layer; how many it packed."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, QuantizedLinear))


def quantize(model: nn.Module, mode: str, keep_dense: bool = True) -> nn.Module:
    """Swap every Linear for a QuantizedLinear (or an Fp8Linear). The output projection, and
    in int4 mode any layer whose shape int4 packing cannot take, become int8."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: expected one of {MODES}")
    bits = 4 if mode == "int4" else 8
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, _quantized(name, child, mode, bits, keep_dense))
        else:
            quantize(child, mode, keep_dense)
    return model


def _quantized(name: str, linear: nn.Linear, mode: str, bits: int, keep_dense: bool) -> nn.Module:
    if name == "lm_head" or (bits == 4 and not int4_fits(linear)):
        return QuantizedLinear(linear, 8, keep_dense)
    if mode == "fp8":
        return Fp8Linear(linear)
    return QuantizedLinear(linear, bits, keep_dense)


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The float weight a layer stands for on its small-batch path (tests compare against it)."""
    if isinstance(layer, QuantizedLinear) and layer.own_int4:
        return layer.int4_weight()
    if isinstance(layer, QuantizedLinear) and layer.i16:  # int8: one scale per output
        return unpack_i16(layer.qweight).float() * unpack_i16_params(layer.scales)[:, :1]
    if isinstance(layer, QuantizedLinear):
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        return layer._quantized_mm(eye).float().T
    if isinstance(layer, Fp8Linear):
        return layer.qweight.float() * layer.scales[:, None]
    assert isinstance(layer, nn.Linear)
    return layer.weight.detach().float()
