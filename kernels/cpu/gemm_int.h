// linear_i16, linear_i8: int4 and int8 GEMMs in integer arithmetic against int16 (or, for
// int4, 8-bit) activations: at every row count on AVX2 CPUs without native bf16, for small
// steps of bf16 layers on AVX512-VNNI (twin: the dequantized weight times the rounded
// activations, in the tests).
#pragma once

#include "common.h"
#include "gemv.h"

namespace {

#if defined(__AVX2__)
// Weight-only int4 or int8 against int16 activations, for CPUs without native bf16, where
// steps of many rows (prefill, big decode batches) ran the fp32 dense matmul and small ones
// the fp32 kernels above. Each row of x is scaled into int16 (one fp32 scale per row: absmax
// / 32767, 15 bits, finer than bf16's 8), and vpmaddwd multiplies a pair of activations into
// eight outputs' pairs of weights: 16 multiply-adds an instruction against 8 for an fp32 FMA,
// at the same rate (two a cycle on Zen 3). Products of a group of 32 inputs sum exactly in
// int32; each group's sum is then scaled in fp32:
//   y[m, n] = xs[m] * sum_g (scale[n, g] * sum_j q[n, g, j] * xi[m, g, j] + zero[n, g] * xsum[m, g] / xs[m])
// with xsum the group's fp32 sum of x (int4: w = q * scale + zero, Q4_1's groups; int8: w = q
// * scale, one scale per output repeated for every group, no zero). A row's result never
// depends on the other rows. The weights are repacked (quantize.pack_i16) as [N / 16, G, 16
// pairs of inputs, B]: word 2i + t of a pair's first operand is q[n0 + i, 2p + t], of its
// second q[n0 + 8 + i, 2p + t]. int8 keeps a byte per weight (B = 32: the two operands' 16
// bytes each, widened with sign); int4 a nibble (B = 16: byte j holds word j of the first
// operand in its low nibble and of the second in its high one), half the bytes to read.
// scale and zero as [N / 16, G, 16] fp32.
constexpr int64_t kOutBlock = 16;  // outputs per block: two vectors of eight int32 lanes
constexpr int64_t kRowTile = 4;    // rows whose accumulators live in registers together
constexpr int64_t kRowPanel = 64;  // rows whose int16 activations stay in L2 while the blocks go by

// tile(rows, m0, b) for every tile of up to RowTile rows from row m0 and every block b of
// kOutBlock outputs: blocks split between threads (parallel_items), rows in panels of kRowPanel
// within each run of blocks.
template <int RowTile = kRowTile, typename Tile>
void for_tiles(int64_t M, int64_t blocks, Tile&& tile) {
  parallel_items(blocks, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t p0 = 0; p0 < M; p0 += kRowPanel) {
      const int64_t p1 = std::min(M, p0 + kRowPanel);
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m0 = p0; m0 < p1; m0 += RowTile)
          with_rows<RowTile>(std::min<int64_t>(RowTile, p1 - m0), [&](auto rows) { tile(rows, m0, b); });
    }
  });
}

// Bytes of one pair of inputs for 16 outputs: int4 nibbles (Signed false) or int8 bytes.
template <bool Signed>
constexpr int64_t pair_bytes() {
  return Signed ? 32 : 16;
}

// The pair's two vpmaddwd operands (outputs 0-7, 8-15), widened to words.
template <bool Signed>
inline void pair_operands(const uint8_t* p, __m256i& lo, __m256i& hi) {
  if constexpr (Signed) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(b, 4);
  }
}

// The four-row tile's inner loop over a group's 16 pairs of inputs (WIDEN: the asm that puts
// the pair's operands in ymm8 and ymm9). Written out because GCC kept some of the intrinsics
// version's 8 accumulators on the stack (a chain through memory every pair); here they stay
// in registers.
#define TY_I16_GROUP(WIDEN, STRIDE)                                                                                \
  for (int p = 0; p < 16; ++p) {                                                                                   \
    asm(WIDEN "vpbroadcastd (%[x0]), %%ymm10\n\t"                                                                   \
              "vpbroadcastd (%[x1]), %%ymm11\n\t"                                                                  \
              "vpbroadcastd (%[x2]), %%ymm12\n\t"                                                                  \
              "vpbroadcastd (%[x3]), %%ymm13\n\t"                                                                  \
              "vpmaddwd %%ymm10, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm10, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a00], %[a00]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a01], %[a01]\n\t"                                                                 \
              "vpmaddwd %%ymm11, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm11, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a10], %[a10]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a11], %[a11]\n\t"                                                                 \
              "vpmaddwd %%ymm12, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm12, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a20], %[a20]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a21], %[a21]\n\t"                                                                 \
              "vpmaddwd %%ymm13, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm13, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a30], %[a30]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a31], %[a31]"                                                                     \
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a20] "+x"(a[2][0]), \
          [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1])                                            \
        : [w] "r"(wg + p * (STRIDE)), [x0] "r"(xg + 2 * p), [x1] "r"(xg + K + 2 * p),                             \
          [x2] "r"(xg + 2 * K + 2 * p), [x3] "r"(xg + 3 * K + 2 * p), [mask] "m"(low_nibbles)                     \
        : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");                         \
  }

template <int MR, bool Signed>
void i16_tile(const int16_t* x, int64_t K, const float* xsum, const float* xs, const uint8_t* w, const float* scale,
              const float* zero, int64_t G, float* out, int64_t N) {
  constexpr int64_t stride = pair_bytes<Signed>();
  alignas(32) static const int16_t low_nibbles[16] = {15, 15, 15, 15, 15, 15, 15, 15,
                                                      15, 15, 15, 15, 15, 15, 15, 15};
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 16 * stride;
    const int16_t* xg = x + g * kGroup;
    if constexpr (MR == 4) {
      if constexpr (Signed) {
        TY_I16_GROUP("vpmovsxbw (%[w]), %%ymm8\n\tvpmovsxbw 16(%[w]), %%ymm9\n\t", stride)
      } else {
        TY_I16_GROUP("vpmovzxbw (%[w]), %%ymm8\n\tvpsrlw $4, %%ymm8, %%ymm9\n\tvpand %[mask], %%ymm8, %%ymm8\n\t",
                     stride)
      }
    } else {
      for (int p = 0; p < 16; ++p) {
        __m256i lo, hi;
        pair_operands<Signed>(wg + p * stride, lo, hi);
        for (int m = 0; m < MR; ++m) {
          int32_t pair;
          std::memcpy(&pair, xg + m * K + 2 * p, sizeof(pair));
          const __m256i xb = _mm256_set1_epi32(pair);
          a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(lo, xb));
          a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(hi, xb));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + g * kOutBlock + 8 * h);
      for (int m = 0; m < MR; ++m) f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][h]), s, f[m][h]);
      if (zero != nullptr) {
        const __m256 z = _mm256_loadu_ps(zero + g * kOutBlock + 8 * h);
        for (int m = 0; m < MR; ++m) f[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[m * G + g]), f[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 r = _mm256_set1_ps(xs[m]);
    _mm256_storeu_ps(out + m * N, _mm256_mul_ps(f[m][0], r));
    _mm256_storeu_ps(out + m * N + 8, _mm256_mul_ps(f[m][1], r));
  }
}
#undef TY_I16_GROUP

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TY_VNNI 1
// The same GEMM on AVX512-VNNI (a Zen 4 EPYC, Ice Lake and later Xeons), where the engine
// computes in bf16: vpdpwssd multiplies 16 pairs of int16 and adds them into int32 lanes in one
// instruction, 32 multiply-adds, one a cycle on a 2-core Zen 4, as many as vdpbf16ps. A block
// of 16 outputs is one zmm: a pair's two operands (outputs 0-7, then 8-15) side by side, the
// same packed layout as the AVX2 tile reads, and each row's activation pair is broadcast
// from memory into the instruction. Up to 16 rows share each widened weight vector (as fast
// as 8 at 16 rows, faster at 24: docs/benchmarks.md).
constexpr int64_t kRowTileVnni = 16;

// A pair of inputs for 16 outputs as 32 words: int32 lane i holds output i's two weights.
template <bool Signed>
inline __m512i pair_vector(const uint8_t* p) {
  if constexpr (Signed) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {  // byte j: word j of the first operand in its low nibble, of the second in its high one
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(b, shift), _mm512_set1_epi16(0x0F));
  }
}

// acc += vpdpwssd(w, the int16 pair at p broadcast to every lane). In asm because GCC copied
// every accumulator to another register and back around the intrinsic (16 moves a pair).
inline void dpwssd_pair(__m512i& acc, __m512i w, const int16_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

template <int MR, bool Signed>
void i16_tile_vnni(const int16_t* x, int64_t K, const float* xsum, const float* xs, const uint8_t* w,
                   const float* scale, const float* zero, int64_t G, float* out, int64_t N) {
  constexpr int64_t stride = pair_bytes<Signed>();
  // Few rows: a second accumulator per row, so that the adds do not wait on each other's
  // latency (integer sums are exact: the order changes nothing).
  constexpr int C = MR <= 4 ? 2 : 1;
  // Above 8 rows the fp32 sums wait in L1 between groups: the int32 ones need the registers.
  constexpr bool kSpill = MR > 8;
  __m512 f[kSpill ? 1 : MR];
  alignas(64) float fm[kSpill ? MR : 1][kOutBlock];
  for (int m = 0; m < MR; ++m) {
    if constexpr (kSpill) _mm512_store_ps(fm[m], _mm512_setzero_ps());
    else f[m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512i a[C][MR];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MR; ++m) a[c][m] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * 16 * stride;
    const int16_t* xg = x + g * kGroup;
    for (int p = 0; p < 16; p += C) {
      for (int c = 0; c < C; ++c) {
        const __m512i wv = pair_vector<Signed>(wg + (p + c) * stride);
        for (int m = 0; m < MR; ++m) dpwssd_pair(a[c][m], wv, xg + m * K + 2 * (p + c));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kOutBlock);
    const __m512 z = zero != nullptr ? _mm512_loadu_ps(zero + g * kOutBlock) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      __m512i sum = a[0][m];
      if constexpr (C == 2) sum = _mm512_add_epi32(sum, a[1][m]);
      __m512 acc = kSpill ? _mm512_load_ps(fm[m]) : f[kSpill ? 0 : m];
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, acc);
      if (zero != nullptr) acc = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[m * G + g]), acc);
      if constexpr (kSpill) _mm512_store_ps(fm[m], acc);
      else f[m] = acc;
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 acc = kSpill ? _mm512_load_ps(fm[m]) : f[kSpill ? 0 : m];
    _mm512_storeu_ps(out + m * N, _mm512_mul_ps(acc, _mm512_set1_ps(xs[m])));
  }
}
#endif

// kW floats rounded to the nearest int16 (ties to even, as std::nearbyint), saturating.
inline void vstore_i16(int16_t* p, vf v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
#else
  const __m256i i = _mm256_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
#endif
}

// x fp32 [M, K] -> xi int16 [M, K], xs [M] (the row's scale), xsum [M, G] (group sums / xs).
// Vectorized: at 512 rows of SmolLM2's layers the scalar loop took a fifth of the GEMM's time.
void quantize_rows_i16(const float* x, int64_t M, int64_t K, int16_t* xi, float* xs, float* xsum) {
  const int64_t G = K / kGroup;
  static_assert(kGroup % kW == 0, "a group is whole vectors");
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      vf vmx = vzero();
      for (int64_t k = 0; k < K; k += kW) vmx = vmax(vmx, vmax(vload(row + k), vsub(vzero(), vload(row + k))));
      const float amax = vhmax(vmx);
      const float s = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / s;
      const vf vinv = vset(inv);
      xs[m] = s;
      for (int64_t g = 0; g < G; ++g) {
        vf sum = vzero();
        for (int64_t j = 0; j < kGroup; j += kW) {
          const vf v = vload(row + g * kGroup + j);
          sum = vadd(sum, v);
          vstore_i16(xi + m * K + g * kGroup + j, vmul(v, vinv));
        }
        xsum[m * G + g] = vsum(sum) * inv;
      }
    }
  });
}

template <bool Signed>
void gemm_i16(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero, float* out,
              int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock;
  std::vector<int16_t> xi(M * K);
  std::vector<float> xs(M), xsum(M * G);
  quantize_rows_i16(x, M, K, xi.data(), xs.data(), xsum.data());
#if defined(TY_VNNI)
  for_tiles<kRowTileVnni>(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    const float* zb = zero == nullptr ? nullptr : zero + b * G * kOutBlock;
    i16_tile_vnni<decltype(rows)::value, Signed>(xi.data() + m0 * K, K, xsum.data() + m0 * G, xs.data() + m0,
                                                 w + b * G * 16 * pair_bytes<Signed>(), scale + b * G * kOutBlock, zb,
                                                 G, out + m0 * N + b * kOutBlock, N);
  });
#else
  for_tiles(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    const float* zb = zero == nullptr ? nullptr : zero + b * G * kOutBlock;
    i16_tile<decltype(rows)::value, Signed>(xi.data() + m0 * K, K, xsum.data() + m0 * G, xs.data() + m0,
                                            w + b * G * 16 * pair_bytes<Signed>(), scale + b * G * kOutBlock, zb, G,
                                            out + m0 * N + b * kOutBlock, N);
  });
#endif
}

// int4 weights against int8 activations quantized per group of 32 (one fp32 scale per row and
// group: absmax / 127), as llama.cpp pairs Q4_1 weights with Q8_1 activations on x86.
// vpmaddubsw multiplies the weights' unsigned nibbles by the activations' signed bytes, 32
// products an instruction summed in pairs into int16 (at most 2 * 15 * 127 each: a group's
// 8 such sums stay below 2^15); one vpmaddwd by ones per group widens them to int32. About
// half the instructions of the int16 path per multiply-add, at 8 bits of activation.
//   y[m, n] = sum_g (scale[n, g] * xs[m, g] * sum_j q[n, g, j] * xq[m, g, j] + zero[n, g] * xsum[m, g])
// Weights as [N / 16, G, 8 quads of inputs, 64] (quantize.pack_i8): byte 4i + t of quad p's
// first 32 holds q[n0 + i, 4p + t], of its second 32 q[n0 + 8 + i, 4p + t]; a byte per weight.
#define TY_I8_QUAD                                                                                               \
  asm("vmovdqu (%[w]), %%ymm8\n\t"                                                                               \
      "vmovdqu 32(%[w]), %%ymm9\n\t"                                                                             \
      "vpbroadcastd (%[x0]), %%ymm10\n\t"                                                                        \
      "vpbroadcastd (%[x1]), %%ymm11\n\t"                                                                        \
      "vpbroadcastd (%[x2]), %%ymm12\n\t"                                                                        \
      "vpbroadcastd (%[x3]), %%ymm13\n\t"                                                                        \
      "vpmaddubsw %%ymm10, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm10, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a00], %[a00]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a01], %[a01]\n\t"                                                                       \
      "vpmaddubsw %%ymm11, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm11, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a10], %[a10]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a11], %[a11]\n\t"                                                                       \
      "vpmaddubsw %%ymm12, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm12, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a20], %[a20]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a21], %[a21]\n\t"                                                                       \
      "vpmaddubsw %%ymm13, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm13, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a30], %[a30]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a31], %[a31]"                                                                           \
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a20] "+x"(a[2][0]), \
        [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1])                                            \
      : [w] "r"(wg + p * 64), [x0] "r"(xg + 4 * p), [x1] "r"(xg + K + 4 * p), [x2] "r"(xg + 2 * K + 4 * p),      \
        [x3] "r"(xg + 3 * K + 4 * p)                                                                             \
      : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory")

template <int MR>
void i8_tile(const int8_t* x, int64_t K, const float* xsc, const float* xsum, const uint8_t* w, const float* scale,
             const float* zero, int64_t G, float* out, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 512;
    const int8_t* xg = x + g * kGroup;
    if constexpr (MR == 4) {
      for (int p = 0; p < 8; ++p) TY_I8_QUAD;
    } else {
      for (int p = 0; p < 8; ++p) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64 + 32));
        for (int m = 0; m < MR; ++m) {
          int32_t quad;
          std::memcpy(&quad, xg + m * K + 4 * p, sizeof(quad));
          const __m256i xb = _mm256_set1_epi32(quad);
          a[m][0] = _mm256_add_epi16(a[m][0], _mm256_maddubs_epi16(lo, xb));
          a[m][1] = _mm256_add_epi16(a[m][1], _mm256_maddubs_epi16(hi, xb));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + g * kOutBlock + 8 * h);
      const __m256 z = _mm256_loadu_ps(zero + g * kOutBlock + 8 * h);
      for (int m = 0; m < MR; ++m) {
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m][h], ones));
        f[m][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(s, _mm256_set1_ps(xsc[m * G + g])), f[m][h]);
        f[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[m * G + g]), f[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * N, f[m][0]);
    _mm256_storeu_ps(out + m * N + 8, f[m][1]);
  }
}
#undef TY_I8_QUAD

// x fp32 [M, K] -> xq int8 [M, K], xsc [M, G] (each group's scale), xsum [M, G] (fp32 group sums).
void quantize_rows_i8(const float* x, int64_t M, int64_t K, int8_t* xq, float* xsc, float* xsum) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* v = x + m * K + g * kGroup;
        float amax = 0.f, sum = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) {
          amax = std::max(amax, std::fabs(v[j]));
          sum += v[j];
        }
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        const float inv = 1.f / s;
        for (int64_t j = 0; j < kGroup; ++j) xq[m * K + g * kGroup + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        xsc[m * G + g] = s;
        xsum[m * G + g] = sum;
      }
    }
  });
}

void gemm_i8(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero, float* out,
             int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xsc(M * G), xsum(M * G);
  quantize_rows_i8(x, M, K, xq.data(), xsc.data(), xsum.data());
  for_tiles(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    i8_tile<decltype(rows)::value>(xq.data() + m0 * K, K, xsc.data() + m0 * G, xsum.data() + m0 * G,
                                   w + b * G * 512, scale + b * G * kOutBlock, zero + b * G * kOutBlock, G,
                                   out + m0 * N + b * kOutBlock, N);
  });
}
#endif

#if defined(__AVX2__)
// The integer GEMMs' operands: scale (and zero, where given) fp32 [N / 16, K / 32, 16] as
// qweight's first two dimensions say, x floating point [M, K].
void check_blocked(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& zero) {
  const int64_t G = qweight.size(1), K = G * kGroup;
  std::vector<const at::Tensor*> params{&scale};
  if (zero) params.push_back(&*zero);
  for (const auto* t : params) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == qweight.size(0) && t->size(1) == G && t->size(2) == kOutBlock,
                "scale and zero must be contiguous fp32 [N / 16, K / 32, 16]");
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
}

// pack_i16's layout: int8 q a byte per weight (no zero) or uint8 nibbles (with a zero); scale
// and zero as check_blocked says. Returns whether the weights are int8.
bool check_i16_layout(const at::Tensor& qweight, const c10::optional<at::Tensor>& zero) {
  const bool is_signed = qweight.scalar_type() == at::kChar;
  TORCH_CHECK((is_signed || qweight.scalar_type() == at::kByte) && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == 16 && qweight.size(3) == (is_signed ? 32 : 16),
              "qweight must be contiguous int8 [N / 16, K / 32, 16, 32] or uint8 nibbles [N / 16, K / 32, 16, 16]");
  TORCH_CHECK(is_signed != zero.has_value(), "int4 (uint8) weights take a zero, int8 weights none");
  return is_signed;
}
#endif

}  // namespace

// Weight-only int4 (uint8 nibbles, with zero) or int8 (int8 q, no zero) against int16
// activations (see gemm_i16): x [M, K] -> [M, N] in x's dtype, any M; qweight [N / 16, K / 32,
// 16, 16 or 32] as quantize.pack_i16 lays it out, scale and zero fp32 [N / 16, K / 32, 16]. Only
// where the kernels are built with AVX2 (i16_available).
static at::Tensor run_linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero) {
#if defined(__AVX2__)
  const bool is_signed = check_i16_layout(qweight, zero);
  const int64_t N = qweight.size(0) * kOutBlock, G = qweight.size(1), K = G * kGroup;
  check_blocked(x, qweight, scale, zero);
  const int64_t M = x.size(0);
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (is_signed) {
    gemm_i16<true>(xf.data_ptr<float>(), M, K, w, scale.data_ptr<float>(), nullptr, out.data_ptr<float>(), N);
  } else {
    gemm_i16<false>(xf.data_ptr<float>(), M, K, w, scale.data_ptr<float>(), zero->data_ptr<float>(),
                    out.data_ptr<float>(), N);
  }
  return out.to(x.scalar_type());
#else
  TORCH_CHECK(false, "linear_i16 needs a CPU with AVX2");
#endif
}

at::Tensor linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero) {
  NoGil nogil;
  return run_linear_i16(x, qweight, scale, zero);
}

// int4 weights (uint8 q in [0, 16), quantize.pack_i8's layout [N / 16, K / 32, 8, 64]) against
// activations quantized to int8 per group of 32 (see gemm_i8); scale, zero fp32 [N / 16, K / 32, 16].
static at::Tensor run_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zero) {
#if defined(__AVX2__)
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == 8 && qweight.size(3) == 64,
              "qweight must be contiguous uint8 [N / 16, K / 32, 8, 64]");
  const int64_t N = qweight.size(0) * kOutBlock, G = qweight.size(1), K = G * kGroup;
  check_blocked(x, qweight, scale, zero);
  const int64_t M = x.size(0);
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_i8(xf.data_ptr<float>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>(),
          out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
#else
  TORCH_CHECK(false, "linear_i8 needs a CPU with AVX2");
#endif
}

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zero) {
  NoGil nogil;
  return run_linear_i8(x, qweight, scale, zero);
}

// Whether linear_i16 is built here.
bool i16_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// Whether linear_i16 runs its AVX512-VNNI tile here (vpdpwssd) rather than the AVX2 one.
bool i16_vnni() {
#if defined(TY_VNNI)
  return true;
#else
  return false;
#endif
}
