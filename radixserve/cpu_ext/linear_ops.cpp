// Matmuls of the few rows of a decode step, where a step reads every weight once and memory
// bandwidth is the limit: float32 or bfloat16 weights (float_linear), weight-only int8
// (int8_linear) and 4-bit blocks (int4_linear).  Where each is used instead of torch's matmul:
// radixserve/quantization/ (float_linear.py's _kernel_rows for the float weights).
//
// Float32 and bfloat16: torch's matmul reads the weights of a decode step below the memory's
// rate at one row and passes over them again for more rows; this loop streams each weight once
// for all the rows of a step, close to the memory's rate.
//
// Int8: y[m][n] = sum_k x[m][k] * (w[n][k] * scale[n][k / group] + offset[n][k / group]), with w
// int8 (a scale per group of weights of a row, and an offset per group for --quantization int8's
// asymmetric groups; none for a GGUF's Q8_0) converted to float in registers, so a step reads
// about a quarter of a float32 weight's bytes.  Rows of x are taken MT at a time and output rows
// NB at a time, so each weight vector loaded feeds MT products and each x vector NB; with AVX-512,
// 3-8 rows go in one pass over 2 output rows at a time, so a verify step's rows read a large
// matrix (an LM head) once.
//
// 4-bit: blocks of 32 weights along K, w = d * q + m with q in [0, 15] and d, m float16
// (llama.cpp's Q4_1; its Q4_0 is m = -8 d): 5 bits a weight, each block expanded to floats in
// registers.  The d and m of a tile's rows are widened to float 16 blocks per vector instruction
// into a buffer the block loop broadcasts from (a scalar conversion per block and output row would
// cost a large share of the time at one row).  d and m stay float16 rather than float32 (6 bits a
// weight): fewer bytes, at no cost in time, since the loop waits on the memory's latency more
// than on its bytes.  With AVX-512 each nibble's weight is looked up by one permute in a
// 16-float table of the block's d * q + m (int4_tile); with 8-float vectors it is a conversion
// and a multiply-add.
// Many rows (a prefill) go another way (radixserve/quantization/): the weight is dequantized
// once per call and multiplied by torch's own float matmul, which this loop cannot beat there.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "row_shares.h"
#include "vec.h"

namespace {

typedef int8_t vb __attribute__((vector_size(W)));

constexpr int NB = 4;  // output rows per pass
constexpr int64_t CHUNK = 4 * NB;  // output rows a thread takes at a time (row_shares.h)
constexpr int MT = 2;  // input rows per pass
// An int8 weight's group (weights per scale along K) is a runtime value, a whole number of
// vectors: 32 for --quantization int8 and for a GGUF Q8_0 tensor (radixserve/quantization/).
constexpr int BLOCK4 = 32;  // weights per 4-bit block: d and m (float16), 16 bytes of nibbles

// W int8 -> W floats: sign extension and conversion (a direct vector conversion of int8 lanes is
// lowered to byte-wise scalar moves by GCC).
inline vf load_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

// Input rows [m, m + MT) times output rows [n, n + nb) (nb <= R; the rows past nb repeat the
// last one and are not written); x is float [M][K]; each row of w has K / group scales, and with
// OFFSET as many offsets: w = q * scale (+ offset), formed in registers, so the products are
// those of the float32 weight a loader dequantizes to (q * scale is exact for a float16 scale).
// Each output's sum runs in the same order whatever MT and R are.
template <int MT, bool OFFSET, int R = NB>
inline void int8_tile(const float* x, const int8_t* w, const float* scale, const float* offset,
                      float* y, int64_t K, int64_t N, int64_t group, int64_t m, int64_t n, int nb) {
  const int64_t groups = K / group;
  const int8_t* wr[R];
  const float* sr[R];
  const float* orow[R];
  for (int i = 0; i < R; ++i) {
    const int64_t row = n + std::min(i, nb - 1);
    wr[i] = w + row * K;
    sr[i] = scale + row * groups;
    orow[i] = OFFSET ? offset + row * groups : nullptr;
  }
  vf acc[MT][R] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vf sv[R], ov[R];
    for (int i = 0; i < R; ++i) {
      sv[i] = splat_as<vf>(sr[i][g]);
      ov[i] = OFFSET ? splat_as<vf>(orow[i][g]) : vf{};
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += W) {
      vf wv[R];
      for (int i = 0; i < R; ++i)
        wv[i] = OFFSET ? load_int8(wr[i] + k) * sv[i] + ov[i] : load_int8(wr[i] + k) * sv[i];
      for (int j = 0; j < MT; ++j) {
        const vf xv = loadw(x + (m + j) * K + k);
        for (int i = 0; i < R; ++i) acc[j][i] += xv * wv[i];
      }
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < nb; ++i) y[(m + j) * N + n + i] = lane_sum(acc[j][i]);
}

// Input rows [m, m + MT) times output rows [n, n + nb) as tiles of 2 output rows (as int4_pairs).
template <int MT, bool OFFSET>
inline void int8_pairs(const float* x, const int8_t* w, const float* scale, const float* offset,
                       float* y, int64_t K, int64_t N, int64_t group, int64_t m, int64_t n,
                       int nb) {
  for (int i = 0; i < nb; i += 2)
    int8_tile<MT, OFFSET, 2>(x, w, scale, offset, y, K, N, group, m, n + i, std::min(2, nb - i));
}

#if defined(__AVX512F__)
// M input rows as passes of 8 and one pass of the rest: `pass(rows, m)` for rows [m, m + rows),
// `rows` a std::integral_constant (the tile's row count is a template argument).  With 32 vector
// registers a pass of up to 8 rows over 2 output rows keeps its accumulators in registers, so each
// weight vector is expanded once for every row of a step.
template <typename Pass>
inline void row_passes(int64_t M, const Pass& pass) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) pass(std::integral_constant<int, 8>{}, m);
  switch (M - m) {
    case 7: pass(std::integral_constant<int, 7>{}, m); break;
    case 6: pass(std::integral_constant<int, 6>{}, m); break;
    case 5: pass(std::integral_constant<int, 5>{}, m); break;
    case 4: pass(std::integral_constant<int, 4>{}, m); break;
    case 3: pass(std::integral_constant<int, 3>{}, m); break;
    case 2: pass(std::integral_constant<int, 2>{}, m); break;
    case 1: pass(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}
#endif

// Asks for the bytes [p, p + bytes) ahead of their use.
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line(c + off);
}

// Output rows [n0, n1) of every input row; rows [n1, reach) come next on this thread.
template <bool OFFSET>
void int8_rows(const float* x, const int8_t* w, const float* scale, const float* offset, float* y,
               int64_t M, int64_t K, int64_t N, int64_t group, int64_t n0, int64_t n1,
               int64_t reach) {
  const int64_t groups = K / group;
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    // the next tile's rows, asked for ahead (as int4_rows does)
    const int64_t ahead = std::min<int64_t>(NB, reach - n - nb);
    if (ahead > 0) {
      prefetch_range(w + (n + nb) * K, ahead * K);
      prefetch_range(scale + (n + nb) * groups, ahead * groups * 4);
      if (OFFSET) prefetch_range(offset + (n + nb) * groups, ahead * groups * 4);
    }
#if defined(__AVX512F__)
    // 1-2 rows keep NB output rows a pass (as fast there; 3-8 rows: see row_passes)
    row_passes(M, [&](auto rows, int64_t m) {
      if constexpr (rows <= 2)
        int8_tile<rows, OFFSET>(x, w, scale, offset, y, K, N, group, m, n, nb);
      else
        int8_pairs<rows, OFFSET>(x, w, scale, offset, y, K, N, group, m, n, nb);
    });
#else
    int64_t m = 0;
    for (; m + MT <= M; m += MT)
      int8_tile<MT, OFFSET>(x, w, scale, offset, y, K, N, group, m, n, nb);
    for (; m < M; ++m) int8_tile<1, OFFSET>(x, w, scale, offset, y, K, N, group, m, n, nb);
#endif
  }
}

// W consecutive weights of a 4-bit block, from byte p on: the low nibbles (weights [j, j + W) of
// the block for bytes [j, j + W)) or the high ones (weights [j + 16, j + 16 + W)), as d * q + m.
// d * q is exact in float32 (a float16 d times a 4-bit q), so the fused multiply-add rounds once,
// as the float32 weight a GGUF loader dequantizes to: the matmul sees the same weights.
template <bool HIGH>
inline vf nibbles_as_weights(const uint8_t* p, vf d, vf m) {
#if defined(__AVX512F__)
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = HIGH ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
  return (vf)_mm512_cvtepi32_ps(b) * d + m;
#elif defined(__AVX2__)
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  b = HIGH ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
  return (vf)_mm256_cvtepi32_ps(b) * d + m;
#else
  vf q;
  for (int l = 0; l < W; ++l) q[l] = static_cast<float>(HIGH ? p[l] >> 4 : p[l] & 15);
  return q * d + m;
#endif
}

#if defined(__AVX512F__)
const __m512 kNibbles =
    _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // q of each lane
#endif

// The c-th of the 32 / W weight vectors of a block (llama.cpp's Q4_1 layout: byte j holds weight j
// in its low nibble and weight j + 16 in its high one).
inline vf block4_vector(const uint8_t* qs, int c, vf d, vf m) {
  constexpr int HALF = 16 / W;  // vectors per half block
  return c < HALF ? nibbles_as_weights<false>(qs + c * W, d, m)
                  : nibbles_as_weights<true>(qs + (c - HALF) * W, d, m);
}

// Input rows [m, m + MT) times output rows [n, n + nb) (nb <= R) of a 4-bit weight: qs [N][K / 2]
// bytes, d and mins [N][K / 32] float16 bits.  One weight vector of R rows at a time, expanded
// once for the MT input rows; the scales of SPAN blocks of the R rows widened to float first.
// Each output's sum runs in the same order whatever MT and R are: a row's result does not
// depend on how many rows its step has.
template <int MT, int R = NB>
inline void int4_tile(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* mins,
                      float* y, int64_t K, int64_t N, int64_t m, int64_t n, int nb) {
  constexpr int V = BLOCK4 / W;  // vectors per block
  constexpr int64_t SPAN = 64;
  const int64_t blocks = K / BLOCK4;
  int64_t row[R];
  for (int i = 0; i < R; ++i) row[i] = n + std::min(i, nb - 1);
  vf acc[MT][R] = {};
  float ds[R][SPAN], ms[R][SPAN];
  for (int64_t g0 = 0; g0 < blocks; g0 += SPAN) {
    const int64_t span = std::min(SPAN, blocks - g0);
    for (int i = 0; i < R; ++i) {
      widen_halves(d + row[i] * blocks + g0, span, ds[i]);
      widen_halves(mins + row[i] * blocks + g0, span, ms[i]);
    }
    for (int64_t b = 0; b < span; ++b) {
      const int64_t g = g0 + b;
      vf dv[R], mv[R];
      for (int i = 0; i < R; ++i) {
        dv[i] = splat_as<vf>(ds[i][b]);
        mv[i] = splat_as<vf>(ms[i][b]);
      }
#if defined(__AVX512F__)
      // The block's 16 possible weights d * q + m (q = 0..15) as one vector, and each nibble's
      // weight looked up in it by one permute: vpermps reads the low 4 bits of an index, so the
      // low nibbles need no mask, and one load and widening of the 16 bytes serves both halves.
      // Per block and output row 9 vector operations, where converting the nibbles takes 12
      // (two int-to-float conversions, a mask and a second widening; a fused multiply-add for
      // 32 weights, not 16), the same weights to the bit (d * q is exact, each rounds once).
      __m512i q[R];
      __m512 table[R];
      for (int i = 0; i < R; ++i) {
        q[i] = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + row[i] * (K / 2) + g * 16)));
        table[i] = _mm512_fmadd_ps(kNibbles, (__m512)dv[i], (__m512)mv[i]);
      }
      for (int c = 0; c < V; ++c) {
        vf wv[R];
        for (int i = 0; i < R; ++i)
          wv[i] = (vf)_mm512_permutexvar_ps(c == 0 ? q[i] : _mm512_srli_epi32(q[i], 4), table[i]);
        for (int j = 0; j < MT; ++j) {
          const vf xv = loadw(x + (m + j) * K + g * BLOCK4 + c * W);
          for (int i = 0; i < R; ++i) acc[j][i] += xv * wv[i];
        }
      }
#else
      for (int c = 0; c < V; ++c) {
        vf wv[R];
        for (int i = 0; i < R; ++i)
          wv[i] = block4_vector(qs + row[i] * (K / 2) + g * 16, c, dv[i], mv[i]);
        for (int j = 0; j < MT; ++j) {
          const vf xv = loadw(x + (m + j) * K + g * BLOCK4 + c * W);
          for (int i = 0; i < R; ++i) acc[j][i] += xv * wv[i];
        }
      }
#endif
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < nb; ++i) y[(m + j) * N + n + i] = lane_sum(acc[j][i]);
}

// Input rows [m, m + MT) times output rows [n, n + nb) as tiles of 2 output rows: where MT is
// too many rows for NB accumulators of each in registers.
template <int MT>
inline void int4_pairs(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* mins,
                       float* y, int64_t K, int64_t N, int64_t m, int64_t n, int nb) {
  for (int i = 0; i < nb; i += 2)
    int4_tile<MT, 2>(x, qs, d, mins, y, K, N, m, n + i, std::min(2, nb - i));
}

// The 4-bit rows of the tile after [n, n + nb), up to reach, asked for ahead: a tile's rows are
// short (K / 2 bytes of nibbles, K / 8 of scales), so the hardware's prefetcher, which follows
// one stream, would not run far enough ahead across the tile's rows alone.
inline void prefetch_next_int4(const uint8_t* qs, const uint16_t* d, const uint16_t* mins,
                               int64_t K, int64_t n, int nb, int64_t reach) {
  const int64_t blocks = K / BLOCK4, ahead = std::min<int64_t>(NB, reach - n - nb);
  if (ahead > 0) {
    prefetch_range(qs + (n + nb) * (K / 2), ahead * (K / 2));
    prefetch_range(d + (n + nb) * blocks, ahead * blocks * 2);
    prefetch_range(mins + (n + nb) * blocks, ahead * blocks * 2);
  }
}

// Output rows [n0, n1) of every input row; rows [n1, reach) come next on this thread.
void int4_rows(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* mins, float* y,
               int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t reach) {
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    prefetch_next_int4(qs, d, mins, K, n, nb, reach);
#if defined(__AVX512F__)
    // Up to 8 rows a pass (row_passes), so a verify step's rows expand each weight vector once;
    // passes of at most 4 rows would expand it twice.
    row_passes(M,
               [&](auto rows, int64_t m) { int4_pairs<rows>(x, qs, d, mins, y, K, N, m, n, nb); });
#else
    // 16 vector registers: 2 input rows a pass over NB output rows
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) int4_tile<2>(x, qs, d, mins, y, K, N, m, n, nb);
    if (m < M) int4_tile<1>(x, qs, d, mins, y, K, N, m, n, nb);
#endif
  }
}

// Quantized weights times int8 activations (--int8-activations; AVX-512 VNNI), as llama.cpp's
// Q4 x Q8 and Q8 x Q8 dot products.  Each row of x is quantized once per call, per block of 32:
// xq = round(x / dx), dx = amax / 127.  Then for 4-bit blocks sum_k (d q_k + m) x_k ~= d dx
// sum_k (q_k - 8) xq_k + (m + 8 d) sum_k x_k, and for int8 groups of 32 sum_k (s q_k + o) x_k ~=
// s dx sum_k q_k xq_k + o sum_k x_k: the integer sums by VPDPBUSD (64 products of unsigned and
// signed bytes per instruction: the nibbles and xq, less 8 sum xq (NibbleRows); xq + 128 and the
// int8 weight, less 128 sum of the weight (ByteRows)), the offset term with the exact sum of x.
// The model's LM head keeps float activations (quantization/apply.py: int8_linear is faster
// there, and exact).  Centring q keeps the error below that of llama.cpp's Q4_1 form (d dx sum
// q xq + m dx sum xq), whose two terms are large and cancel (bench/quant_accuracy.py measures
// the agreement with the float weights).  Blocks go
// four at a time: x is laid out per group of four blocks as 64 bytes of their low halves' xq
// (weights 0-15 of each) then 64 of the high ones' (16-31), the nibbles' order (byte j & 15,
// byte j >> 4), so that 32-bit lane i of the sums belongs to block i / 4.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_Q8_DOT 1
constexpr int G4 = 4;  // blocks per group

// One row of x as the kernel reads it: per group of G4 blocks, 128 bytes of xq (as xq + 128 for
// int8 weights, as xq with 16 lanes of cx for 4-bit ones), 16 lanes of dx (each block's value
// repeated over its 4 lanes; zeros past the last block); and each block's exact sum of x (zeros
// past the last block, to a whole vector).
struct Q8Row {
  std::vector<uint8_t> xq;  // xq + 128 (for int8 weights: signed, the second operand of VPDPBUSD)
  std::vector<int8_t> xs;   // xq (for 4-bit weights: unsigned nibbles, the first operand)
  std::vector<int8_t> xl;   // wide rows: x16 = 256 xs + xl (xl's bytes in xs's layout)
  std::vector<int32_t> cx;  // per lane, 8 times the sum of its 8 xq: sum (q - 8) xq = sum q xq - cx
  std::vector<float> dx;
  std::vector<float> sum;   // per block
};

// `nibbles`: the layout 4-bit weights read (xs and cx), else int8 weights' (xq); `wide` (with
// nibbles): x in 16 bits as two bytes (xs and xl), dx = amax / Q16_MAX.
void quantize_row_q8(const float* x, int64_t K, bool nibbles, bool wide, Q8Row& row) {
  const int64_t blocks = K / BLOCK4, groups = (blocks + G4 - 1) / G4;
  if (nibbles) {
    row.xs.assign(groups * 128, 0);
    if (wide) {
      row.xl.assign(groups * 128, 0);
    } else {
      row.cx.assign(groups * 16, 0);
    }
  } else {
    row.xq.assign(groups * 128, 128);
  }
  row.dx.assign(groups * 16, 0.f);
  row.sum.assign((blocks + 15) / 16 * 16, 0.f);
  const __m512i bias = _mm512_set1_epi32(nibbles ? 0 : 128);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 a0 = _mm512_loadu_ps(x + b * BLOCK4), a1 = _mm512_loadu_ps(x + b * BLOCK4 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    row.sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    // a block below 1e-30 in magnitude (where 127 / amax could overflow) counts as zeros here;
    // its exact sum still enters the offset term
    const float top = wide ? Q16_MAX : 127.f;
    const float dx = amax / top, inv = amax > 1e-30f ? top / amax : 0.f;
    const int64_t g = b / G4, i = b % G4;
    for (int l = 0; l < 4; ++l) row.dx[g * 16 + i * 4 + l] = dx;
    if (wide) {
      split_block16(a0, a1, inv, row.xs.data() + g * 128 + i * 16,
                    row.xl.data() + g * 128 + i * 16, 64);
      continue;
    }
    uint8_t* lo =
        (nibbles ? reinterpret_cast<uint8_t*>(row.xs.data()) : row.xq.data()) + g * 128 + i * 16;
    // x * inv rounded half to even (as nearbyint), plus the bias, as bytes: weights 0-15 and 16-31
    const __m512 iv = _mm512_set1_ps(inv);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(_mm512_add_epi32(
        _mm512_cvt_roundps_epi32(_mm512_mul_ps(a0, iv), rnd), bias)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 64), _mm512_cvtepi32_epi8(_mm512_add_epi32(
        _mm512_cvt_roundps_epi32(_mm512_mul_ps(a1, iv), rnd), bias)));
  }
  if (!nibbles || wide) return;
  // lane i of a group's sums holds bytes [4i, 4i + 4) of its low and of its high 64
  for (int64_t g = 0; g < groups; ++g)
    for (int lane = 0; lane < 16; ++lane) {
      int32_t total = 0;
      for (int b = 0; b < 4; ++b)
        total += row.xs[g * 128 + 4 * lane + b] + row.xs[g * 128 + 64 + 4 * lane + b];
      row.cx[g * 16 + lane] = 8 * total;
    }
}

// The weights of a q8 tile, one row and one group of G4 blocks at a time: `lo` and `hi` the
// bytes that meet x's low and high halves (zero past the last block), `scale` each lane's block
// scale.  The term of each block's exact sum of x (its `centre` times it) goes apart, 16 blocks a
// vector instruction (centre_sums), instead of once per group in each tile's loop.
const __m512i kSpread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);

// The first `lanes` (at most 4) of four float16 values as floats in lanes 0-3.
inline __m512 halves4(__mmask16 lanes, const uint16_t* p) {
  return _mm512_castps128_ps512(
      _mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>(lanes), p)));
}

// The mask of the first min(16, n) lanes.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// out[j] = sum over the blocks of `centre(b)` times row j's exact block sum, for the MT rows of x.
template <int MT, typename Centre>
inline void centre_sums(const Q8Row* x, int64_t blocks, const Centre& centre, float* out) {
  __m512 acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 16) {
    const __m512 c = centre(b, first_lanes(blocks - b));
    for (int j = 0; j < MT; ++j)
      acc[j] = _mm512_fmadd_ps(c, _mm512_loadu_ps(x[j].sum.data() + b), acc[j]);
  }
  for (int j = 0; j < MT; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

// 4-bit blocks (w = d q + m): the nibbles q as they are (unsigned: VPDPBUSD's first operand, x's
// signed xq its second), whose sums less x's cx are those of q - 8; and the centre m + 8 d, the
// weight's value at q = 8.  Against centring q in the weight (q - 8 signed, x's bytes xq + 128,
// less 128 times each lane's sum of q - 8, itself two more VPDPBUSD per group and output row):
// the same integer sums with 5 fewer vector operations per group of 128 weights and output row.
struct NibbleRows {
  static constexpr bool kNibbles = true;
  const uint8_t* qs;
  const uint16_t *d, *mins;  // float16 bits
  int64_t K;
  void group(int64_t r, int64_t g, int, __mmask64 bytes, __mmask16 lanes, __m512i& lo, __m512i& hi,
             __m512& scale) const {
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i packed =
        _mm512_maskz_loadu_epi8(bytes, qs + r * (K / 2) + g * 64);  // zeros past the last block
    lo = _mm512_and_si512(packed, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    scale = _mm512_permutexvar_ps(kSpread, halves4(lanes, d + r * (K / BLOCK4) + g * G4));
  }
  // CENTRED: the sums were of q - 8 (m + 8 d times each block's sum of x), else of q (m times it)
  template <int MT, bool CENTRED>
  void centres(int64_t r, const Q8Row* x, float* out) const {
    const int64_t blocks = K / BLOCK4;
    const uint16_t *dr = d + r * blocks, *mr = mins + r * blocks;
    centre_sums<MT>(x, blocks, [&](int64_t b, __mmask16 live) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mr + b));
      if constexpr (!CENTRED) return mv;
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, dr + b));
      return _mm512_fmadd_ps(dv, _mm512_set1_ps(8.f), mv);
    }, out);
  }
};

// Int8 groups of 32 (w = q scale (+ offset)): a group's 128 bytes are its four blocks in order,
// whose 16-byte halves the 128-bit lane shuffles sort into x's low and high halves.
struct ByteRows {
  static constexpr bool kNibbles = false;
  const int8_t* q;
  const float *scale_, *offset;  // offset: nullptr for symmetric groups (a GGUF's Q8_0)
  int64_t K;
  void group(int64_t r, int64_t g, int in_group, __mmask64, __mmask16 lanes, __m512i& lo,
             __m512i& hi, __m512& scale) const {
    const int8_t* src = q + r * K + g * (G4 * BLOCK4);
    // 32 bytes per block: the first 64 in a, the rest in b
    const int valid = 32 * in_group;
    const __mmask64 ma = valid >= 64 ? ~0ULL : (1ULL << valid) - 1;
    const __mmask64 mb = valid >= 128 ? ~0ULL : valid <= 64 ? 0ULL : (1ULL << (valid - 64)) - 1;
    const __m512i a = _mm512_maskz_loadu_epi8(ma, src), b = _mm512_maskz_loadu_epi8(mb, src + 64);
    lo = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    hi = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    scale = _mm512_permutexvar_ps(kSpread,
                                  _mm512_maskz_loadu_ps(lanes, scale_ + r * (K / BLOCK4) + g * G4));
  }
  template <int MT, bool>
  void centres(int64_t r, const Q8Row* x, float* out) const {
    if (offset == nullptr) {  // symmetric groups: no term
      for (int j = 0; j < MT; ++j) out[j] = 0.f;
      return;
    }
    const float* orow = offset + r * (K / BLOCK4);
    centre_sums<MT>(
        x, K / BLOCK4,
        [&](int64_t b, __mmask16 live) { return _mm512_maskz_loadu_ps(live, orow + b); }, out);
  }
};

// Rows [m, m + MT) of x times output rows [n, n + nb) (nb <= R).  Per group the R rows' weights
// are formed once, then each row of x is loaded once for all R of them.
template <typename Rows, int MT, int R, bool WIDE>
inline void q8_tile(const Q8Row* x, const Rows& w, float* y, int64_t K, int64_t N, int64_t m,
                    int64_t n, int nb) {
  const int64_t blocks = K / BLOCK4, groups = (blocks + G4 - 1) / G4;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[MT][R];
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int in_group = static_cast<int>(std::min<int64_t>(G4, blocks - g * G4));
    const __mmask64 bytes = in_group == G4 ? ~0ULL : (1ULL << (16 * in_group)) - 1;
    const __mmask16 lanes = static_cast<__mmask16>((1u << in_group) - 1);
    __m512i wlo[R], whi[R], bias[R];
    __m512 sv[R];
    for (int i = 0; i < R; ++i) {
      w.group(n + std::min(i, nb - 1), g, in_group, bytes, lanes, wlo[i], whi[i], sv[i]);
      // int8 weights: x's bytes are xq + 128, less 128 sum(w) per lane
      if constexpr (!Rows::kNibbles)
        bias[i] = _mm512_slli_epi32(
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, wlo[i]), ones,
                                whi[i]),
            7);
    }
    for (int j = 0; j < MT; ++j) {
      const Q8Row& xr = x[m + j];
      const __m512 dxv = _mm512_loadu_ps(xr.dx.data() + g * 16);
      if constexpr (WIDE) {
        // x16's high bytes' sums, times 256, then its low bytes' added: the sums of q x16
        const __m512i xlo = _mm512_loadu_si512(xr.xs.data() + g * 128);
        const __m512i xhi = _mm512_loadu_si512(xr.xs.data() + g * 128 + 64);
        const __m512i llo = _mm512_loadu_si512(xr.xl.data() + g * 128);
        const __m512i lhi = _mm512_loadu_si512(xr.xl.data() + g * 128 + 64);
        for (int i = 0; i < R; ++i) {
          const __m512i high = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[i], xlo), whi[i], xhi);
          const __m512i sums = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), wlo[i], llo), whi[i], lhi);
          acc[j][i] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sv[i], dxv), acc[j][i]);
        }
      } else if constexpr (Rows::kNibbles) {
        const __m512i xlo = _mm512_loadu_si512(xr.xs.data() + g * 128);
        const __m512i xhi = _mm512_loadu_si512(xr.xs.data() + g * 128 + 64);
        const __m512i cx = _mm512_loadu_si512(xr.cx.data() + g * 16);
        for (int i = 0; i < R; ++i) {
          const __m512i sums = _mm512_sub_epi32(
              _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[i], xlo), whi[i],
                                  xhi),
              cx);
          acc[j][i] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sv[i], dxv), acc[j][i]);
        }
      } else {
        const __m512i xlo = _mm512_loadu_si512(xr.xq.data() + g * 128);
        const __m512i xhi = _mm512_loadu_si512(xr.xq.data() + g * 128 + 64);
        for (int i = 0; i < R; ++i) {
          const __m512i sums = _mm512_sub_epi32(
              _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xlo, wlo[i]), xhi,
                                  whi[i]),
              bias[i]);
          acc[j][i] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sv[i], dxv), acc[j][i]);
        }
      }
    }
  }
  for (int i = 0; i < nb; ++i) {
    float centre[MT];
    w.template centres<MT, !WIDE>(n + i, x + m, centre);
    for (int j = 0; j < MT; ++j)
      y[(m + j) * N + n + i] = _mm512_reduce_add_ps(acc[j][i]) + centre[j];
  }
}

// Output rows [n0, n1) of every row of x; `prefetch(n, nb)` asks for the next tile's weights.
// Up to 8 rows of x go in one pass over 4 output rows (5-8 rows spill some of the tile's weight
// vectors, which still costs less than passes over pairs of output rows), more as passes of 8
// and the rest.
template <typename Rows, bool WIDE = false, typename Prefetch>
void q8_rows(const Q8Row* x, const Rows& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t n1, const Prefetch& prefetch) {
  const auto pass = [&](int64_t m, int64_t rows, int64_t n, int nb) {
    switch (rows) {
      case 1: return q8_tile<Rows, 1, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 2: return q8_tile<Rows, 2, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 3: return q8_tile<Rows, 3, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 4: return q8_tile<Rows, 4, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 5: return q8_tile<Rows, 5, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 6: return q8_tile<Rows, 6, NB, WIDE>(x, w, y, K, N, m, n, nb);
      case 7: return q8_tile<Rows, 7, NB, WIDE>(x, w, y, K, N, m, n, nb);
      default: return q8_tile<Rows, 8, NB, WIDE>(x, w, y, K, N, m, n, nb);
    }
  };
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    prefetch(n, nb);
    for (int64_t m = 0; m < M; m += 8) pass(m, std::min<int64_t>(8, M - m), n, nb);
  }
}
#else
#define RADIXSERVE_Q8_DOT 0
#endif

// Products of x's rows with w's rows, K elements at a time by STEP: float32, or bfloat16 with
// float sums.  With AVX-512 BF16 one instruction multiplies 32 bf16 pairs into 16 float sums;
// elsewhere each 16-bit value is widened to the float with the same top bits (a bfloat16 is a
// float's upper half).  `load` brings STEP elements into a register, `madd(acc, x, w)` adds
// their products to acc; ONE_ROW_AHEAD: see dot_tiles.
template <typename Elem, vf (*Load)(const Elem*)>
struct VecDot {
  using T = Elem;
  using V = vf;
  using Acc = vf;
  static constexpr int STEP = W;
  static constexpr int64_t ONE_ROW_AHEAD = 0;
  static Acc zero() { return vf{}; }
  static V load(const T* p) { return Load(p); }
  static Acc madd(Acc acc, V x, V w) { return acc + x * w; }
  static float sum(Acc acc) { return lane_sum(acc); }
};
using FloatDot = VecDot<float, loadw>;

#if defined(__AVX512BF16__)
struct Bf16Dot {
  using T = uint16_t;
  using V = __m512bh;
  using Acc = __m512;
  static constexpr int STEP = 32;
  static constexpr int64_t ONE_ROW_AHEAD = 8;
  static Acc zero() { return _mm512_setzero_ps(); }
  static V load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc madd(Acc acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#else
using Bf16Dot = VecDot<uint16_t, load_bf16>;
#endif

// Input rows [m, m + MR) times output rows [n, n + nb) (nb <= R; the rows past nb repeat the
// last one and are not written): each weight vector is loaded once for the MR rows, so a step of
// a few rows reads its weights once, as a one-row step does (a pass per input row would read
// the tile's weights once per row).  Each
// output's sum runs over K in the same order whatever MR and R are: a row's result does not
// depend on the rows beside it.
template <typename D, int MR, int R>
inline void dot_tile(const typename D::T* x, const typename D::T* w, float* y, int64_t K, int64_t N,
                     int64_t m, int64_t n, int nb) {
  const typename D::T* wr[R];
  for (int i = 0; i < R; ++i) wr[i] = w + (n + std::min(i, nb - 1)) * K;
  typename D::Acc acc[MR][R];
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = D::zero();
  for (int64_t k = 0; k < K; k += D::STEP) {
    typename D::V wv[R];
    for (int i = 0; i < R; ++i) wv[i] = D::load(wr[i] + k);
    for (int j = 0; j < MR; ++j) {
      const typename D::V xv = D::load(x + (m + j) * K + k);
      for (int i = 0; i < R; ++i) acc[j][i] = D::madd(acc[j][i], xv, wv[i]);
    }
  }
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < nb; ++i) y[(m + j) * N + n + i] = D::sum(acc[j][i]);
}

// Input rows per pass over a tile (a multiple-row step's rows as passes of DOT_ROWS and one of
// the rest, the tile in L1 after the first) and output rows per tile, within the vector
// registers (32 with AVX-512, 16 with AVX2): MR x R accumulators, R weight vectors, an x vector.
#if defined(__AVX512F__)
constexpr int DOT_ROWS = 8;
inline constexpr int dot_tile_rows(int64_t M) { return M <= 6 ? 4 : 3; }
#else
constexpr int DOT_ROWS = 4;
inline constexpr int dot_tile_rows(int64_t M) { return M == 1 ? 4 : 2; }
#endif

// Weight rows a tile asks for ahead of its own: one-row steps of bfloat16 only (D::ONE_ROW_AHEAD;
// a one-row float32 step streams fast enough on the hardware's prefetch, and asking ahead slows
// it); more rows, 8 ahead: a pass does M times the arithmetic of a one-row step per weight, and
// without it its loads do not run far enough ahead.
constexpr int64_t ROWS_AHEAD = 8;

template <typename D, int R>
void dot_tiles(const typename D::T* x, const typename D::T* w, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  const int64_t ahead = M == 1 ? D::ONE_ROW_AHEAD : ROWS_AHEAD;
  for (int64_t n = n0; n < n1; n += R) {
    const int nb = static_cast<int>(std::min<int64_t>(R, n1 - n));
    if (ahead > 0 && n + ahead < n1)
      prefetch_range(w + (n + ahead) * K,
                     std::min<int64_t>(R, n1 - n - ahead) * K * sizeof(typename D::T));
    int64_t m = 0;
    for (; m + DOT_ROWS <= M; m += DOT_ROWS) dot_tile<D, DOT_ROWS, R>(x, w, y, K, N, m, n, nb);
    switch (M - m) {
#if defined(__AVX512F__)
      case 7: dot_tile<D, 7, R>(x, w, y, K, N, m, n, nb); break;
      case 6: dot_tile<D, 6, R>(x, w, y, K, N, m, n, nb); break;
      case 5: dot_tile<D, 5, R>(x, w, y, K, N, m, n, nb); break;
      case 4: dot_tile<D, 4, R>(x, w, y, K, N, m, n, nb); break;
#endif
      case 3: dot_tile<D, 3, R>(x, w, y, K, N, m, n, nb); break;
      case 2: dot_tile<D, 2, R>(x, w, y, K, N, m, n, nb); break;
      case 1: dot_tile<D, 1, R>(x, w, y, K, N, m, n, nb); break;
      default: break;
    }
  }
}

// Output rows [n0, n1) of every input row.
template <typename D>
void dot_rows(const typename D::T* x, const typename D::T* w, float* y, int64_t M, int64_t K,
              int64_t N, int64_t n0, int64_t n1) {
  switch (dot_tile_rows(M)) {
    case 4: return dot_tiles<D, 4>(x, w, y, M, K, N, n0, n1);
    case 3: return dot_tiles<D, 3>(x, w, y, M, K, N, n0, n1);
    default: return dot_tiles<D, 2>(x, w, y, M, K, N, n0, n1);
  }
}

template <typename D>
void dot_linear(const typename D::T* x, const typename D::T* w, float* y, int64_t M, int64_t K,
                int64_t N) {
  TORCH_CHECK(K % D::STEP == 0, "float_linear: K must be a multiple of ", D::STEP);
  constexpr int64_t unit = 12;  // output rows: a whole number of tiles of 4, 3 or 2
  at::parallel_for(0, (N + unit - 1) / unit, 6, [&](int64_t b0, int64_t b1) {
    dot_rows<D>(x, w, y, M, K, N, b0 * unit, std::min(N, b1 * unit));
  });
}

// x's rows as float32 (x itself when it is float32 and contiguous).
inline const float* rows_as_float(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buf.resize(xc.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rows_as_float", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(src[i]);
  });
  return buf.data();
}

// ``rows(x, y, n0, n1, reach)`` run over chunks of output rows on the threads (row_shares.h:
// rows [n1, reach) come next on the same thread), on x's rows as float32 into float32 sums;
// returns [M, N] in x's dtype, each sum rounded once (c10's round-to-nearest-even, as torch's
// conversion).  The conversions are loops here, not ATen ops: two ATen ops per matmul would cost
// a large share of a one-row decode step.
template <typename Rows>
at::Tensor few_row_matmul(const at::Tensor& x, const float* xp, int64_t N, const Rows& rows) {
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    float* yp = y.data_ptr<float>();
    run_row_shares(&N, 1, NB, CHUNK, [&](int64_t, int64_t n0, int64_t n1, int64_t reach) {
      rows(xp, yp, n0, n1, reach);
    });
    return y;
  }
  std::unique_ptr<float[]> sums(new float[M * N]);  // every element written by rows(): no zero fill
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "few_row_matmul", [&] {
    scalar_t* dst = y.data_ptr<scalar_t>();
    run_row_shares(&N, 1, NB, CHUNK, [&](int64_t, int64_t n0, int64_t n1, int64_t reach) {
      rows(xp, sums.get(), n0, n1, reach);
      for (int64_t m = 0; m < M; ++m)  // this chunk's columns, while they are in the cache
        for (int64_t n = n0; n < n1; ++n) dst[m * N + n] = static_cast<scalar_t>(sums[m * N + n]);
    });
  });
  return y;
}

template <typename Rows>
at::Tensor few_row_matmul(const at::Tensor& x, int64_t N, const Rows& rows) {
  std::vector<float> xbuf;
  return few_row_matmul(x, rows_as_float(x, xbuf), N, rows);
}

#if RADIXSERVE_Q8_DOT
// few_row_matmul over x's rows quantized for q8_tile (in 4-bit weights' layout with `nibbles`):
// ``rows(q8_rows, y, n0, n1)``.
template <typename Rows>
at::Tensor q8_matmul(const at::Tensor& x, int64_t N, bool nibbles, const Rows& rows,
                     bool wide = false) {
  std::vector<float> xbuf;
  const float* xf = rows_as_float(x, xbuf);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Q8Row> q8(M);
  for (int64_t m = 0; m < M; ++m) quantize_row_q8(xf + m * K, K, nibbles, wide, q8[m]);
  return few_row_matmul(x, xf, N,
                        [&](const float*, float* yp, int64_t n0, int64_t n1, int64_t reach) {
                          rows(q8.data(), yp, n0, n1, reach);
                        });
}
#endif

}  // namespace

// x: [M, K], w: [N, K], both float32 or both bfloat16, contiguous, K a multiple of W (of 32 for
// bfloat16 with AVX-512 BF16).  Returns [M, N] in their dtype (bfloat16 sums are taken in
// float32 and rounded once, as torch does).
at::Tensor float_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "float_linear: x [M, K], w [N, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && w.scalar_type() == x.scalar_type() &&
                  x.is_contiguous() && w.is_contiguous(),
              "float_linear: contiguous x and w, both float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (!bf16) {
    dot_linear<FloatDot>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
    return y;
  }
  std::unique_ptr<float[]> sums(new float[M * N]);  // every element written by dot_linear
  dot_linear<Bf16Dot>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), sums.get(), M,
                      K, N);
  at::BFloat16* dst = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) dst[i] = static_cast<at::BFloat16>(sums[i]);  // rounded once
  return y;
}

// The float lanes of the vectors the kernels were built with (8: AVX2, 16: AVX-512).
int64_t vector_width() { return W; }

// An int8 weight's scales (and offsets: an empty tensor for none) [N, K / group] float32, the
// group a whole number of vectors; returns the group.
static int64_t int8_group(const char* what, const at::Tensor& w, const at::Tensor& scale,
                          const at::Tensor& offset) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), what,
              ": w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) > 0 &&
                  K % scale.size(1) == 0 && (K / scale.size(1)) % W == 0 &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              what, ": scale must be [N, K / group] float32, the group a multiple of ", W);
  TORCH_CHECK(offset.numel() == 0 || (offset.sizes() == scale.sizes() &&
                                      offset.scalar_type() == at::kFloat && offset.is_contiguous()),
              what, ": offset must be empty or shaped as scale, float32");
  return K / scale.size(1);
}

// x: [M, K] float32 / bfloat16 / float16; w: [N, K] int8; scale and offset: see int8_group. Returns
// [M, N] in x's dtype.
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset) {
  const int64_t group = int8_group("int8_linear", w, scale, offset);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K], w [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.numel() ? offset.data_ptr<float>() : nullptr;
  return few_row_matmul(
      x, N, [&](const float* xp, float* yp, int64_t n0, int64_t n1, int64_t reach) {
        if (op)
          int8_rows<true>(xp, wp, sp, op, yp, M, K, N, group, n0, n1, reach);
        else
          int8_rows<false>(xp, wp, sp, nullptr, yp, M, K, N, group, n0, n1, reach);
      });
}

// As int8_linear for groups of 32, with each row of x quantized to int8 per block of 32 (see
// q8_tile): where the CPU has AVX-512 VNNI (q8_supported), an error elsewhere.
at::Tensor int8_linear_q8(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor offset) {
  const int64_t group = int8_group("int8_linear_q8", w, scale, offset);
  TORCH_CHECK(group == BLOCK4, "int8_linear_q8: groups of ", BLOCK4, " weights, got ", group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "int8_linear_q8: x [M, K], w [N, K]");
#if RADIXSERVE_Q8_DOT
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.numel() ? offset.data_ptr<float>() : nullptr;
  const ByteRows rows{wp, sp, op, K};
  return q8_matmul(
      x, N, ByteRows::kNibbles,
      [&](const Q8Row* q8, float* yp, int64_t n0, int64_t n1, int64_t reach) {
        q8_rows(q8, rows, yp, M, K, N, n0, n1, [&](int64_t n, int nb) {
          const int64_t ahead = std::min<int64_t>(NB, reach - n - nb), groups = K / BLOCK4;
          if (ahead > 0) {
            prefetch_range(wp + (n + nb) * K, ahead * K);
            prefetch_range(sp + (n + nb) * groups, ahead * groups * 4);
            if (op) prefetch_range(op + (n + nb) * groups, ahead * groups * 4);
          }
        });
      });
#else
  TORCH_CHECK(false, "int8_linear_q8: this build has no AVX-512 VNNI");
  return x;
#endif
}

// out[n][k] = scale[n][k / group] * w[n][k] (+ offset[n][k / group]) in out's dtype (float32 /
// bfloat16 / float16): the weight of a many-row matmul, written into a scratch buffer the caller
// keeps.
void int8_dequant_(at::Tensor w, at::Tensor scale, at::Tensor offset, at::Tensor out) {
  const int64_t group = int8_group("int8_dequant_", w, scale, offset);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == w.sizes(),
              "int8_dequant_: out must be contiguous [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* offp = offset.numel() ? offset.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, out.scalar_type(), "int8_dequant_", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* src = wp + n * K;
        const float* sc = sp + n * (K / group);
        const float* off = offp ? offp + n * (K / group) : nullptr;
        scalar_t* dst = op + n * K;
        for (int64_t k = 0; k < K; k += W) {
          const vf v = load_int8(src + k) * sc[k / group];
          store_elems(dst + k, off ? v + off[k / group] : v);
        }
      }
    });
  });
}

namespace {

void check_int4(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins, int64_t K,
                const char* what) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  K % BLOCK4 == 0 && qs.size(1) * 2 == K,
              what, ": qs must be [N, K / 2] uint8 and K a multiple of ", BLOCK4);
  const int64_t N = qs.size(0);
  for (const at::Tensor* t : {&d, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == K / BLOCK4,
                what, ": d and m must be [N, K / ", BLOCK4, "] float16");
}

// A float16 tensor's elements as their bit patterns (the kernels widen them: widen_halves,
// halves4).
inline const uint16_t* half_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

}  // namespace

// x: [M, K] float32 / bfloat16 / float16; the weight [N, K] in 4-bit blocks of 32 (w = d * q + m):
// qs [N, K / 2] uint8, d and mins [N, K / 32] float16.  Returns [M, N] in x's dtype.
at::Tensor int4_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_int4(qs, d, mins, K, "int4_linear");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = half_bits(d);
  const uint16_t* mp = half_bits(mins);
  return few_row_matmul(
      x, N, [&](const float* xp, float* yp, int64_t n0, int64_t n1, int64_t reach) {
        int4_rows(xp, qp, dp, mp, yp, M, K, N, n0, n1, reach);
      });
}

// As int4_linear, with each row of x quantized to int8 per block of 32 (see q8_tile): where the
// CPU has AVX-512 VNNI (q8_supported), an error elsewhere.
namespace {
// int4_linear with x quantized per block of 32: in int8 (int4_linear_q8), or `wide` in 16 bits.
at::Tensor int4_linear_x(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins, bool wide,
                         const char* name) {
  TORCH_CHECK(x.dim() == 2, name, ": x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_int4(qs, d, mins, K, name);
#if RADIXSERVE_Q8_DOT
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = half_bits(d);
  const uint16_t* mp = half_bits(mins);
  const NibbleRows w{qp, dp, mp, K};
  return q8_matmul(
      x, N, NibbleRows::kNibbles,
      [&](const Q8Row* rows, float* yp, int64_t n0, int64_t n1, int64_t reach) {
        const auto prefetch = [&](int64_t n, int nb) {
          prefetch_next_int4(qp, dp, mp, K, n, nb, reach);
        };
        if (wide) {
          q8_rows<NibbleRows, true>(rows, w, yp, M, K, N, n0, n1, prefetch);
        } else {
          q8_rows<NibbleRows, false>(rows, w, yp, M, K, N, n0, n1, prefetch);
        }
      },
      wide);
#else
  TORCH_CHECK(false, name, ": this build has no AVX-512 VNNI");
  return x;
#endif
}
}  // namespace

at::Tensor int4_linear_q8(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins) {
  return int4_linear_x(x, qs, d, mins, false, "int4_linear_q8");
}

// int4_linear with x in 16-bit integers per block of 32: x16 = round(x / dx), dx = amax / Q16_MAX,
// stored as two signed bytes (x16 = 256 hi + lo), so that the same VPDPBUSD sums of the nibbles
// with each byte give sum q x16 = 256 sum q hi + sum q lo, exact in int32 and in its conversion
// to float (|sum| < 2^24 a lane); then d dx sum q x16 + m sum x.  The only error is x's rounding,
// at most dx / 2 an element (against int8 activations' amax / 254: 257x smaller).  Not centred
// on q = 8 as int4_linear_q8 is: at this precision the two terms' cancellation costs nothing
// measurable, so the centring's subtraction is left out.  Where it runs: radixserve/quantization/.
at::Tensor int4_linear_q16(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor mins) {
  return int4_linear_x(x, qs, d, mins, true, "int4_linear_q16");
}

// Whether int4_linear_q8 and int8_linear_q8 run here (the kernels were built for AVX-512 VNNI).
bool q8_supported() { return RADIXSERVE_Q8_DOT; }

// out[n][k] = d * q + m of the 4-bit weight, in out's dtype (float32 / bfloat16 / float16).
void int4_dequant_(at::Tensor qs, at::Tensor d, at::Tensor mins, at::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == qs.size(0),
              "int4_dequant_: out [N, K]");
  const int64_t N = out.size(0), K = out.size(1);
  check_int4(qs, d, mins, K, "int4_dequant_");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = half_bits(d);
  const uint16_t* mp = half_bits(mins);
  const int64_t blocks = K / BLOCK4;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, out.scalar_type(), "int4_dequant_", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      std::vector<float> ds(blocks), ms(blocks);
      for (int64_t n = n0; n < n1; ++n) {
        widen_halves(dp + n * blocks, blocks, ds.data());
        widen_halves(mp + n * blocks, blocks, ms.data());
        for (int64_t g = 0; g < blocks; ++g) {
          const vf dv = splat_as<vf>(ds[g]), mv = splat_as<vf>(ms[g]);
          vf wv[BLOCK4 / W];
          for (int c = 0; c < BLOCK4 / W; ++c)
            wv[c] = block4_vector(qp + n * (K / 2) + g * 16, c, dv, mv);
          scalar_t* dst = op + n * K + g * BLOCK4;
          for (int c = 0; c < BLOCK4 / W; ++c) store_elems(dst + c * W, wv[c]);
        }
      }
    });
  });
}
