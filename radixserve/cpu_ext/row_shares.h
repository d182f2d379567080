// How a one-row (decode) matmul's output rows are split over the threads, for the quantized
// kernels (linear_ops.cpp's int4 / int8, kquant_ops.cpp's K-quants).
//
// Each thread owns an equal run of every part's rows (a share: whole tiles), and goes through
// its shares from the front, chunk by chunk, the next chunk's weights asked for as it streams
// one; a thread done with its own takes the chunks still left in the others' shares, one at a
// time from their back.  A step's threads then finish together even when one of them is held
// up (the OS lends its core to a server's front end or detokenizer, two memory streams run at
// unequal rates), where a fixed split leaves the others waiting at the region's end.  Every
// output is still computed whole by one thread, so the bits do not depend on the split.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// A thread's run [n0, n1) of a part's rows, in chunks: ``ends`` holds the first chunk not yet
// taken (low 32 bits) and one past the last (high 32 bits); the owner takes from the front,
// the other threads from the back.
struct alignas(64) RowShare {
  int64_t n0 = 0, n1 = 0;
  std::atomic<uint64_t> ends{0};
  // A chunk's index, or -1 when none is left.
  int64_t take(bool back) {
    uint64_t e = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = e & 0xFFFFFFFFu, end = e >> 32;
      if (front >= end) return -1;
      const uint64_t next = back ? (end - 1) << 32 | front : end << 32 | (front + 1);
      if (ends.compare_exchange_weak(e, next, std::memory_order_relaxed))
        return static_cast<int64_t>(back ? end - 1 : front);
    }
  }
};

// ``run(p, n0, n1, reach)`` computes part p's output rows [n0, n1), for every chunk of ``chunk``
// rows (a multiple of ``tile``) of every part (``rows[p]`` rows each, ``np`` parts); rows
// [n1, reach) come next on the same thread, so their weights may be asked for ahead.  A weight
// of few rows runs on fewer threads: at least 16 tiles a thread.
template <typename Run>
void run_row_shares(const int64_t* rows, int64_t np, int64_t tile, int64_t chunk,
                    const Run& run) {
  int64_t total = 0;
  for (int64_t p = 0; p < np; ++p) total += rows[p];
  const int64_t threads = std::clamp<int64_t>(total / (16 * tile), 1, at::get_num_threads());
  std::vector<RowShare> shares(np * threads);
  for (int64_t p = 0; p < np; ++p) {
    const int64_t n = rows[p], step = (n + threads - 1) / threads;
    const int64_t per = (step + tile - 1) / tile * tile;  // rows a share, whole tiles
    for (int64_t t = 0; t < threads; ++t) {
      RowShare& sh = shares[p * threads + t];
      sh.n0 = std::min(n, t * per);
      sh.n1 = std::min(n, sh.n0 + per);
      sh.ends.store(static_cast<uint64_t>((sh.n1 - sh.n0 + chunk - 1) / chunk) << 32);
    }
  }
  const auto chunk_of = [&](int64_t s, int64_t c, bool own) {
    const RowShare& sh = shares[s];
    const int64_t n0 = sh.n0 + c * chunk, n1 = std::min(sh.n1, n0 + chunk);
    run(s / threads, n0, n1, own ? sh.n1 : n1);  // the owner goes on to its next chunk
  };
  if (threads == 1) {  // no region: the calling thread takes every chunk in order
    for (int64_t p = 0; p < np; ++p)
      for (int64_t c; (c = shares[p].take(false)) >= 0;) chunk_of(p, c, true);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t p = 0; p < np; ++p) {
        const int64_t s = p * threads + t;
        for (int64_t c; (c = shares[s].take(false)) >= 0;) chunk_of(s, c, true);
      }
      for (int64_t p = 0; p < np; ++p)
        for (int64_t u = 1; u < threads; ++u) {
          const int64_t s = p * threads + (t + u) % threads;
          for (int64_t c; (c = shares[s].take(true)) >= 0;) chunk_of(s, c, false);
        }
    }
  });
}

}  // namespace
