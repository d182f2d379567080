// LoRA adapters applied to the few rows of a decode step in one call (lora_apply_), each row
// with its own adapter: out[t] += b[s] @ (a[s] @ x[t]) for every row t whose slot
// s = token_slots[t] is not -1; rows of slot -1 are not touched.
//
// Why a kernel: in torch a step of mixed adapters is a gather of each row's A and B, two batched
// matmuls and an add, and at a few rows those ops' dispatch costs more than their arithmetic.
//
// Two passes, each split over the threads only where it has work for more than one:
//   shrink  u[i] = a[s] @ x[t]  (R sums of K products per active row i; pairs of a row and a
//           tile of RT ranks on the threads; an x row is read once per tile),
//   expand  out[t][n] += b[s][n] . u[i]  (N sums of R products per row; blocks of NB columns on
//           the threads, the rows of one adapter next to each other so that the block's B rows,
//           read from memory for the first of them, are in cache for the rest; W columns'
//           accumulators reduced together, since R is a few vectors and a reduction per column
//           would cost as much as its products).
// Sums are float32 (bfloat16 elements widened exactly); a bfloat16 out element becomes
// bf16(float(out) + sum), rounded to nearest even as torch's add_ rounds.  Every u is formed
// before any out is written, so out may be x itself.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

constexpr int RT = 4;  // rows of a (shrink) or of b (the expand's last < W) per pass over x / u
constexpr int64_t NB = 64;  // output columns per block of the expand
constexpr int64_t THREAD_WORK = 1 << 20;  // products worth waking the other threads (~1 MB read)

// W elements at p as floats: float32 as they are, bfloat16 widened exactly (vec.h).
inline vf widen(const float* p) { return loadw(p); }
inline vf widen(const uint16_t* p) { return load_bf16(p); }
inline float widen1(float v) { return v; }
inline float widen1(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The n < W elements at p as floats, the lanes past n zero: the tails of K and R (a masked load
// with AVX-512, never reading past p + n).
template <typename T>
inline vf widen_part(const T* p, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return (vf)_mm512_maskz_loadu_ps(m, p);
  } else {
    return (vf)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
#else
  vf v{};
  for (int64_t i = 0; i < n; ++i) v[i] = widen1(p[i]);
  return v;
#endif
}

// sums[i] = rows[i] . v over L elements for i < NR: one pass over v for NR rows, whose NR
// independent chains of adds keep the vector units busy where L is a few vectors.
template <int NR, typename T, typename V>
inline void dots(const T* const* rows, const V* v, int64_t L, float* sums) {
  vf acc[NR];
  for (int i = 0; i < NR; ++i) acc[i] = vf{};
  int64_t k = 0;
  for (; k + W <= L; k += W) {
    const vf vv = widen(v + k);
    for (int i = 0; i < NR; ++i) acc[i] += widen(rows[i] + k) * vv;
  }
  if (k < L) {
    const vf vv = widen_part(v + k, L - k);
    for (int i = 0; i < NR; ++i) acc[i] += widen_part(rows[i] + k, L - k) * vv;
  }
  for (int i = 0; i < NR; ++i) sums[i] = lane_sum(acc[i]);
}

// sums[j] = m[j] . v for the n rows of m (length L each, contiguous): tiles of RT rows, then
// one row at a time.
template <typename T, typename V>
inline void dot_rows(const T* m, int64_t n, const V* v, int64_t L, float* sums) {
  int64_t j = 0;
  for (; j + RT <= n; j += RT) {
    const T* rows[RT];
    for (int i = 0; i < RT; ++i) rows[i] = m + (j + i) * L;
    dots<RT>(rows, v, L, sums + j);
  }
  for (; j < n; ++j) {
    const T* row = m + j * L;
    dots<1>(&row, v, L, sums + j);
  }
}

// Two vectors of W / G rows' G partial sums each (a row's G lanes next to each other, p's rows
// before q's) as one vector of 2W / G rows' G / 2 partial sums: a level of a reduction tree.
template <int G>
inline vf fold(vf p, vf q) {
  vi lo, hi;
  for (int l = 0; l < W; ++l) {
    const int row = l / (G / 2), part = l % (G / 2);  // row of the result, in [0, 2W / G)
    lo[l] = (row < W / G ? row * G : W + (row - W / G) * G) + part;
    hi[l] = lo[l] + G / 2;
  }
  return __builtin_shuffle(p, q, lo) + __builtin_shuffle(p, q, hi);
}

// The sums of the G vectors v (W / G rows each, as fold takes them): lane i, row i's.
template <int G>
inline vf fold_rows(vf* v) {
  if constexpr (G == 1) {
    return v[0];
  } else {
    for (int j = 0; j < G / 2; ++j) v[j] = fold<G>(v[2 * j], v[2 * j + 1]);
    return fold_rows<G / 2>(v);
  }
}

// The W sums m[j] . v for rows j < W of m (length L each, contiguous) as one vector: the W
// accumulators are reduced together (about two shuffles a row; lane_sum takes log2 W).
template <typename T>
inline vf dot_w_rows(const T* m, const float* v, int64_t L) {
  vf acc[W];
  for (int i = 0; i < W; ++i) acc[i] = vf{};
  int64_t k = 0;
  for (; k + W <= L; k += W) {
    const vf vv = loadw(v + k);
    for (int i = 0; i < W; ++i) acc[i] += widen(m + i * L + k) * vv;
  }
  if (k < L) {
    const vf vv = widen_part(v + k, L - k);
    for (int i = 0; i < W; ++i) acc[i] += widen_part(m + i * L + k, L - k) * vv;
  }
  return fold_rows<W>(acc);
}

// dst[j] += sums[j] for j < n, in dst's type: float32 as summed, bfloat16 rounded once to
// nearest even (vec.h's store_elems and c10's conversion round alike).
template <typename T>
inline void add_sums(T* dst, const float* sums, int64_t n) {
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf v = widen(dst + j) + loadw(sums + j);
    if constexpr (std::is_same_v<T, float>) {
      storew(dst + j, v);
    } else {
      store_elems(reinterpret_cast<c10::BFloat16*>(dst + j), v);
    }
  }
  for (; j < n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      dst[j] += sums[j];
    } else {
      dst[j] = static_cast<c10::BFloat16>(widen1(dst[j]) + sums[j]).x;
    }
  }
}

struct Active {
  int64_t row;   // t: the row of x and out
  int64_t slot;  // s: its adapter
};

// A parallel_for grain: items per thread so that each thread does at least THREAD_WORK products
// (one thread, no fork, for a small call).
inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, THREAD_WORK / std::max<int64_t>(1, work_per_item));
}

// u [nact, R] <- a[s] @ x[t] of each active row.
template <typename T>
void shrink(const T* x, int64_t x_stride, const T* a, const std::vector<Active>& act, int64_t R,
            int64_t K, float* u) {
  const int64_t tiles = (R + RT - 1) / RT, nact = static_cast<int64_t>(act.size());
  at::parallel_for(0, nact * tiles, grain(RT * K), [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t i = item / tiles, r0 = (item % tiles) * RT;
      const T* rows = a + (act[i].slot * R + r0) * K;
      dot_rows(rows, std::min<int64_t>(RT, R - r0), x + act[i].row * x_stride, K, u + i * R + r0);
    }
  });
}

// out[t] += b[s] @ u[i] of each active row, columns [0, N) in blocks of NB.
template <typename T>
void expand(const T* b, const std::vector<Active>& act, const float* u, int64_t N, int64_t R,
            T* out) {
  const int64_t nact = static_cast<int64_t>(act.size());
  at::parallel_for(0, (N + NB - 1) / NB, grain(nact * NB * R), [&](int64_t b0, int64_t b1) {
    float sums[NB];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * NB, nb = std::min(NB, N - n0);
      for (int64_t i = 0; i < nact; ++i) {
        const T* rows = b + (act[i].slot * N + n0) * R;
        int64_t j = 0;
        for (; j + W <= nb; j += W) storew(sums + j, dot_w_rows(rows + j * R, u + i * R, R));
        dot_rows(rows + j * R, nb - j, u + i * R, R, sums + j);
        add_sums(out + act[i].row * N + n0, sums, nb);
      }
    }
  });
}

template <typename T>
void apply(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
           const std::vector<Active>& act) {
  const int64_t N = out.size(1), K = x.size(1), R = a.size(1);
  std::vector<float> u(act.size() * R);
  const auto* xp = static_cast<const T*>(x.data_ptr());
  shrink(xp, x.stride(0), static_cast<const T*>(a.data_ptr()), act, R, K, u.data());
  expand(static_cast<const T*>(b.data_ptr()), act, u.data(), N, R, static_cast<T*>(out.data_ptr()));
}

}  // namespace

// out: [T, N] contiguous; x: [T, K], its last dim contiguous (any row stride); a: [S, R, K] and
// b: [S, N, R] contiguous (A and B of each adapter slot, ranks padded to R with zeros, B scaled);
// all float32 or all bfloat16.  token_slots: [T] int64, each row's slot in [0, S) or -1 (none).
// out[t] += b[s] @ (a[s] @ x[t]) in place, for the rows of a slot.
void lora_apply_(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b,
                 at::Tensor token_slots) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "lora_apply_: out must be contiguous [T, N]");
  const int64_t T = out.size(0), N = out.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == T && (x.size(1) <= 1 || x.stride(1) == 1),
              "lora_apply_: x must be [T, K] with its last dim contiguous, T = ", T);
  const int64_t K = x.size(1);
  TORCH_CHECK(a.dim() == 3 && a.size(2) == K && a.is_contiguous(),
              "lora_apply_: a must be contiguous [S, R, K], K = ", K);
  const int64_t S = a.size(0), R = a.size(1);
  TORCH_CHECK(b.dim() == 3 && b.size(0) == S && b.size(1) == N && b.size(2) == R &&
                  b.is_contiguous(),
              "lora_apply_: b must be contiguous [S, N, R] = [", S, ", ", N, ", ", R, "]");
  const auto dtype = out.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_apply_: out, x, a and b must be all float32 or all bfloat16");
  TORCH_CHECK(out.is_cpu() && x.is_cpu() && a.is_cpu() && b.is_cpu() && token_slots.is_cpu(),
              "lora_apply_: CPU tensors only");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == T &&
                  token_slots.scalar_type() == at::kLong,
              "lora_apply_: token_slots must be [T] int64, T = ", T);
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t slot_stride = token_slots.stride(0);
  std::vector<Active> act;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t * slot_stride];
    TORCH_CHECK(s >= -1 && s < S, "lora_apply_: row ", t, " has slot ", s,
                ", outside -1 (none) and [0, ", S, ")");
    if (s >= 0) act.push_back({t, s});
  }
  if (act.empty() || R == 0) return;
  // The rows of one adapter together: the expand reads a block of its B once for all of them.
  std::stable_sort(act.begin(), act.end(),
                   [](const Active& l, const Active& r) { return l.slot < r.slot; });
  if (dtype == at::kFloat) {
    apply<float>(out, x, a, b, act);
  } else {
    apply<uint16_t>(out, x, a, b, act);
  }
}
