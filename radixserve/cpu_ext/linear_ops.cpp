// Matmuls of the few rows of a decode step, where a step reads every weight once and memory
// bandwidth is the limit: float32 or bfloat16 weights (float_linear) and weight-only int8
// (int8_linear).  Where each is used instead of torch's matmul: radixserve/quantization.py,
// _kernel_rows, with the measurements.
//
// Float32: torch's matmul read the default model's weights at 11.8 GB/s for one row and took
// twice that time for 2-8 rows (45.6 ms and 85-90 ms for one decode step's matmuls, 538 MB,
// on the 2-core AVX2 CPU); this loop streams them at 18.7 GB/s (28.7 ms for 1-4 rows, 50.7 ms
// for 8).  Bfloat16 (2-core AVX-512 BF16 CPU): torch 13 GB/s at one row, this loop 22 GB/s.
//
// Int8: y[m][n] = sum_k x[m][k] * w[n][k] *
// scale[n][k / GROUP], with w int8 (a scale per GROUP weights of a row) converted to float in
// registers, so a step reads about a quarter of a float32 weight's bytes.  Rows of x are taken MT at a time and output
// rows NB at a time, so each weight vector loaded feeds MT products and each x vector NB.
// Many rows (a prefill) go another way (radixserve/model/quant.py): the weight is dequantized
// once per call and multiplied by torch's own float matmul, which this loop cannot beat there.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>

#include "vec.h"

namespace {

typedef int8_t vb __attribute__((vector_size(W)));

constexpr int NB = 4;  // output rows per pass
constexpr int MT = 2;  // input rows per pass
constexpr int GROUP = 64;  // weights per scale along K (radixserve/quantization.py: GROUP)

// W int8 -> W floats: sign extension and conversion (a direct vector conversion of int8 lanes is
// lowered to byte-wise scalar moves by GCC).
inline vf load_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

inline float lane_sum(vf a) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += a[l];
  return s;
}

// Input rows [m, m + MT) times output rows [n, n + nb) (nb <= NB; the rows past nb repeat the
// last one and are not written); x is float [M][K]; each row of w has K / GROUP scales.
template <int MT>
inline void int8_tile(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N,
                      int64_t m, int64_t n, int nb) {
  const int64_t groups = K / GROUP;
  const int8_t* wr[NB];
  const float* sr[NB];
  for (int i = 0; i < NB; ++i) {
    wr[i] = w + (n + std::min(i, nb - 1)) * K;
    sr[i] = scale + (n + std::min(i, nb - 1)) * groups;
  }
  vf acc[MT][NB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vf part[MT][NB] = {};
    for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += W) {
      vf wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = load_int8(wr[i] + k);
      for (int j = 0; j < MT; ++j) {
        const vf xv = loadw(x + (m + j) * K + k);
        for (int i = 0; i < NB; ++i) part[j][i] += xv * wv[i];
      }
    }
    for (int i = 0; i < NB; ++i) {
      const float sc = sr[i][g];
      for (int j = 0; j < MT; ++j) acc[j][i] += part[j][i] * sc;
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < nb; ++i) y[(m + j) * N + n + i] = lane_sum(acc[j][i]);
}

// Output rows [n0, n1) of every input row.
void int8_rows(const float* x, const int8_t* w, const float* scale, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    int64_t m = 0;
    for (; m + MT <= M; m += MT) int8_tile<MT>(x, w, scale, y, K, N, m, n, nb);
    for (; m < M; ++m) int8_tile<1>(x, w, scale, y, K, N, m, n, nb);
  }
}

// Dot products of a row of x with a row of w, K elements at a time by STEP: float32, or
// bfloat16 with float sums.  With AVX-512 BF16 one instruction multiplies 32 bf16 pairs into
// 16 float sums; elsewhere each 16-bit value is widened to the float with the same top bits (a
// bfloat16 is a float's upper half).
// W lanes at a time, elements widened to float by Load.
template <typename Elem, vf (*Load)(const Elem*)>
struct VecDot {
  using T = Elem;
  using Acc = vf;
  static constexpr int STEP = W;
  static Acc zero() { return vf{}; }
  static Acc step(Acc acc, const T* x, const T* w) { return acc + Load(x) * Load(w); }
  static float sum(Acc acc) { return lane_sum(acc); }
};
using FloatDot = VecDot<float, loadw>;

#if defined(__AVX512BF16__)
struct Bf16Dot {
  using T = uint16_t;
  using Acc = __m512;
  static constexpr int STEP = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc step(Acc acc, const T* x, const T* w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
  }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#else
inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  vf out;
  for (int l = 0; l < W; ++l) {
    const uint32_t bits = static_cast<uint32_t>(p[l]) << 16;
    std::memcpy(&out[l], &bits, 4);
  }
  return out;
#endif
}

using Bf16Dot = VecDot<uint16_t, load_bf16>;
#endif

// Output rows [n0, n1) of every input row, NB weight rows at a time (they stay in L1 while
// each input row passes over them).
template <typename D>
void dot_rows(const typename D::T* x, const typename D::T* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, n1 - n));
    const typename D::T* wr[NB];
    for (int i = 0; i < NB; ++i) wr[i] = w + (n + std::min(i, nb - 1)) * K;
    for (int64_t m = 0; m < M; ++m) {
      const typename D::T* xr = x + m * K;
      typename D::Acc acc[NB];
      for (int i = 0; i < NB; ++i) acc[i] = D::zero();
      for (int64_t k = 0; k < K; k += D::STEP)
        for (int i = 0; i < NB; ++i) acc[i] = D::step(acc[i], xr + k, wr[i] + k);
      for (int i = 0; i < nb; ++i) y[m * N + n + i] = D::sum(acc[i]);
    }
  }
}

template <typename D>
void dot_linear(const typename D::T* x, const typename D::T* w, float* y, int64_t M, int64_t K, int64_t N) {
  TORCH_CHECK(K % D::STEP == 0, "float_linear: K must be a multiple of ", D::STEP);
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t b0, int64_t b1) {
    dot_rows<D>(x, w, y, M, K, N, b0 * NB, std::min(N, b1 * NB));
  });
}

}  // namespace

// x: [M, K], w: [N, K], both float32 or both bfloat16, contiguous, K a multiple of W (of 32 for
// bfloat16 with AVX-512 BF16).  Returns [M, N] in their dtype (bfloat16 sums are taken in
// float32 and rounded once, as torch does).
at::Tensor float_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "float_linear: x [M, K], w [N, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && w.scalar_type() == x.scalar_type() &&
                  x.is_contiguous() && w.is_contiguous(),
              "float_linear: contiguous x and w, both float32 or both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (!bf16) {
    dot_linear<FloatDot>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
    return y;
  }
  dot_linear<Bf16Dot>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y.data_ptr<float>(), M, K, N);
  return y.to(at::kBFloat16);
}

// The float lanes of the vectors the kernels were built with (8: AVX2, 16: AVX-512).
int64_t vector_width() { return W; }

// x: [M, K] float32 / bfloat16 / float16; w: [N, K] int8; scale: [N, K / GROUP] float32.  Returns [M, N]
// float32 (the caller casts to its dtype).
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_linear: w must be contiguous int8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % GROUP == 0, "int8_linear: K must be a multiple of ", GROUP);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * (K / GROUP),
              "int8_linear: scale must be [N, K / ", GROUP, "] float32");
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Chunks of output rows per task: a multiple of NB, enough of them to share the threads.
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t b0, int64_t b1) {
    int8_rows(xp, wp, sp, yp, M, K, N, b0 * NB, std::min(N, b1 * NB));
  });
  return y;
}

// out[n][k] = scale[n][k / GROUP] * w[n][k] in out's dtype (float32 / bfloat16 / float16): the weight of a
// many-row matmul, written into a scratch buffer the caller keeps.
void int8_dequant_(at::Tensor w, at::Tensor scale, at::Tensor out) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && out.is_contiguous() &&
                  out.sizes() == w.sizes() && scale.scalar_type() == at::kFloat &&
                  w.size(1) % GROUP == 0 && scale.numel() == w.size(0) * (w.size(1) / GROUP),
              "int8_dequant_: w [N, K] int8, scale [N, K / GROUP] float32, out [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "int8_dequant_", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* src = wp + n * K;
        const float* sc = sp + n * (K / GROUP);
        scalar_t* dst = op + n * K;
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (int64_t k = 0; k < K; k += W)
            storew(reinterpret_cast<float*>(dst) + k, load_int8(src + k) * sc[k / GROUP]);
        } else {
          for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<scalar_t>(static_cast<float>(src[k]) * sc[k / GROUP]);
        }
      }
    });
  });
}
