// The one-row steps of a GGUF's K-quant weights with x in 16-bit integers
// (kquant_wide.cpp), the K-quant counterpart of linear_ops.cpp's int4_linear_q16: kquant_ops.cpp's
// kq_linear_q16 runs those parts through it.
#pragma once

#include <cstdint>
#include <vector>

// A row of x as 16-bit integers per block of 32 weights, x16 = round(x / dx) with
// dx = amax / 32639, split into signed bytes x16 = 256 hi + lo, laid out for one weight type:
// - Q4_K and Q5_K: each super-block's 256 bytes of hi (and of lo) hold its blocks in the order
//   their nibbles meet them (0, 2, 1, 3, 4, 6, 5, 7); `scales` per super-block: the 8 blocks'
//   dx, then their exact sums of x (16 floats);
// - Q6_K: the blocks in order; `scales` per super-block: each 16 weights' dx (their block's),
//   then their exact sums of x (32 floats).
struct KqWideRow {
  std::vector<int8_t> hi, lo;
  std::vector<float> scales;
};

// Whether the kernels were built for AVX-512 VNNI (the only build kq_wide_rows runs in).
bool kq_wide_supported();

// x's K floats (a whole number of super-blocks) into `row`, laid out for Q6_K or for Q4_K and
// Q5_K.
void kq_wide_row(const float* x, int64_t K, bool q6k, KqWideRow& row);

// y[m][n] for output rows [n0, n1) of the blocks w ([N][K / 256] of 144 bytes: Q4_K, 176: Q5_K,
// 210: Q6_K) and the M rows of x laid out for that type (y's rows N apart).  Rows [n1, reach)
// come next on this thread: the last tile asks for them as the others do for the next tile.
void kq_wide_rows(const KqWideRow* x, const uint8_t* w, int bytes, float* y, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t reach);
