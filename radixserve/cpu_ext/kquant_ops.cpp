// A GGUF's K-quant weights (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights, kquant.h) multiplied
// as stored: the few rows of a decode step (kq_linear) and the
// weight dequantized for a many-row matmul (kq_dequant_).  radixserve/quantization/kquant.py
// says where each runs.
//
// The matmul streams each weight byte once for all the rows of x: output rows NB at a time (a
// tile), each super-block's weights formed in registers once per output row and pass, and
// multiplied with every row of the pass (AVX-512: up to 8 rows of x, over pairs of output rows
// past 2; 8-float vectors: up to 4, over one output row at a time past 2).  The sums are float32,
// each output's in the same order whatever the number of rows of x and the tile: a row's result
// does not depend on the rows beside it.  A tensor's blocks are contiguous, a thread's rows one
// stream; the next tile's rows are asked for while a tile runs, which a one-row step needs to
// read at the memory's rate.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kquant.h"
#include "kquant_wide.h"
#include "row_shares.h"

namespace {

constexpr int NB = 4;  // output rows per tile

#if defined(__AVX512F__)
constexpr int ACC = 1;
#else
// Accumulators per output: 16 registers hold one row's weights at a time, so each output's sum
// alternates between two (weights of even and odd offset / 32) to keep the chain of dependent
// adds short.
constexpr int ACC = 2;
#endif

// Rows [m, m + MT) of x (float32 [M][K]) times output rows [n, n + nb) (nb <= R; the rows past
// nb repeat the last one and are not written) of the weight w ([N][K / 256] blocks of Q).
template <typename Q, int MT, int R>
inline void kq_tile(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t m,
                    int64_t n, int nb, int64_t ahead) {
  const int64_t blocks = K / QK_K, row_bytes = blocks * Q::BYTES;
  const uint8_t* wr[R];
  for (int i = 0; i < R; ++i) wr[i] = w + (n + std::min(i, nb - 1)) * row_bytes;
  vf acc[MT][R][ACC] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    typename Q::Scales s[R];
    for (int i = 0; i < R; ++i) Q::scales(wr[i] + b * Q::BYTES, s[i]);
    if (ahead)  // the next tile's rows, asked for as this tile streams its own
      for (int i = 0; i < R; ++i)
        for (int off = 0; off < Q::BYTES; off += 64)
          prefetch_line(reinterpret_cast<const char*>(wr[i] + b * Q::BYTES + ahead + off));
    const float* xb = x + m * K + b * QK_K;
    each_unit<Q::UNITS>([&](auto u) {
#if defined(__AVX512F__)
      // the R rows' weights of the unit first, then each vector of x loaded once for all of them
      constexpr int V = QK_K / Q::UNITS / W;
      vf wv[R][V];
      int off[V];
      for (int i = 0; i < R; ++i) {
        int v = 0;
        Q::template unit<u>(wr[i] + b * Q::BYTES, s[i], [&](int o, vf w) {
          wv[i][v] = w;
          off[v++] = o;
        });
      }
      for (int v = 0; v < V; ++v)
        for (int j = 0; j < MT; ++j) {
          const vf xv = loadw(xb + j * K + off[v]);
          for (int i = 0; i < R; ++i) acc[j][i][0] = fmadd(xv, wv[i][v], acc[j][i][0]);
        }
#else
      for (int i = 0; i < R; ++i)
        Q::template unit<u>(wr[i] + b * Q::BYTES, s[i], [&](int off, vf wv) {
          for (int j = 0; j < MT; ++j) {
            vf& a = acc[j][i][(off / 32) % ACC];
            a = fmadd(loadw(xb + j * K + off), wv, a);
          }
        });
#endif
    });
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < nb; ++i) {
      vf sum = acc[j][i][0];
      for (int a = 1; a < ACC; ++a) sum += acc[j][i][a];
      y[(m + j) * N + n + i] = lane_sum(sum);
    }
}

// Rows [m, m + MT) of x times output rows [n, n + nb) as tiles of 2 output rows: where MT rows
// are too many for NB accumulators of each in registers.
template <typename Q, int MT>
inline void kq_pairs(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t m,
                     int64_t n, int nb, int64_t ahead) {
  for (int i = 0; i < nb; i += 2)
    kq_tile<Q, MT, 2>(x, w, y, K, N, m, n + i, std::min(2, nb - i), ahead);
}

// Every row of x times output rows [n0, n1); rows [n1, reach) come next on this thread.
template <typename Q>
void kq_rows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1, int64_t reach) {
  const int64_t row_bytes = K / QK_K * Q::BYTES;
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    const int64_t ahead = n + nb < reach ? NB * row_bytes : 0;
#if defined(__AVX512F__)
    // 32 vector registers: up to 8 rows of x a pass, so a verify step's rows form each weight once
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) kq_pairs<Q, 8>(x, w, y, K, N, m, n, nb, ahead);
    switch (M - m) {
      case 7: kq_pairs<Q, 7>(x, w, y, K, N, m, n, nb, ahead); break;
      case 6: kq_pairs<Q, 6>(x, w, y, K, N, m, n, nb, ahead); break;
      case 5: kq_pairs<Q, 5>(x, w, y, K, N, m, n, nb, ahead); break;
      case 4: kq_pairs<Q, 4>(x, w, y, K, N, m, n, nb, ahead); break;
      case 3: kq_pairs<Q, 3>(x, w, y, K, N, m, n, nb, ahead); break;
      case 2: kq_tile<Q, 2, NB>(x, w, y, K, N, m, n, nb, ahead); break;
      case 1: kq_tile<Q, 1, NB>(x, w, y, K, N, m, n, nb, ahead); break;
      default: break;
    }
#else
    // 16 vector registers: up to 4 rows of x a pass (over one output row at a time past 2)
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int i = 0; i < nb; ++i) kq_tile<Q, 4, 1>(x, w, y, K, N, m, n + i, 1, ahead);
    switch (M - m) {
      case 3:
        for (int i = 0; i < nb; ++i) kq_tile<Q, 3, 1>(x, w, y, K, N, m, n + i, 1, ahead);
        break;
      case 2: kq_pairs<Q, 2>(x, w, y, K, N, m, n, nb, ahead); break;
      case 1: kq_tile<Q, 1, NB>(x, w, y, K, N, m, n, nb, ahead); break;
      default: break;
    }
#endif
  }
}

// x's rows as float32 (x itself when it is float32 and contiguous).
const float* rows_as_float(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buf.resize(xc.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "kq_x", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(src[i]);
  });
  return buf.data();
}

using RowsFn = void (*)(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t);

// The row loop of a part's type, told apart by its bytes per super-block (144, 176, 210).
RowsFn rows_of(const at::Tensor& part, int64_t K) {
  TORCH_CHECK_VALUE(part.dim() == 3 && part.scalar_type() == at::kByte && part.is_contiguous() &&
                        part.size(1) * QK_K == K,
                    "kq_linear: each part must be contiguous uint8 [N, ", K / QK_K, ", bytes]");
  switch (part.size(2)) {
    case Q4K::BYTES: return kq_rows<Q4K>;
    case Q5K::BYTES: return kq_rows<Q5K>;
    case Q6K::BYTES: return kq_rows<Q6K>;
    default:
      TORCH_CHECK_VALUE(false, "kq_linear: ", part.size(2), " bytes a super-block is not Q4_K ",
                        "(", Q4K::BYTES, "), Q5_K (", Q5K::BYTES, ") or Q6_K (", Q6K::BYTES, ")");
  }
}

constexpr int64_t CHUNK = 4 * NB;  // output rows a thread takes at a time (row_shares.h)

// kq_linear, and with `wide` kq_linear_q16.
at::Tensor kq_matmul(const at::Tensor& x, const at::Tensor& b0, const at::Tensor& b1,
                     const at::Tensor& b2, bool wide) {
  TORCH_CHECK_VALUE(b0.dim() == 3, "kq_linear: the first part must be uint8 [N, K / 256, bytes]");
  const int64_t K = b0.size(1) * QK_K;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K, "kq_linear: x must be [M, ", K, "]");
  TORCH_CHECK_VALUE(at::isFloatingType(x.scalar_type()), "kq_linear: x must be floating point");
  std::vector<std::pair<RowsFn, const at::Tensor*>> parts;
  int64_t N = 0;
  for (const at::Tensor* part : {&b0, &b1, &b2})
    if (part->numel()) {
      parts.emplace_back(rows_of(*part, K), part);
      N += part->size(0);
    }
  const int64_t M = x.size(0);
  std::vector<float> xbuf;
  const float* xp = rows_as_float(x, xbuf);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  TORCH_CHECK(!wide || kq_wide_supported(), "kq_linear_q16: this build has no AVX-512 VNNI");
  // x's rows laid out for the Q4_K / Q5_K parts and for the Q6_K parts (kquant_wide.h)
  std::vector<KqWideRow> xw[2];
  for (const auto& [rows, part] : parts) {
    const bool q6k = part->size(2) == Q6K::BYTES;
    if (wide && xw[q6k].empty()) {
      xw[q6k].resize(M);
      for (int64_t m = 0; m < M; ++m) kq_wide_row(xp + m * K, K, q6k, xw[q6k][m]);
    }
  }
  const bool direct = x.scalar_type() == at::kFloat;
  std::unique_ptr<float[]> buf(direct ? nullptr : new float[M * N]);  // all written below
  float* sums = direct ? y.data_ptr<float>() : buf.get();
  // The parts' rows over the threads (row_shares.h); part p's columns of y start at col[p].
  std::vector<int64_t> rows_of_part, col;
  for (const auto& [rows, part] : parts) {
    col.push_back(rows_of_part.empty() ? 0 : col.back() + rows_of_part.back());
    rows_of_part.push_back(part->size(0));
  }
  const auto run = [&](int64_t p, int64_t n0, int64_t n1, int64_t reach) {
    const auto& [rows, part] = parts[p];
    const uint8_t* wp = part->data_ptr<uint8_t>();
    const int bytes = static_cast<int>(part->size(2));
    if (wide)
      kq_wide_rows(xw[bytes == Q6K::BYTES].data(), wp, bytes, sums + col[p], M, K, N, n0, n1,
                   reach);
    else
      rows(xp, wp, sums + col[p], M, K, N, n0, n1, reach);
  };
  run_row_shares(rows_of_part.data(), static_cast<int64_t>(parts.size()), NB, CHUNK, run);
  if (!direct)
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "kq_linear", [&] {
      scalar_t* dst = y.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M * N; ++i) dst[i] = static_cast<scalar_t>(sums[i]);
    });
  return y;
}

}  // namespace

// x [M, K] (float32 / bfloat16 / float16) times a weight whose rows are the parts' rows one
// after the other (a merged q/k/v layer's parts may be of different types: a Q4_K_M file's v in
// Q6_K); each part uint8 [N_i, K / 256, bytes per super-block], an empty tensor for none.
// Returns [M, sum N_i] in x's dtype: float32 sums, other dtypes rounded once (c10's
// round-to-nearest-even).  Output rows in chunks of whole tiles on the threads (kq_matmul).
at::Tensor kq_linear(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2) {
  return kq_matmul(x, b0, b1, b2, false);
}

// kq_linear with the products taken with x in 16-bit integers per block of 32 (kquant_wide.cpp:
// VNNI integer dot products, an error of at most dx / 2 an element of x, as int4_linear_q16's).
// Where the CPU has AVX-512 VNNI (q8_supported), an error elsewhere.  Where it runs:
// radixserve/quantization/.
at::Tensor kq_linear_q16(at::Tensor x, at::Tensor b0, at::Tensor b1, at::Tensor b2) {
  return kq_matmul(x, b0, b1, b2, true);
}

namespace {

// out [N, K] <- the weight of `blocks`, in out's dtype, rows in parallel.
template <typename Q, typename T>
void kq_dequant_rows(const uint8_t* w, T* out, int64_t N, int64_t K) {
  const int64_t blocks = K / QK_K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = w + (n * blocks + b) * Q::BYTES;
        T* dst = out + n * K + b * QK_K;
        typename Q::Scales s;
        Q::scales(blk, s);
        each_unit<Q::UNITS>([&](auto u) {
          Q::template unit<u>(blk, s, [&](int off, vf wv) { store_elems(dst + off, wv); });
        });
      }
  });
}

template <typename Q>
void kq_dequant(const at::Tensor& blocks, const at::Tensor& out) {
  TORCH_CHECK_VALUE(blocks.dim() == 3 && blocks.scalar_type() == at::kByte &&
                        blocks.is_contiguous() && blocks.size(2) == Q::BYTES,
                    "kq_dequant_: blocks must be contiguous uint8 [N, K / ", QK_K, ", ", Q::BYTES,
                    "]");
  const int64_t N = blocks.size(0), K = blocks.size(1) * QK_K;
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
                    "kq_dequant_: out must be contiguous [", N, ", ", K, "]");
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  switch (out.scalar_type()) {
    case at::kFloat: return kq_dequant_rows<Q>(wp, out.data_ptr<float>(), N, K);
    case at::kBFloat16: return kq_dequant_rows<Q>(wp, out.data_ptr<at::BFloat16>(), N, K);
    case at::kHalf: return kq_dequant_rows<Q>(wp, out.data_ptr<at::Half>(), N, K);
    default: TORCH_CHECK_VALUE(false, "kq_dequant_: out must be float32, bfloat16 or float16");
  }
}

}  // namespace

// out [N, K] (float32 / bfloat16 / float16) <- the weight of a K-quant tensor's blocks; `kind`
// is its GGUF type name ("Q4_K", "Q5_K" or "Q6_K").
void kq_dequant_(at::Tensor blocks, const std::string& kind, at::Tensor out) {
  if (kind == "Q4_K") return kq_dequant<Q4K>(blocks, out);
  if (kind == "Q5_K") return kq_dequant<Q5K>(blocks, out);
  if (kind == "Q6_K") return kq_dequant<Q6K>(blocks, out);
  TORCH_CHECK_VALUE(false, "kq_dequant_: kind must be Q4_K, Q5_K or Q6_K, got ", kind);
}
