// CPU kernels, built at first use by tokenyard.kernels.cpu (torch's extension loader; the
// object is cached on disk). Each has a torch twin that the tests compare it against. One
// family per header, what they share in common.h:
//
//   attention.h       write_kv, decode_attention, span_attention, gather_kv
//   norm_rope_silu.h  add_rms_norm, rotary, silu_and_mul
//   gemv.h            int8_linear, int4_linear: weight-only GEMMs of a few rows
//   gemm_int.h        linear_i16, linear_i8: integer GEMMs against int16 or int8 activations
//   gemm_amx.h        linear_amx, linear_amx_silu: int4 and int8 weights on AMX tiles
//   gemm_bf16.h       linear_bf16: the dense bf16 GEMM on AVX512-BF16
//   argmax.h          argmax_rows
//   decoder_layers.h  decoder_layers: a step through every layer in one call of the above
//
// NOTE: one translation unit, the families included here rather than compiled apart: one
// compiler run, about a minute on two cores (a translation unit each would parse torch's
// headers again), and the compiled kernels are those of the single file they came from
// (decoder_layers inlines the other families' helpers as before).
#include "common.h"

#include "attention.h"
#include "norm_rope_silu.h"
#include "gemv.h"
#include "gemm_int.h"
#include "gemm_amx.h"
#include "gemm_bf16.h"
#include "argmax.h"
#include "decoder_layers.h"
