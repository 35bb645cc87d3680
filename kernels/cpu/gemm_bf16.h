// linear_bf16: the dense bf16 GEMM on AVX512-BF16 without AMX, over a weight in
// quantize.pack_pairs' layout.
#pragma once

#include "common.h"
#include "gemm_int.h"

namespace {

#if defined(TY_DOT_BF16) && defined(__AVX512BW__)
#define TY_PAIRS 1
// A bf16 GEMM for the dense copies of bf16 layers on AVX512-BF16 CPUs without AMX (a Zen 4
// EPYC), where oneDNN's bf16 matmul reached 60-140 G multiply-adds a second at decode sizes
// (8 to 32 rows) of the 230 that vdpbf16ps gives two cores. Weights as [N / 16, K / 2, 16, 2]
// (quantize.pack_pairs): per block of 16 outputs and pair of inputs, one zmm whose lane i holds
// output i's two weights, the operand vdpbf16ps multiplies against a row's pair of activations
// broadcast from memory. A tile keeps kPairRows rows by kPairBlocks blocks of fp32 sums in
// registers (24 of the 32 zmm) across the whole of K, reading each weight vector once for
// its rows; while a block's later tiles run from L2, the next block's weights are fetched
// into L2 a line per pair (the first tile reads memory at about the rate the others compute).
// Each row's sums run over K in one order whatever the step holds, so a row's result never
// depends on the other rows. Faster than oneDNN's packed bf16 matmul at every row count
// measured, twice as fast at decode sizes (docs/benchmarks.md).
constexpr int kPairRows = 8;
constexpr int kPairBlocks = 3;
constexpr int64_t kPairPanel = 192;  // rows whose activations stay in L2 while the blocks go by

// acc += vdpbf16ps(w, the bf16 pair at p broadcast to every lane). In asm, as dpwssd_pair.
inline void dpbf16_pair(__m512& acc, __m512 w, const at::BFloat16* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// y[0:MR, 0:16 NB] = x[0:MR] @ the NB blocks from w (wstride elements apart)^T; pf: the next
// blocks' weights to fetch into L2 (a line per block and pair), or null. Out of line: inlined
// into gemm_pairs, the tiles of 4 to 6 rows ran at half the rate of those of 8.
template <int MR, int NB, typename out_t>
__attribute__((noinline)) void pairs_tile(const at::BFloat16* x, int64_t K, const at::BFloat16* w,
                                          int64_t wstride, out_t* y, int64_t N, const at::BFloat16* pf) {
  __m512 acc[NB][MR];
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[nb][m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + nb * wstride + p * 32), _MM_HINT_T1);
      wv[nb] = _mm512_loadu_ps(reinterpret_cast<const float*>(w + nb * wstride + p * 32));
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int nb = 0; nb < NB; ++nb) dpbf16_pair(acc[nb][m], wv[nb], x + m * K + 2 * p);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      if constexpr (std::is_same_v<out_t, float>) {
        _mm512_storeu_ps(y + m * N + nb * kOutBlock, acc[nb][m]);
      } else {
        vstore<out_t>(y + m * N + nb * kOutBlock, acc[nb][m]);
      }
    }
}

// y [M, N] = x [M, K] @ W^T, W in pack_pairs' layout. Threads take runs of kPairBlocks blocks
// (parallel_items hands out ranges of runs); within a panel of rows, each run's tiles split
// the panel's rows evenly (8 rows or fewer a tile: 20 rows are 7 + 7 + 6, not 8 + 8 + 4).
template <typename out_t>
void gemm_pairs(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, out_t* y, int64_t N) {
  const int64_t blocks = N / kOutBlock, runs = (blocks + kPairBlocks - 1) / kPairBlocks, wstride = K * kOutBlock;
  parallel_items(runs, [&](int64_t begin, int64_t end, int64_t after) {
    for (int64_t p0 = 0; p0 < M; p0 += kPairPanel) {
      const int64_t rows = std::min(M - p0, kPairPanel), tiles = (rows + kPairRows - 1) / kPairRows;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r * kPairBlocks, nb = std::min<int64_t>(kPairBlocks, blocks - b);
        // The next run's weights (the thread's next one: in this range, then the next panel's
        // first, then the range parallel_items hands it next), during the second tile (the
        // first reads this run's from memory), or the only one.
        const int64_t nr = r + 1 < end ? r + 1 : p0 + kPairPanel < M ? begin : after;
        const bool ahead = nr >= 0 && (nr + 1) * kPairBlocks <= blocks;
        const int64_t fetch_tile = tiles > 1 ? 1 : 0;
        int64_t m0 = p0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t mr = rows / tiles + (t < rows % tiles ? 1 : 0);
          const at::BFloat16* pf = ahead && t == fetch_tile ? w + nr * kPairBlocks * wstride : nullptr;
          with_rows<kPairRows>(mr, [&](auto r_) {
            constexpr int R = decltype(r_)::value;
            const at::BFloat16* wb = w + b * wstride;
            out_t* yb = y + m0 * N + b * kOutBlock;
            if (nb == kPairBlocks) {
              pairs_tile<R, kPairBlocks>(x + m0 * K, K, wb, wstride, yb, N, pf);
            } else if (nb == 2) {
              pairs_tile<R, 2>(x + m0 * K, K, wb, wstride, yb, N, nullptr);
            } else {
              pairs_tile<R, 1>(x + m0 * K, K, wb, wstride, yb, N, nullptr);
            }
          });
          m0 += mr;
        }
      }
    }
  });
}
#endif

}  // namespace

// bf16 weights in quantize.pack_pairs' layout [N / 16, K / 2, 16, 2] (see gemm_pairs): x bf16
// [M, K] -> [M, N] bf16, or fp32 (the sums as they are) where fp32_out. Only where the kernels
// are built with AVX512-BF16 (pairs_available).
static at::Tensor run_linear_bf16(const at::Tensor& x, const at::Tensor& weight, bool fp32_out) {
#if defined(TY_PAIRS)
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kOutBlock && weight.size(3) == 2,
              "weight must be contiguous bf16 [N / 16, K / 2, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_bf16 takes bf16 activations");
  const int64_t N = weight.size(0) * kOutBlock, K = weight.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  const int64_t M = x.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  if (fp32_out) {
    gemm_pairs(xp, M, K, wp, out.data_ptr<float>(), N);
  } else {
    gemm_pairs(xp, M, K, wp, out.data_ptr<at::BFloat16>(), N);
  }
  return out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a CPU with AVX512-BF16 (and kernels built there)");
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, bool fp32_out) {
  NoGil nogil;
  return run_linear_bf16(x, weight, fp32_out);
}

// Whether linear_bf16 is built here.
bool pairs_available() {
#if defined(TY_PAIRS)
  return true;
#else
  return false;
#endif
}
