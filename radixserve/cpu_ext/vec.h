// Float vectors (GCC vector extensions) shared by the CPU kernels: loads, stores, e^x, and the
// native width W of the machine the extension is built on.
//
// W is 16 floats where the CPU has AVX-512F and 8 elsewhere (AVX2, or any other target): a
// 64-byte vector type on a CPU with 32-byte registers is split by the compiler into halves, and
// every cross-lane shuffle of it (transposes, horizontal reductions) is lowered to scalar
// inserts and extracts, which makes a shuffle-heavy kernel (attention) many times slower than
// torch's SDPA on such a CPU.  Code that shuffles uses ``vf`` (W lanes); v16 stays for
// elementwise loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

// x in every lane, by the broadcast intrinsic: a load-port broadcast where x is in memory.  Not
// `V{} + x`: the compiler may not drop the + 0.0 (it turns -0.0 into +0.0), so that costs an add
// and a register broadcast (a shuffle) a call, a large share of the 4-bit kernel's vector
// operations per block and output row (d and m); nor a per-lane loop, which GCC builds lane by
// lane under AVX-512.
template <typename V>
inline V splat_as(float x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_set1_ps(x);
#endif
#if defined(__AVX__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_set1_ps(x);
  if constexpr (sizeof(V) == 64) {
    const __m256 h = _mm256_set1_ps(x);
    V v;
    std::memcpy(&v, &h, sizeof(h));
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof(h), &h, sizeof(h));
    return v;
  }
#endif
  return V{} + x;
}
inline v16 splat(float x) { return splat_as<v16>(x); }

template <typename V = v16>
inline V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16 load16(const float* p) { return load_as<v16>(p); }
inline vf loadw(const float* p) { return load_as<vf>(p); }

template <typename V>
inline void store_as(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
inline void store16(float* p, v16 v) { store_as(p, v); }
inline void storew(float* p, vf v) { store_as(p, v); }

typedef uint16_t v16h __attribute__((vector_size(32)));

// 16 half-precision bit patterns as floats (exact, subnormals included).
inline v16 halves_to_float(v16h h) {
  v16 f;
#if defined(__AVX512F__)
  __m256i x;
  std::memcpy(&x, &h, sizeof(x));
  const __m512 y = _mm512_cvtph_ps(x);
  std::memcpy(&f, &y, sizeof(f));
#elif defined(__F16C__)
  __m128i lo, hi;
  std::memcpy(&lo, &h, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&h) + 16, sizeof(hi));
  const __m256 a = _mm256_cvtph_ps(lo), b = _mm256_cvtph_ps(hi);
  std::memcpy(&f, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&f) + 32, &b, sizeof(b));
#else
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
#endif
  return f;
}

// n half-precision bit patterns from src as floats into dst (a 4-bit weight's d and m per
// block, linear_ops.cpp), 16 at a time; the tail by a masked load (AVX-512) or one at a time.
inline void widen_halves(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16h h;
    std::memcpy(&h, src + i, sizeof(h));
    store16(dst + i, halves_to_float(h));
  }
  if (i == n) return;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  _mm512_mask_storeu_ps(dst + i, tail, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, src + i)));
#elif defined(__F16C__)
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
#else
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
#endif
}

// Halves added until one lane is left (log2 W shuffles, not W dependent scalar adds).
// W bfloat16 values at p as floats (bfloat16 is float32's upper 16 bits: exact).  By
// intrinsics: GCC lowers a vector extension's 16-to-32-bit conversion of 16 lanes as two halves
// joined by shuffles.
inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  vf out;
  for (int l = 0; l < W; ++l) {
    const uint32_t bits = static_cast<uint32_t>(p[l]) << 16;
    std::memcpy(&out[l], &bits, 4);
  }
  return out;
#endif
}

inline float lane_sum(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)a);
#elif defined(__AVX__)
  const __m128 h =
      _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#else
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += a[l];
  return s;
#endif
}

// e^x for any float vector type, relative error ~2e-7 (Taylor to degree 7 after range
// reduction); x below -87 gives 0, x above 88 gives e^88.
template <typename V>
inline V vexp(V x) {
  using VI = decltype(x < x);  // the signed int vector of the same lanes
  const V lo = splat_as<V>(-87.0f), hi = splat_as<V>(88.0f);
  const VI dead = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = round(x / ln 2); conversion truncates toward zero, so add +-0.5 first.
  const V t = x * 1.44269504088896341f;
  const V n = __builtin_convertvector(
      __builtin_convertvector(t + (t < 0 ? splat_as<V>(-0.5f) : splat_as<V>(0.5f)), VI), V);
  V f = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  V p = splat_as<V>(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const V r = p * scale;
  return dead ? splat_as<V>(0.0f) : r;
}
inline v16 exp16(v16 x) { return vexp(x); }

// One butterfly stage of span H inside a W-lane vector: lane i with bit H clear becomes
// x[i] + x[i ^ H], lane i with it set x[i ^ H] - x[i] (the pair (a, b) -> (a + b, a - b)).
template <int H>
inline vf butterfly_w(vf x) {
  vi lanes;
  for (int i = 0; i < W; ++i) lanes[i] = i;
  const vf p = __builtin_shuffle(x, lanes ^ H);
  return (lanes & H) != 0 ? p - x : x + p;
}

// A vector of `n` floats (a power of two) times the normalised Hadamard matrix in Sylvester's
// order, in place: the basis an 8-bit KV pool stores K and V in (kv_pool.py).  The butterflies
// (spans 1, 2, 4, ... in that order; those below W inside each vector) and the final scale are
// those of kv_pool.fwht, so both give the same bits.
inline void hadamard_row(float* v, int64_t n) {
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  if (n % W != 0) {  // shorter than a vector: one element at a time
    for (int64_t h = 1; h < n; h <<= 1) {
      for (int64_t i = 0; i < n; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) v[i] *= s;
    return;
  }
  for (int64_t k = 0; k < n; k += W) {
    vf x = loadw(v + k);
    x = butterfly_w<1>(x);
    x = butterfly_w<2>(x);
    x = butterfly_w<4>(x);
    if (W == 16) x = butterfly_w<W / 2>(x);
    storew(v + k, x);
  }
  for (int64_t h = W; h < n; h <<= 1) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += W) {
        const vf a = loadw(v + j), b = loadw(v + j + h);
        storew(v + j, a + b);
        storew(v + j + h, a - b);
      }
    }
  }
  for (int64_t k = 0; k < n; k += W) storew(v + k, loadw(v + k) * s);
}

// One cache line asked for ahead of its use.  Not __builtin_prefetch: GCC 12 at -O3 deletes the
// loops of it in the 4-bit kernels (linear_ops.cpp's int4_rows, q8_rows: no prefetch instruction
// in the built library; other loops keep theirs), leaving those kernels to stream their weights
// on the hardware's prefetch alone.  An asm statement stays (tests/test_cpu_prefetch.py reads
// the library), and a one-row step's 4-bit matmuls, which stream weights too large for any
// cache, depend on it.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

#if defined(__AVX512F__)
// x in 16-bit integers as two signed bytes, x16 = 256 hi + lo with lo in [-128, 127] (the 4-bit
// and K-quant kernels' one-row steps: VNNI dot products of the weights' bytes with each): the
// largest |x16| is 127 * 257, so that hi stays in [-127, 127].
constexpr float Q16_MAX = 32639.f;

// A block of 32 of x times `inv`, rounded to 16-bit integers and split into hi and lo bytes,
// stored at `hi` and `lo`: weights 0-15, and weights 16-31 `gap` bytes on.
inline void split_block16(__m512 a0, __m512 a1, float inv, int8_t* hi, int8_t* lo, int gap) {
  const __m512 iv = _mm512_set1_ps(inv);
  const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
  for (int half = 0; half < 2; ++half) {
    const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(half ? a1 : a0, iv), rnd);
    const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, k128), k255), k128);
    const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(v, l), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + half * gap), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + half * gap), _mm512_cvtepi32_epi8(l));
  }
}
#endif

// W floats stored as the output's element type: float32 as they are, bfloat16 rounded to nearest
// even in vectors (a scalar conversion per element would make a bfloat16 dequantization cost
// more than the matmul it feeds), others element by element.
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

template <typename T>
inline void store_elems(T* dst, vf v) {
  if constexpr (std::is_same_v<T, float>) {
    storew(dst, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vu bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const vh top = __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, vh);
    std::memcpy(dst, &top, sizeof(top));
  } else {
    for (int l = 0; l < W; ++l) dst[l] = static_cast<T>(v[l]);
  }
}

}  // namespace
