// Q4_K, Q5_K and Q6_K times x in 16-bit integers (kquant_wide.h): VNNI integer dot products of the
// stored q with x's two bytes, where a float kernel forms each weight in registers first.
//
// With x = dx_b x16 per block b of 32 (x16 = 256 hi + lo, KqWideRow), each group g of weights
// that shares a scale gives
//   Q4_K, Q5_K (8 groups of 32, w = D_g q - N_g, D_g = d sc_g, N_g = dmin m_g, q in [0, 15],
//   [0, 31]):
//     D_g dx_b (256 sum q hi + sum q lo) - N_g sum_g(x)
//   Q6_K (16 groups of 16, w = D_g (q - 32), D_g = d sc_g, q in [0, 63]):
//     D_g dx_b (256 sum q hi + sum q lo) - 32 D_g sum_g(x)
// the integer sums exact in int32 (|sum| < 2^23 a lane) and in their conversion to float, the
// other term taken with x's exact sums.  The only error is x's rounding, at most dx / 2 an
// element, as int4_linear_q16's (linear_ops.cpp).
//
// VPDPBUSD sums 4 bytes a lane, so a 64-byte vector of q gives 16 lanes of 4 weights, each lane
// inside one group; each lane's sum is scaled by its group's D dx (one permute of the
// super-block's scales a vector) and added up in floats across the row.
// - Q4_K, Q5_K: a 64-byte load of the nibbles holds runs u and u + 1 (32 bytes each): its low
//   nibbles are groups 2u and 2u + 2, its high ones 2u + 1 and 2u + 3, which x's block order
//   matches.
// - Q6_K: 64 bytes of ql (weights 128 h + l and 128 h + 32 + l in their low nibbles, + 64 in
//   their high ones) and the 32 bytes of qh that hold their top two bits, both halves of the
//   vector reading the same qh bytes at their own shift: weights in order.

#include "kquant_wide.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "kquant.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

namespace {

constexpr int TILE = 4;  // output rows per tile

// A block's place in a Q4_K row's order: blocks 0, 2, 1, 3, 4, 6, 5, 7.
constexpr int q4k_place(int s) { return (s & 4) | ((s & 1) << 1) | ((s & 2) >> 1); }

// Lanes 0-7 take value a, lanes 8-15 value b.
inline __m512i halves(int a, int b) {
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
}

// 16-bit lanes 0-15 take value a, lanes 16-31 value b (per-half shift counts).
inline __m512i halves16(int a, int b) {
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi16(static_cast<int16_t>(a)),
                                 _mm512_set1_epi16(static_cast<int16_t>(b)));
}

// The sums of q x16 of a vector of q bytes with x's hi and lo bytes at h and l.
inline __m512 q_x16(__m512i q, const int8_t* h, const int8_t* l) {
  const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(h));
  return _mm512_cvtepi32_ps(
      _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), q, _mm512_loadu_si512(l)));
}

// Q4_K, and with FIFTH Q5_K: its 32 bytes of qh before the nibbles give each weight a fifth bit
// (bit g of qh[l]: weight l of group g), both halves of a vector reading the same qh bytes at
// their own group's bit.
template <bool FIFTH>
struct Q4KWide {
  static constexpr int BYTES = FIFTH ? Q5K::BYTES : Q4K::BYTES, SCALES = 16;
  // acc += the super-block's products with x (xs: its dx and sums, xh / xl: its bytes)
  static void block(const uint8_t* blk, const float* xs, const int8_t* xh, const int8_t* xl,
                    __m512& acc) {
    const __m512i picks[4] = {halves(0, 2), halves(1, 3), halves(4, 6), halves(5, 7)};
    const __m512i low4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const uint8_t* qs = blk + (FIFTH ? 48 : 16);
    Q4K::Scales s;
    Q4K::scales(blk, s);
    // lanes 0-7: D_g dx_g; lanes 8-15: -N_g times the group's sum of x
    const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(s.v), _mm512_loadu_ps(xs));
    acc = _mm512_mask_add_ps(acc, 0xFF00, acc, sd);
    for (int h = 0; h < 2; ++h) {
      const __m512i packed = _mm512_loadu_si512(qs + 64 * h);
      __m512i q[2] = {_mm512_and_si512(packed, low4),
                      _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4)};
      if constexpr (FIFTH) {
        const __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
        for (int t = 0; t < 2; ++t) {  // groups 4h + t (low half), 4h + t + 2 (high half)
          const __m512i bit = _mm512_srlv_epi16(qh, halves16(4 * h + t, 4 * h + t + 2));
          q[t] = _mm512_or_si512(q[t], _mm512_and_si512(_mm512_slli_epi16(bit, 4), bit4));
        }
      }
      for (int t = 0; t < 2; ++t) {
        const int at = 128 * h + 64 * t;
        acc = _mm512_fmadd_ps(q_x16(q[t], xh + at, xl + at),
                              _mm512_permutexvar_ps(picks[2 * h + t], sd), acc);
      }
    }
  }
};

struct Q6KWide {
  static constexpr int BYTES = Q6K::BYTES, SCALES = 32;
  static void block(const uint8_t* blk, const float* xs, const int8_t* xh, const int8_t* xl,
                    __m512& acc) {
    // lane i of the v-th 64 weights: group 4 v + i / 4
    const __m512i picks[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
        _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
        _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
    // qh's bits 2t, 2t + 1 to bits 4, 5: t = 0 | 1 left by 4 | 2, t = 2 | 3 right by 0 | 2
    const __m512i up = halves16(4, 2), down = halves16(0, 2);
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
    Q6K::Scales s;
    Q6K::scales(blk, s);
    const __m512 d = _mm512_loadu_ps(s.v);
    const __m512 sd = _mm512_mul_ps(d, _mm512_loadu_ps(xs));  // D_g dx_g
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-32.f)), _mm512_loadu_ps(xs + 16), acc);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      const __m512i q[2] = {
          _mm512_or_si512(_mm512_and_si512(ql, low4),
                          _mm512_and_si512(_mm512_sllv_epi16(qh, up), top2)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                          _mm512_and_si512(_mm512_srlv_epi16(qh, down), top2))};
      for (int t = 0; t < 2; ++t) {
        const int at = 128 * h + 64 * t;
        acc = _mm512_fmadd_ps(q_x16(q[t], xh + at, xl + at),
                              _mm512_permutexvar_ps(picks[2 * h + t], sd), acc);
      }
    }
  }
};

// Output rows [n0, n1) of the M rows of x, TILE output rows at a time; `ahead` bytes on, the
// next tile's rows (up to `reach`) are asked for as a tile streams its own.
template <typename Q>
void wide_rows(const KqWideRow* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N,
               int64_t n0, int64_t n1, int64_t reach) {
  const int64_t blocks = K / QK_K, row_bytes = blocks * Q::BYTES;
  for (int64_t n = n0; n < n1; n += TILE) {
    const int nb = static_cast<int>(std::min<int64_t>(TILE, n1 - n));
    const int64_t ahead = n + nb < reach ? TILE * row_bytes : 0;
    for (int64_t m = 0; m < M; ++m) {
      const KqWideRow& xr = x[m];
      __m512 acc[TILE];
      for (int i = 0; i < TILE; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b)
        for (int i = 0; i < TILE; ++i) {
          const uint8_t* blk = w + (n + std::min(i, nb - 1)) * row_bytes + b * Q::BYTES;
          if (ahead)
            for (int off = 0; off < Q::BYTES; off += 64)
              prefetch_line(reinterpret_cast<const char*>(blk + ahead + off));
          Q::block(blk, xr.scales.data() + Q::SCALES * b, xr.hi.data() + QK_K * b,
                   xr.lo.data() + QK_K * b, acc[i]);
        }
      for (int i = 0; i < nb; ++i) y[m * N + n + i] = _mm512_reduce_add_ps(acc[i]);
    }
  }
}

}  // namespace

bool kq_wide_supported() { return true; }

void kq_wide_row(const float* x, int64_t K, bool q6k, KqWideRow& row) {
  const int64_t blocks = K / QK_K;
  const int per = q6k ? Q6KWide::SCALES : Q4KWide<false>::SCALES;
  row.hi.resize(K);
  row.lo.resize(K);
  row.scales.resize(per * blocks);
  for (int64_t b = 0; b < blocks; ++b)
    for (int s = 0; s < 8; ++s) {
      const float* src = x + b * QK_K + 32 * s;
      const __m512 a[2] = {_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16)};
      const float amax =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a[0]), _mm512_abs_ps(a[1])));
      float* sc = row.scales.data() + per * b;
      if (q6k) {
        sc[2 * s] = sc[2 * s + 1] = amax / Q16_MAX;
        sc[16 + 2 * s] = _mm512_reduce_add_ps(a[0]);
        sc[16 + 2 * s + 1] = _mm512_reduce_add_ps(a[1]);
      } else {
        sc[s] = amax / Q16_MAX;
        sc[8 + s] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
      }
      // a block below 1e-30 in magnitude counts as zeros; its exact sum still enters
      const int64_t at = b * QK_K + 32 * (q6k ? s : q4k_place(s));
      split_block16(a[0], a[1], amax > 1e-30f ? Q16_MAX / amax : 0.f, row.hi.data() + at,
                    row.lo.data() + at, 16);
    }
}

void kq_wide_rows(const KqWideRow* x, const uint8_t* w, int bytes, float* y, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t reach) {
  switch (bytes) {
    case Q4K::BYTES: return wide_rows<Q4KWide<false>>(x, w, y, M, K, N, n0, n1, reach);
    case Q5K::BYTES: return wide_rows<Q4KWide<true>>(x, w, y, M, K, N, n0, n1, reach);
    case Q6K::BYTES: return wide_rows<Q6KWide>(x, w, y, M, K, N, n0, n1, reach);
    default: TORCH_CHECK(false, "kq_wide_rows: Q4_K, Q5_K or Q6_K blocks, got ", bytes, " bytes");
  }
}

#else

bool kq_wide_supported() { return false; }

void kq_wide_row(const float*, int64_t, bool, KqWideRow&) {
  TORCH_CHECK(false, "kq_linear_q16: this build has no AVX-512 VNNI");
}

void kq_wide_rows(const KqWideRow*, const uint8_t*, int, float*, int64_t, int64_t, int64_t,
                  int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "kq_linear_q16: this build has no AVX-512 VNNI");
}

#endif
