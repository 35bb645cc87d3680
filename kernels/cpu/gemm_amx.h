// linear_amx: linear_i16's int4 and int8 weights widened to bf16 tiles for AMX, for bf16
// layers on CPUs with AMX (twin: x times the widened weight, in the tests). linear_amx_silu:
// linear_amx of a gate/up projection with silu_and_mul in its epilogue (twin:
// silu_and_mul(linear_amx(x)), equal to the bit).
#pragma once

#include "common.h"
#include "gemm_int.h"

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TY_AMX 1
// The int4 and int8 GEMMs on AMX (Sapphire Rapids and later Xeons), where the engine computes
// in bf16 and oneDNN's bf16 matmul runs on the same tiles: its decode steps read two bytes per
// weight, these read half a byte (int4) or one (int8). Weights in linear_i16's layout
// (quantize.pack_i16), since a pair of inputs for 16 outputs is exactly one row of an AMX B
// tile: per block of 16 outputs and group of 32 inputs, each of the 16 pairs becomes 32 bf16
// (int4: q * scale + zero in fp32, rounded once to bf16, as a dense bf16 copy of those
// weights holds them; int8: q itself, exact in bf16, with the output's scale applied to the
// fp32 sums), one 1 KiB tile. The activations are the A tiles as they lie in memory (16 rows
// of 32 bf16), the fp32 sums the C tiles: y[m, n0:n0+16] for 16 rows at a time, two blocks
// of rows a pass sharing each weight tile. A block's weights are widened during the first
// pass and kept (K / 32 KiB) for the passes of later rows, so a prefill step widens each
// weight once however many rows it has.
constexpr int kAmxRows = 16;  // rows of a C tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process the tiles' 8 KiB of state only once it asks (arch_prctl, once per
// process); oneDNN asks too when it first runs an AMX kernel.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// A pass takes up to 32 rows (two blocks of rows, r0 and r1 of them) against one block of 16
// outputs, or two in steps of more than 32 rows (see gemm_amx): tiles 0 and 1 hold the sums
// of the first rows against each block of outputs, 2 and 3 of the second rows; 4 and 5 the
// two blocks of rows' activations; 6 and 7 the two blocks' weights. Each activation tile is
// loaded once for the pass's blocks of outputs and each weight tile once for both blocks of
// rows.
void amx_configure(int r0, int r1) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(r0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(r1);
  cfg.rows[6] = cfg.rows[7] = 16;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] > 0 ? 64 : 0;
  _tile_loadconfig(&cfg);
}

// One group of a block's weights as a B tile: 16 rows of 32 bf16.
template <bool Signed>
inline void widen_tile(const uint8_t* w, const float* scale, const float* zero, at::BFloat16* tile) {
  if constexpr (Signed) {
    for (int p = 0; p < 16; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {
    // lane 2i + t of the first half is output i's input t, of the second half output 8 + i's
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 s = _mm512_loadu_ps(scale), z = _mm512_loadu_ps(zero);
    const __m512 s_lo = _mm512_permutexvar_ps(first, s), s_hi = _mm512_permutexvar_ps(second, s);
    const __m512 z_lo = _mm512_permutexvar_ps(first, z), z_hi = _mm512_permutexvar_ps(second, z);
    const __m512i mask = _mm512_set1_epi32(15);
    for (int p = 0; p < 16; ++p) {
      const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(nib, mask)), s_lo, z_lo);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(nib, 4)), s_hi, z_hi);
      _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// y[0:rows, 0:16] = a C tile's sums (16 fp32 a row) * scale (int8's per-output scales; none
// for int4).
template <typename out_t>
inline void store_sums(const float* sums, int rows, const float* scale, out_t* y, int64_t N) {
  const __m512 s = scale != nullptr ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums + r * 16), s);
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(y + r * N, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// silu_and_mul's rows from the sums of a block of gate outputs and the block of up outputs
// with the same columns: y[0:rows, 0:16] = silu(gate) * up, each rounded where the GEMM's
// bf16 output and silu_and_mul round them (the gate and up values, silu's result, the
// product), so equal to the bit to silu_and_mul(linear_amx(x)).
inline void store_silu(const float* gate, const float* up, int rows, const float* gate_scale, const float* up_scale,
                       at::BFloat16* y, int64_t N) {
  const vf gs = gate_scale != nullptr ? vload(gate_scale) : vset(1.f);
  const vf us = up_scale != nullptr ? vload(up_scale) : vset(1.f);
  for (int r = 0; r < rows; ++r) {
    const vf g = round_as<at::BFloat16>(vmul(vload(gate + r * 16), gs));
    const vf u = round_as<at::BFloat16>(vmul(vload(up + r * 16), us));
    const vf act = round_as<at::BFloat16>(vmul(g, vrcp(vadd(vset(1.f), vexp(vsub(vzero(), g))))));
    vstore(y + r * N, vmul(act, u));
  }
}

// Silu: the weights are a gate/up projection (gate outputs, then as many up outputs), and y
// gets silu_and_mul's [M, N / 2] instead of the [M, N] sums. Each unit pairs a block of gate
// outputs with the up block of the same columns, so that the epilogue holds both.
template <bool Signed, typename out_t, bool Silu = false>
void gemm_amx(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero,
              out_t* y, int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock, tile_bytes = 16 * pair_bytes<Signed>();
  const int64_t stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  // Steps of up to 32 rows (decode) take one block of outputs at a time: widening is most of
  // their time, and with two blocks they ran slower; bigger steps pair the blocks, faster
  // there (docs/benchmarks.md).
  const bool paired = Silu || M > 2 * kAmxRows;
  // A unit's second block: the next one, or (Silu) the up block of the gate block's columns.
  const int64_t partner = Silu ? blocks / 2 : 1, y_width = Silu ? N / 2 : N;
  const int64_t units = Silu ? blocks / 2 : paired ? (blocks + 1) / 2 : blocks;
  // A unit's passes of up to 32 rows, and the group iterations it spreads the next unit's
  // prefetches over: those of its later passes, or of its one pass.
  const int64_t passes = (M + 2 * kAmxRows - 1) / (2 * kAmxRows);
  const int64_t later = (passes > 1 ? passes - 1 : 1) * G;
  parallel_items(units, [&](int64_t begin, int64_t end, int64_t after) {
    // Each thread's widened tiles live from call to call: a fresh vector per call zeroed up to
    // 96 KiB, 120 calls a step.
    thread_local std::vector<at::BFloat16> widened;
    if (widened.size() < static_cast<size_t>((paired ? 2 : 1) * G * 16 * 32)) {
      widened.resize((paired ? 2 : 1) * G * 16 * 32);
    }
    alignas(64) float sums[kAmxRows * 16];
    int configured = -1;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b0 = Silu ? unit : paired ? 2 * unit : unit;
      const int64_t b1 = b0 + partner;
      const bool two = paired && b1 < blocks;  // N / 16 odd: the last block goes alone
      at::BFloat16* wide[2] = {widened.data(), widened.data() + (two ? G * 16 * 32 : 0)};
      auto widen = [&](int64_t b, int t, int64_t g) {
        const float* zb = zero == nullptr ? nullptr : zero + (b * G + g) * kOutBlock;
        widen_tile<Signed>(w + (b * G + g) * tile_bytes, scale + (b * G + g) * kOutBlock, zb,
                           wide[t] + g * 16 * 32);
      };
      // The next unit's weights (its blocks' packed bytes, scales and zeros each lie
      // contiguous) are asked for into L2 a share per group while this unit runs: during
      // its later passes, which read only tiles already widened, or during its one pass in
      // steps of up to 32 rows. The next unit then widens from the cache, not from memory
      // (5-15% faster in the model). Widening the next unit's tiles ahead instead, during
      // the later passes, won with the weights in cache and lost in the model
      // (docs/benchmarks.md).
      const int64_t nu = unit + 1 < end ? unit + 1 : after;  // the thread's next unit
      const bool ahead = nu >= 0;
      // (Silu: its gate block here, its up block, `partner` blocks on, through the *_up's.)
      const int64_t nb0 = !ahead ? b0 : Silu ? nu : paired ? 2 * nu : nu;
      const int64_t nblocks = Silu ? 1 : std::min<int64_t>(paired ? 2 : 1, blocks - nb0);
      const char* next_w = reinterpret_cast<const char*>(w + nb0 * G * tile_bytes);
      const char* next_s = reinterpret_cast<const char*>(scale + nb0 * G * kOutBlock);
      const char* next_z = zero == nullptr ? nullptr : reinterpret_cast<const char*>(zero + nb0 * G * kOutBlock);
      const int64_t up_w = partner * G * tile_bytes, up_s = partner * G * kOutBlock * 4;
      const int64_t w_lines = ahead ? nblocks * G * tile_bytes / 64 : 0;
      const int64_t s_lines = ahead ? nblocks * G * kOutBlock * 4 / 64 : 0;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
        const int r0 = static_cast<int>(std::min<int64_t>(kAmxRows, M - m0));
        const int r1 = static_cast<int>(std::clamp<int64_t>(M - m0 - kAmxRows, 0, kAmxRows));
        if (configured != r0 * 32 + r1) {
          amx_configure(r0, r1);
          configured = r0 * 32 + r1;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (r1 > 0) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const at::BFloat16* x0 = x + m0 * K;
        const at::BFloat16* x1 = x0 + kAmxRows * K;
        // The first pass widens each group as it goes; later passes (steps of more than 32
        // rows) reuse the widened tiles.
        for (int64_t g = 0; g < G; ++g) {
          if (m0 == 0) {
            widen(b0, 0, g);
            if (two) widen(b1, 1, g);
          }
          _tile_loadd(6, wide[0] + g * 16 * 32, 64);
          _tile_loadd(4, x0 + g * kGroup, stride);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            _tile_loadd(7, wide[1] + g * 16 * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (r1 > 0) {
            _tile_loadd(5, x1 + g * kGroup, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
          }
          if (ahead && (m0 > 0 || passes == 1)) {  // iteration i of `later`: its share of the lines
            const int64_t i = (passes > 1 ? m0 / (2 * kAmxRows) - 1 : 0) * G + g;
            for (int64_t l = i * w_lines / later; l < (i + 1) * w_lines / later; ++l) {
              _mm_prefetch(next_w + l * 64, _MM_HINT_T1);
              if constexpr (Silu) _mm_prefetch(next_w + up_w + l * 64, _MM_HINT_T1);
            }
            for (int64_t l = i * s_lines / later; l < (i + 1) * s_lines / later; ++l) {
              _mm_prefetch(next_s + l * 64, _MM_HINT_T1);
              if (next_z != nullptr) _mm_prefetch(next_z + l * 64, _MM_HINT_T1);
              if constexpr (Silu) {
                _mm_prefetch(next_s + up_s + l * 64, _MM_HINT_T1);
                if (next_z != nullptr) _mm_prefetch(next_z + up_s + l * 64, _MM_HINT_T1);
              }
            }
          }
        }
        if constexpr (Silu) {
          static_assert(std::is_same_v<out_t, at::BFloat16>, "silu_and_mul's output is bf16");
          alignas(64) float up[kAmxRows * 16];
          const float* s_gate = Signed ? scale + b0 * G * kOutBlock : nullptr;
          const float* s_up = Signed ? scale + b1 * G * kOutBlock : nullptr;
          out_t* yb = y + m0 * y_width + b0 * kOutBlock;
          _tile_stored(0, sums, 64);
          _tile_stored(1, up, 64);
          store_silu(sums, up, r0, s_gate, s_up, yb, y_width);
          if (r1 > 0) {
            _tile_stored(2, sums, 64);
            _tile_stored(3, up, 64);
            store_silu(sums, up, r1, s_gate, s_up, yb + kAmxRows * y_width, y_width);
          }
          continue;
        }
        for (int t = 0; t < (two ? 2 : 1); ++t) {
          const float* s_out = Signed ? scale + (b0 + t) * G * kOutBlock : nullptr;
          out_t* yb = y + m0 * N + (b0 + t) * kOutBlock;
          if (t == 0) _tile_stored(0, sums, 64); else _tile_stored(1, sums, 64);
          store_sums(sums, r0, s_out, yb, N);
          if (r1 > 0) {
            if (t == 0) _tile_stored(2, sums, 64); else _tile_stored(3, sums, 64);
            store_sums(sums, r1, s_out, yb + kAmxRows * N, N);
          }
        }
      }
    }
    if (configured >= 0) _tile_release();
  });
}
#endif

}  // namespace

// Weight-only int4 (uint8 nibbles, with zero) or int8 (int8 q, no zero) in linear_i16's layout,
// on AMX tiles (see gemm_amx): x bf16 [M, K] -> [M, N] bf16, or fp32 (the sums as they are)
// where fp32_out. Only where the kernels are built with AMX and the kernel lets the process use
// the tiles (amx_available). With silu, the weights are a gate/up projection (N / 2 gate
// outputs, then N / 2 up) and the result is silu_and_mul's [M, N / 2] bf16, equal to the bit
// to silu_and_mul(linear_amx(x)): each unit pairs a gate block with its up block (two blocks
// a unit, as steps of more than 32 rows run anyway) and the [M, N] projection is never
// written out (constants.SILU_FUSED_ABOVE says where that pays).
static at::Tensor run_linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero, bool fp32_out, bool silu = false) {
#if defined(TY_AMX)
  TORCH_CHECK(amx_permitted(), "the kernel did not grant this process the AMX tiles");
  const bool is_signed = check_i16_layout(qweight, zero);
  check_blocked(x, qweight, scale, zero);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_amx takes bf16 activations");
  TORCH_CHECK(!silu || (!fp32_out && qweight.size(0) % 2 == 0),
              "linear_amx_silu needs as many up blocks of 16 outputs as gate blocks, and gives bf16");
  const int64_t N = qweight.size(0) * kOutBlock, K = qweight.size(1) * kGroup, M = x.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({M, silu ? N / 2 : N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero ? zero->data_ptr<float>() : nullptr;
  auto run = [&](auto* y, auto with_silu) {
    constexpr bool kSilu = decltype(with_silu)::value;
    using out_t = std::remove_pointer_t<decltype(y)>;
    if (is_signed) {
      gemm_amx<true, out_t, kSilu>(xp, M, K, w, sp, zp, y, N);
    } else {
      gemm_amx<false, out_t, kSilu>(xp, M, K, w, sp, zp, y, N);
    }
  };
  if (silu) {
    run(out.data_ptr<at::BFloat16>(), std::true_type{});
  } else if (fp32_out) {
    run(out.data_ptr<float>(), std::false_type{});
  } else {
    run(out.data_ptr<at::BFloat16>(), std::false_type{});
  }
  return out;
#else
  TORCH_CHECK(false, "linear_amx needs a CPU with AMX-BF16 (and kernels built there)");
#endif
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero, bool fp32_out) {
  NoGil nogil;
  return run_linear_amx(x, qweight, scale, zero, fp32_out);
}

// linear_amx of a gate/up projection with silu_and_mul in its epilogue (run_linear_amx's silu).
at::Tensor linear_amx_silu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& zero) {
  NoGil nogil;
  return run_linear_amx(x, qweight, scale, zero, false, true);
}

// Whether linear_amx runs here: built with AMX and granted the tiles by the kernel.
bool amx_available() {
#if defined(TY_AMX)
  return amx_permitted();
#else
  return false;
#endif
}
