// Paged attention for CPUs: reads K/V in place from the KV pool through the request-to-token
// table (no gathered copy), in the pool's dtype (float32, bfloat16 or float16) with float32
// accumulation, grouped-query aware (the G query heads of one KV head share every key load),
// online softmax over key blocks.
//
// One call computes a whole step's attention over the pool, as a list of *jobs*:
//   job j reads table row job_row[j], key columns [job_kv_begin[j], limit) where `limit` is per
//   query entry (entry e sees columns [job_kv_begin[j], entry_limit[e])), for the entries
//   [job_entry_ptr[j], job_entry_ptr[j+1]) whose query rows in `q` are entry_row[e].
// A query row may appear in several jobs (the cascade of a prefix shared through the radix
// tree: one job reads the shared columns once for all members' queries, one job per request
// reads its own columns); each job leaves a normalised partial output and its log-sum-exp, and
// the rows are merged exactly at the end:  out = sum_e e^{lse_e} out_e / sum_e e^{lse_e}.
//
// Tasks are (job, KV head, block of queries), heaviest first, taken one at a time by torch's
// intra-op threads (OpenMP: the thread count is the scheduler's torch setting); with at least two
// (job, block) tasks a thread, a thread takes all KV heads of one at a time, which read lines side
// by side (the KV heads of a token are adjacent in the pool, so a pool out of cache is read in
// longer runs).  Two paths:
//  - pair path (bfloat16 pool, AVX-512 BF16): run_task_pairs.  Q.K and P.V are products of
//    bfloat16 pairs with float32 sums; scores stay in registers; softmax in base 2 with a
//    lazily raised max (the max, e^x and accumulator rescale are paid only when the max grows
//    past LAZY_MAX, not per row and key block).  The extension must be built with OpenMP, or
//    at::parallel_for runs the tasks serially (cpu_ext/__init__.py: -fopenmp).
//  - float path (float32/float16 pools, or no AVX-512 BF16): run_task, written with GCC vector
//    extensions of the CPU's native width W (16 floats with AVX-512F, 8 with AVX2: vec.h) and
//    unrolled over query rows so that one key load feeds several; float32 pools are read in
//    place, other dtypes converted once per block.  On an AVX2-only CPU it matches the gather
//    path's SDPA on a causal prompt and beats it on decode, where SDPA first gathers a copy.
//  - 8-bit pools (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2): each block's rows are widened to
//    float once per task (int8 times the row's scale of its token and head; fp8 through the
//    half-precision converter, see fp8_row), so every query row of the task shares one
//    conversion.  Under a bfloat16 model with AVX-512 BF16 the widened rows are rounded to
//    bfloat16 and take the pair path; otherwise the float path runs with float32 queries.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RADIXSERVE_BF16_DOT 1
#else
#define RADIXSERVE_BF16_DOT 0
#endif

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int KB = 32;          // keys per block
constexpr int MAX_ROWS = 32;    // query rows (tokens x heads per KV head) per task
// Float path: below this many rows (a decode request's G heads) the scores are dot products
// over K rows as stored, 16 keys at a time; transposing K would cost more than few rows use.
constexpr int FEW_ROWS = 8;
// Query rows per task on the pair path: every row of a shared-prefix job of up to 64 / G
// members reads each K/V block once (the block is converted to pairs once per task).
template <int D>
constexpr int pair_rows() { return D <= 64 ? 64 : 32; }
constexpr float NEG = -1e30f;   // masked score (finite: the inner loops never see inf)


template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void convert_row(const T* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// bfloat16 -> float is a 16-bit shift: 16 lanes at a time (n is a multiple of 16).
template <>
inline void convert_row<at::BFloat16>(const at::BFloat16* src, float* dst, int n) {
  for (int i = 0; i < n; i += 16) {
    v16h h;
    std::memcpy(&h, src + i, sizeof(h));
    const v16i w = __builtin_convertvector(h, v16i) << 16;
    std::memcpy(dst + i, &w, sizeof(w));
  }
}

// The two 8-bit float formats of an fp8 pool, as stored bytes.
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

typedef uint8_t v16b __attribute__((vector_size(16)));
// fp8 bytes as floats, 16 at a time through the half converter.  e5m2 is the top byte of a
// half (same exponent bias).  e4m3 (bias 7) shifted into a half's exponent and mantissa fields
// reads as the value times 2^-8, subnormals included, so the half is scaled by 2^8 after.  The
// byte 0x7f (e4m3's NaN) would read as 480; the pool never holds it (values are saturated).
template <typename F8>
inline void fp8_row(const F8* src, float* dst, int n) {
  for (int i = 0; i < n; i += 16) {
    v16b b;
    std::memcpy(&b, src + i, sizeof(b));
    const v16h w = __builtin_convertvector(b, v16h);
    v16 f;
    if constexpr (std::is_same_v<F8, Fp8E5M2>) {
      f = halves_to_float(w << 8);
    } else {
      f = halves_to_float(((w & 0x7f) << 7) | ((w & 0x80) << 8)) * 256.f;
    }
    std::memcpy(dst + i, &f, sizeof(f));
  }
}

template <>
inline void convert_row<Fp8E4M3>(const Fp8E4M3* src, float* dst, int n) { fp8_row(src, dst, n); }
template <>
inline void convert_row<Fp8E5M2>(const Fp8E5M2* src, float* dst, int n) { fp8_row(src, dst, n); }

// An int8 row times its scale (n is a multiple of 16).  Widened by the sign-extending
// conversions: GCC lowers a vector-extension conversion from 8-bit lanes to scalar code.
inline void int8_row(const int8_t* src, float scale, float* dst, int n) {
  for (int i = 0; i < n; i += 16) {
#if defined(__AVX512F__)
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(
        dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), _mm512_set1_ps(scale)));
#elif defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(scale);
    for (int h = 0; h < 16; h += 8) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i + h));
      _mm256_storeu_ps(dst + i + h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv));
    }
#else
    for (int j = 0; j < 16; ++j) dst[i + j] = static_cast<float>(src[i + j]) * scale;
#endif
  }
}

// Horizontal max / sum of a W-lane vector, and the W sums of W vectors (the few-rows scores):
// by halving shuffles on 16 lanes; on 8 lanes with AVX's in-lane shuffles (a generic 8-lane
// shuffle of two inputs is not always one instruction on AVX2).
#if defined(__AVX512F__)
inline vf swap_halves(vf v, int w) {
  const vi idx8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi idx4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const vi idx2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const vi idx1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  switch (w) {
    case 8: return __builtin_shuffle(v, idx8);
    case 4: return __builtin_shuffle(v, idx4);
    case 2: return __builtin_shuffle(v, idx2);
    default: return __builtin_shuffle(v, idx1);
  }
}

inline float hmax(vf v) {
  for (int w = 8; w >= 1; w /= 2) {
    const vf o = swap_halves(v, w);
    v = v > o ? v : o;
  }
  return v[0];
}

inline float hsum(vf v) {
  for (int w = 8; w >= 1; w /= 2) v += swap_halves(v, w);
  return v[0];
}

// out[i] = sum of the 16 lanes of t[i]: a tree of pairwise shuffles (15 adds), then one
// permutation that undoes the tree's bit-reversed lane order.
inline vf reduce_w(const vf* t) {
  const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const vi order = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  vf u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)
    u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo8) +
           __builtin_shuffle(t[2 * i], t[2 * i + 1], hi8);
  for (int i = 0; i < 4; ++i)
    w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], lo4) +
           __builtin_shuffle(u[2 * i], u[2 * i + 1], hi4);
  for (int i = 0; i < 2; ++i)
    x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo2) +
           __builtin_shuffle(w[2 * i], w[2 * i + 1], hi2);
  const vf y = __builtin_shuffle(x[0], x[1], lo1) + __builtin_shuffle(x[0], x[1], hi1);
  return __builtin_shuffle(y, order);
}
#elif defined(__AVX__)
inline float hmax(vf v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline float hsum(vf v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// out[i] = sum of the 8 lanes of t[i]: two levels of pairwise horizontal adds within each
// 128-bit half, then the two halves added across.
inline vf reduce_w(const vf* t) {
  const __m256 a = _mm256_hadd_ps((__m256)t[0], (__m256)t[1]),
               b = _mm256_hadd_ps((__m256)t[2], (__m256)t[3]);
  const __m256 c = _mm256_hadd_ps((__m256)t[4], (__m256)t[5]),
               d = _mm256_hadd_ps((__m256)t[6], (__m256)t[7]);
  const __m256 lo = _mm256_hadd_ps(a, b), hi = _mm256_hadd_ps(c, d);  // [t0..t3 | t0..t3] halves
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                           _mm256_permute2f128_ps(lo, hi, 0x31));
}
#else
inline float hmax(vf v) {
  float x = v[0];
  for (int i = 1; i < W; ++i) x = x > v[i] ? x : v[i];
  return x;
}

inline float hsum(vf v) {
  float x = v[0];
  for (int i = 1; i < W; ++i) x += v[i];
  return x;
}

inline vf reduce_w(const vf* t) {
  vf out;
  for (int i = 0; i < W; ++i) out[i] = hsum(t[i]);
  return out;
}
#endif

// float -> bfloat16 bits, round to nearest even (finite inputs).
inline v16i bf16_bits(v16 x) {
  v16i b;
  std::memcpy(&b, &x, sizeof(b));
  return (b + 0x7FFF + ((b >> 16) & 1)) >> 16 & 0xFFFF;
}

#if RADIXSERVE_BF16_DOT
// acc += dot of bfloat16 pairs: acc[i] += a[2i] * b[2i] + a[2i + 1] * b[2i + 1].
inline v16 dot_pairs(v16 acc, const uint32_t* a, uint32_t b) {
  const __m512bh av = (__m512bh)_mm512_loadu_si512(a);
  const __m512bh bv = (__m512bh)_mm512_set1_epi32(static_cast<int>(b));
  return (v16)_mm512_dpbf16_ps((__m512)acc, av, bv);
}
#endif

// Entry e, query head h: the normalised partial output acc / total and its log-sum-exp
// (``max`` is the row's running max in natural-log units).
template <int D>
inline void write_partial(int64_t e, int64_t h, int64_t num_heads, const float* acc, float total,
                          float max, float* part, float* lse) {
  const float inv = 1.f / total;
  float* dst = part + (e * num_heads + h) * D;
  for (int d = 0; d < D; ++d) dst[d] = acc[d] * inv;
  lse[e * num_heads + h] = max + std::log(total);
}

struct Plan {
  const int32_t* table;
  int64_t table_stride;
  const int64_t* job_row;
  const int64_t* job_kv_begin;
  const int64_t* job_entry_ptr;
  const int64_t* entry_row;
  const int64_t* entry_limit;
};

// In place: t[i][c] <- t[c][i] for a 16 x 16 tile of 32-bit words, by four butterfly levels
// that swap the off-diagonal blocks of size s = 8, 4, 2, 1 (64 two-input shuffles).
inline void transpose16(v16i* t) {
  // Level l swaps blocks of size 8 >> l: lo[l] takes row i's kept half and row i+s's front,
  // hi[l] row i's back and row i+s's kept half (indices >= 16 pick from the second row).
  static const v16i lo[4] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
      {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
      {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
  static const v16i hi[4] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
      {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
      {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#pragma GCC unroll 4
  for (int level = 0; level < 4; ++level) {
    const int s = 8 >> level;
    for (int i = 0; i < 16; ++i) {
      if (i & s) continue;
      const v16i a = t[i], b = t[i + s];
      t[i] = __builtin_shuffle(a, b, lo[level]);
      t[i + s] = __builtin_shuffle(a, b, hi[level]);
    }
  }
}

// In place: t[i][c] <- t[c][i] for a W x W tile of 32-bit words.
#if defined(__AVX512F__)
inline void transpose_w(vi* t) { transpose16(t); }
#elif defined(__AVX__)
inline void transpose_w(vi* t) {
  // Interleave pairs of rows, then pairs of pairs, within each 128-bit half; then swap halves.
  __m256 r[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = (__m256)t[i];
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = (vi)_mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = (vi)_mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
}
#else
inline void transpose_w(vi* t) {
  for (int i = 0; i < W; ++i)
    for (int c = i + 1; c < W; ++c) {
      const int32_t x = t[i][c];
      t[i][c] = t[c][i];
      t[c][i] = x;
    }
}
#endif

// A zero K/V row (head_dim <= 128) for the keys past a block's end.
alignas(64) const float kZeroRow[128] = {};

// The rows of one K (or V) block as float: pointers into a float32 pool, or into `buf` where the
// pool holds bfloat16 / float16 / 8 bits (converted once per task and block; an int8 row times
// its scale in `scales`, [slots, KV heads]); keys past `nk` are zeros.
template <typename KT, int D>
inline void block_rows(const int32_t* slots, int nk, const KT* pool, const at::Half* scales,
                       int64_t num_kv, int64_t kvh, float (*buf)[D], const float** rows) {
  const int64_t kv_stride = num_kv * D;
  for (int j = 0; j < nk; ++j) {
    const KT* src = pool + slots[j] * kv_stride + kvh * D;
    if constexpr (std::is_same_v<KT, float>) {
      rows[j] = src;
      continue;
    } else if constexpr (std::is_same_v<KT, int8_t>) {
      int8_row(src, static_cast<float>(scales[slots[j] * num_kv + kvh]), buf[j], D);
    } else {
      convert_row(src, buf[j], D);
    }
    rows[j] = buf[j];
  }
  for (int j = nk; j < KB; ++j) rows[j] = kZeroRow;
}

// The K block transposed to [D][KB], in W x W tiles transposed in registers.
template <int D>
void load_k_transposed(const float* const* krow, float (*kt)[KB]) {
  for (int j0 = 0; j0 < KB; j0 += W) {
    for (int d0 = 0; d0 < D; d0 += W) {
      vi t[W];
      for (int jj = 0; jj < W; ++jj) std::memcpy(&t[jj], krow[j0 + jj] + d0, sizeof(vi));
      transpose_w(t);
      for (int i = 0; i < W; ++i) std::memcpy(&kt[d0 + i][j0], &t[i], sizeof(vi));
    }
  }
}

// Keys of the block after the one at `kb` (0 past the last).
inline int next_block_keys(int64_t kb, int64_t kv_end) {
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(KB, kv_end - kb - KB)));
}

// The next block's K/V rows, requested now: between two steps the other layers' weights and
// KV have pushed this layer's out of the caches, and the rows sit behind a table.
template <typename KT, int D>
inline void prefetch_rows(const int32_t* slots, int n, const KT* kp, const KT* vp,
                          int64_t kv_stride, int64_t kvh) {
  for (int j = 0; j < n; ++j) {
    const int64_t off = static_cast<int64_t>(slots[j]) * kv_stride + kvh * D;
    for (int b = 0; b < D * static_cast<int>(sizeof(KT)); b += 64) {
      prefetch_line(reinterpret_cast<const char*>(kp + off) + b);
      prefetch_line(reinterpret_cast<const char*>(vp + off) + b);
    }
  }
}

#if RADIXSERVE_BF16_DOT
// A zero bfloat16 row (head_dim <= 128) for the keys past a block's end.
alignas(64) const uint16_t kZeroRow16[128] = {};

// One K (or V) row of an 8-bit pool as bfloat16 bits in `dst`: widened to float (an int8 row
// times its scale), then rounded to nearest even by the BF16 conversion instruction.
template <typename KT, int D>
inline void bf16_row(const KT* src, float scale, uint16_t* dst) {
  for (int d = 0; d < D; d += 16) {
    alignas(64) float f[16];
    if constexpr (std::is_same_v<KT, int8_t>) {
      int8_row(src + d, scale, f, 16);
    } else {
      convert_row(src + d, f, 16);
    }
    const __m512 x = _mm512_load_ps(f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

// The block's K and V rows as bfloat16 bits: pointers into a bfloat16 pool, or into
// `kbuf` / `vbuf` where the pool holds 8 bits (converted once per task and block); keys past
// `nk` point at a zero row.
template <typename KT, int D>
inline void block_rows16(const int32_t* slots, int nk, const KT* kp, const KT* vp,
                         const at::Half* ks, const at::Half* vs, int64_t num_kv, int64_t kvh,
                         uint16_t (*kbuf)[D], uint16_t (*vbuf)[D], const uint16_t** krow,
                         const uint16_t** vrow) {
  const int64_t kv_stride = num_kv * D;
  for (int j = 0; j < nk; ++j) {
    const int64_t off = slots[j] * kv_stride + kvh * D;
    if constexpr (std::is_same_v<KT, at::BFloat16>) {
      krow[j] = reinterpret_cast<const uint16_t*>(kp + off);
      vrow[j] = reinterpret_cast<const uint16_t*>(vp + off);
      continue;
    } else {
      const int64_t at_scale = slots[j] * num_kv + kvh;
      bf16_row<KT, D>(kp + off, ks ? static_cast<float>(ks[at_scale]) : 1.f, kbuf[j]);
      bf16_row<KT, D>(vp + off, vs ? static_cast<float>(vs[at_scale]) : 1.f, vbuf[j]);
      krow[j] = kbuf[j];
      vrow[j] = vbuf[j];
    }
  }
  for (int j = nk; j < KB; ++j) krow[j] = vrow[j] = kZeroRow16;
}

// The K block as bfloat16 pairs transposed to [D/2][KB] (a 32-bit transpose), from the block's
// bfloat16 rows.
template <int D>
void load_k_pairs(const uint16_t* const* krow, uint32_t (*kp2)[KB]) {
  if constexpr (D / 2 < 16) {  // head_dim 16: fewer pairs than a tile
    for (int j = 0; j < KB; ++j) {
      const uint32_t* k32 = reinterpret_cast<const uint32_t*>(krow[j]);
      for (int dp = 0; dp < D / 2; ++dp) kp2[dp][j] = k32[dp];
    }
  } else {
    // K: 16 x 16 tiles of (key, pair) words, transposed in registers.
    for (int j0 = 0; j0 < KB; j0 += 16) {
      for (int dp0 = 0; dp0 < D / 2; dp0 += 16) {
        v16i t[16];
        for (int jj = 0; jj < 16; ++jj) std::memcpy(&t[jj], krow[j0 + jj] + 2 * dp0, sizeof(v16i));
        transpose16(t);
        for (int i = 0; i < 16; ++i) std::memcpy(&kp2[dp0 + i][j0], &t[i], sizeof(v16i));
      }
    }
  }
}

// The V block as pairs of consecutive keys [KB/2][D], from the block's bfloat16 rows.
template <int D>
void load_v_pairs(const uint16_t* const* vrow, uint32_t (*vp2)[D]) {
  for (int jp = 0; jp < KB / 2; ++jp) {
    const uint16_t* v0 = vrow[2 * jp];
    const uint16_t* v1 = vrow[2 * jp + 1];
    for (int d = 0; d < D; d += 16) {
      v16h a, b;
      std::memcpy(&a, v0 + d, sizeof(a));
      std::memcpy(&b, v1 + d, sizeof(b));
      const v16i w = __builtin_convertvector(a, v16i) | (__builtin_convertvector(b, v16i) << 16);
      std::memcpy(&vp2[jp][d], &w, sizeof(w));
    }
  }
}

// Pair vector c of keys (a, b) (two bfloat16 rows), as the in-lane interleave of their 32 values
// from 32 (c / 2) on: unpacklo (even c) pairs the values 0-3 of each 128-bit lane, unpackhi
// (odd c) the values 4-7.  So lane 4L + i of vector c pairs value 32 (c / 2) + 8L + 4 (c % 2) + i
// of a and of b: the accumulators of P.V hold head dimensions in that order (unpermute_v_pairs).
inline __m512bh v_pair(const uint16_t* a, const uint16_t* b, int c) {
  const __m512i x = _mm512_loadu_si512(a + 32 * (c / 2));
  const __m512i y = _mm512_loadu_si512(b + 32 * (c / 2));
  return (__m512bh)(c % 2 ? _mm512_unpackhi_epi16(x, y) : _mm512_unpacklo_epi16(x, y));
}

// A row of P.V accumulated through v_pair, back in head-dimension order.
template <int D>
inline void unpermute_v_pairs(float* acc) {
  alignas(64) float t[D];
  for (int g = 0; g < D / 32; ++g)
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 4; ++lane)
        for (int i = 0; i < 4; ++i)
          t[32 * g + 8 * lane + 4 * half + i] = acc[32 * g + 16 * half + 4 * lane + i];
  std::memcpy(acc, t, sizeof(t));
}

// 2^x for 16 lanes: 2^round(x) * 2^f with f in [-1/2, 1/2] (degree-5 Taylor, relative error
// ~2e-6, far below the bfloat16 rounding of the weights that follows) and scalef, which gives
// exactly 0 for a masked score (-1e30) without a clamp.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The running max of a row is raised only when a score exceeds it by more than this (in log2
// units), so the rescale of the row's accumulator is rare; weights stay below 2^LAZY_MAX.
constexpr float LAZY_MAX = 8.f;

// One task on a bfloat16 pool (or an 8-bit one, its blocks converted to bfloat16) with AVX-512
// BF16: KV head `kvh` of job `job`, entries [e0, e1).
// Scores (base 2) stay in registers for CHUNK rows (8, or exactly the task's 1-4 rows: a decode
// request's few heads, without a padded row's products): Q.K by pair products, the online softmax
// with a lazily raised max, the weights rounded to bfloat16 pairs by one instruction, then P.V
// by pair products into the float32 accumulators.  Output as run_task's.
template <typename QT, typename KT, int D, int CHUNK>
void run_task_pairs(const Plan& plan, const QT* q, const KT* kp, const KT* vp, const at::Half* ks,
                    const at::Half* vs, int64_t num_heads, int64_t num_kv, int64_t group,
                    float scaling, int64_t job, int64_t kvh, int64_t e0, int64_t e1, float* part,
                    float* lse) {
  constexpr int ROWS = pair_rows<D>();
  constexpr int DV = D / 16;
  constexpr int DC = DV < 4 ? DV : 4;  // accumulator vectors per row held in registers in P.V
  // A task of at most 4 rows (one decode request's heads) is one chunk: each V pair vector is
  // used once, so it is formed in registers (v_pair: one unpack of two loads) instead of stored
  // to vp2 and loaded back (two widenings, a shift and an or per vector).  CHUNK is exactly the
  // task's rows (the default model: 9 heads over 3 KV heads, 3 rows a task), so no padded row
  // costs products.
  constexpr bool DIRECT_V = CHUNK <= 4 && D % 32 == 0;
  constexpr int RB = CHUNK < 4 ? CHUNK : 4;  // rows of a P.V pass sharing each V load
  const int rows = static_cast<int>((e1 - e0) * group);
  const int padded = (rows + CHUNK - 1) / CHUNK * CHUNK;
  alignas(64) uint32_t qp2[ROWS][D / 2];  // Q[r][d, d+1] as bfloat16 pairs
  alignas(64) float acc[ROWS][D];
  alignas(64) uint32_t kp2[D / 2][KB];
  alignas(64) uint32_t vp2[DIRECT_V ? 1 : KB / 2][D];
  alignas(64) uint32_t pp[CHUNK][KB / 2];  // P[r][j, j+1] as bfloat16 pairs
  constexpr int BUF = std::is_same_v<KT, at::BFloat16> ? 1 : KB;  // converted rows (8-bit pools)
  alignas(64) uint16_t kbuf[BUF][D];
  alignas(64) uint16_t vbuf[BUF][D];
  const uint16_t* krow[KB];
  const uint16_t* vrow[KB];
  float m[ROWS];
  __m512 l[ROWS];  // softmax denominators by lane
  int64_t limit[ROWS];

  int64_t kv_end = 0;
  for (int r = 0; r < padded; ++r) {
    std::memset(acc[r], 0, sizeof(acc[r]));
    m[r] = NEG;
    l[r] = _mm512_setzero_ps();
    if (r >= rows) {  // padding: a zero query over live keys, never written out
      std::memset(qp2[r], 0, sizeof(qp2[r]));
      limit[r] = limit[0];
      continue;
    }
    const int64_t e = e0 + r / group;
    const QT* src = q + (plan.entry_row[e] * num_heads + kvh * group + r % group) * D;
    for (int d = 0; d < D; d += 16) {  // rounded to bfloat16 (exact when the model runs in it)
      v16 x;
      for (int i = 0; i < 16; ++i) x[i] = to_float(src[d + i]);
      const v16i b = bf16_bits(x);
      for (int i = 0; i < 8; ++i)
        qp2[r][d / 2 + i] =
            static_cast<uint32_t>(b[2 * i]) | (static_cast<uint32_t>(b[2 * i + 1]) << 16);
    }
    limit[r] = plan.entry_limit[e];
    kv_end = std::max(kv_end, limit[r]);
  }
  const int32_t* trow = plan.table + plan.job_row[job] * plan.table_stride;
  const int64_t kv_begin = plan.job_kv_begin[job];
  const int64_t kv_stride = num_kv * D;
  const __m512 scale2 = _mm512_set1_ps(scaling * 1.4426950408889634f);  // scores in log2 units
  const __m512 negv = _mm512_set1_ps(NEG);
  const __m512i col0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i col1 = _mm512_add_epi32(col0, _mm512_set1_epi32(16));

  for (int64_t kb = kv_begin; kb < kv_end; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, kv_end - kb));
    prefetch_rows<KT, D>(trow + kb + KB, next_block_keys(kb, kv_end), kp, vp, kv_stride, kvh);
    block_rows16<KT, D>(trow + kb, nk, kp, vp, ks, vs, num_kv, kvh, kbuf, vbuf, krow, vrow);
    load_k_pairs<D>(krow, kp2);
    if constexpr (!DIRECT_V) load_v_pairs<D>(vrow, vp2);
    for (int r = 0; r < padded; r += CHUNK) {
      __m512 s[CHUNK][2];
      for (int i = 0; i < CHUNK; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int dp = 0; dp < D / 2; ++dp) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(&kp2[dp][0]);
        const __m512bh k1 = (__m512bh)_mm512_load_si512(&kp2[dp][16]);
        for (int i = 0; i < CHUNK; ++i) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp2[r + i][dp]));
          s[i][0] = _mm512_dpbf16_ps(s[i][0], k0, b);
          s[i][1] = _mm512_dpbf16_ps(s[i][1], k1, b);
        }
      }
      int64_t min_limit = limit[r];
      for (int i = 1; i < CHUNK; ++i) min_limit = std::min(min_limit, limit[r + i]);
      const bool partial = kb + KB > min_limit;  // some key of the block is past a row's limit
      for (int i = 0; i < CHUNK; ++i) {
        const int row = r + i;
        __m512 x0 = _mm512_mul_ps(s[i][0], scale2), x1 = _mm512_mul_ps(s[i][1], scale2);
        __mmask16 live0 = 0xFFFF, live1 = 0xFFFF;
        if (partial) {
          const __m512i live =
              _mm512_set1_epi32(static_cast<int>(std::min<int64_t>(nk, limit[row] - kb)));
          live0 = _mm512_cmplt_epi32_mask(col0, live);
          live1 = _mm512_cmplt_epi32_mask(col1, live);
          x0 = _mm512_mask_blend_ps(live0, negv, x0);
          x1 = _mm512_mask_blend_ps(live1, negv, x1);
        }
        const __m512 raise = _mm512_set1_ps(m[row] + LAZY_MAX);
        if (_mm512_cmp_ps_mask(x0, raise, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x1, raise, _CMP_GT_OQ)) {
          const float mnew = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
          const float alpha = std::exp2(m[row] - mnew);
          l[row] = _mm512_mul_ps(l[row], _mm512_set1_ps(alpha));
          for (int d = 0; d < D; ++d) acc[row][d] *= alpha;
          m[row] = mnew;
        }
        const __m512 mv = _mm512_set1_ps(m[row]);
        const __m512 p0 = _mm512_maskz_mov_ps(live0, exp2_16(_mm512_sub_ps(x0, mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(live1, exp2_16(_mm512_sub_ps(x1, mv)));
        l[row] = _mm512_add_ps(l[row], _mm512_add_ps(p0, p1));
        // Keys (2j, 2j+1) of the block as one 32-bit lane j: the layout of vp2.
        _mm512_store_si512(pp[i], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      // acc += P V for the chunk, RB rows at a time sharing each V load.
      for (int i0 = 0; i0 < CHUNK; i0 += RB) {
        for (int c0 = 0; c0 < DV; c0 += DC) {
          __m512 a[RB][DC];
          for (int i = 0; i < RB; ++i)
            for (int c = 0; c < DC; ++c) a[i][c] = _mm512_load_ps(&acc[r + i0 + i][(c0 + c) * 16]);
          for (int jp = 0; jp < KB / 2; ++jp) {
            __m512bh v[DC];
            for (int c = 0; c < DC; ++c) {
              if constexpr (DIRECT_V) {
                v[c] = v_pair(vrow[2 * jp], vrow[2 * jp + 1], c0 + c);
              } else {
                v[c] = (__m512bh)_mm512_load_si512(&vp2[jp][(c0 + c) * 16]);
              }
            }
            for (int i = 0; i < RB; ++i) {
              const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i0 + i][jp]));
              for (int c = 0; c < DC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], v[c], w);
            }
          }
          for (int i = 0; i < RB; ++i)
            for (int c = 0; c < DC; ++c) _mm512_store_ps(&acc[r + i0 + i][(c0 + c) * 16], a[i][c]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    if constexpr (DIRECT_V) unpermute_v_pairs<D>(acc[r]);
    write_partial<D>(e0 + r / group, kvh * group + r % group, num_heads, acc[r],
                     _mm512_reduce_add_ps(l[r]), m[r] * 0.69314718055994531f, part, lse);
  }
}
#else
template <typename QT, typename KT, int D, int CHUNK>
void run_task_pairs(const Plan&, const QT*, const KT*, const KT*, const at::Half*, const at::Half*,
                    int64_t, int64_t, int64_t, float, int64_t, int64_t, int64_t, int64_t, float*,
                    float*) {}
#endif

// One task: KV head `kvh` of job `job`, entries [e0, e1).  Writes each entry's normalised
// partial output part[e, h, :] and lse[e, h] for the G query heads h of this KV head.
// Vectors are W floats (vec.h); a row of block scores is SV of them.
template <typename QT, typename KT, int D>
void run_task(const Plan& plan, const QT* q, const KT* kp, const KT* vp, const at::Half* ks,
              const at::Half* vs, int64_t num_heads, int64_t num_kv, int64_t group, float scaling,
              int64_t job, int64_t kvh, int64_t e0, int64_t e1, float* part, float* lse) {
  constexpr int DV = D / W;            // vectors per head row
  constexpr int SV = KB / W;           // vectors per row of block scores (2 or 4: even)
  constexpr int DC = DV < 4 ? DV : 4;  // accumulator vectors per row held in registers in P.V
  const int rows = static_cast<int>((e1 - e0) * group);
  alignas(64) float qs[MAX_ROWS][D];
  alignas(64) float acc[MAX_ROWS][D];
  alignas(64) float kt[D][KB];    // K block transposed (many rows)
  alignas(64) float kbuf[KB][D];  // K / V rows converted to float (pools other than float32)
  alignas(64) float vbuf[KB][D];
  alignas(64) float s[MAX_ROWS][KB];
  const float* krow[KB];
  const float* vrow[KB];
  const bool few = rows < FEW_ROWS;
  float m[MAX_ROWS];
  vf l[MAX_ROWS];  // softmax denominators by lane, summed once at the end
  int64_t limit[MAX_ROWS];

  int64_t kv_end = 0;
  for (int r = 0; r < rows; ++r) {
    const int64_t e = e0 + r / group;
    const int64_t h = kvh * group + r % group;
    const QT* src = q + (plan.entry_row[e] * num_heads + h) * D;
    for (int d = 0; d < D; ++d) qs[r][d] = to_float(src[d]) * scaling;
    std::memset(acc[r], 0, sizeof(acc[r]));
    m[r] = NEG;
    l[r] = vf{};
    limit[r] = plan.entry_limit[e];
    kv_end = std::max(kv_end, limit[r]);
  }
  const int32_t* trow = plan.table + plan.job_row[job] * plan.table_stride;
  const int64_t kv_begin = plan.job_kv_begin[job];
  const int64_t kv_stride = num_kv * D;
  vi col[SV];  // key column of each score lane within the block
  for (int c = 0; c < SV; ++c)
    for (int i = 0; i < W; ++i) col[c][i] = c * W + i;

  for (int64_t kb = kv_begin; kb < kv_end; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, kv_end - kb));
    prefetch_rows<KT, D>(trow + kb + KB, next_block_keys(kb, kv_end), kp, vp, kv_stride, kvh);
    block_rows<KT, D>(trow + kb, nk, kp, ks, num_kv, kvh, kbuf, krow);
    block_rows<KT, D>(trow + kb, nk, vp, vs, num_kv, kvh, vbuf, vrow);
    int r = 0;
    if (few) {  // each score a dot product over a K row as stored, W keys reduced at once
      for (; r < rows; ++r) {
        vf qv[DV];
        for (int dv = 0; dv < DV; ++dv) qv[dv] = loadw(&qs[r][dv * W]);
        for (int c = 0; c < SV; ++c) {
          vf t[W];
          for (int jj = 0; jj < W; ++jj) {
            const float* k = krow[c * W + jj];
            vf a = qv[0] * loadw(k);
#pragma GCC unroll 8
            for (int dv = 1; dv < DV; ++dv) a += qv[dv] * loadw(k + dv * W);
            t[jj] = a;
          }
          storew(&s[r][c * W], reduce_w(t));
        }
      }
    } else {
      load_k_transposed<D>(krow, kt);
    }
    // Scores: 4 rows x 2 vectors of keys at a time share each K load.
    for (; r + 4 <= rows; r += 4) {
      for (int c = 0; c < SV; c += 2) {
        vf a0 = {}, a1 = {}, b0 = {}, b1 = {}, c0 = {}, c1 = {}, d0 = {}, d1 = {};
#pragma GCC unroll 8
        for (int d = 0; d < D; ++d) {
          const vf k0 = loadw(&kt[d][c * W]), k1 = loadw(&kt[d][c * W + W]);
          a0 += qs[r][d] * k0; a1 += qs[r][d] * k1;
          b0 += qs[r + 1][d] * k0; b1 += qs[r + 1][d] * k1;
          c0 += qs[r + 2][d] * k0; c1 += qs[r + 2][d] * k1;
          d0 += qs[r + 3][d] * k0; d1 += qs[r + 3][d] * k1;
        }
        storew(&s[r][c * W], a0); storew(&s[r][c * W + W], a1);
        storew(&s[r + 1][c * W], b0); storew(&s[r + 1][c * W + W], b1);
        storew(&s[r + 2][c * W], c0); storew(&s[r + 2][c * W + W], c1);
        storew(&s[r + 3][c * W], d0); storew(&s[r + 3][c * W + W], d1);
      }
    }
    for (; r < rows; ++r) {
      for (int c = 0; c < SV; ++c) {
        vf a = {};
        for (int d = 0; d < D; ++d) a += qs[r][d] * loadw(&kt[d][c * W]);
        storew(&s[r][c * W], a);
      }
    }
    // Mask (key column >= the row's limit, or past the block) and online softmax.
    for (int r2 = 0; r2 < rows; ++r2) {
      const int live = static_cast<int>(std::min<int64_t>(nk, limit[r2] - kb));
      vf x[SV];
      for (int c = 0; c < SV; ++c) {
        x[c] = loadw(&s[r2][c * W]);
        x[c] = col[c] < live ? x[c] : splat_as<vf>(NEG);
      }
      vf top = x[0];
      for (int c = 1; c < SV; ++c) top = top > x[c] ? top : x[c];
      const float mnew = std::max(m[r2], hmax(top));
      const float alpha = std::exp(m[r2] - mnew);
      vf sum = {};
      for (int c = 0; c < SV; ++c) {
        const vf p = vexp(x[c] - mnew);
        sum += p;
        storew(&s[r2][c * W], p);
      }
      l[r2] = l[r2] * alpha + sum;
      m[r2] = mnew;
      if (alpha != 1.f) {
        for (int dv = 0; dv < DV; ++dv) storew(&acc[r2][dv * W], loadw(&acc[r2][dv * W]) * alpha);
      }
    }
    // acc += P V: 2 rows x DC vectors at a time share each V load.
    r = 0;
    for (; r + 2 <= rows; r += 2) {
      for (int c0 = 0; c0 < DV; c0 += DC) {
        vf x[DC], y[DC];
        for (int c = 0; c < DC; ++c) {
          x[c] = loadw(&acc[r][(c0 + c) * W]);
          y[c] = loadw(&acc[r + 1][(c0 + c) * W]);
        }
        for (int j = 0; j < nk; ++j) {
          const float px = s[r][j], py = s[r + 1][j];
          const float* v = vrow[j] + c0 * W;
#pragma GCC unroll 8
          for (int c = 0; c < DC; ++c) {
            const vf vv = loadw(v + c * W);
            x[c] += px * vv;
            y[c] += py * vv;
          }
        }
        for (int c = 0; c < DC; ++c) {
          storew(&acc[r][(c0 + c) * W], x[c]);
          storew(&acc[r + 1][(c0 + c) * W], y[c]);
        }
      }
    }
    for (; r < rows; ++r) {
      for (int j = 0; j < nk; ++j) {
        const float px = s[r][j];
        for (int dv = 0; dv < DV; ++dv)
          storew(&acc[r][dv * W], loadw(&acc[r][dv * W]) + px * loadw(vrow[j] + dv * W));
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    write_partial<D>(e0 + r / group, kvh * group + r % group, num_heads, acc[r], hsum(l[r]), m[r],
                     part, lse);
}
template <typename QT, typename KT, int D>
void run_jobs(const Plan& plan, int64_t num_jobs, const QT* q, const KT* kp, const KT* vp,
              const at::Half* ks, const at::Half* vs, int64_t num_heads, int64_t num_kv,
              float scaling, bool bf16_model, float* part, float* lse) {
  const int64_t group = num_heads / num_kv;
  // On a CPU with AVX-512 BF16 a bfloat16 pool runs every task on the pair path
  // (run_task_pairs), and so does an 8-bit pool under a bfloat16 model (`bf16_model`: its
  // blocks rounded to bfloat16, as a bfloat16 pool would hold them); other pools, or a CPU
  // without those instructions, run the float path.
  constexpr bool PAIR_TYPE =
      RADIXSERVE_BF16_DOT && (std::is_same_v<KT, at::BFloat16> || sizeof(KT) == 1);
  const bool pairs = PAIR_TYPE && (std::is_same_v<KT, at::BFloat16> || bf16_model);
  const int64_t per_task = std::max<int64_t>(1, (pairs ? pair_rows<D>() : MAX_ROWS) / group);
  // Tasks (job, first entry), heaviest first (keys read x rows), handed out one at a time
  // from a shared counter: a static split would give one thread every shared-prefix job.
  struct Task {
    int64_t job, e0, e1, cost;
  };
  std::vector<Task> tasks;
  for (int64_t j = 0; j < num_jobs; ++j) {
    for (int64_t e = plan.job_entry_ptr[j]; e < plan.job_entry_ptr[j + 1]; e += per_task) {
      const int64_t e1 = std::min(e + per_task, plan.job_entry_ptr[j + 1]);
      int64_t kv_end = 0;
      for (int64_t x = e; x < e1; ++x) kv_end = std::max(kv_end, plan.entry_limit[x]);
      tasks.push_back({j, e, e1, (kv_end - plan.job_kv_begin[j] + KB) * (e1 - e)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const auto run_one = [&](const Task& task, int64_t kvh) {
    if constexpr (PAIR_TYPE) {
      if (pairs) {
        const int64_t rows = (task.e1 - task.e0) * group;
        if (rows <= 4) {  // one chunk of exactly the task's rows (no padded row's products)
          const auto run = [&](auto chunk) {
            run_task_pairs<QT, KT, D, decltype(chunk)::value>(plan, q, kp, vp, ks, vs, num_heads,
                                                              num_kv, group, scaling, task.job, kvh,
                                                              task.e0, task.e1, part, lse);
          };
          switch (rows) {
            case 1: run(std::integral_constant<int, 1>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            default: run(std::integral_constant<int, 4>{}); break;
          }
        } else {
          run_task_pairs<QT, KT, D, 8>(plan, q, kp, vp, ks, vs, num_heads, num_kv, group, scaling,
                                       task.job, kvh, task.e0, task.e1, part, lse);
        }
        return;
      }
    }
    run_task<QT, KT, D>(plan, q, kp, vp, ks, vs, num_heads, num_kv, group, scaling, task.job, kvh,
                        task.e0, task.e1, part, lse);
  };
  // With at least two tasks a thread, a unit is a task's every KV head, one after the other: a
  // key's K (and V) rows of all heads lie side by side in the pool, so the heads after the first
  // read lines the first one's pass brought into this core's cache.  Fewer tasks: a unit is one
  // head of a task, for more units than threads.
  const int64_t threads = at::get_num_threads();
  const bool whole = static_cast<int64_t>(tasks.size()) >= 2 * threads;
  const int64_t per_unit = whole ? num_kv : 1;
  const int64_t n_units = static_cast<int64_t>(tasks.size()) * num_kv / per_unit;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1); u < n_units; u = next.fetch_add(1)) {
      for (int64_t t = u * per_unit; t < (u + 1) * per_unit; ++t)
        run_one(tasks[t / num_kv], t % num_kv);
    }
  });
}

template <typename QT, typename KT>
void dispatch_dim(int64_t head_dim, const Plan& plan, int64_t num_jobs, const QT* q, const KT* kp,
                  const KT* vp, const at::Half* ks, const at::Half* vs, int64_t num_heads,
                  int64_t num_kv, float scaling, bool bf16_model, float* part, float* lse) {
  switch (head_dim) {
    case 16:
      return run_jobs<QT, KT, 16>(plan, num_jobs, q, kp, vp, ks, vs, num_heads, num_kv, scaling,
                                  bf16_model, part, lse);
    case 32:
      return run_jobs<QT, KT, 32>(plan, num_jobs, q, kp, vp, ks, vs, num_heads, num_kv, scaling,
                                  bf16_model, part, lse);
    case 64:
      return run_jobs<QT, KT, 64>(plan, num_jobs, q, kp, vp, ks, vs, num_heads, num_kv, scaling,
                                  bf16_model, part, lse);
    case 128:
      return run_jobs<QT, KT, 128>(plan, num_jobs, q, kp, vp, ks, vs, num_heads, num_kv, scaling,
                                   bf16_model, part, lse);
    default:
      TORCH_CHECK(false, "paged_attention: head_dim ", head_dim, " not in {16, 32, 64, 128}");
  }
}

// `src` ([rows, n], any float type) as float32 rows, turned into the Hadamard basis when
// `rotated` (one pass, both cores).
template <typename T>
void float_rows(const T* src, int64_t rows, int64_t n, bool rotated, float* dst) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < n; ++d) dst[r * n + d] = to_float(src[r * n + d]);
      if (rotated) hadamard_row(dst + r * n, n);
    }
  });
}

// Merge the partials of each output row: row t's entries are [row_entry_ptr[t], ...[t+1]) of
// `row_entries`; out[t] = sum_e w_e part_e / sum_e w_e with w_e = e^{lse_e - max}; with
// `rotated` each merged head row is turned back from the Hadamard basis before it is written.
template <typename OT>
void merge_rows(const float* part, const float* lse, const int64_t* row_entry_ptr,
                const int64_t* row_entries, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                bool rotated, OT* out) {
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = row_entry_ptr[t], p1 = row_entry_ptr[t + 1];
      for (int64_t h = 0; h < num_heads; ++h) {
        OT* dst = out + (t * num_heads + h) * head_dim;
        if (p1 - p0 == 1) {
          const float* src = part + (row_entries[p0] * num_heads + h) * head_dim;
          if (!rotated) {
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<OT>(src[d]);
            continue;
          }
          std::copy(src, src + head_dim, buf.begin());
        } else {
          float top = NEG;
          for (int64_t p = p0; p < p1; ++p)
            top = std::max(top, lse[row_entries[p] * num_heads + h]);
          float total = 0.f;
          std::fill(buf.begin(), buf.end(), 0.f);
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t e = row_entries[p];
            const float w = std::exp(lse[e * num_heads + h] - top);
            total += w;
            const float* src = part + (e * num_heads + h) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) buf[d] += w * src[d];
          }
          const float inv = 1.f / total;
          for (int64_t d = 0; d < head_dim; ++d) buf[d] *= inv;
        }
        if (rotated) hadamard_row(buf.data(), head_dim);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<OT>(buf[d]);
      }
    }
  });
}

}  // namespace

// q: [T, H, D]; k_pool, v_pool: [S, KV, D]; k_scale, v_scale: [S, KV] float16 for an int8 pool,
// empty otherwise; table: [R, C] int32; plan tensors int64 (see top); rotated: an 8-bit pool
// whose K/V are stored in the Hadamard basis.  Returns [T, H, D] in q's dtype.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                           at::Tensor v_scale, at::Tensor table, at::Tensor job_row,
                           at::Tensor job_kv_begin, at::Tensor job_entry_ptr, at::Tensor entry_row,
                           at::Tensor entry_limit, at::Tensor row_entry_ptr, at::Tensor row_entries,
                           double scaling, bool rotated) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
              "q/k_pool/v_pool must be 3-D");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "q, k_pool and v_pool must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "k_pool and v_pool dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous(),
              "table must be contiguous int32");
  for (const auto* t : {&job_row, &job_kv_begin, &job_entry_ptr, &entry_row, &entry_limit,
                        &row_entry_ptr, &row_entries}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "plan tensors must be contiguous int64");
  }
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv = k_pool.size(1);
  TORCH_CHECK(num_heads % num_kv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(num_heads / num_kv <= MAX_ROWS, "paged_attention: more than ", MAX_ROWS,
              " query heads per KV head");
  TORCH_CHECK(k_pool.size(2) == head_dim, "head_dim of q and the pool differ");
  TORCH_CHECK(row_entry_ptr.size(0) == num_rows + 1, "row_entry_ptr must have T + 1 entries");
  const int64_t num_jobs = job_row.size(0);
  const int64_t num_entries = entry_row.size(0);

  Plan plan{table.data_ptr<int32_t>(), table.stride(0), job_row.data_ptr<int64_t>(),
            job_kv_begin.data_ptr<int64_t>(), job_entry_ptr.data_ptr<int64_t>(),
            entry_row.data_ptr<int64_t>(), entry_limit.data_ptr<int64_t>()};
  auto part = at::empty({num_entries, num_heads, head_dim}, q.options().dtype(at::kFloat));
  auto lse = at::empty({num_entries, num_heads}, q.options().dtype(at::kFloat));
  const float scale = static_cast<float>(scaling);

  const auto kv_type = k_pool.scalar_type();
  TORCH_CHECK(!rotated || (kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn ||
                           kv_type == at::kFloat8_e5m2),
              "paged_attention: only an 8-bit pool is rotated");
  if (kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn || kv_type == at::kFloat8_e5m2) {
    // An 8-bit pool: float32 queries (one instantiation per pool type), outputs in q's dtype;
    // under a bfloat16 model the pair path rounds queries and K/V blocks to bfloat16.
    const bool bf16_model = q.scalar_type() == at::kBFloat16;
    const at::Half* ks = nullptr;
    const at::Half* vs = nullptr;
    if (kv_type == at::kChar) {
      for (const auto* t : {&k_scale, &v_scale}) {
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                        t->size(0) == k_pool.size(0) && t->size(1) == num_kv,
                    "an int8 pool needs contiguous float16 scales of shape [slots, kv_heads]");
      }
      ks = k_scale.data_ptr<at::Half>();
      vs = v_scale.data_ptr<at::Half>();
    }
    // A rotated pool holds H k and H v (H orthogonal and symmetric): q.k = (H q).(H k), and the
    // output comes out as H o, turned back by H as the rows are merged.
    auto qf = at::empty(q.sizes(), q.options().dtype(at::kFloat));
    auto out = at::empty_like(q);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_q", [&] {
      float_rows<scalar_t>(q.data_ptr<scalar_t>(), num_rows * num_heads, head_dim, rotated,
                           qf.data_ptr<float>());
    });
    const float* qp = qf.data_ptr<float>();
    const void* kp = k_pool.data_ptr();
    const void* vp = v_pool.data_ptr();
    if (kv_type == at::kChar) {
      dispatch_dim<float, int8_t>(head_dim, plan, num_jobs, qp, static_cast<const int8_t*>(kp),
                                  static_cast<const int8_t*>(vp), ks, vs, num_heads, num_kv, scale,
                                  bf16_model, part.data_ptr<float>(), lse.data_ptr<float>());
    } else if (kv_type == at::kFloat8_e4m3fn) {
      dispatch_dim<float, Fp8E4M3>(head_dim, plan, num_jobs, qp, static_cast<const Fp8E4M3*>(kp),
                                   static_cast<const Fp8E4M3*>(vp), nullptr, nullptr, num_heads,
                                   num_kv, scale, bf16_model, part.data_ptr<float>(),
                                   lse.data_ptr<float>());
    } else {
      dispatch_dim<float, Fp8E5M2>(head_dim, plan, num_jobs, qp, static_cast<const Fp8E5M2*>(kp),
                                   static_cast<const Fp8E5M2*>(vp), nullptr, nullptr, num_heads,
                                   num_kv, scale, bf16_model, part.data_ptr<float>(),
                                   lse.data_ptr<float>());
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_out", [&] {
      merge_rows<scalar_t>(part.data_ptr<float>(), lse.data_ptr<float>(),
                           row_entry_ptr.data_ptr<int64_t>(), row_entries.data_ptr<int64_t>(),
                           num_rows, num_heads, head_dim, rotated, out.data_ptr<scalar_t>());
    });
    return out;
  }

  // One element type for q and the pool (the model's dtype): every pair of types would be
  // instantiated otherwise, quadrupling the build for combinations the runtime never makes.
  auto qk = q.scalar_type() == k_pool.scalar_type() ? q : q.to(k_pool.scalar_type());
  auto out = at::empty_like(qk);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, k_pool.scalar_type(), "paged_attention", [&] {
    using T = scalar_t;
    dispatch_dim<T, T>(head_dim, plan, num_jobs, qk.data_ptr<T>(), k_pool.data_ptr<T>(),
                       v_pool.data_ptr<T>(), nullptr, nullptr, num_heads, num_kv, scale, false,
                       part.data_ptr<float>(), lse.data_ptr<float>());
    merge_rows<T>(part.data_ptr<float>(), lse.data_ptr<float>(), row_entry_ptr.data_ptr<int64_t>(),
                  row_entries.data_ptr<int64_t>(), num_rows, num_heads, head_dim, false,
                  out.data_ptr<T>());
  });
  if (qk.scalar_type() != q.scalar_type()) return out.to(q.scalar_type());
  return out;
}
