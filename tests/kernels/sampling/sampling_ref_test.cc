// The reference sampler: greedy ties, the top-k / top-p / min-p filters, and seeded draws that
// depend only on (seed, step) and follow the softmax distribution.
#include "kernels/sampling/sampling_ref.h"

#include <cmath>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "worker/model/sampler.h"

namespace mlaserve {
namespace {

TEST(SamplingRefTest, GreedyTakesTheFirstMaximum) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(SampleRef(logits.data(), 4, {}, 0, nullptr), 1);
  float lp = 0;
  SampleRef(logits.data(), 4, {}, 0, &lp);
  const double z = std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0);
  EXPECT_NEAR(lp, 2.0 - std::log(z), 1e-6);
}

TEST(SamplingRefTest, SeededDrawsDependOnlyOnSeedAndStep) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(i * 0.7f);
  SamplingRefParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  const int a = SampleRef(logits.data(), 50, p, 7, nullptr);
  EXPECT_EQ(SampleRef(logits.data(), 50, p, 7, nullptr), a);
  EXPECT_EQ(SamplingUniform(42, 7), SamplingUniform(42, 7));
  EXPECT_NE(SamplingUniform(42, 7), SamplingUniform(42, 8));
  EXPECT_NE(SamplingUniform(42, 7), SamplingUniform(43, 7));
}

TEST(SamplingRefTest, DrawsFollowTheTemperedSoftmax) {
  const std::vector<float> logits = {1.0f, 0.0f, -1.0f, 0.5f};
  SamplingRefParams p;
  p.temperature = 0.8f;
  std::map<int, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    p.seed = static_cast<uint64_t>(i);
    ++counts[SampleRef(logits.data(), 4, p, 0, nullptr)];
  }
  double z = 0;
  for (float l : logits) z += std::exp(l / 0.8);
  for (int t = 0; t < 4; ++t) {
    const double want = std::exp(logits[t] / 0.8) / z;
    // Binomial standard deviation sqrt(p(1-p)/n) <= 0.0025; allow 5 of them.
    EXPECT_NEAR(counts[t] / double(n), want, 0.0125) << t;
  }
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
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {0}, 1, 0).token, 0);      // 0 is a prompt token
  EXPECT_EQ(SampleToken(logits.data(), 3, s, {2, 0}, 1, 1).token, 1);   // 0 generated once
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

}  // namespace
}  // namespace mlaserve
