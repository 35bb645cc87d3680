// int8_linear, int4_linear: weight-only GEMMs for steps of a few rows, where decoding is
// bound by the bytes of weights read (twin: tokenyard.models.quantize.QuantizedLinear). int4
// runs here on x86 CPUs with AVX2 or AVX-512: in fp32 without native bf16 (where torch's int4
// kernel converts its activations to bf16 in software), with bf16 dot products on
// AVX512-BF16.
#pragma once

#include "common.h"

namespace {

// The GEMV kernel takes the rows in chunks of at most kChunk, with each row's accumulators
// held in registers (MB is a template argument, so the row loops unroll) and split in two
// so that consecutive FMAs do not wait on each other. A chunk re-reads the weights; steps
// big enough for that to matter take the dense path instead.
constexpr int64_t kChunk = 4;

// out[m, n] = scale[n] * sum_k x[m, k] * q[n, k]; q int8 [N, K], scale fp32 [N].
template <int MB>
void int8_gemv_chunk(const float* x, int64_t K, const int8_t* q, const float* scale, float* out, int64_t N,
                     int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = q + n * K;
    float acc[MB] = {};
    int64_t k = 0;
#if defined(TY_VEC)
    // The vector loop: the scalar one below alone took 3.7 times torch's int8 kernel's
    // time (docs/benchmarks.md).
    vf a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = vzero();
    for (; k + 2 * kW <= K; k += 2 * kW) {
      const vf w0 = vload_i8(row + k), w1 = vload_i8(row + k + kW);
      for (int m = 0; m < MB; ++m) {
        a0[m] = vfma(w0, vload(x + m * K + k), a0[m]);
        a1[m] = vfma(w1, vload(x + m * K + k + kW), a1[m]);
      }
    }
    for (int m = 0; m < MB; ++m) acc[m] = vsum(vadd(a0[m], a1[m]));
#endif
    for (; k < K; ++k) {
      for (int m = 0; m < MB; ++m) acc[m] += static_cast<float>(row[k]) * x[m * K + k];
    }
    for (int m = 0; m < MB; ++m) out[m * N + n] = acc[m] * scale[n];
  }
}

// fn(std::integral_constant<int, R>{}, m0) for each chunk of R <= kRows rows from row m0:
// the weight-only GEMMs take the chunk's row count as a template argument, so that each
// row's accumulators are unrolled into registers.
template <int R, typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, fn);
  }
  fn(std::integral_constant<int, R>{});
}

template <int kRows, typename Fn>
void for_row_chunks(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&](auto r) { fn(r, m0); });
}

// out = x @ (q * scale)^T for every chunk of rows, output rows in parallel.
void int8_gemv(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, float* out, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk>(M, [&](auto rows, int64_t m0) {
      int8_gemv_chunk<decltype(rows)::value>(x + m0 * K, K, q, scale, out + m0 * N, N, begin, end);
    });
  });
}

// Weight-only int4 in GGUF Q4_1's layout: row n of q holds K / 32 groups of 16 bytes, whose
// low nibbles are the group's weights 0-15 and high nibbles 16-31; w = q * scale + zero, one
// fp32 scale and zero per (row, group). Each group is unpacked and scaled once per chunk of
// up to kChunk4 rows, then multiplied into every row of the chunk: torch's int4 kernel
// unpacks once per four rows, and its time doubles with each doubling of the rows
// (docs/benchmarks.md).
constexpr int64_t kChunk4 = 8;

template <int MB>
void int4_gemm_chunk(const float* x, int64_t K, const uint8_t* q, const float* scale, const float* zero, float* out,
                     int64_t N, int64_t begin, int64_t end) {
  const int64_t G = K / kGroup;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const float* sr = scale + n * G;
    const float* zr = zero + n * G;
    float acc[MB] = {};
#if defined(TY_VEC)
    vf a[MB];
    for (int m = 0; m < MB; ++m) a[m] = vzero();
    alignas(16) uint8_t nib[kGroup];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      _mm_store_si128(reinterpret_cast<__m128i*>(nib), _mm_and_si128(b, low));
      _mm_store_si128(reinterpret_cast<__m128i*>(nib + 16), _mm_and_si128(_mm_srli_epi16(b, 4), low));
      const vf s = vset(sr[g]), z = vset(zr[g]);
      for (int v = 0; v < kGroup / kW; ++v) {
        const vf w = vfma(vload_u8(nib + v * kW), s, z);
        for (int m = 0; m < MB; ++m) a[m] = vfma(w, vload(x + m * K + g * kGroup + v * kW), a[m]);
      }
    }
    for (int m = 0; m < MB; ++m) acc[m] = vsum(a[m]);
#else
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < kGroup; ++j) {
        const uint8_t byte = row[g * 16 + (j & 15)];
        const float w = static_cast<float>(j < 16 ? byte & 15 : byte >> 4) * sr[g] + zr[g];
        for (int m = 0; m < MB; ++m) acc[m] += w * x[m * K + g * kGroup + j];
      }
    }
#endif
    for (int m = 0; m < MB; ++m) out[m * N + n] = acc[m];
  }
}

#if defined(TY_DOT_BF16)
// The same layout with bf16 activations on a CPU with AVX512-BF16. Each group becomes 32 bf16
// weights once per chunk: its 16 values q * scale + zero form a table, and one permute per
// 16 nibbles looks them up (no integer-to-float conversions); each row of the chunk then
// takes one vdpbf16ps per group (32 products summed into fp32 lanes) on its activations as
// they are. The groups alternate between two accumulators per row, so that with one or two
// rows the additions do not all wait on each other; every chunk size does the same (a row's
// sums, in the same order, whatever its neighbours: deterministic mode relies on it).
// Faster than torch's int4 kernel from 1 row on (docs/benchmarks.md).
template <int MB>
void int4_gemm_chunk_bf16(const at::BFloat16* x, int64_t K, const uint8_t* q, const float* scale, const float* zero,
                          float* out, int64_t N, int64_t begin, int64_t end) {
  const int64_t G = K / kGroup;
  const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  constexpr int A = 2;  // accumulator chains per row
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const float* sr = scale + n * G;
    const float* zr = zero + n * G;
    vf a[A][MB];
    for (int c = 0; c < A; ++c)
      for (int m = 0; m < MB; ++m) a[c][m] = vzero();
    auto group = [&](int64_t g, vf* acc) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      const vf table = vfma(iota, vset(sr[g]), vset(zr[g]));
      const __m512i idx = _mm512_cvtepu8_epi32(b);  // the permute reads each lane's low 4 bits
      const vf lo = _mm512_permutexvar_ps(idx, table);
      const vf hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // weights 0-15, then 16-31
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_loadu_si512(x + m * K + g * kGroup));
    };
    int64_t g = 0;
    for (; g + A <= G; g += A)
      for (int c = 0; c < A; ++c) group(g + c, a[c]);
    for (; g < G; ++g) group(g, a[0]);
    for (int m = 0; m < MB; ++m) {
      vf t = a[0][m];
      for (int c = 1; c < A; ++c) t = vadd(t, a[c][m]);
      out[m * N + n] = vsum(t);
    }
  }
}

void int4_gemm_bf16(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                    const float* zero, float* out, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk4>(M, [&](auto rows, int64_t m0) {
      int4_gemm_chunk_bf16<decltype(rows)::value>(x + m0 * K, K, q, scale, zero, out + m0 * N, N, begin, end);
    });
  });
}
#endif

void int4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, const float* zero,
               float* out, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk4>(M, [&](auto rows, int64_t m0) {
      int4_gemm_chunk<decltype(rows)::value>(x + m0 * K, K, q, scale, zero, out + m0 * N, N, begin, end);
    });
  });
}

void check_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most ", kMaxRows, " rows per call, got ", x.size(0));
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
}

}  // namespace

// Weight-only int8: x [M, K] (M <= 16) @ (qweight int8 [N, K] * scale fp32 [N])^T -> [M, N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  NoGil nogil;
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qweight.size(0),
              "scale must be fp32 [N]");
  check_rows(x, qweight.size(1));
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1);
  const auto xf = x.to(at::kFloat).contiguous();  // the inner loops read one format
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  int8_gemv(xf.data_ptr<float>(), M, K, qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
}

// Weight-only int4: x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized from qweight uint8
// [N, K / 2] (Q4_1 nibbles, see int4_gemm_chunk), scale and zero fp32 [N, K / 32].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const at::Tensor& zero) {
  NoGil nogil;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup);
  for (const auto* t : {&scale, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / kGroup,
                "scale and zero must be contiguous fp32 [N, K / 32]");
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
  const int64_t M = x.size(0);
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(TY_DOT_BF16)
  if (x.scalar_type() == at::kBFloat16) {
    const auto xc = x.contiguous();
    int4_gemm_bf16(xc.data_ptr<at::BFloat16>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                   zero.data_ptr<float>(), out.data_ptr<float>(), N);
    return out.to(x.scalar_type());
  }
#endif
  const auto xf = x.to(at::kFloat).contiguous();
  int4_gemm(xf.data_ptr<float>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>(),
            out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
}
