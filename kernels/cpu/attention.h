// Paged attention over the KV pool. write_kv and decode_attention (twins in
// tokenyard.models.attention): a decode row walks its block table in the pool and never
// gathers its context into a temporary tensor, which is what made the torch path's decode
// attention cost a quarter of a 32-sequence step. span_attention: a prefill span's causal
// attention on AVX512-BF16. gather_kv: a span's keys and values widened from a narrower pool.
//
// The pool's per-layer view is [num_blocks, 2, block_size, num_kv_heads, head_dim] with any
// strides but a unit innermost one (the layer is a slice of a block-major pool).
#pragma once

#include "common.h"

namespace {

// Rows of k and v (src_t) into the pool (kv_t): a copy, or a conversion where the pool keeps
// keys and values narrower than the activations (an fp16 pool beside fp32 compute).
template <typename src_t, typename kv_t>
inline void copy_row(const src_t* src, kv_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, kv_t>) {
    std::copy_n(src, n, dst);
  } else {
    int64_t d = 0;
#if defined(TY_VEC)
    if constexpr (kVectorType<src_t> && kVectorType<kv_t>) {
      for (; d + kW <= n; d += kW) vstore(dst + d, vload(src + d));
    }
#endif
    for (; d < n; ++d) {
      float x = static_cast<float>(src[d]);
      if constexpr (std::is_same_v<kv_t, at::Float8_e4m3fn>) x = std::clamp(x, -448.f, 448.f);  // as vstore
      dst[d] = static_cast<kv_t>(x);
    }
  }
}

template <typename src_t, typename kv_t>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  const int64_t rows = k.size(0), row_len = k.size(1) * k.size(2);
  const int64_t s_block = kv_layer.stride(0), s_kv = kv_layer.stride(1), s_tok = kv_layer.stride(2);
  // A row's heads lie side by side; rows may be apart (k and v as views of a fused q/k/v).
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  const src_t* kp = k.data_ptr<src_t>();
  const src_t* vp = v.data_ptr<src_t>();
  kv_t* pool = kv_layer.data_ptr<kv_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    kv_t* dst = pool + blocks[r] * s_block + offsets[r] * s_tok;
    copy_row(kp + r * k_row, dst, row_len);
    copy_row(vp + r * v_row, dst + s_kv, row_len);
  }
}

// Where one (sequence, KV head) pair's inputs and outputs live; see decode_attention_impl.
template <typename scalar_t>
struct DecodeItem {
  const float* q;  // [group, head_dim], already multiplied by the softmax scale
  const scalar_t* pool;  // this layer's pool view, offset to KV head h
  const int64_t* table;  // the sequence's block table
  int64_t ctx, group, head_dim, block_size, s_block, s_kv, s_tok;
  float* scores;  // scratch [group, ctx]
  float* out;  // [group, head_dim]
  const scalar_t* q_raw;  // the same rows as q, unscaled, when q has the pool's dtype (the bf16 dot path)
  float scale;
};

// Softmax over each query head's scores, in place.
void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t i = 0; i < rows; ++i) {
    float* si = scores + i * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    int64_t t = 0;
#if defined(TY_VEC)
    // The maximum in vectors: a scalar max is a chain of dependent instructions (the
    // compiler may not reorder it); half the time (docs/benchmarks.md).
    vf vmx_acc = vset(mx);
    for (; t + kW <= ctx; t += kW) vmx_acc = vmax(vmx_acc, vload(si + t));
    mx = vhmax(vmx_acc);
#endif
    for (; t < ctx; ++t) mx = std::max(mx, si[t]);
    float sum = 0.f;
    t = 0;
#if defined(TY_VEC)
    vf acc = vzero();
    const vf vmx = vset(mx);
    for (; t + kW <= ctx; t += kW) {
      const vf e = vexp(vsub(vload(si + t), vmx));
      vstore(si + t, e);
      acc = vadd(acc, e);
    }
    sum = vsum(acc);
#endif
    for (; t < ctx; ++t) {
      si[t] = std::exp(si[t] - mx);
      sum += si[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < ctx; ++t) si[t] *= inv;
  }
}

// The portable path: any head_dim, any group size.
template <typename scalar_t>
void attend_item(const DecodeItem<scalar_t>& it, float* row) {
  const scalar_t* block = nullptr;
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 1: scores = q . k
    if ((t & (it.block_size - 1)) == 0) block = it.pool + it.table[t / it.block_size] * it.s_block;
    to_float(block + (t & (it.block_size - 1)) * it.s_tok, row, it.head_dim);
    for (int64_t i = 0; i < it.group; ++i) {
      const float* qi = it.q + i * it.head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < it.head_dim; ++d) s += qi[d] * row[d];
      it.scores[i * it.ctx + t] = s;
    }
  }
  softmax_rows(it.scores, it.group, it.ctx);
  std::fill(it.out, it.out + it.group * it.head_dim, 0.f);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 2: out = probs . v
    if ((t & (it.block_size - 1)) == 0) block = it.pool + it.table[t / it.block_size] * it.s_block + it.s_kv;
    to_float(block + (t & (it.block_size - 1)) * it.s_tok, row, it.head_dim);
    for (int64_t i = 0; i < it.group; ++i) {
      const float p = it.scores[i * it.ctx + t];
      float* oi = it.out + i * it.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < it.head_dim; ++d) oi[d] += p * row[d];
    }
  }
}

#if defined(TY_VEC)
constexpr int64_t kMaxGroup = 8;  // query heads per KV head that the vector path holds

// Asks for the next block's rows of this KV head while the current block is being read: the
// rows are strided (the other KV heads lie between them), which hardware prefetchers miss.
// Into L2 (T1), not L1: a block's rows are more lines than L1 can have in flight, and
// with T0 a core read the pool no faster than with no prefetch at all. Prefetching whole
// token rows (every KV head's part) or two to eight blocks ahead was slower
// (docs/benchmarks.md).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* rows, int64_t n, int64_t stride, int64_t row_bytes) {
  for (int64_t r = 0; r < n; ++r) {
    const char* p = reinterpret_cast<const char*>(rows + r * stride);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

#if defined(TY_DOT_BF16)
// attend_item_vec's second pass for a bf16 pool: out = probs . v, two keys an instruction. Each
// pair of value rows (keys t and t + 1) is interleaved so that every 32-bit lane holds one
// dimension's two values, and vdpbf16ps multiplies it by the pair of probabilities, rounded to
// bf16 (as flash attention rounds them before its second matmul), summing in fp32. The fp32
// path took a conversion of each row and an FMA per key and head for every 16 dimensions; this
// takes one instruction per key pair and head for every 16: faster with the pool in cache,
// a little faster from memory, where the reads are the limit (docs/benchmarks.md). G: the
// query heads per KV head when known at compile time (0: it.group), so that the
// accumulators stay in registers.
template <int NV, int G>
void attend_values_bf16(const DecodeItem<at::BFloat16>& it) {
  constexpr int NC = NV / 2;  // vectors of 32 bf16 in a row
  const int64_t group = G ? G : it.group;
  const int64_t pairs = (it.ctx + 1) / 2;
  // The probabilities as bf16 pairs (p[t], p[t + 1]), one 32-bit word per pair and head; an
  // odd context's last pair is (p[t], 0).
  thread_local std::vector<uint32_t> pp;
  pp.resize(group * pairs);
  for (int64_t i = 0; i < group; ++i) {
    const float* p = it.scores + i * it.ctx;
    uint32_t* dst = pp.data() + i * pairs;
    int64_t t = 0;
    for (; t + 2 * kW <= it.ctx; t += 2 * kW)
      _mm512_storeu_si512(dst + t / 2, (__m512i)_mm512_cvtne2ps_pbh(vload(p + t + kW), vload(p + t)));
    for (; t < it.ctx; t += 2) {
      const uint16_t lo = c10::BFloat16(p[t]).x;
      const uint16_t hi = t + 1 < it.ctx ? c10::BFloat16(p[t + 1]).x : 0;
      dst[t / 2] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  const int64_t num_blocks = (it.ctx + it.block_size - 1) / it.block_size;
  const int64_t row_bytes = NV * kW * sizeof(at::BFloat16);
  vf acc[G ? G : kMaxGroup][NV];
  for (int64_t i = 0; i < group; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  const at::BFloat16* block = nullptr;
  for (int64_t t = 0; t < it.ctx; t += 2) {  // t even: t and t + 1 lie in one block
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block + it.s_kv;
      if (j + 1 < num_blocks) prefetch_rows(it.pool + it.table[j + 1] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
    }
    const at::BFloat16* r0 = block + (t & (it.block_size - 1)) * it.s_tok;
    const bool two = t + 1 < it.ctx;  // else the row after is not this sequence's (maybe not numbers)
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 2 * kW * c);
      const __m512i b = two ? _mm512_loadu_si512(r0 + it.s_tok + 2 * kW * c) : _mm512_setzero_si512();
      // Lane k of lo: dimension 8 * (k / 4) + k % 4 of this vector's 32; of hi: that + 4.
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t i = 0; i < group; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * pairs + t / 2]));
        acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], lo, p);
        acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], hi, p);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < group; ++i) {
    for (int c = 0; c < NC; ++c) {
      float* o = it.out + (i * NV + 2 * c) * kW;
      vstore(o, _mm512_permutex2var_ps(acc[i][2 * c], first, acc[i][2 * c + 1]));
      vstore(o + kW, _mm512_permutex2var_ps(acc[i][2 * c], second, acc[i][2 * c + 1]));
    }
  }
}
#endif

#if defined(TY_DOT_BF16)
// A prefill span's attention (span_attention): n query rows over ctx keys, row j at position
// ctx - n + j seeing keys 0 to its own position. The rows path (decode attention, one work
// item per row and KV head) reads every key once per row and scores it with a sum across
// lanes; here each KV head's keys are laid out once per call with one key's pair of
// dimensions in each 32-bit lane (16 keys a vector), so that a tile of rows scores 16 keys per
// vdpbf16ps with no sum across lanes, and its values in pairs of keys for the second product,
// as attend_values_bf16 takes them (the probabilities rounded to bf16, sums in fp32; the sum
// of the exponentials divides the output once). A half to three fifths of the rows path's
// time for a fresh prompt (docs/benchmarks.md).
struct SpanHead {
  const uint32_t* kt;  // [ceil(ctx / 16)][head_dim / 2][16]: key 16b + l's pair dp at [b][dp][l]
  const uint32_t* vp;  // [ceil(ctx / 2)][head_dim]: (v[2t][d], v[2t + 1][d]) at [t][d]
};

// Query rows a work item takes: with the group's heads, R * G score accumulators in registers.
constexpr int span_rows(int g) { return g <= 3 ? 4 : (g <= 6 ? 2 : 1); }

// Rows [r0, r0 + rows) of one KV head's group (G query heads from head h * G), rows <= span_rows(G).
template <int ND, int G>
void span_tile(const at::BFloat16* q, int64_t q_row, const SpanHead& kv, int64_t h, int64_t r0, int64_t rows,
               int64_t pos0, int64_t ctx, float scale, at::BFloat16* out, int64_t o_row) {
  constexpr int R = span_rows(G);
  constexpr int DP = ND * kW / 2;  // pairs of dimensions
  constexpr int64_t D = ND * kW;
  const int64_t keys = std::min(ctx, pos0 + r0 + rows);  // the last row's keys
  const int64_t stride = (keys + 2 * kW - 1) / (2 * kW) * (2 * kW);
  thread_local std::vector<float> scores;
  thread_local std::vector<uint32_t> pp;
  scores.resize(R * G * stride);
  pp.resize(R * G * stride / 2);
  const uint32_t* qp[R][G];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < G; ++i)
      qp[r][i] = reinterpret_cast<const uint32_t*>(q + (r0 + std::min<int64_t>(r, rows - 1)) * q_row + (h * G + i) * D);
  const vf vscale = vset(scale);
  for (int64_t b = 0; b * kW < keys; ++b) {  // scores, 16 keys at a time
    vf acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i) acc[r][i] = vzero();
    const uint32_t* kb = kv.kt + b * DP * kW;
    for (int dp = 0; dp < DP; ++dp) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + dp * kW);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < G; ++i)
          acc[r][i] = _mm512_dpbf16_ps(acc[r][i], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][i][dp])));
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i) vstore(scores.data() + (r * G + i) * stride + b * kW, vmul(acc[r][i], vscale));
  }
  // Softmax over each row's own keys, not yet divided by the sum (the output is, once): the
  // exponentials go straight to bf16 pairs, zeros from the row's last key to the stride.
  float inv[R][G];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = std::min(ctx, pos0 + r0 + r + 1), full = len / kW;
    const __mmask16 tail = static_cast<__mmask16>((1u << (len % kW)) - 1);
    for (int i = 0; i < G; ++i) {
      const float* sc = scores.data() + (r * G + i) * stride;
      vf mx = vset(-std::numeric_limits<float>::infinity());
      for (int64_t b = 0; b < full; ++b) mx = vmax(mx, vload(sc + b * kW));
      if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sc + full * kW));
      const vf m = vset(vhmax(mx));
      vf sum = vzero();
      uint32_t* dst = pp.data() + (r * G + i) * stride / 2;
      for (int64_t t = 0; t < stride; t += 2 * kW) {
        vf e[2];
        for (int half = 0; half < 2; ++half) {
          const int64_t b = t / kW + half;
          if (b < full) {
            e[half] = vexp(vsub(vload(sc + b * kW), m));
          } else if (b == full && tail) {
            e[half] = _mm512_maskz_mov_ps(tail, vexp(vsub(_mm512_maskz_loadu_ps(tail, sc + b * kW), m)));
          } else {
            e[half] = vzero();
          }
          sum = vadd(sum, e[half]);
        }
        _mm512_storeu_si512(dst + t / 2, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      }
      inv[r][i] = 1.f / vsum(sum);
    }
  }
  const int64_t pairs = (keys + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {  // out = probs . v, two keys a vdpbf16ps
    vf acc[G][ND];
    for (int i = 0; i < G; ++i)
      for (int c = 0; c < ND; ++c) acc[i][c] = vzero();
    const uint32_t* pr = pp.data() + r * G * stride / 2;
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh v[ND];
      for (int c = 0; c < ND; ++c) v[c] = (__m512bh)_mm512_loadu_si512(kv.vp + t * D + c * kW);
      for (int i = 0; i < G; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[i * stride / 2 + t]));
        for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], p);
      }
    }
    for (int i = 0; i < G; ++i) {
      at::BFloat16* o = out + (r0 + r) * o_row + (h * G + i) * D;
      const vf norm = vset(inv[r][i]);
      for (int c = 0; c < ND; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * kW), (__m256i)_mm512_cvtneps_pbh(vmul(acc[i][c], norm)));
    }
  }
}

template <int ND, int G>
void span_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  constexpr int64_t D = ND * kW;
  const int64_t n = q.size(0), ctx = k.size(0), hkv = k.size(1), pos0 = ctx - n;
  const int64_t kblocks = (ctx + kW - 1) / kW, pairs = (ctx + 1) / 2;
  // Each KV head's keys and values in the layouts above (zeros past the context).
  std::vector<uint32_t> kt(hkv * kblocks * kW * D / 2, 0u), vp(hkv * pairs * D, 0u);
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vptr = v.data_ptr<at::BFloat16>();
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  at::parallel_for(0, hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      uint32_t* kth = kt.data() + h * kblocks * kW * D / 2;
      uint32_t* vph = vp.data() + h * pairs * D;
      for (int64_t t = 0; t < ctx; ++t) {
        const auto* kr = reinterpret_cast<const uint32_t*>(kp + t * k_row + h * D);
        uint32_t* dst = kth + (t / kW) * (D / 2) * kW + t % kW;
        for (int64_t dp = 0; dp < D / 2; ++dp) dst[dp * kW] = kr[dp];
        const uint16_t* vr = reinterpret_cast<const uint16_t*>(vptr + t * v_row + h * D);
        uint32_t* vd = vph + (t / 2) * D;
        const int shift = (t & 1) * 16;
        for (int64_t d = 0; d < D; ++d) vd[d] |= static_cast<uint32_t>(vr[d]) << shift;
      }
    }
  });
  constexpr int R = span_rows(G);
  const int64_t tiles = (n + R - 1) / R, items = hkv * tiles;
  // Split by cost (a tile's keys), as decode attention splits its rows.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  int64_t total = 0;
  for (int64_t it = 0; it < items; ++it) total += std::min(ctx, pos0 + (it % tiles) * R + R);
  std::vector<int64_t> first(parts + 1, items);
  first[0] = 0;
  for (int64_t it = 0, done = 0, p = 1; it < items && p < parts; ++it) {
    done += std::min(ctx, pos0 + (it % tiles) * R + R);
    while (p < parts && done * parts >= p * total) first[p++] = it + 1;
  }
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  parallel_items(items, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / tiles, r0 = (it % tiles) * R;
      const SpanHead kv{kt.data() + h * kblocks * kW * D / 2, vp.data() + h * pairs * D};
      span_tile<ND, G>(qp, q.stride(0), kv, h, r0, std::min<int64_t>(R, n - r0), pos0, ctx, fscale, op, out.stride(0));
    }
  }, first);
}
#endif

// NV = head_dim / kW vectors per row. Pass 1 reads each key row once for all the group's
// query heads; pass 2 keeps every head's output accumulators in vectors (in registers with
// AVX-512 and head_dim 64; partly on the stack, in L1, otherwise).
template <typename scalar_t, int NV>
void attend_item_vec(const DecodeItem<scalar_t>& it) {
  const scalar_t* block = nullptr;
  const int64_t num_blocks = (it.ctx + it.block_size - 1) / it.block_size;
  const int64_t row_bytes = NV * kW * sizeof(scalar_t);
  // Pass 1 takes kW keys at a time where blocks hold whole tiles: each query head's kW
  // partial-sum vectors are reduced together (vsum_lanes), not one horizontal sum per key.
  const bool tiles = it.block_size % kW == 0;
  vf part[kMaxGroup][kW];
#if defined(TY_DOT_BF16)
  // A bf16 pool on a CPU with AVX512-BF16: q . k as bf16 pair products summed in fp32
  // (vdpbf16ps), 32 elements an instruction and no conversion of the keys; the scale is
  // applied to the sums. NV / 2 such vectors per row.
  constexpr bool dot_bf16 = std::is_same_v<scalar_t, at::BFloat16>;
  __m512bh qb[kMaxGroup][NV / 2];
  if constexpr (dot_bf16) {
    for (int64_t i = 0; i < it.group; ++i)
      for (int v = 0; v < NV / 2; ++v)
        qb[i][v] = (__m512bh)_mm512_loadu_si512(it.q_raw + i * NV * kW + 2 * kW * v);
  }
#else
  constexpr bool dot_bf16 = false;
#endif
  // An fp8 pool's rows are read at 2^-8 of their value (vload_fp8_scaled): the scores and
  // the output take the 256 back (a power of two: exact).
  constexpr bool fp8 = std::is_same_v<scalar_t, at::Float8_e4m3fn>;
  constexpr float row_scale = fp8 ? 256.f : 1.f;
  auto row = [](const scalar_t* p) -> vf {
    if constexpr (fp8) {
      return vload_fp8_scaled(p);
    } else {
      return vload(p);
    }
  };
  // The fp32 path's queries carry the scale already (times 1 is exact).
  const float score_scale = dot_bf16 ? it.scale : row_scale;
  const vf vscale = vset(score_scale);
  // q . (the key row at kr), for query head i: a vector whose lanes sum to the score.
  auto dot = [&](const scalar_t* kr, int64_t i, const vf* k) -> vf {
#if defined(TY_DOT_BF16)
    if constexpr (dot_bf16) {
      vf a = _mm512_dpbf16_ps(vzero(), qb[i][0], (__m512bh)_mm512_loadu_si512(kr));
      for (int v = 1; v < NV / 2; ++v)
        a = _mm512_dpbf16_ps(a, qb[i][v], (__m512bh)_mm512_loadu_si512(kr + 2 * kW * v));
      return a;
    }
#endif
    const float* qi = it.q + i * NV * kW;
    vf a = vmul(vload(qi), k[0]);
    for (int v = 1; v < NV; ++v) a = vfma(vload(qi + kW * v), k[v], a);
    return a;
  };
  for (int64_t t = 0; t < it.ctx;) {
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block;
      if (j + 1 < num_blocks) {
        prefetch_rows(it.pool + it.table[j + 1] * it.s_block, it.block_size, it.s_tok, row_bytes);
      } else {  // the last key block: start on the values
        prefetch_rows(it.pool + it.table[0] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
      }
    }
    if (tiles && t + kW <= it.ctx) {  // t is a multiple of kW here: the tile is in one block
      for (int r = 0; r < kW; ++r) {
        const scalar_t* kr = block + ((t + r) & (it.block_size - 1)) * it.s_tok;
        vf k[NV];
        if constexpr (!dot_bf16)
          for (int v = 0; v < NV; ++v) k[v] = row(kr + kW * v);
        for (int64_t i = 0; i < it.group; ++i) part[i][r] = dot(kr, i, k);
      }
      for (int64_t i = 0; i < it.group; ++i) vstore(it.scores + i * it.ctx + t, vmul(vsum_lanes(part[i]), vscale));
      t += kW;
      continue;
    }
    const scalar_t* kr = block + (t & (it.block_size - 1)) * it.s_tok;
    vf k[NV];
    if constexpr (!dot_bf16)
      for (int v = 0; v < NV; ++v) k[v] = row(kr + kW * v);
    for (int64_t i = 0; i < it.group; ++i)
      it.scores[i * it.ctx + t] = vsum(dot(kr, i, k)) * score_scale;
    ++t;
  }
  softmax_rows(it.scores, it.group, it.ctx);
#if defined(TY_DOT_BF16)
  if constexpr (dot_bf16) {
    if (it.group == 3) {  // SmolLM2's 9 query heads over 3 KV heads, as Llama-style models group them
      attend_values_bf16<NV, 3>(it);
    } else {
      attend_values_bf16<NV, 0>(it);
    }
    return;
  }
#endif
  vf acc[kMaxGroup][NV];
  for (int64_t i = 0; i < it.group; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t t = 0; t < it.ctx; ++t) {
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block + it.s_kv;
      if (j + 1 < num_blocks) prefetch_rows(it.pool + it.table[j + 1] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
    }
    const scalar_t* vr = block + (t & (it.block_size - 1)) * it.s_tok;
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = row(vr + kW * v);
    for (int64_t i = 0; i < it.group; ++i) {
      const vf p = vset(it.scores[i * it.ctx + t]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(p, vv[v], acc[i][v]);
    }
  }
  for (int64_t i = 0; i < it.group; ++i) {
    for (int v = 0; v < NV; ++v) {
      if constexpr (fp8) acc[i][v] = vmul(acc[i][v], vset(row_scale));
      vstore(it.out + (i * NV + v) * kW, acc[i][v]);
    }
  }
}
#endif

// q: [B, num_heads, head_dim]; one work item = one (sequence, KV head), whose `group` query
// heads share every K/V row read. The pool is read in place through the block tables.
// q_t: the queries' and output's dtype; scalar_t: the pool's (see pool_pairs_with).
template <typename q_t, typename scalar_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  const int64_t group = num_heads / num_kv_heads;  // query heads [h*group, (h+1)*group) read KV head h
  const q_t* qp = q.data_ptr<q_t>();
  const int64_t q_row = q.stride(0);  // out is contiguous; q's rows may be apart
  const scalar_t* pool = kv_layer.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  q_t* op = out.data_ptr<q_t>();
  const float fscale = static_cast<float>(scale);
#if defined(TY_VEC)
  const bool vector_path = group <= kMaxGroup && (head_dim == 64 || head_dim == 128);
#endif

  // Items start in one contiguous share per thread (parallel_items) by cost (an item's
  // context length), not by count: a prefill chunk's rows (prompt tokens as rows of their
  // own, see tokenyard.models.attention) cost from one key to the whole prompt. Under 512
  // keys in all stay on the calling thread: waking the thread pool costs more than they do.
  const int64_t items = num_seqs * num_kv_heads;
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) total += lens[b] * num_kv_heads;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 512));
  std::vector<int64_t> first(parts + 1, items);  // first[p]: part p's first item
  first[0] = 0;
  for (int64_t item = 0, done = 0, p = 1; item < items && p < parts; ++item) {
    done += lens[item / num_kv_heads];
    while (p < parts && done * parts >= p * total) first[p++] = item + 1;
  }
  parallel_items(items, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      scores.resize(group * lens[b]);
      for (int64_t i = 0; i < group; ++i) {
        const q_t* src = qp + b * q_row + (h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      DecodeItem<scalar_t> it{qf.data(), pool + h * kv_layer.stride(3), tables + b * block_tables.stride(0),
                                    lens[b], group, head_dim, block_size, kv_layer.stride(0), kv_layer.stride(1),
                                    kv_layer.stride(2), scores.data(), acc.data(), nullptr, fscale};
      if constexpr (std::is_same_v<q_t, scalar_t>) it.q_raw = qp + b * q_row + h * group * head_dim;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path && head_dim == 64) {
          attend_item_vec<scalar_t, 64 / kW>(it);
        } else if (vector_path) {
          attend_item_vec<scalar_t, 128 / kW>(it);
        } else {
          attend_item(it, row.data());
        }
      } else {
        attend_item(it, row.data());
      }
#else
      attend_item(it, row.data());
#endif
      for (int64_t i = 0; i < group; ++i) {
        q_t* dst = op + (b * num_heads + h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<q_t>(acc[i * head_dim + d]);
      }
    }
  }, first);
}

}  // namespace

// [T, heads, head_dim] whose rows each hold their heads side by side, the rows any distance
// apart (a row stride of at least a row): a view of a fused projection's output qualifies.
static bool rows_of_heads(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) &&
         (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// Writes each row's key and value into the pool at (slot_blocks[r], slot_offsets[r]).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_layer, const at::Tensor& slot_blocks,
              const at::Tensor& slot_offsets) {
  check_pool(kv_layer);
  TORCH_CHECK(rows_of_heads(k) && rows_of_heads(v),
              "k and v must be [T, num_kv_heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && pool_pairs_with(k.scalar_type(), kv_layer.scalar_type()),
              "k and v must share a dtype with the pool, or be float32 beside a float16 pool, or "
              "bf16 or float32 beside a float8_e4m3fn pool");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4),
              "k and v must be [T, num_kv_heads, head_dim] matching the pool");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous(),
              "slots must be contiguous int64");
  TORCH_CHECK(slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0), "one slot per row");
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < k.size(0); ++r) {
    TORCH_CHECK(blocks[r] >= 0 && blocks[r] < kv_layer.size(0) && offsets[r] >= 0 && offsets[r] < kv_layer.size(2),
                "slot outside the pool");
  }
  with_pool_types(k.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    write_kv_impl<decltype(act), decltype(kv)>(k, v, kv_layer, slot_blocks, slot_offsets);
  });
}

// A prefill span's first n keys and values from the pool, widened to `like`'s dtype: [2, n,
// num_kv_heads, head_dim], for torch's fused attention beside a pool narrower than the
// activations (fp8: torch's own float8 -> bf16 conversion was a large share of a prefill
// step, docs/benchmarks.md).
static at::Tensor gather_kv_rows(const at::Tensor& kv_layer, const at::Tensor& block_ids, int64_t n,
                                 const at::Tensor& like) {
  check_pool(kv_layer);
  TORCH_CHECK(pool_pairs_with(like.scalar_type(), kv_layer.scalar_type()),
              "the pool's dtype does not pair with ", like.scalar_type());
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              "block_ids must be contiguous int64 [num_blocks]");
  const int64_t block_size = kv_layer.size(2), heads = kv_layer.size(3), head_dim = kv_layer.size(4);
  TORCH_CHECK(n >= 0 && n <= block_ids.numel() * block_size, "n = ", n, " is more than the blocks hold");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < (n + block_size - 1) / block_size; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < kv_layer.size(0), "block id ", ids[j], " outside the pool");
  TORCH_CHECK(kv_layer.stride(3) == head_dim, "kv_layer's heads must lie side by side");
  auto out = at::empty({2, n, heads, head_dim}, like.options());
  with_pool_types(like.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    using act_t = decltype(act);
    using kv_t = decltype(kv);
    const kv_t* pool = kv_layer.data_ptr<kv_t>();
    act_t* dst = out.data_ptr<act_t>();
    const int64_t row_len = heads * head_dim;
    at::parallel_for(0, 2 * n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t which = r / n, t = r % n;  // keys, then values (n > 0 here)
        const kv_t* src = pool + ids[t / block_size] * kv_layer.stride(0) + which * kv_layer.stride(1) +
                          (t % block_size) * kv_layer.stride(2);
        copy_row(src, dst + r * row_len, row_len);
      }
    });
  });
  return out;
}

at::Tensor gather_kv(const at::Tensor& kv_layer, const at::Tensor& block_ids, int64_t n, const at::Tensor& like) {
  NoGil nogil;
  return gather_kv_rows(kv_layer, block_ids, n, like);
}

// q: [B, num_heads, head_dim], each row's heads contiguous (rows may be apart: q as a view
// of a fused q/k/v); block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1).
// Returns a contiguous [B, num_heads, head_dim] in q's dtype.
static at::Tensor run_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  check_pool(kv_layer);
  TORCH_CHECK(q.dim() == 3 && rows_of_heads(q), "q must be [B, num_heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(pool_pairs_with(q.scalar_type(), kv_layer.scalar_type()),
              "q must share the pool's dtype, or be float32 beside a float16 pool, or bf16 or "
              "float32 beside a float8_e4m3fn pool");
  TORCH_CHECK(q.size(2) == kv_layer.size(4) && q.size(1) % kv_layer.size(3) == 0,
              "q's heads do not match the pool's KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [B, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.size(0) == q.size(0) && block_tables.size(0) == q.size(0),
              "context_lens must be contiguous int64 [B]");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t capacity = block_tables.size(1) * kv_layer.size(2), num_blocks = kv_layer.size(0);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= capacity, "context length ", lens[b], " outside [1, ", capacity, "]");
    for (int64_t j = 0; j < (lens[b] + kv_layer.size(2) - 1) / kv_layer.size(2); ++j) {
      const int64_t blk = tables[b * block_tables.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " outside the pool");
    }
  }
  auto out = at::empty(q.sizes(), q.options());
  with_pool_types(q.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    decode_attention_impl<decltype(act), decltype(kv)>(q, kv_layer, block_tables, context_lens, scale, out);
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  NoGil nogil;
  return run_decode_attention(q, kv_layer, block_tables, context_lens, scale);
}

// Whether span_attention is built here: AVX512-BF16 (vdpbf16ps) with 16-lane vectors.
bool span_available() {
#if defined(TY_DOT_BF16)
  return true;
#else
  return false;
#endif
}

// The heads span_attention takes (tokenyard.models.kernel_choice.span_fits asks the same, from constants.h).
static bool span_fits(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return span_head_dim(head_dim) && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kSpanMaxGroup;
}

// A prefill span's causal attention, bf16: q [n, heads, head_dim] (rows may be apart), k and v
// [ctx, kv_heads, head_dim] with ctx >= n (the span's rows are the last n positions); head_dim
// 64 or 128, up to 8 query heads per KV head. Returns [n, heads, head_dim].
static at::Tensor run_span_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#if defined(TY_DOT_BF16)
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "span_attention takes [rows, heads, head_dim] tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "span_attention takes bf16");
  const int64_t d = q.size(2), heads = q.size(1), hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && k.size(0) >= q.size(0), "k and v must be [ctx >= rows, kv_heads, head_dim]");
  TORCH_CHECK(hkv > 0 && heads % hkv == 0 && heads / hkv <= kSpanMaxGroup, "up to ", kSpanMaxGroup,
              " query heads per KV head");
  TORCH_CHECK(span_head_dim(d), "span_attention takes head_dim 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 &&
                  v.stride(1) == d,
              "each row's heads must lie side by side");
  auto out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  auto run = [&](auto nd) {
    constexpr int ND = decltype(nd)::value;
    switch (heads / hkv) {
      case 1: span_attention_impl<ND, 1>(q, k, v, scale, out); break;
      case 2: span_attention_impl<ND, 2>(q, k, v, scale, out); break;
      case 3: span_attention_impl<ND, 3>(q, k, v, scale, out); break;
      case 4: span_attention_impl<ND, 4>(q, k, v, scale, out); break;
      case 5: span_attention_impl<ND, 5>(q, k, v, scale, out); break;
      case 6: span_attention_impl<ND, 6>(q, k, v, scale, out); break;
      case 7: span_attention_impl<ND, 7>(q, k, v, scale, out); break;
      default: span_attention_impl<ND, 8>(q, k, v, scale, out); break;
    }
  };
  if (d == 64) {
    run(std::integral_constant<int, 4>{});
  } else {
    run(std::integral_constant<int, 8>{});
  }
  return out;
#else
  TORCH_CHECK(false, "span_attention needs a CPU with AVX512-BF16 (and kernels built there)");
#endif
}

at::Tensor span_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  NoGil nogil;
  return run_span_attention(q, k, v, scale);
}
