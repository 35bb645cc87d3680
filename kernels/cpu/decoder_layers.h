// decoder_layers: a step through every layer of a Llama model in one call of the other
// families' kernels (twin: tokenyard.models.llama's layers, one call at a time).
#pragma once

#include "common.h"
#include "attention.h"
#include "norm_rope_silu.h"
#include "gemm_int.h"
#include "gemm_amx.h"
#include "gemm_bf16.h"

// A step's pass through a stack of Llama decoder layers, in one call: per layer
// add_rms_norm, the q/k/v projection, rotary, write_kv, the attention (attend_layer), the
// output projection, add_rms_norm, gate/up, silu_and_mul and down, then the final norm; the
// same kernels in the same order as tokenyard.models.llama's layers call them one by one
// (its twin, equal to the bit), without the Python between them: between a step's few
// hundred kernel calls the layers' Python cost about a sixth of a decode step (docs/benchmarks.md).
//
// x: [T, hidden], the embedded rows; slots as write_kv takes them; block_tables,
// context_lens, kernel_rows, span_blocks and spans: the step's attention as attend_layer
// takes it. kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
// weights: per layer its two norms' weights, then four projections (q/k/v, o, gate/up, down)
// of four tensors each, then the final norm's weight; kinds: per layer the four
// projections' kernels (kKernel*), whose first three tensors are the layer's weights as that
// kernel takes them and the fourth its bias (Qwen2's q/k/v), added after the kernel as the
// twin adds it (an unused or absent one: an empty tensor).
constexpr int64_t kProjectionWeights = 4;
constexpr int64_t kLayerWeights = 2 + 4 * kProjectionWeights;

static at::Tensor project(int64_t kind, const at::Tensor& x, const at::Tensor* w) {
  const c10::optional<at::Tensor> zero = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
  switch (kind) {
    case kKernelAmx:
      return run_linear_amx(x.to(at::kBFloat16), w[0], w[1], zero, false);
    case kKernelI16:
      return run_linear_i16(x, w[0], w[1], zero);
    case kKernelI8:
      TORCH_CHECK(zero, "linear_i8 takes int4 weights, with zeros");
      return run_linear_i8(x, w[0], w[1], *zero);
    case kKernelPairs:
      return run_linear_bf16(x, w[0], false);
  }
  TORCH_CHECK(false, "unknown projection kernel ", kind);
}

static at::Tensor run_projection(int64_t kind, const at::Tensor& x, const at::Tensor* w) {
  at::Tensor y = project(kind, x, w);
  return w[3].numel() ? y + w[3] : y;
}

// The MLP's gate/up projection and silu_and_mul: in one pass where the projection runs on AMX
// tiles in a step of more than kSiluFusedAbove rows (run_linear_amx with silu, equal to the bit),
// else one after the other; as tokenyard.models.mlp chooses.

static at::Tensor gate_up_silu(int64_t kind, const at::Tensor& x, const at::Tensor* w) {
  if (kind == kKernelAmx && x.size(0) > kSiluFusedAbove && !w[3].numel()) {
    const c10::optional<at::Tensor> zero = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
    return run_linear_amx(x.to(at::kBFloat16), w[0], w[1], zero, false, true);
  }
  return silu_and_mul(run_projection(kind, x, w));
}

// A step's attention for one layer, as tokenyard.models.attention splits it on a CPU
// (AttnMetadata.cpu_split): with no spans, every row through decode_attention; else the rows
// `kernel_rows` through it (none: an empty tensor) and each span (start, rows, context) in
// torch's fused attention (on AMX; span_attention on bf16 elsewhere) over its own rows (a
// fresh prompt) or the keys and values gathered from its blocks, widened where the pool is
// narrower than q (gather_kv).
static at::Tensor attend_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& kv_layer, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& kernel_rows,
                               const std::vector<at::Tensor>& span_blocks, const std::vector<int64_t>& spans,
                               double scale) {
  if (span_blocks.empty()) return run_decode_attention(q, kv_layer, block_tables, context_lens, scale);
  auto out = at::empty(q.sizes(), q.options());
  if (kernel_rows.numel()) {
    out.index_put_({kernel_rows}, run_decode_attention(q.index_select(0, kernel_rows), kv_layer, block_tables,
                                                       context_lens, scale));
  }
  for (size_t i = 0; i < span_blocks.size(); ++i) {
    const int64_t start = spans[3 * i], n = spans[3 * i + 1], ctx = spans[3 * i + 2];
    at::Tensor keys, values;
    if (kv_layer.scalar_type() == q.scalar_type()) {
      if (ctx == n) {
        keys = k.narrow(0, start, n);
        values = v.narrow(0, start, n);
      } else {
        const auto kv_shape = std::vector<int64_t>{-1, k.size(1), k.size(2)};
        keys = kv_layer.select(1, 0).index_select(0, span_blocks[i]).view(kv_shape).narrow(0, 0, ctx);
        values = kv_layer.select(1, 1).index_select(0, span_blocks[i]).view(kv_shape).narrow(0, 0, ctx);
      }
    } else {
      const auto kv = gather_kv_rows(kv_layer, span_blocks[i], ctx, q);
      keys = kv[0];
      values = kv[1];
    }
#if defined(TY_DOT_BF16) && !defined(TY_AMX)
    if (q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
        span_fits(q.size(1), keys.size(1), q.size(2))) {  // kernel_choice.SPAN_ATTENTION
      out.narrow(0, start, n).copy_(run_span_attention(q.narrow(0, start, n), keys, values, scale));
      continue;
    }
#endif
    c10::optional<at::Tensor> mask;
    if (ctx != n) {  // row j (position ctx - n + j) sees keys 0..its own position
      mask = (at::arange(ctx, block_tables.options()).unsqueeze(0) <=
              at::arange(ctx - n, ctx, block_tables.options()).unsqueeze(1))
                 .unsqueeze(0)
                 .unsqueeze(0);
    }
    const auto o = at::scaled_dot_product_attention(q.narrow(0, start, n).transpose(0, 1).unsqueeze(0),
                                                    keys.transpose(0, 1).unsqueeze(0),
                                                    values.transpose(0, 1).unsqueeze(0), mask, 0.0, ctx == n, scale,
                                                    /*enable_gqa=*/true);
    out.narrow(0, start, n).copy_(o[0].transpose(0, 1));
  }
  return out;
}

at::Tensor decoder_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                          const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, const at::Tensor& kernel_rows,
                          const std::vector<at::Tensor>& span_blocks, const std::vector<int64_t>& spans,
                          const std::vector<at::Tensor>& weights, const std::vector<int64_t>& kinds,
                          int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  TORCH_CHECK(kv_cache.dim() == 6, "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]");
  const int64_t layers = kv_cache.size(1), head_dim = kv_cache.size(5), rows = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerWeights + 1 &&
                  static_cast<int64_t>(kinds.size()) == layers * 4,
              "weights and kinds must describe every one of the pool's ", layers, " layers");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(spans.size() == 3 * span_blocks.size(), "spans must hold (start, rows, context) per span's blocks");
  for (size_t i = 0; i < span_blocks.size(); ++i) {
    const int64_t start = spans[3 * i], n = spans[3 * i + 1], ctx = spans[3 * i + 2];
    TORCH_CHECK(start >= 0 && n >= 1 && start + n <= x.size(0) && ctx >= n &&
                    ctx <= span_blocks[i].numel() * kv_cache.size(3) && span_blocks[i].scalar_type() == at::kLong,
                "span ", i, " does not fit the step's rows or its blocks");
  }
  TORCH_CHECK(kernel_rows.scalar_type() == at::kLong && kernel_rows.dim() == 1, "kernel_rows must be int64 [R]");
  NoGil nogil;
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  at::Tensor h = x, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kLayerWeights;
    const int64_t* kind = kinds.data() + l * 4;
    at::Tensor normed;
    if (l == 0) {
      normed = add_rms_norm(h, c10::nullopt, w[0], eps);
      residual = h;
    } else {
      normed = add_rms_norm(h, residual, w[0], eps);
    }
    at::Tensor qkv = run_projection(kind[0], normed, w + 2);
    TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "the q/k/v projection's width does not match the heads");
    rotary(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    const auto q = qkv.narrow(1, 0, q_width).view({rows, num_heads, head_dim});
    const auto k = qkv.narrow(1, q_width, kv_width).view({rows, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, num_kv_heads, head_dim});
    const at::Tensor kv_layer = kv_cache.select(1, l);
    write_kv(k, v, kv_layer, slot_blocks, slot_offsets);
    const at::Tensor o =
        attend_layer(q, k, v, kv_layer, block_tables, context_lens, kernel_rows, span_blocks, spans, scale);
    h = run_projection(kind[1], o.view({rows, q_width}), w + 2 + kProjectionWeights);
    normed = add_rms_norm(h, residual, w[1], eps);
    h = run_projection(kind[3], gate_up_silu(kind[2], normed, w + 2 + 2 * kProjectionWeights),
                       w + 2 + 3 * kProjectionWeights);
  }
  return add_rms_norm(h, residual, weights.back(), eps);
}
