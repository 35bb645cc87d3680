// argmax_rows: greedy sampling's argmax over each row of fp32 logits.
#pragma once

#include "common.h"

// Each row's index of its largest value, the first of equals, as torch's max(dim=-1) gives
// it (a NaN wins, the first one); logits: contiguous float32 [B, V]. One pass per row in
// vectors, rows split between threads: torch's max over a batch's logits was a measurable
// share of a decode step (docs/benchmarks.md).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be contiguous float32 [B, V] with V > 0");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      int64_t best = 0, i = 0;
      float top = x[0];
      bool nan = false;
#if defined(__AVX512F__)
      if (V >= 16) {
        // Per lane: the largest value so far and the first index holding it (strictly
        // greater replaces, so the first of equals stays); NaNs only noted.
        __m512 vmax = _mm512_loadu_ps(x);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i cur = vidx;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V; i += 16) {
          cur = _mm512_add_epi32(cur, step);
          const __m512 v = _mm512_loadu_ps(x + i);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          vmax = _mm512_mask_mov_ps(vmax, gt, v);
          vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        nan = unordered != 0;
        top = _mm512_reduce_max_ps(vmax);
        const __mmask16 at_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(at_top, vidx);
      }
#elif defined(__AVX2__)
      if (V >= 8) {  // as above, 8 lanes
        __m256 vmax = _mm256_loadu_ps(x);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i cur = vidx;
        const __m256i step = _mm256_set1_epi32(8);
        __m256 unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= V; i += 8) {
          cur = _mm256_add_epi32(cur, step);
          const __m256 v = _mm256_loadu_ps(x + i);
          const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
          unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          vmax = _mm256_blendv_ps(vmax, v, gt);
          vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        alignas(32) float vals[8];
        alignas(32) int32_t idxs[8];
        _mm256_store_ps(vals, vmax);
        _mm256_store_si256(reinterpret_cast<__m256i*>(idxs), vidx);
        top = vals[0];
        best = idxs[0];
        for (int l = 1; l < 8; ++l) {
          if (vals[l] > top || (vals[l] == top && idxs[l] < best)) {
            top = vals[l];
            best = idxs[l];
          }
        }
      }
#endif
      for (; i < V && !nan; ++i) {  // the tail (or all of a row without AVX2)
        if (x[i] > top) {  // later equals never replace: the first of them stays
          top = x[i];
          best = i;
        } else if (std::isnan(x[i])) {
          nan = true;
        }
      }
      if (nan) {  // torch's max propagates the first NaN
        for (int64_t j = 0; j < V; ++j) {
          if (std::isnan(x[j])) {
            best = j;
            break;
          }
        }
      }
      op[r] = best;
    }
  });
  return out;
}
