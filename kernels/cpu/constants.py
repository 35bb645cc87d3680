"""Numbers the C++ kernels and the Python that calls them agree on, defined once, here.

The build writes them into a C++ header (`header()`, included by common.h as constants.h)
before it compiles, and that text is part of the build's content-hashed name: a changed
number builds anew. Python reads them from this module, with or without a built extension
(the torch twins need them too). Plain Python: no torch.
"""

from __future__ import annotations

# The projection kernels decoder_layers runs, by the codes its `kinds` list takes
# (tokenyard.models.kernel_choice.LinearKernel.step).
KERNEL_AMX = 0  # linear_amx: int4/int8 weights widened to bf16 AMX tiles
KERNEL_I16 = 1  # linear_i16: int16 activations (AVX2 or AVX512-VNNI)
KERNEL_I8 = 2  # linear_i8: int4 weights against 8-bit activations
KERNEL_PAIRS = 3  # linear_bf16: the dense bf16 copy in pack_pairs' layout

# Steps of more rows than this run an AMX gate/up projection and silu_and_mul in one call
# (linear_amx_silu): docs/benchmarks.md has the measurement.
SILU_FUSED_ABOVE = 32

# The heads span_attention takes: these head sizes, up to this many query heads per KV head.
SPAN_HEAD_DIMS = (64, 128)
SPAN_MAX_GROUP = 8

# int8_linear's rows per call (its GEMV tiles); callers split bigger steps.
GEMV_MAX_ROWS = 16

# Input channels per int4 group (one scale and zero each: GGUF Q4_1's group).
GROUP_SIZE = 32


def header() -> str:
    """constants.h: the numbers above as C++ constants."""
    ints = {
        "kKernelAmx": KERNEL_AMX,
        "kKernelI16": KERNEL_I16,
        "kKernelI8": KERNEL_I8,
        "kKernelPairs": KERNEL_PAIRS,
        "kSiluFusedAbove": SILU_FUSED_ABOVE,
        "kSpanMaxGroup": SPAN_MAX_GROUP,
        "kMaxRows": GEMV_MAX_ROWS,
        "kGroup": GROUP_SIZE,
    }
    head_dims = " || ".join(f"head_dim == {d}" for d in SPAN_HEAD_DIMS)
    return "\n".join(
        [
            "// Written by the build from tokenyard/kernels/cpu/constants.py: change them there.",
            "#pragma once",
            "#include <cstdint>",
            *(f"constexpr int64_t {name} = {value};" for name, value in ints.items()),
            f"constexpr bool span_head_dim(int64_t head_dim) {{ return {head_dims}; }}",
            "",
        ]
    )
