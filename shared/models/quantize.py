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

Decoding is bound by the bytes of weights read per step, and the weight-only kernels read
fewer bytes, but on a CPU most of them are slower than a dense matmul once a step carries
more than a handful of rows. A quantized layer therefore keeps its dense weight too
(`keep_dense`, the default) where that pays, and uses it for steps of more rows than its
threshold: decode of a few sequences gets the bandwidth, prefill and big batches get the
FLOPs. That costs memory: the report counts both copies, and the tied lm_head reuses the
embeddings. At the sizes people serve the copies outweigh the rest of the engine, so the
engine asks `keeps_dense` first: by default a model keeps them only where they come to at
most DENSE_COPIES_MAX_BYTES (EngineConfig.dense_copies). Which kernels a layer runs, with or without a dense copy, is chosen once when
the layer is built (`tokenyard.models.kernel_choice`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenyard import platforms
from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.kernels.cpu.constants import (
    GEMV_MAX_ROWS,
    GROUP_SIZE,
    KERNEL_AMX,
    KERNEL_I8,
    KERNEL_PAIRS,
    SILU_FUSED_ABOVE,
)
from tokenyard.models.kernel_choice import LinearKernel, LinearSpec, choose_linear_kernel
from tokenyard.models.module import LeanModule

MODES = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# The row count oneDNN picks a packed layout for: a mid-size decode batch (any count runs).
PREPACK_ROWS = 32

_NONE = torch.empty(0)  # an absent weight tensor (no zeros for int8)


def run_kernel(
    kind: int, weights: list[torch.Tensor], x: torch.Tensor, fp32_out: bool
) -> torch.Tensor:
    """x [M, in] through a step kernel of QuantizedLinear.step_kernel: [M, out] in x's dtype
    (linear_amx and linear_bf16: bf16), or the fp32 sums where fp32_out."""
    ops = cpu_kernels.ops()
    assert ops is not None, "a step kernel is chosen only where the kernels are built"
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


def project(layer: nn.Module, x: torch.Tensor, prompt: bool) -> torch.Tensor:
    """layer(x) in a step that carries prompt tokens or not: a quantized layer's kernel may
    depend on it (LinearKernel.dense_step); a float layer has no use for it."""
    if isinstance(layer, QuantizedLinear):
        return layer(x, prompt)
    return layer(x)


def gate_up_silu(layer: nn.Module, x: torch.Tensor, prompt: bool) -> torch.Tensor | None:
    """silu_and_mul(layer(x)) in one kernel call (linear_amx_silu, equal to the bit), where
    `layer` is a gate/up projection that a step of x's rows (more than SILU_FUSED_ABOVE) runs
    on AMX tiles; None elsewhere. The kernels' decoder_layers chooses the same."""
    if not isinstance(layer, QuantizedLinear) or layer.bias is not None:
        return None
    if x.dim() != 2 or x.shape[0] <= SILU_FUSED_ABOVE:
        return None
    kernel = layer.step_kernel(x.shape[0], prompt)
    if kernel is None or kernel[0] != KERNEL_AMX:
        return None
    q, scales, zeros = kernel[1]
    z = zeros if zeros.numel() else None
    ops = cpu_kernels.ops()
    assert ops is not None
    return ops.linear_amx_silu(x.to(torch.bfloat16).contiguous(), q, scales, z)


class QuantizedLinear(LeanModule):
    """A Linear whose weight is kept int8 (per channel) or int4 (per group of 32).

    `kernel` (a LinearKernel, chosen once from this machine's capabilities) says how: the
    weight's layout, whether a dense copy is kept for big steps and in which layout, and
    which C++ kernel a step of so many rows runs. Layouts and their paths:
    - "i16" / "i8": linear_i16's blocked layout (linear_i8's for int4 against 8-bit
      activations), run by linear_i16 / linear_i8, and on AMX CPUs by linear_amx;
    - "int8": [out, in], our C++ GEMV for up to 16 rows a call, or torch's int8 kernel;
    - "q4_1": our C++ int4 kernel's (GGUF Q4_1's nibbles, fp32 scales and zeros);
    - "torch_int4": torch's CPU weight-only int4 kernel, fast only with bf16 activations:
      rows are cast to bf16 and the result back to the input's dtype.
    """

    # Buffers (register_buffer), declared for the type checker.
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor  # int4 in our layouts only
    pairs: torch.Tensor | None

    def __init__(self, linear: nn.Linear, bits: int, keep_dense: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.bits = bits
        self.out_features, self.in_features = w.shape
        self.bias = linear.bias
        if bits == 4 and not int4_fits(linear):
            raise ValueError(
                f"int4 needs in_features divisible by {GROUP_SIZE} and out_features by 16, "
                f"got {self.in_features} -> {self.out_features}"
            )
        spec = LinearSpec(linear.weight.dtype, bits, int4_fits(linear), keep_dense)
        self.kernel: LinearKernel = choose_linear_kernel(spec)
        self.dense: torch.Tensor | None = linear.weight if self.kernel.dense == "plain" else None
        # The dense copy in pack_pairs' layout (linear_bf16). The output projection's is a
        # second copy of a tied embeddings' weight, as oneDNN's packed one was.
        pairs = pack_pairs(linear.weight.detach()) if self.kernel.dense == "pairs" else None
        self.register_buffer("pairs", pairs)
        if bits == 8:
            self._quantize_int8(w)
        else:
            self._quantize_int4(w)

    def _quantize_int8(self, w: torch.Tensor) -> None:
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        q8 = torch.round(w / scale[:, None]).to(torch.int8)
        if self.kernel.blocked:
            per_group = scale[:, None].expand(-1, self.in_features // GROUP_SIZE)
            packed8, scales8, _ = pack_i16(q8, per_group, None)
            self.register_buffer("qweight", packed8)  # int8 [out / 16, in / 32, 16, 32]
            self.register_buffer("scales", scales8)  # fp32 [out / 16, in / 32, 16]
        else:
            self.register_buffer("qweight", q8)  # [out, in]
            self.register_buffer("scales", scale)  # fp32

    def _quantize_int4(self, w: torch.Tensor) -> None:
        groups = w.view(self.out_features, -1, GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        layout = self.kernel.layout
        if self.kernel.blocked:
            pack = pack_i8 if layout == "i8" else pack_i16
            packed4, scales4, zeros4 = pack(q.to(torch.uint8).view_as(w), scale, lo)
            self.register_buffer("qweight", packed4)  # uint8, see pack_i16 and pack_i8
            self.register_buffer("scales", scales4)  # fp32 [out / 16, in / 32, 16]
            self.register_buffer("zeros", zeros4)
        elif layout == "q4_1":
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

    @property
    def own_int4(self) -> bool:
        """int4 weights in one of our layouts (fp32 scales and zeros), not torch's."""
        return self.bits == 4 and self.kernel.layout != "torch_int4"

    def _weights(self) -> list[torch.Tensor]:
        """The quantized weight as the C++ step kernels take it: three tensors."""
        return [self.qweight, self.scales, self.zeros if self.bits == 4 else _NONE]

    def step_kernel(self, rows: int, prompt: bool) -> tuple[int, list[torch.Tensor]] | None:
        """The C++ kernel that a step of `rows` rows runs this layer through (a KERNEL_* code)
        and its weights as three tensors (an absent one empty), or None where torch's
        kernels or the twin run it. forward() and the fused decoder (`decoder_layers`) both
        take it from here; the bias is added apart."""
        kind = self.kernel.step_kernel(rows, prompt)
        if kind is None:
            return None
        if kind == KERNEL_PAIRS:
            assert self.pairs is not None  # the kernel keeps its dense copy in pairs
            return kind, [self.pairs, _NONE, _NONE]
        return kind, self._weights()

    def forward(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]; `prompt`: the step carries prompt tokens (see
        LinearKernel.dense_step)."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        kernel = self.step_kernel(rows.shape[0], prompt)
        if kernel is not None:
            y = run_kernel(*kernel, rows, False).reshape(*shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        if self.dense is not None and self.kernel.dense_step(rows.shape[0], prompt):
            if self.dense.is_mkldnn:  # prepack(): the same oneDNN kernel, no reorder per call
                return torch.ops.mkldnn._linear_pointwise(x, self.dense, None, "none", [], "")
            return F.linear(x, self.dense, self.bias)
        y = self._quantized_mm(rows, prompt=prompt).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def prepack(self) -> bool:
        """Keep the dense copy in oneDNN's blocked layout, which torch's CPU linear otherwise
        reorders a plain weight into on every call; results equal to the bit for bf16, in
        other last bits for fp32 (oneDNN orders its sums otherwise than MKL).
        docs/benchmarks.md has the gains. The packed weight is opaque: it cannot be viewed,
        saved or shared between processes, so only private weights are packed.
        False where there is nothing to pack (no dense copy, not on the CPU, a dtype `packs`
        leaves alone), with a bias (oneDNN adds it with other rounding than torch's addmm;
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

    def _quantized_mm(
        self, x: torch.Tensor, fp32_out: bool = False, prompt: bool = False
    ) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype (fp32 where fp32_out, for AMX layers), through
        the weight-only kernel."""
        kind = self.kernel.weight_kernel(x.shape[0], prompt)
        if kind is not None:
            return run_kernel(kind, self._weights(), x, fp32_out)
        if fp32_out:  # the other kernels return x's dtype
            x = x.float()
        if self.bits == 8:
            kernels = cpu_kernels.ops_for(x)
            if kernels is not None:  # each row's sums never depend on the others
                rows = x.contiguous().split(GEMV_MAX_ROWS)
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
        if self.kernel.blocked:
            unpack = unpack_i8 if self.kernel.layout == "i8" else unpack_i16
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
            or (kernels is None and not self.kernel.blocked)
            or (self.dense is not None and x.shape[0] > self.kernel.dense_above)
        ):
            return self(x).float()
        kernel = self.step_kernel(x.shape[0], False)
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

    qweight: torch.Tensor
    scales: torch.Tensor

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


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] -> linear_bf16's layout [N / 16, K / 2, 16, 2]: per block of 16
    outputs and pair of inputs, each output's two weights side by side."""
    n, k = w.shape
    return w.to(torch.bfloat16).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """pack_pairs' weight back to [N, K]."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)


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
    """torch's int4 packing, and our integer kernels' layout (kernel_choice.i16_kernel), want whole groups
    of 32 along in_features and blocks of 16 along out_features."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


def packs(dtype: torch.dtype) -> bool:
    """Whether prepack() packs a dense copy of this dtype on this CPU: bf16 where oneDNN has
    a bf16 linear; fp32 on CPUs without AVX-512, where oneDNN's packed matmul beat MKL's
    (docs/benchmarks.md), and AVX-512 ones keep MKL's."""
    if dtype == torch.bfloat16:
        return mkldnn_packs_bf16()
    return dtype == torch.float32 and not platforms.cpu().avx512


@functools.cache
def mkldnn_packs_bf16() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(model: nn.Module) -> int:
    """QuantizedLinear.prepack() on every quantized layer; how many it packed."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, QuantizedLinear))


# EngineConfig.dense_copies "auto": a model keeps its quantized layers' dense copies where
# they come to at most this many bytes. SmolLM2-135M's (about 260 MiB in bf16) stay; at the
# 0.5B and 1B shapes (about 770 and 2,050 MiB) they made the engine's memory 0.80x and 0.94x
# vLLM's, against 0.45x without them (docs/benchmarks.md).
DENSE_COPIES_MAX_BYTES = 512 * 1024**2


def keeps_dense(model: nn.Module, mode: str, policy: str) -> bool:
    """Whether quantize(model, mode) should keep dense copies under EngineConfig.dense_copies'
    `policy`: "all", "none", or "auto" (at most DENSE_COPIES_MAX_BYTES of them)."""
    if policy == "auto":
        return dense_copy_bytes(model, mode) <= DENSE_COPIES_MAX_BYTES
    return policy == "all"


def dense_copy_bytes(model: nn.Module, mode: str) -> int:
    """What the dense copies that quantize(model, mode) keeps come to, in the model's dtype:
    each projection whose chosen kernel keeps one, the output projection's included (tied, a
    plain copy is the embedding itself, counted all the same)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: expected one of {MODES}")
    if mode == "fp8":
        return 0
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        bits = 8 if mode == "int8" or name.endswith("lm_head") or not int4_fits(module) else 4
        spec = LinearSpec(module.weight.dtype, bits, int4_fits(module), True)
        if choose_linear_kernel(spec).dense is not None:
            total += module.weight.numel() * module.weight.element_size()
    return total


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
    if isinstance(layer, QuantizedLinear) and layer.kernel.blocked:  # int8: a scale per output
        return unpack_i16(layer.qweight).float() * unpack_i16_params(layer.scales)[:, :1]
    if isinstance(layer, QuantizedLinear):
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        return layer._quantized_mm(eye).float().T
    if isinstance(layer, Fp8Linear):
        return layer.qweight.float() * layer.scales[:, None]
    assert isinstance(layer, nn.Linear)
    return layer.weight.detach().float()
