// Seeded draws of the sampled rows of a batch on a CPU (sampling/sampler.py), one row per task.
//
// The torch path of sampler.py takes each filtered row's 256 most likely tokens by topk, runs
// ~30 small ops over them and reruns the whole batch with 4096 candidates where 256 fall short,
// a noticeable share of a one-row decode step.  Here a row is one pass that scales its logits and
// finds their maximum, one that takes e_i = exp(s_i - max) and their sum, and passes that count the
// tokens with e_i >= t (and their mass) for t = 1/2, 1/4, ... until those tokens must hold the kept
// prefix; only they are sorted.
//
// The filters are sampler.py's, in e-space (e_i / sum is the probability): top-k keeps the k
// largest; top-p the smallest prefix (in descending order) whose mass reaches top_p of what
// top-k kept (of the whole row without top-k); min-p the tokens with p >= min_p * p_max, that is
// e_i >= min_p.  Each keeps a prefix, so the kept set lies inside {e >= t} once the last token
// of that set is filtered out (or the set has top_k tokens, or t is below min_p, or t is 0).
// The draw is the inverse CDF of the kept weights in descending order (token ids ascending
// among equal weights) with the uniform of sampler.counter_uniform (splitmix64 of the seed and
// step, the same bits); a row without filters draws over the whole vocabulary in id order.  A
// row's arithmetic depends only on its own logits and knobs, never on the rows beside it.
// Where no two candidates tie, it picks the token the torch path picks for the same seed; torch's
// topk leaves the order of ties open, and bfloat16 logits tie often, so there the two paths
// draw from the same distribution but may pick different tokens for one uniform.
// A row runs on one thread, in a few passes over its logits, never topk or a rerun.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr int kUniformBits = 23;
constexpr int64_t kBlock = 256;  // the plain draw's running sum goes block by block

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// sampler.counter_uniform(seeds, steps, 1): the first uniform of (seed, step), same bits.
float counter_uniform(int64_t seed, int64_t step) {
  uint64_t key = mix64(static_cast<uint64_t>(seed) + kGamma);
  key = mix64(key + (static_cast<uint64_t>(step) + 1) * kGamma);
  const uint64_t bits = mix64(key + kGamma) >> (64 - kUniformBits);
  return (static_cast<float>(bits) + 0.5f) * (1.0f / (1 << kUniformBits));
}

struct RowWeights {
  float total;       // the sum of e
  int64_t weighted;  // how many e are not 0
};

// e[i] = exp(x[i] / temperature - max) over the row, with their sum (by W lanes) and how many
// are not 0 (vexp gives 0 or at least e^-87, a normal float: counted against FLT_MIN, which
// still reads as nonzero where denormals are flushed).
RowWeights exp_row(const float* x, int64_t n, float temperature, float* e) {
  const vf tv = splat_as<vf>(temperature);
  vf top = splat_as<vf>(-INFINITY);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf s = loadw(x + i) / tv;
    storew(e + i, s);
    top = s > top ? s : top;
  }
  float m = -INFINITY;
  for (int j = 0; j < W; ++j) m = std::max(m, top[j]);
  for (; i < n; ++i) {
    e[i] = x[i] / temperature;
    m = std::max(m, e[i]);
  }
  if (!(m > -INFINITY)) m = 0.f;  // every logit -inf: every e is 0, and the draw takes token 0
  const vf mv = splat_as<vf>(m), tiny = splat_as<vf>(FLT_MIN);
  vf acc = {};
  vi cnt = {};
  for (i = 0; i + W <= n; i += W) {
    const vf v = vexp(loadw(e + i) - mv);
    storew(e + i, v);
    acc += v;
    cnt -= v >= tiny;
  }
  RowWeights row{lane_sum(acc), 0};
  for (int j = 0; j < W; ++j) row.weighted += cnt[j];
  for (; i < n; ++i) {
    const vf v = vexp(splat_as<vf>(e[i] - m));
    e[i] = v[0];
    row.total += e[i];
    row.weighted += e[i] >= FLT_MIN;
  }
  return row;
}

// How many e[i] >= t, and their sum.
std::pair<int64_t, float> count_above(const float* e, int64_t n, float t) {
  const vf tv = splat_as<vf>(t);
  vf acc = {};
  vi cnt = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = loadw(e + i);
    const vi keep = v >= tv;
    acc += keep ? v : vf{};
    cnt -= keep;
  }
  int64_t count = 0;
  for (int j = 0; j < W; ++j) count += cnt[j];
  float mass = lane_sum(acc);
  for (; i < n; ++i) {
    if (e[i] >= t) {
      ++count;
      mass += e[i];
    }
  }
  return {count, mass};
}

// A row without filters: the first token whose running sum of e exceeds u times the total.  The
// running sum goes block by block (each block's sum by W lanes), then token by token inside the
// block that crosses; where rounding leaves the target unreached, the last token with a weight.
int64_t draw_plain(const float* e, int64_t n, float u, std::vector<float>& blocks) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  blocks.assign(num_blocks, 0.f);
  float total = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kBlock);
    vf acc = {};
    int64_t i = b * kBlock;
    for (; i + W <= end; i += W) acc += loadw(e + i);
    blocks[b] = lane_sum(acc);
    for (; i < end; ++i) blocks[b] += e[i];
    total += blocks[b];
  }
  const float target = u * total;
  float run = 0.f;
  int64_t b = 0;
  while (b + 1 < num_blocks && (blocks[b] == 0.f || run + blocks[b] <= target)) run += blocks[b++];
  int64_t last = -1;
  for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
    if (e[i] == 0.f) continue;
    run += e[i];
    last = i;
    if (run > target) return i;
  }
  for (int64_t i = n - 1; last < 0 && i >= 0; --i)
    if (e[i] > 0.f) last = i;
  return std::max<int64_t>(last, 0);
}

struct Knobs {
  int64_t top_k;  // n: off
  float top_p, min_p, total;  // total: the sum of e over the row
};

// The kept prefix of the candidates (sorted, descending), its weights' running sums in `run`;
// returns its length, or -1 where the prefix may go on past the candidates.
int64_t kept_prefix(const std::vector<std::pair<float, int32_t>>& cand, int64_t n_above_zero,
                    const Knobs& k, bool top_k_on, float t, std::vector<float>& run) {
  const int64_t size = static_cast<int64_t>(cand.size());
  const int64_t by_k = top_k_on ? std::min<int64_t>(k.top_k, size) : size;
  float total = k.total;
  if (top_k_on) {
    total = 0.f;
    for (int64_t j = 0; j < by_k; ++j) total += cand[j].first;
  }
  run.assign(size, 0.f);
  float sum = 0.f;
  int64_t kept = 0;
  for (int64_t j = 0; j < by_k; ++j) {
    const float w = cand[j].first;
    if (k.top_p < 1.f && sum > k.top_p * total) break;  // the mass before it reached top_p
    if (w < k.min_p) break;
    sum += w;
    run[j] = sum;
    kept = j + 1;
  }
  // Every token past the candidates has e < t: min-p drops it where t <= min_p, and top-p where
  // the candidates' mass already passed top_p of the total (its own weight is not read).  So a
  // confident row (one token over top_p) stops at its first threshold.
  const bool next_cut = kept == size && ((k.min_p > 0.f && t <= k.min_p) ||
                                         (k.top_p < 1.f && !top_k_on && sum > k.top_p * total));
  const bool complete =
      kept < size || next_cut || size >= n_above_zero || (top_k_on && size >= k.top_k);
  return complete ? std::max<int64_t>(kept, 1) : -1;
}

int64_t draw_filtered(const float* e, int64_t n, int64_t n_above_zero, const Knobs& k, float u,
                      std::vector<std::pair<float, int32_t>>& cand, std::vector<float>& run) {
  const bool top_k_on = k.top_k < n, top_p_on = k.top_p < 1.f, min_p_on = k.min_p > 0.f;
  // Halving t at first; past 2^-16 by 16 at a time (a tiny min-p alone would take a pass per bit).
  const auto lower = [](float t) { return t < 1e-37f ? 0.f : t * (t > 1.5e-5f ? 0.5f : 0.0625f); };
  float t = 0.5f;
  for (;;) {
    auto [count, mass] = count_above(e, n, t);
    const bool enough = t == 0.f || count >= n_above_zero || (top_k_on && count >= k.top_k) ||
                        (top_p_on && !top_k_on && mass > k.top_p * k.total) ||
                        (min_p_on && t <= k.min_p && !(top_p_on && top_k_on && count < k.top_k));
    if (!enough) {
      t = lower(t);
      continue;
    }
    cand.clear();
    for (int64_t i = 0; i < n; ++i)
      if (e[i] >= t && e[i] > 0.f) cand.emplace_back(e[i], static_cast<int32_t>(i));
    const auto first = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    if (top_k_on && static_cast<int64_t>(cand.size()) > k.top_k) {
      std::partial_sort(cand.begin(), cand.begin() + k.top_k, cand.end(), first);
      cand.resize(k.top_k);
    } else {
      std::sort(cand.begin(), cand.end(), first);
    }
    int64_t kept = cand.empty() ? 0 : kept_prefix(cand, n_above_zero, k, top_k_on, t, run);
    if (kept < 0 && t > 0.f) {  // rounding left the prefix open at this threshold: take more tokens
      t = lower(t);
      continue;
    }
    // every token a candidate: all there is
    if (kept < 0) kept = static_cast<int64_t>(cand.size());
    if (kept == 0) return 0;
    const float target = u * run[kept - 1];
    const auto at = std::upper_bound(run.begin(), run.begin() + kept, target) - run.begin();
    return cand[std::min<int64_t>(at, kept - 1)].second;
  }
}

// The index of the first largest value of x[0, n), as torch.argmax gives it (a NaN counts as the
// largest: the first NaN's index).  One pass keeps each lane's largest value and the index where
// it first appeared (a later equal value does not replace it); the first index among the lanes
// holding the maximum is the row's.  A row with a NaN is searched again for its first NaN.
int64_t argmax_row(const float* x, int64_t n) {
  vf top = splat_as<vf>(-INFINITY);
  vi at = {}, nan = {};
  vi index;
  for (int j = 0; j < W; ++j) index[j] = j;
  int64_t i = 0;
  for (; i + W <= n; i += W, index += W) {
    const vf v = loadw(x + i);
    const vi higher = v > top;
    top = higher ? v : top;
    at = higher ? index : at;
    nan |= v != v;
  }
  float m = -INFINITY;
  int64_t best = 0;
  bool any_nan = false;
  for (int j = 0; j < W; ++j) any_nan |= nan[j] != 0;
  for (int j = 0; j < W; ++j) {
    if (top[j] > m) {
      m = top[j];
      best = at[j];
    } else if (top[j] == m && at[j] < best) {
      best = at[j];
    }
  }
  for (; i < n; ++i) {
    any_nan |= x[i] != x[i];
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
  }
  if (any_nan) {
    for (int64_t k = 0; k < n; ++k)
      if (x[k] != x[k]) return k;
  }
  if (m == -INFINITY) return 0;  // every value -inf (or n == 0)
  return best;
}

}  // namespace

at::Tensor sample_rows(at::Tensor logits, at::Tensor rows, at::Tensor temperatures,
                       at::Tensor top_ks, at::Tensor top_ps, at::Tensor min_ps, at::Tensor seeds,
                       at::Tensor steps) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be a contiguous float32 [B, V] tensor");
  const int64_t batch = logits.size(0), n = logits.size(1);
  for (const at::Tensor* t : {&temperatures, &top_ps, &min_ps})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == batch && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "per-row float32 knobs must be [B]");
  for (const at::Tensor* t : {&top_ks, &seeds, &steps})
    TORCH_CHECK(
        t->dim() == 1 && t->size(0) == batch && t->scalar_type() == at::kLong && t->is_contiguous(),
        "per-row int64 knobs must be [B]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be int64 [S]");
  const bool all = rows.numel() == 0;
  const int64_t count = all ? batch : rows.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < (all ? 0 : count); ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < batch, "row index out of range");
  at::Tensor out = at::empty({count}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float *temp = temperatures.data_ptr<float>(), *tp = top_ps.data_ptr<float>(),
              *mp = min_ps.data_ptr<float>();
  const int64_t *tk = top_ks.data_ptr<int64_t>(), *seed = seeds.data_ptr<int64_t>(),
                *step = steps.data_ptr<int64_t>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> e, run;
    thread_local std::vector<std::pair<float, int32_t>> cand;
    e.resize(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = all ? r : row_ids[r];
      const RowWeights weights = exp_row(x + b * n, n, temp[b], e.data());
      const float u = counter_uniform(seed[b], step[b]);
      const Knobs knobs{std::clamp<int64_t>(tk[b], 1, n), tp[b], mp[b], weights.total};
      const bool filtered = knobs.top_k < n || knobs.top_p < 1.f || knobs.min_p > 0.f;
      ids[r] = filtered ? draw_filtered(e.data(), n, weights.weighted, knobs, u, cand, run)
                        : draw_plain(e.data(), n, u, run);
    }
  });
  return out;
}

// argmax_row of every row of logits [B, V] float32: torch.argmax(dim=-1) without its scalar loop
// (torch's CPU argmax is a scalar loop, and a greedy row's sampling step is that argmax alone).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0,
              "logits must be a contiguous float32 [B, V] tensor, V > 0");
  const int64_t batch = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({batch}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, batch, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * n, n);
  });
  return out;
}
