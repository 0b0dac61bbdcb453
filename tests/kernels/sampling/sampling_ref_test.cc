// The reference sampler: greedy ties; the counter-based uniforms; the kept set of the top-k /
// top-p / min-p filters against an independent long-double oracle; the exponential race's
// distribution (chi-square against softmax(logits / T) over the kept set); and its stability under
// last-bit logit noise, measured against the inverse-CDF draw it replaced.
#include "kernels/sampling/sampling_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/sampling/sampling_race.h"
#include "worker/model/sampler.h"

namespace mlaserve {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The chi-square critical value at upper-tail probability 1e-4 for `df` degrees of freedom, by
// Wilson-Hilferty: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3 with z = 3.719, the normal's 1 - 1e-4
// quantile. Its exact tail probability is 0.6e-4 (df 1) to 0.96e-4 (df 63): a little stricter.
double ChiSquareCritical(int df) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + 3.719 * std::sqrt(a), 3.0);
}

// Independent oracle of the kept set and its probabilities: a stable sort by logit, then the
// filters in long double, then softmax(logits / T) renormalised over the kept ids.
std::map<int32_t, double> OracleKept(const std::vector<float>& logits, const SamplingRefParams& p) {
  const int n = static_cast<int>(logits.size());
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  int keep = p.top_k > 0 ? std::min(n, p.top_k) : n;
  std::vector<long double> w(keep);
  long double sum = 0;
  for (int i = 0; i < keep; ++i) {
    w[i] = std::exp(static_cast<long double>(logits[ids[i]]) / p.temperature);
    sum += w[i];
  }
  if (p.min_p > 0) {
    int k = 0;
    while (k < keep && w[k] >= static_cast<long double>(p.min_p) * w[0]) ++k;
    keep = k;
  }
  if (p.top_p < 1) {
    long double cum = 0;
    int k = 0;
    while (k < keep && cum < static_cast<long double>(p.top_p) * sum) cum += w[k++];
    keep = k;
  }
  long double total = 0;
  for (int i = 0; i < keep; ++i) total += w[i];
  std::map<int32_t, double> out;
  for (int i = 0; i < keep; ++i) out[ids[i]] = static_cast<double>(w[i] / total);
  return out;
}

// The pick of the sampler this one replaced: inverse CDF over the probability-sorted kept list,
// one uniform per (seed, step) (53 bits of the step key). Only to measure what the race improves.
int32_t InverseCdfPick(const std::vector<float>& logits, const SamplingRefParams& p,
                       uint64_t step) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  int keep = p.top_k > 0 ? std::min(vocab, p.top_k) : vocab;
  std::vector<double> probs(keep);
  const double mx = logits[ids[0]] / p.temperature;
  double sum = 0.0;
  for (int i = 0; i < keep; ++i) {
    probs[i] = std::exp(logits[ids[i]] / p.temperature - mx);
    sum += probs[i];
  }
  for (double& q : probs) q /= sum;
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    int k = 0;
    while (k < keep) {
      cum += probs[k++];
      if (cum >= p.top_p) break;
    }
    keep = std::max(1, k);
  }
  double total = 0.0;
  for (int i = 0; i < keep; ++i) total += probs[i];
  const double u =
      static_cast<double>(SamplingStepKey(p.seed, step) >> 11) * (1.0 / 9007199254740992.0) * total;
  double cum = 0.0;
  for (int i = 0; i < keep; ++i) {
    cum += probs[i];
    if (u < cum) return ids[i];
  }
  return ids[keep - 1];
}

TEST(SamplingRefTest, GreedyTakesTheFirstMaximum) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(SampleRef(logits.data(), 4, {}, 0, nullptr), 1);
  float lp = 0;
  SampleRef(logits.data(), 4, {}, 0, &lp);
  const double z = std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0);
  EXPECT_NEAR(lp, 2.0 - std::log(z), 1e-6);
  SamplingRefParams neg;
  neg.temperature = -1.0f;  // <= 0 is greedy too
  neg.seed = 5;
  EXPECT_EQ(SampleRef(logits.data(), 4, neg, 3, nullptr), 1);
}

TEST(SamplingRefTest, UniformsAreCounterBasedAndInsideTheOpenInterval) {
  // The formula of sampling_race.h, spelled out for one triple: SplitMix64 over (seed, step),
  // then over token * odd constant, its top 52 bits k giving (2k + 1) / 2^53.
  const uint64_t key = SamplingSplitMix64(SamplingSplitMix64(42) ^ (7 * 0xd1b54a32d192ed03ull));
  const uint64_t bits = SamplingSplitMix64(key ^ (11 * 0x8cb92ba72f3d8dd7ull));
  EXPECT_EQ(SamplingUniform(42, 7, 11), (2.0 * static_cast<double>(bits >> 12) + 1.0) / 0x1p53);
  EXPECT_EQ(SamplingUniform(42, 7, 11), SamplingUniform(42, 7, 11));
  EXPECT_NE(SamplingUniform(42, 7, 11), SamplingUniform(42, 8, 11));
  EXPECT_NE(SamplingUniform(42, 7, 11), SamplingUniform(43, 7, 11));
  EXPECT_NE(SamplingUniform(42, 7, 11), SamplingUniform(42, 7, 12));
  // SplitMix64's first known outputs for state 0 (Vigna's reference implementation): the
  // finaliser here is that generator's, not a variant.
  EXPECT_EQ(SamplingSplitMix64(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(SamplingSplitMix64(0x9e3779b97f4a7c15ull), 0x6e789e6aa1b965f4ull);

  // 64 equal bins over 2^20 (seed, step, token) triples: chi-square with 63 degrees of freedom
  // below the 1e-4 critical value (~110); the extremes never reach 0 or 1; and the lag-1
  // correlation between neighbouring tokens' uniforms is below 5 standard errors (1/sqrt(n)).
  std::vector<double> bins(64, 0.0);
  double lo = 1.0, hi = 0.0, prod = 0.0, prev = 0.5;
  const int n = 1 << 20;
  for (int i = 0; i < n; ++i) {
    const double u = SamplingUniform(static_cast<uint64_t>(i >> 12), (i >> 8) & 15, i & 255);
    bins[static_cast<int>(u * 64)] += 1;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    prod += (u - 0.5) * (prev - 0.5);
    prev = u;
  }
  double chi2 = 0;
  for (double b : bins) chi2 += (b - n / 64.0) * (b - n / 64.0) / (n / 64.0);
  EXPECT_LT(chi2, ChiSquareCritical(63));
  EXPECT_GT(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  EXPECT_LT(std::abs(prod / n) * 12.0, 5.0 / std::sqrt(static_cast<double>(n)));
}

TEST(SamplingRefTest, RaceScoreIsScaledLogitMinusLogOfTheExponential) {
  for (int32_t token : {0, 1, 77, 163839}) {
    const long double u = SamplingUniform(9, 3, token);
    const long double want = 1.25L - std::log(-std::log(u));
    EXPECT_NEAR(SamplingRaceScore(1.25f, SamplingStepKey(9, 3), token), static_cast<double>(want),
                1e-13)
        << token;
  }
}

TEST(SamplingRefTest, KeptIdsMatchTheOracle) {
  // Distinct logits with clear gaps at every filter's boundary, and ties (ids 2, 5 and 9 at 1.0)
  // that top-k must cut by lower id.
  const std::vector<float> logits = {3.0f, 2.5f, 1.0f, -2.0f, 0.2f, 1.0f, -0.7f, 2.0f, -4.0f, 1.0f};
  const int vocab = static_cast<int>(logits.size());
  struct Case {
    const char* name;
    float t;
    int top_k;
    float top_p, min_p;
    std::vector<int32_t> want;  // by hand, in candidate order
  };
  const std::vector<Case> cases = {
      {"off", 1.0f, 0, 1.0f, 0.0f, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},
      {"top_k=vocab is off", 1.0f, 10, 1.0f, 0.0f, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},
      {"top_k=5 cuts the tie at 1.0 by id", 1.0f, 5, 1.0f, 0.0f, {0, 1, 7, 2, 5}},
      // p at T=1: 0.404, 0.245, 0.149, 3 x 0.055, ...: cum 0.404, 0.650, 0.798.
      {"top_p=0.7", 1.0f, 0, 0.7f, 0.0f, {0, 1, 7}},
      {"top_p tiny keeps one", 1.0f, 0, 1e-6f, 0.0f, {0}},
      // min_p 0.3: p >= 0.3 p_max means logit >= 3 - log(1/0.3) = 1.796 at T=1: 0, 1, 7.
      {"min_p=0.3", 1.0f, 0, 1.0f, 0.3f, {0, 1, 7}},
      // At T=2 the threshold is 3 - 2 log(1/0.3) = 0.592: the ties at 1.0 join.
      {"min_p=0.3 at T=2", 2.0f, 0, 1.0f, 0.3f, {0, 1, 7, 2, 5, 9}},
      // top_k 4 at T=2: {0, 1, 7, 2}, all above min_p's 0.592; their p 0.363, 0.283, 0.220,
      // 0.134: cum 0.646 >= 0.6 after two.
      {"top_k then min_p then top_p", 2.0f, 4, 0.6f, 0.3f, {0, 1}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SamplingRefParams p;
    p.temperature = c.t;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    const std::vector<int32_t> got = SamplingKeptIds(logits.data(), vocab, p);
    EXPECT_EQ(got, c.want);
    std::vector<int32_t> oracle;
    for (const auto& [id, q] : OracleKept(logits, p)) oracle.push_back(id);
    std::vector<int32_t> sorted_got = got;
    std::sort(sorted_got.begin(), sorted_got.end());
    EXPECT_EQ(sorted_got, oracle);
  }
}

// Draws over 600 seeds x 100 steps against softmax(logits / T) over the oracle's kept set:
// nothing outside it, and the chi-square over its ids below the 1e-4 critical value (deterministic
// for these fixed seeds; a correct sampler exceeds it with probability 1e-4 per configuration).
// Each configuration also checks that the test has power: the same counts against the softmax
// at 1.5 T over the same ids exceed twice the critical value.
TEST(SamplingRefTest, DrawsFollowTheTemperedSoftmaxOverTheKeptSet) {
  std::vector<float> logits(24);
  for (int i = 0; i < 24; ++i) logits[i] = 2.0f * std::sin(i * 1.7f) + 0.1f * (i % 5);
  logits[20] = logits[3];  // a tie across the list
  logits[21] = -kInf;      // a masked token: never drawn
  struct Case {
    const char* name;
    float t;
    int top_k;
    float top_p, min_p;
  };
  const std::vector<Case> cases = {
      {"temperature 0.7", 0.7f, 0, 1.0f, 0.0f}, {"temperature 1.3", 1.3f, 0, 1.0f, 0.0f},
      {"top_k 6", 1.0f, 6, 1.0f, 0.0f},         {"top_p 0.8", 1.0f, 0, 0.8f, 0.0f},
      {"min_p 0.1", 0.9f, 0, 1.0f, 0.1f},       {"all three", 1.2f, 10, 0.9f, 0.05f},
  };
  const int seeds = 600, steps = 100, n = seeds * steps;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SamplingRefParams p;
    p.temperature = c.t;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    const std::map<int32_t, double> want = OracleKept(logits, p);
    std::vector<int32_t> kept = SamplingKeptIds(logits.data(), 24, p), oracle_ids;
    std::sort(kept.begin(), kept.end());
    for (const auto& [id, q] : want) oracle_ids.push_back(id);
    ASSERT_EQ(kept, oracle_ids);
    std::map<int32_t, int> counts;
    for (int s = 0; s < seeds; ++s) {
      p.seed = 1000003ull * s + 17;
      for (int step = 0; step < steps; ++step) {
        ++counts[SampleRef(logits.data(), 24, p, static_cast<uint64_t>(step), nullptr)];
      }
    }
    double chi2 = 0, chi2_wrong = 0;
    int categories = 0;  // kept ids of positive probability (the masked id has none)
    long double z_wrong = 0;
    for (const auto& [id, q] : want) z_wrong += std::exp(logits[id] / (1.5L * c.t));
    for (const auto& [id, q] : want) {
      const double got = counts.count(id) ? counts[id] : 0;
      if (q == 0) {
        EXPECT_EQ(got, 0) << "drew the masked id " << id;
        continue;
      }
      ++categories;
      chi2 += (got - n * q) * (got - n * q) / (n * q);
      const double q_wrong = static_cast<double>(std::exp(logits[id] / (1.5L * c.t)) / z_wrong);
      chi2_wrong += (got - n * q_wrong) * (got - n * q_wrong) / (n * q_wrong);
    }
    for (const auto& [id, k] : counts) EXPECT_EQ(want.count(id), 1u) << "drew id " << id;
    ASSERT_GE(categories, 3);
    const double crit = ChiSquareCritical(categories - 1);
    std::printf("[sampling] %s: %d kept, chi2 %.1f (critical %.1f at 1e-4), at 1.5 T %.0f\n",
                c.name, categories, chi2, crit, chi2_wrong);
    EXPECT_LT(chi2, crit);
    EXPECT_GT(chi2_wrong, 2 * crit);
  }
}

// Ties: ten ids share the largest logit; the race draws each with probability 1/10 whatever the
// candidate order, and top-k 4 keeps the four lowest ids of the tie.
TEST(SamplingRefTest, TiedLogitsAreDrawnEquallyAndTopKCutsTiesByLowerId) {
  std::vector<float> logits(40, -30.0f);
  for (int i = 3; i < 40; i += 4) logits[i] = 5.0f;  // ids 3, 7, ..., 39
  SamplingRefParams p;
  p.temperature = 1.0f;
  const int n = 50000;
  for (int top_k : {0, 4}) {
    SCOPED_TRACE("top_k " + std::to_string(top_k));
    p.top_k = top_k;
    const int kept = top_k > 0 ? 4 : 10;
    std::map<int32_t, int> counts;
    for (int i = 0; i < n; ++i) {
      p.seed = static_cast<uint64_t>(i / 50);
      ++counts[SampleRef(logits.data(), 40, p, static_cast<uint64_t>(i % 50), nullptr)];
    }
    double chi2 = 0;
    for (int j = 0; j < kept; ++j) {
      const int id = 3 + 4 * j;
      const double got = counts.count(id) ? counts[id] : 0;
      chi2 += (got - n / double(kept)) * (got - n / double(kept)) / (n / double(kept));
    }
    // The 36 ids at -30 (e^-35 relative weight each) never win in 50000 draws (expected 3e-11).
    EXPECT_EQ(counts.size(), static_cast<size_t>(kept));
    EXPECT_LT(chi2, ChiSquareCritical(kept - 1));
  }
}

// Without a filter the race runs over the unsorted vocabulary; with a filter that keeps every id
// (min_p 1e-30 over logits spanning less than 69 T) it runs over the sorted candidates: the same
// race, so the same token for every seed and step.
TEST(SamplingRefTest, SortedAndUnsortedCandidatesDrawTheSameToken) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(2000);
  for (float& l : logits) l = std::round(normal(rng) * 8.0f) / 8.0f;  // many ties
  SamplingRefParams unfiltered, filtered;
  unfiltered.temperature = filtered.temperature = 0.9f;
  filtered.min_p = 1e-30f;
  ASSERT_EQ(SamplingKeptIds(logits.data(), 2000, filtered).size(), 2000u);
  for (uint64_t s = 0; s < 300; ++s) {
    unfiltered.seed = filtered.seed = s;
    EXPECT_EQ(SampleRef(logits.data(), 2000, unfiltered, s * 3, nullptr),
              SampleRef(logits.data(), 2000, filtered, s * 3, nullptr))
        << s;
  }
}

// Masked (-inf) tokens never win; a row whose kept logits are all -inf gives the lowest kept id.
TEST(SamplingRefTest, MaskedTokensNeverWin) {
  std::vector<float> logits(100, -kInf);
  logits[37] = -50.0f;
  logits[61] = -49.0f;
  SamplingRefParams p;
  p.temperature = 2.0f;
  std::map<int32_t, int> counts;
  for (uint64_t s = 0; s < 2000; ++s) {
    p.seed = s;
    ++counts[SampleRef(logits.data(), 100, p, 0, nullptr)];
  }
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts[37], 0);
  EXPECT_GT(counts[61], counts[37]);
  std::vector<float> none(10, -kInf);
  EXPECT_EQ(SampleRef(none.data(), 10, p, 0, nullptr), 0);
  p.top_k = 3;
  EXPECT_EQ(SampleRef(none.data(), 10, p, 0, nullptr), 0);
}

// Last-bit noise, as recompute after preemption or another batch's reduction order produces it:
// bf16-valued logits (many exact ties, as a bf16 LM head gives) at temperature 0.9 and top-p 0.95
// (the workload), each logit moved by -1, 0 or +1 fp32 ulp at random. The inverse-CDF
// draw changes its pick whenever tied candidates swap order; the race only when the perturbation
// (~1e-7 of a logit, ~2e-7 of a score) exceeds the gap between the two best scores, whose density
// near 0 is O(1): about 1e-6 of the draws. Bounds: at most 3 changes in the 4000 draws (expected
// ~0.004), and the inverse CDF at least 100 times as many (it changes ~50% here).
TEST(SamplingRefTest, LastBitNoiseRarelyChangesThePick) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::uniform_int_distribution<int> dir(-1, 1);
  const int vocab = 4096, trials = 4000;
  int race_changes = 0, cdf_changes = 0;
  SamplingRefParams p;
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  std::vector<float> x(vocab), y(vocab);
  for (int t = 0; t < trials; ++t) {
    if (t % 100 == 0) {
      for (float& l : x) {
        // Round to bf16 (8 bits of mantissa) by truncating the fp32 bits.
        float v = normal(rng);
        uint32_t b;
        std::memcpy(&b, &v, 4);
        b &= 0xffff0000u;
        std::memcpy(&l, &b, 4);
      }
    }
    for (int i = 0; i < vocab; ++i) {
      const int d = dir(rng);
      y[i] = d == 0 ? x[i] : std::nextafter(x[i], d > 0 ? kInf : -kInf);
    }
    p.seed = static_cast<uint64_t>(t);
    const uint64_t step = static_cast<uint64_t>(t % 37);
    race_changes += SampleRef(x.data(), vocab, p, step, nullptr) !=
                    SampleRef(y.data(), vocab, p, step, nullptr);
    cdf_changes += InverseCdfPick(x, p, step) != InverseCdfPick(y, p, step);
  }
  std::printf("[sampling] 1-ulp noise over %d draws: race changed %d picks, inverse CDF %d\n",
              trials, race_changes, cdf_changes);
  EXPECT_LE(race_changes, 3);
  EXPECT_GE(cdf_changes, 100 * std::max(race_changes, 1));
}

TEST(SamplingRefTest, FiltersCutTheTail) {
  const std::vector<float> logits = {3.0f, 2.9f, 0.0f, -5.0f, 2.0f};
  SamplingRefParams p;
  p.temperature = 1.0f;
  std::map<int, int> topk, topp, minp;
  for (uint64_t s = 0; s < 3000; ++s) {
    p.seed = s;
    p.top_k = 2;
    ++topk[SampleRef(logits.data(), 5, p, 0, nullptr)];
    p.top_k = 0;
    p.top_p = 0.5f;  // the first token alone has p ~ 0.44 < 0.5: the nucleus is {0, 1}
    ++topp[SampleRef(logits.data(), 5, p, 0, nullptr)];
    p.top_p = 1.0f;
    p.min_p = 0.5f;  // keeps tokens with p >= 0.5 * p_max: 0, 1 (e^-0.1 = 0.90), not 4 (e^-1)
    ++minp[SampleRef(logits.data(), 5, p, 0, nullptr)];
    p.min_p = 0.0f;
  }
  for (const auto* m : {&topk, &topp, &minp}) {
    EXPECT_EQ(m->size(), 2u);
    EXPECT_GT(m->count(0), 0u);
    EXPECT_GT(m->count(1), 0u);
  }
}

TEST(SamplerTest, PenaltiesAndMinTokens) {
  std::vector<float> logits = {2.0f, 1.9f, 0.0f};
  SequenceSampling s;
  // Greedy picks 0; a repetition penalty on a seen token 0 (logit 2.0 / 1.2 = 1.67) makes 1 win.
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {}, 0, 0).token, 0);
  s.repetition_penalty = 1.2f;
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {0}, 1, 0).token, 1);
  // Presence/frequency penalties apply to output tokens only (after prompt_len).
  s.repetition_penalty = 1.0f;
  s.frequency_penalty = 0.2f;
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {0}, 1, 0).token, 0);     // 0 is a prompt token
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {2, 0}, 1, 1).token, 1);  // 0 generated once
  // min_tokens masks eos until enough tokens were generated.
  s.frequency_penalty = 0.0f;
  s.min_tokens = 2;
  s.eos_ids = {0};
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {}, 0, 1).token, 1);
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {}, 0, 2).token, 0);
  // Logprobs are the model's own distribution, with ordered alternatives.
  s.top_logprobs = 2;
  const SampledOutput out = SampleToken(logits.data(), 3, s, {}, 0, 2);
  ASSERT_EQ(out.top.size(), 2u);
  EXPECT_EQ(out.top[0].first, 0);
  EXPECT_EQ(out.top[1].first, 1);
  EXPECT_FLOAT_EQ(out.top[0].second, out.logprob);
}

// Sampled steps: the masked eos is never drawn before min_tokens, and drawn afterwards; the
// token is SampleRef of PenalizedLogits at the step index `generated`.
TEST(SamplerTest, SampledStepsUseThePenalizedLogits) {
  const std::vector<float> logits = {2.0f, 1.9f, 0.0f, 1.5f};
  SequenceSampling s;
  s.base.temperature = 1.0f;
  s.min_tokens = 3;
  s.eos_ids = {0};
  s.repetition_penalty = 1.3f;
  const std::vector<int32_t> history = {3, 1, 3};
  int eos_early = 0, eos_late = 0;
  for (uint64_t seed = 0; seed < 500; ++seed) {
    s.base.seed = seed;
    eos_early += SampleToken(logits.data(), 4, s, history, 1, 2).token == 0;
    eos_late += SampleToken(logits.data(), 4, s, history, 1, 3).token == 0;
    const std::vector<float> w = PenalizedLogits(logits.data(), 4, s, history, 1, 3);
    EXPECT_EQ(w[1], 1.9f / 1.3f);
    EXPECT_EQ(w[0], 2.0f);
    EXPECT_EQ(SampleToken(logits.data(), 4, s, history, 1, 3).token,
              SampleRef(w.data(), 4, s.base, 3, nullptr));
  }
  EXPECT_EQ(eos_early, 0);
  EXPECT_GT(eos_late, 100);  // p(eos) ~ 0.47 after the penalties
}

}  // namespace
}  // namespace mlaserve
