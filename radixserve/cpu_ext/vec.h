// 16-float vectors (GCC vector extensions) shared by the CPU kernels: loads, stores, e^x.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// e^x, relative error ~2e-7 (Taylor to degree 7 after range reduction); x below -87 -> 0,
// x above 88 -> e^88.
inline v16 exp16(v16 x) {
  const v16 lo = splat(-87.0f), hi = splat(88.0f);
  v16i dead = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = round(x / ln 2); conversion truncates toward zero, so add +-0.5 first.
  const v16 t = x * 1.44269504088896341f;
  const v16 n = __builtin_convertvector(
      __builtin_convertvector(t + (t < 0 ? splat(-0.5f) : splat(0.5f)), v16i), v16);
  v16 f = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  v16 p = splat(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  v16 r = p * scale;
  return dead ? splat(0.0f) : r;
}

}  // namespace
