// GGUF's K-quant super-blocks (llama.cpp's block_q4_K, block_q5_K and block_q6_K: 256 weights
// each, as ggml's dequantize_row_q4_K / q5_K / q6_K read them) decoded into vectors of W floats
// for kquant_ops.cpp.
//
// Each weight is formed as the gguf package's numpy dequantization forms it (gguf/quants.py),
// to the bit: Q4_K and Q5_K's (d * sc) * q - dmin * m, whose product (d * sc) * q is exact in
// float32 (a float16 d, a 6-bit sc and a 4- or 5-bit q), so one fused multiply-add rounds once
// as numpy's subtraction does; Q6_K's (d * sc) * (q - 32), an exact product (with numpy's sign of
// zero, which a multiply-add of -32 d sc would not keep).
//
// A type's `unit<U>(block, scales, use)` calls use(offset, w) for each vector w of its U-th run
// of weights, offset the first weight's place in the super-block.  With AVX-512, Q4_K and Q5_K
// look each weight up in a table of its sub-block's 16 or 32 possible values (one permute, as
// linear_ops.cpp's int4_tile does for 4-bit blocks); elsewhere each q is converted to float.
#pragma once

#include <utility>

#include "vec.h"

namespace {

constexpr int QK_K = 256;  // weights per super-block

// W bytes from p, each zero-extended to a 32-bit lane.
inline vi widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vi v;
  for (int l = 0; l < W; ++l) v[l] = p[l];
  return v;
#endif
}

inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }

// a * b + c, rounded once where the CPU has FMA (the kernels' sums; a weight's a * b is exact).
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Q4_K and Q5_K's 8 sub-block scales and mins (6 bits each, packed in 12 bytes at p + 4) as
// out[0..7] = d * sc and out[8..15] = -(dmin * m), with d and dmin the float16s at p and p + 2.
inline void k_scales(const uint8_t* p, float* out) {
  const float d = half_at(p), dmin = half_at(p + 2);
  // sc[0..3] and m[0..3] are the low 6 bits of bytes 0-3 and 4-7; sc[4..7] and m[4..7] the low
  // and high nibbles of bytes 8-11, with their top 2 bits in the top bits of bytes 0-3 and 4-7
  uint32_t u[4];
  std::memcpy(u, p + 4, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);  // m[4..7]
  const uint32_t m03 = u[1] & 0x3f3f3f3f;
  u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);  // sc[4..7]
  u[2] = m03;
  u[0] &= 0x3f3f3f3f;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(u))));
  const __m512 dm = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
  _mm512_storeu_ps(out, _mm512_mul_ps(f, dm));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
  _mm256_storeu_ps(out, _mm256_mul_ps(sc, _mm256_set1_ps(d)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(m, _mm256_set1_ps(-dmin)));
#else
  uint8_t v[16];
  std::memcpy(v, u, 16);
  for (int i = 0; i < 8; ++i) {
    out[i] = d * static_cast<float>(v[i]);
    out[8 + i] = -dmin * static_cast<float>(v[8 + i]);
  }
#endif
}

#if defined(__AVX512F__)
// A sub-block's possible weights d * q + m for q = base .. base + 15.
inline __m512 value_table(float d, float m, float base) {
  const __m512 q = _mm512_add_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(base));
  return _mm512_fmadd_ps(q, _mm512_set1_ps(d), _mm512_set1_ps(m));
}

// Lanes whose bits 0-3 are a's and bit 4 is bit B of h (above it: anything): a 5-bit index.
template <int B>
inline __m512i with_bit4(__m512i a, __m512i h) {
  return _mm512_ternarylogic_epi32(a, _mm512_rol_epi32(h, (4 - B) & 31), _mm512_set1_epi32(15),
                                   0xE4);  // (a & 15) | (rotated h & ~15)
}
#else
// h shifted so that its bit B is bit 4.
template <int B>
inline vi bit_to_4(vi h) {
  if constexpr (B <= 4) return h << (4 - B);
  else return h >> (B - 4);
}
#endif

// block_q4_K (144 bytes): float16 d and dmin, 12 bytes of scales and mins, 128 bytes of nibbles
// (32-byte run u: sub-block 2u in the low nibbles, 2u + 1 in the high ones).
struct Q4K {
  static constexpr int BYTES = 144;
  static constexpr int UNITS = 4;  // runs of 64 weights: sub-blocks 2U and 2U + 1
  struct Scales {
    float v[16];  // d * sc, then -(dmin * m), per sub-block of 32
  };
  static void scales(const uint8_t* b, Scales& s) { k_scales(b, s.v); }

  template <int U, typename Use>
  static void unit(const uint8_t* b, const Scales& s, const Use& use) {
    const uint8_t* qs = b + 16 + 32 * U;
#if defined(__AVX512F__)
    const __m512 lo = value_table(s.v[2 * U], s.v[8 + 2 * U], 0);
    const __m512 hi = value_table(s.v[2 * U + 1], s.v[9 + 2 * U], 0);
    for (int l = 0; l < 32; l += 16) {
      const __m512i q = (__m512i)widen_bytes(qs + l);
      use(64 * U + l, (vf)_mm512_permutexvar_ps(q, lo));  // reads bits 0-3 of q alone
      use(64 * U + 32 + l, (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), hi));
    }
#else
    const vf d0 = splat_as<vf>(s.v[2 * U]), m0 = splat_as<vf>(s.v[8 + 2 * U]);
    const vf d1 = splat_as<vf>(s.v[2 * U + 1]), m1 = splat_as<vf>(s.v[9 + 2 * U]);
    for (int l = 0; l < 32; l += W) {
      const vi q = widen_bytes(qs + l);
      use(64 * U + l, fmadd(to_float(q & 15), d0, m0));
      use(64 * U + 32 + l, fmadd(to_float(q >> 4), d1, m1));
    }
#endif
  }
};

// block_q5_K (176 bytes): as block_q4_K, with 32 bytes of fifth bits (qh) before the nibbles:
// bit s of qh[l] is the fifth bit of weight l of sub-block s.
struct Q5K {
  static constexpr int BYTES = 176;
  static constexpr int UNITS = 4;
  using Scales = Q4K::Scales;
  static void scales(const uint8_t* b, Scales& s) { k_scales(b, s.v); }

  template <int U, typename Use>
  static void unit(const uint8_t* b, const Scales& s, const Use& use) {
    const uint8_t *qh = b + 16, *qs = b + 48 + 32 * U;
#if defined(__AVX512F__)
    const __m512 lo0 = value_table(s.v[2 * U], s.v[8 + 2 * U], 0);
    const __m512 lo1 = value_table(s.v[2 * U], s.v[8 + 2 * U], 16);
    const __m512 hi0 = value_table(s.v[2 * U + 1], s.v[9 + 2 * U], 0);
    const __m512 hi1 = value_table(s.v[2 * U + 1], s.v[9 + 2 * U], 16);
    for (int l = 0; l < 32; l += 16) {
      const __m512i q = (__m512i)widen_bytes(qs + l), h = (__m512i)widen_bytes(qh + l);
      use(64 * U + l, (vf)_mm512_permutex2var_ps(lo0, with_bit4<2 * U>(q, h), lo1));
      use(64 * U + 32 + l, (vf)_mm512_permutex2var_ps(
                               hi0, with_bit4<2 * U + 1>(_mm512_srli_epi32(q, 4), h), hi1));
    }
#else
    const vf d0 = splat_as<vf>(s.v[2 * U]), m0 = splat_as<vf>(s.v[8 + 2 * U]);
    const vf d1 = splat_as<vf>(s.v[2 * U + 1]), m1 = splat_as<vf>(s.v[9 + 2 * U]);
    for (int l = 0; l < 32; l += W) {
      const vi q = widen_bytes(qs + l), h = widen_bytes(qh + l);
      use(64 * U + l, fmadd(to_float((q & 15) | (bit_to_4<2 * U>(h) & 16)), d0, m0));
      use(64 * U + 32 + l, fmadd(to_float((q >> 4) | (bit_to_4<2 * U + 1>(h) & 16)), d1, m1));
    }
#endif
  }
};

// block_q6_K (210 bytes): 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8
// scales (one per 16 weights), float16 d.  Weight 128 h + 32 t + l (h < 2, t < 4, l < 32): the
// low (t < 2) or high nibble of ql[64 h + 32 (t % 2) + l] and bits 2t, 2t + 1 of qh[32 h + l].
struct Q6K {
  static constexpr int BYTES = 210;
  static constexpr int UNITS = 4;  // weights 128 h + 32 t + l, l in [16 (U % 2), +16), h = U / 2
  struct Scales {
    float v[16];  // d * scale per 16 weights
  };
  static void scales(const uint8_t* b, Scales& s) {
    const float d = half_at(b + 208);
#if defined(__AVX512F__)
    const __m512 sc = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_storeu_ps(s.v, _mm512_mul_ps(sc, _mm512_set1_ps(d)));
#elif defined(__AVX2__)
    for (int h = 0; h < 16; h += 8) {
      const __m256 sc = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + h))));
      _mm256_storeu_ps(s.v + h, _mm256_mul_ps(sc, _mm256_set1_ps(d)));
    }
#else
    for (int i = 0; i < 16; ++i) s.v[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
#endif
  }

  template <int U, typename Use>
  static void unit(const uint8_t* b, const Scales& s, const Use& use) {
    constexpr int H = U / 2, L = 16 * (U % 2);
    const uint8_t *ql = b + 64 * H, *qh = b + 128 + 32 * H;
    for (int l = L; l < L + 16; l += W) {
      const vi a = widen_bytes(ql + l), c = widen_bytes(ql + 32 + l), h = widen_bytes(qh + l);
      const vi q[4] = {(a & 15) | ((h << 4) & 48), (c & 15) | ((h << 2) & 48),
                       (a >> 4) | (h & 48), (c >> 4) | ((h >> 2) & 48)};
      for (int t = 0; t < 4; ++t)
        use(128 * H + 32 * t + l, to_float(q[t] - 32) * splat_as<vf>(s.v[8 * H + 2 * t + U % 2]));
    }
  }
};

template <typename F, int... U>
inline void each_unit_of(const F& f, std::integer_sequence<int, U...>) {
  (f(std::integral_constant<int, U>{}), ...);
}

// f(std::integral_constant<int, U>{}) for U = 0 .. N - 1, in order (a type's units).
template <int N, typename F>
inline void each_unit(const F& f) {
  each_unit_of(f, std::make_integer_sequence<int, N>{});
}

}  // namespace
