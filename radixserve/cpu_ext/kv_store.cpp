// Writing this step's K/V into the pool, one call per layer for K and V.  A pool in the model's
// dtype (store_kv) takes the rows as they are, in one call where torch needs two index writes,
// each with its own dispatch overhead, per layer.  An 8-bit pool (kv_cache_dtype int8 /
// fp8_e4m3 / fp8_e5m2, store_kv_quant) quantizes them in the same call, where the torch ops of
// the same quantization (amax, divide, round, clamp, cast, three index writes, for each of K and
// V) would pay a dispatch each, per layer, every decoded token.  Numerics are those of
// kv_pool.py's quantize_kv, its reference: int8 scale = amax / 127 rounded to float16, values
// round-half-even(x / scale) clamped to [-127, 127]; fp8 values saturated at the format's largest
// finite value, then cast (c10's round-to-nearest-even conversion, as torch's).  With `rotated`
// each row is first turned into the Hadamard basis (kv_pool.fwht: the same butterflies, the same
// bits).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

template <typename T>
void row_as_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void quantize_int8_row(const float* x, int64_t n, int8_t* q, at::Half* scale) {
  float amax = 0.f;
#if defined(__AVX512F__)
  const bool vec = n % 16 == 0;
  if (vec) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(m);
  }
#else
  const bool vec = false;
#endif
  if (!vec) {
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  }
  const at::Half s = static_cast<at::Half>(amax / 127.f);
  *scale = s;
  const float sf = static_cast<float>(s);
  const float div = sf > 0.f ? sf : 1.f;
#if defined(__AVX512F__)
  if (vec) {  // the same IEEE division and round-half-even as below, 16 at a time
    const __m512 dv = _mm512_set1_ps(div), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), dv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(c));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(x[i] / div);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
}

template <typename F8>
void fp8_row(const float* x, int64_t n, F8* q) {
  const float top = static_cast<float>(std::numeric_limits<F8>::max());
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<F8>(std::min(top, std::max(-top, x[i])));
}

}  // namespace

// k, v: [n, KV, D] (float32 / bfloat16 / float16); k_pool, v_pool: [S, KV, D] 8-bit; k_scale,
// v_scale: [S, KV] float16 for an int8 pool (empty otherwise); slots: [n] int64.
void store_kv_quant(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool,
                    at::Tensor k_scale, at::Tensor v_scale, at::Tensor slots, bool rotated) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [n, kv_heads, head_dim]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(1) == k.size(1) &&
                  k_pool.size(2) == k.size(2),
              "pools must be contiguous [slots, kv_heads, head_dim] matching k");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0),
              "slots must be [n] int64");
  const auto type = k_pool.scalar_type();
  TORCH_CHECK(type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2,
              "store_kv_quant: the pool must hold int8 or fp8");
  if (type == at::kChar) {
    for (const auto* t : {&k_scale, &v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == k_pool.size(0) && t->size(1) == k.size(1),
                  "an int8 pool needs contiguous float16 scales of shape [slots, kv_heads]");
    }
  }
  auto kc = k.contiguous(), vc = v.contiguous();
  auto sl = slots.contiguous();
  const int64_t n = k.size(0), heads = k.size(1), dim = k.size(2);
  TORCH_CHECK(!rotated || (dim & (dim - 1)) == 0,
              "store_kv_quant: a rotated row's size must be a power of two");
  const int64_t num_slots = k_pool.size(0);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv_quant: slot ", sp[t],
                " outside the pool");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, kc.scalar_type(), "store_kv_quant", [&] {
    using T = scalar_t;
    const T* srcs[2] = {kc.data_ptr<T>(), vc.data_ptr<T>()};
    at::Tensor* pools[2] = {&k_pool, &v_pool};
    at::Tensor* scales[2] = {&k_scale, &v_scale};
    at::parallel_for(0, 2 * n, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (int64_t w = begin; w < end; ++w) {
        const int64_t side = w / n, t = w % n;
        for (int64_t h = 0; h < heads; ++h) {
          row_as_float(srcs[side] + (t * heads + h) * dim, row.data(), dim);
          if (rotated) hadamard_row(row.data(), dim);
          const int64_t dst = (sp[t] * heads + h) * dim;
          if (type == at::kChar) {
            quantize_int8_row(row.data(), dim, static_cast<int8_t*>(pools[side]->data_ptr()) + dst,
                              scales[side]->data_ptr<at::Half>() + sp[t] * heads + h);
          } else if (type == at::kFloat8_e4m3fn) {
            fp8_row(row.data(), dim,
                    static_cast<c10::Float8_e4m3fn*>(pools[side]->data_ptr()) + dst);
          } else {
            fp8_row(row.data(), dim, static_cast<c10::Float8_e5m2*>(pools[side]->data_ptr()) + dst);
          }
        }
      }
    });
  });
}

// k, v: [n, KV, D]; k_pool, v_pool: [S, KV, D] of k's dtype; slots: [n] int64.
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [n, kv_heads, head_dim]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(1) == k.size(1) &&
                  k_pool.size(2) == k.size(2),
              "pools must be contiguous [slots, kv_heads, head_dim] matching k");
  TORCH_CHECK(k_pool.scalar_type() == k.scalar_type() && v_pool.scalar_type() == v.scalar_type() &&
                  v.scalar_type() == k.scalar_type(),
              "store_kv: k, v and the pools must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0),
              "slots must be [n] int64");
  for (const auto* t : {&k, &v, &k_pool, &v_pool, &slots})
    TORCH_CHECK(t->is_cpu(), "store_kv: CPU tensors only");
  auto kc = k.contiguous(), vc = v.contiguous();
  auto sl = slots.contiguous();
  const int64_t n = k.size(0), num_slots = k_pool.size(0);
  const int64_t row = k.size(1) * k.size(2) * k.element_size();  // bytes of one token's heads
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv: slot ", sp[t], " outside the pool");
  }
  const char* srcs[2] = {static_cast<const char*>(kc.data_ptr()),
                         static_cast<const char*>(vc.data_ptr())};
  char* dsts[2] = {static_cast<char*>(k_pool.data_ptr()), static_cast<char*>(v_pool.data_ptr())};
  // One token's row is a few hundred bytes: a decode step copies on the calling thread; a
  // prompt's rows are shared out.
  at::parallel_for(0, 2 * n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t side = w / n, t = w % n;
      std::memcpy(dsts[side] + sp[t] * row, srcs[side] + t * row, row);
    }
  });
}
