// CPU kernels, built at first use by tokenyard.kernels.cpu (torch's JIT extension loader;
// the object is cached on disk). Each has a torch twin that the tests compare it against.
//
// - write_kv, decode_attention: twins in tokenyard.models.attention. A decode row walks its
//   block table in the pool and never gathers its context into a temporary tensor, which is
//   what made the torch path's decode attention cost a quarter of a 32-sequence step.
// - add_rms_norm, rotary, silu_and_mul: twins in tokenyard.models.fused. Each replaces five
//   to eight small torch ops per layer; at batch 1 those ops' dispatch cost more than the
//   arithmetic, a third of a decode step on a 30-layer model.
//
// The pool's per-layer view is [num_blocks, 2, block_size, num_kv_heads, head_dim] with any
// strides but a unit innermost one (the layer is a slice of a block-major pool).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void check_pool(const at::Tensor& kv_layer) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2,
              "kv_layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_layer.stride(4) == 1, "kv_layer's head_dim axis must be contiguous");
}

template <typename scalar_t>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  const int64_t rows = k.size(0), row_len = k.size(1) * k.size(2);
  const int64_t s_block = kv_layer.stride(0), s_kv = kv_layer.stride(1), s_tok = kv_layer.stride(2);
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* pool = kv_layer.data_ptr<scalar_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = pool + blocks[r] * s_block + offsets[r] * s_tok;
    std::copy_n(kp + r * row_len, row_len, dst);
    std::copy_n(vp + r * row_len, row_len, dst + s_kv);
  }
}

template <typename scalar_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  const int64_t group = num_heads / num_kv_heads;  // query heads [h*group, (h+1)*group) read KV head h
  const int64_t s_block = kv_layer.stride(0), s_kv = kv_layer.stride(1), s_tok = kv_layer.stride(2),
                s_head = kv_layer.stride(3);
  const int64_t s_table = block_tables.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* pool = kv_layer.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // One work item = one (sequence, KV head): its `group` query heads share every K/V row read.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * s_table;
      scores.resize(group * ctx);
      for (int64_t i = 0; i < group; ++i) {
        const scalar_t* src = qp + (b * num_heads + h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      // Pass 1: scores = q . k for every context position, in fp32.
      for (int64_t t = 0; t < ctx; ++t) {
        const scalar_t* kr = pool + table[t / block_size] * s_block + (t % block_size) * s_tok + h * s_head;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(kr[d]);
        for (int64_t i = 0; i < group; ++i) {
          const float* qi = qf.data() + i * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qi[d] * row[d];
          scores[i * ctx + t] = s;
        }
      }
      // Softmax per query head.
      for (int64_t i = 0; i < group; ++i) {
        float* si = scores.data() + i * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, si[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          si[t] = std::exp(si[t] - mx);
          sum += si[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) si[t] *= inv;
      }
      // Pass 2: out = probs . v.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const scalar_t* vr = pool + table[t / block_size] * s_block + s_kv + (t % block_size) * s_tok + h * s_head;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(vr[d]);
        for (int64_t i = 0; i < group; ++i) {
          const float p = scores[i * ctx + t];
          float* ai = acc.data() + i * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ai[d] += p * row[d];
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        scalar_t* dst = op + (b * num_heads + h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i * head_dim + d]);
      }
    }
  });
}

template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                       double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = xp + r * dim;
      float ss = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        // The residual sum is rounded to the model's dtype, as the torch twin's x + residual is.
        const scalar_t sum = rp ? static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rp[r * dim + d])) : xr[d];
        if (rp) rp[r * dim + d] = sum;
        h[d] = static_cast<float>(sum);
        ss += h[d] * h[d];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        const scalar_t normed = static_cast<scalar_t>(h[d] * inv);
        op[r * dim + d] = static_cast<scalar_t>(static_cast<float>(wp[d]) * static_cast<float>(normed));
      }
    }
  });
}

template <typename scalar_t>
void rotary_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t num_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  scalar_t* base = qkv.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t table_stride = cos.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * table_stride;
      const float* s = sp + pos[r] * table_stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x = base + r * row_stride + h * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
          x[d] = static_cast<scalar_t>(x1 * c[d] - x2 * s[d]);
          x[d + half] = static_cast<scalar_t>(x2 * c[d + half] + x1 * s[d + half]);
        }
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = xp + r * 2 * width;
      const scalar_t* up = gate + width;
      for (int64_t d = 0; d < width; ++d) {
        const float g = static_cast<float>(gate[d]);
        // Rounded where the twin's F.silu(gate) * up rounds: after silu, then after the product.
        const scalar_t act = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
        op[r * width + d] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(up[d]));
      }
    }
  });
}

}  // namespace

// out = rms_norm(x + residual) * weight, and residual <- x + residual (in place); with no
// residual, out = rms_norm(x) * weight. x, residual: [T, dim] contiguous; weight: [dim].
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] in x's dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] { add_rms_norm_impl<scalar_t>(x, residual, weight, eps, out); });
  return out;
}

// Rotates, in place, the first num_heads heads of each row of qkv ([T, >= num_heads *
// head_dim], unit inner stride): the query and key heads of a fused q/k/v projection.
// cos, sin: fp32 [max_positions, head_dim] tables (rotate-half layout).
void rotary(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
            int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "qkv must be [T, >= num_heads * head_dim] with a unit inner stride");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == head_dim &&
                  cos.stride(1) == 1 && sin.strides() == cos.strides() && sin.sizes() == cos.sizes(),
              "cos and sin must be fp32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == qkv.size(0),
              "positions must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.size(0); ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " outside the RoPE table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary",
                                  [&] { rotary_impl<scalar_t>(qkv, positions, cos, sin, num_heads, head_dim); });
}

// silu(x[:, :I]) * x[:, I:] for x: [T, 2I] contiguous -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [T, 2I]");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

// Writes each row's key and value into the pool at (slot_blocks[r], slot_offsets[r]).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_layer, const at::Tensor& slot_blocks,
              const at::Tensor& slot_offsets) {
  check_pool(kv_layer);
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous [T, num_kv_heads, head_dim]");
  TORCH_CHECK(k.scalar_type() == kv_layer.scalar_type() && v.scalar_type() == kv_layer.scalar_type(),
              "k, v and the pool must share a dtype");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4),
              "k and v must be [T, num_kv_heads, head_dim] matching the pool");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous(),
              "slots must be contiguous int64");
  TORCH_CHECK(slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0), "one slot per row");
  for (int64_t r = 0; r < k.size(0); ++r) {
    TORCH_CHECK(slot_blocks.data_ptr<int64_t>()[r] >= 0 && slot_blocks.data_ptr<int64_t>()[r] < kv_layer.size(0) &&
                    slot_offsets.data_ptr<int64_t>()[r] >= 0 && slot_offsets.data_ptr<int64_t>()[r] < kv_layer.size(2),
                "slot outside the pool");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv",
                                  [&] { write_kv_impl<scalar_t>(k, v, kv_layer, slot_blocks, slot_offsets); });
}

// q: [B, num_heads, head_dim] (contiguous); block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (>= 1). Returns [B, num_heads, head_dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  check_pool(kv_layer);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, num_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and the pool must share a dtype");
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
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, kv_layer, block_tables, context_lens, scale, out);
  });
  return out;
}
