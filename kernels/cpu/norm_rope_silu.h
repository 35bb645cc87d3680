// add_rms_norm, rotary, silu_and_mul: twins in tokenyard.models.fused. Each replaces five
// to eight small torch ops per layer, whose dispatch at batch 1 cost more than the
// arithmetic.
#pragma once

#include "common.h"

namespace {

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
      scalar_t* rr = rp ? rp + r * dim : nullptr;
      float ss = 0.f;
      int64_t d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        vf acc = vzero();
        for (; d + kW <= dim; d += kW) {
          vf sum = vload(xr + d);
          if (rr) {
            sum = round_as<scalar_t>(vadd(sum, vload(rr + d)));
            vstore(rr + d, sum);
          }
          vstore(h.data() + d, sum);
          acc = vfma(sum, sum, acc);
        }
        ss = vsum(acc);
      }
#endif
      for (; d < dim; ++d) {
        // The residual sum is rounded to the model's dtype, as the torch twin's x + residual is.
        const scalar_t sum = rr ? static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d])) : xr[d];
        if (rr) rr[d] = sum;
        h[d] = static_cast<float>(sum);
        ss += h[d] * h[d];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        const vf vinv = vset(inv);
        for (; d + kW <= dim; d += kW) {
          const vf normed = round_as<scalar_t>(vmul(vload(h.data() + d), vinv));
          vstore(op + r * dim + d, vmul(vload(wp + d), normed));
        }
      }
#endif
      for (; d < dim; ++d) {
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
      int64_t d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        for (; d + kW <= width; d += kW) {
          const vf g = vload(gate + d);
          const vf act = round_as<scalar_t>(vmul(g, vrcp(vadd(vset(1.f), vexp(vsub(vzero(), g))))));
          vstore(op + r * width + d, vmul(act, vload(up + d)));
        }
      }
#endif
      for (; d < width; ++d) {
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
