// Elementwise parts of the decoder step fused per token row: RMSNorm (with the residual add
// before it), rotate-half RoPE in place, and silu(gate) * up.  Each rounds to the model dtype
// where the unfused torch code does (HF's reference order), so float32 results are those of
// the torch ops up to summation order, and bfloat16 results differ only by the rounding of
// intermediate products in RoPE.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <type_traits>

#include "vec.h"

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * h;
      v16 acc = {};  // sum of squares by 16 lanes (float sums do not vectorize by themselves)
      int64_t i = 0;
      for (; i + 16 <= h; i += 16) {
        v16 v;
        for (int j = 0; j < 16; ++j) v[j] = f32(xr[i + j]);
        acc += v * v;
      }
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += acc[j];
      for (; i < h; ++i) ss += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* o = out + t * h;
      for (i = 0; i < h; ++i) o[i] = round_to<T>(f32(w[i]) * f32(round_to<T>(f32(xr[i]) * inv)));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected a contiguous [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [H] of the input's dtype");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight);
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor residual, at::Tensor delta, at::Tensor weight,
                           double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta must match the residual");
  auto d = delta.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    const int64_t n = residual.numel();
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) r[i] = round_to<scalar_t>(f32(r[i]) + f32(dp[i]));
    });
    rms_rows<scalar_t>(r, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), residual.size(0),
                       residual.size(1), static_cast<float>(eps));
  });
  return out;
}

// x: [T, heads, D] (rows of heads may be strided: a view into the fused q/k/v projection);
// cos, sin: [T, D] (any float dtype, contiguous).  x <- x * cos + rotate_half(x) * sin.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: x must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rotary_: cos/sin must be contiguous [T, D]");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row_stride = x.stride(0);
  // float32 cos / sin are read in place (the model passes them so); others converted here
  const bool as_is = cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat;
  const at::Tensor c32 = as_is ? cos : cos.to(at::kFloat), s32 = as_is ? sin : sin.to(at::kFloat);
  const float* cp = c32.data_ptr<float>();
  const float* sp = s32.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + t * dim;
        const float* s = sp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = base + t * row_stride + h * dim;
          for (int64_t i = 0; i < half; ++i) {
            const float a = f32(v[i]), b = f32(v[i + half]);
            v[i] = round_to<scalar_t>(a * c[i] - b * s[i]);
            v[i + half] = round_to<scalar_t>(b * c[i + half] + a * s[i + half]);
          }
        }
      }
    });
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: expected a contiguous [T, 2I] tensor");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gr = g + t * 2 * inter;
        const scalar_t* ur = gr + inter;
        scalar_t* orow = o + t * inter;
        int64_t i = 0;
        alignas(64) float act[16];
        for (; i + 16 <= inter; i += 16) {  // silu by 16 lanes (e^x is most of its cost)
          v16 x;
          for (int j = 0; j < 16; ++j) x[j] = f32(gr[i + j]);
          store16(act, x / (1.f + exp16(-x)));
          for (int j = 0; j < 16; ++j)
            orow[i + j] = round_to<scalar_t>(f32(round_to<scalar_t>(act[j])) * f32(ur[i + j]));
        }
        for (; i < inter; ++i) {
          const float x = f32(gr[i]);
          const scalar_t a = round_to<scalar_t>(x / (1.f + std::exp(-x)));
          orow[i] = round_to<scalar_t>(f32(a) * f32(ur[i]));
        }
      }
    });
  });
  return out;
}
