// The CPU router against hand-worked routing decisions (DESIGN.md's rule) and the deterministic
// exp against the C library.
#include "kernels/moe/moe_router_ref.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moe/moe_router_math.h"

namespace mlaserve {
namespace {

float Logit(double p) { return static_cast<float>(std::log(p / (1.0 - p))); }
double Sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(MoeRouterMathTest, ExpAndSigmoidAreAccurate) {
  double worst = 0;
  for (float x = -100.0f; x < 88.0f; x += 0.01173f) {
    const double ref = std::exp(static_cast<double>(x));
    const double got = router_math::Exp(x);
    if (ref > 1e-37) worst = std::max(worst, std::fabs(got - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);  // about 2.5 ulp of fp32
  EXPECT_EQ(router_math::Exp(0.0f), 1.0f);
  EXPECT_EQ(router_math::Exp(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(router_math::Exp(100.0f)));
  for (float x = -20.0f; x < 20.0f; x += 0.0371f) {
    EXPECT_NEAR(router_math::Sigmoid(x), Sig(x), 3e-7 * Sig(x)) << x;
  }
}

MoeRouterConfig Cfg(int e, int k, int ng, int kg, bool softmax, bool norm, float scale) {
  return MoeRouterConfig{e, k, ng, kg, softmax, norm, scale};
}

TEST(MoeRouterRefTest, SigmoidTopKNormalisedAndScaled) {
  const float logits[4] = {0.0f, 1.0f, -1.0f, 2.0f};
  int32_t ids[2];
  float w[2];
  MoeRouteRef(Cfg(4, 2, 1, 1, false, true, 2.5f), logits, nullptr, 1, ids, w);
  EXPECT_EQ(ids[0], 3);  // sigmoid(2) = 0.8808
  EXPECT_EQ(ids[1], 1);  // sigmoid(1) = 0.7311
  const double s3 = Sig(2), s1 = Sig(1);
  EXPECT_NEAR(w[0], 2.5 * s3 / (s3 + s1), 1e-6);
  EXPECT_NEAR(w[1], 2.5 * s1 / (s3 + s1), 1e-6);
}

TEST(MoeRouterRefTest, BiasSelectsButDoesNotWeigh) {
  const float logits[4] = {0.0f, 1.0f, -1.0f, 2.0f};
  const float bias[4] = {0.0f, 0.0f, 1.0f, 0.0f};  // expert 2: 0.2689 + 1 wins the first place
  int32_t ids[2];
  float w[2];
  MoeRouteRef(Cfg(4, 2, 1, 1, false, false, 1.0f), logits, bias, 1, ids, w);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  EXPECT_NEAR(w[0], Sig(-1), 1e-7);  // unbiased, not normalised
  EXPECT_NEAR(w[1], Sig(2), 1e-7);
}

TEST(MoeRouterRefTest, GroupsKeepTopTwoSums) {
  // 8 experts in 4 groups of 2; keep 2 groups. Group sums: g0 0.9+0.1 = 1.0, g1 0.6+0.6 = 1.2,
  // g2 0.55+0.55 = 1.1, g3 0.4. The best single expert (0, 0.9) is in a dropped group.
  const double p[8] = {0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2};
  float logits[8];
  for (int e = 0; e < 8; ++e) logits[e] = Logit(p[e]);
  int32_t ids[3];
  float w[3];
  MoeRouteRef(Cfg(8, 3, 4, 2, false, true, 1.0f), logits, nullptr, 1, ids, w);
  EXPECT_EQ(ids[0], 2);  // 0.6 == 0.6: the lower index first
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids[2], 4);
  EXPECT_NEAR(w[0], 0.6 / 1.75, 1e-6);
  EXPECT_NEAR(w[2], 0.55 / 1.75, 1e-6);
}

TEST(MoeRouterRefTest, TiesGoToTheLowerIndex) {
  std::vector<float> logits(16, 0.5f);
  int32_t ids[4];
  float w[4];
  MoeRouteRef(Cfg(16, 4, 4, 2, false, true, 1.0f), logits.data(), nullptr, 1, ids, w);
  // Equal group sums: groups 0 and 1 are kept; equal scores: experts 0, 1, 2, 3.
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(ids[i], i);
    EXPECT_FLOAT_EQ(w[i], 0.25f);
  }
}

TEST(MoeRouterRefTest, SoftmaxGroupLimitedGreedyUsesGroupMax) {
  // V2: softmax, group score = max. Group 1 holds the single largest logit (3.0) but a smaller
  // sum of its top two than group 0; with max, group 1 is kept.
  const float logits[8] = {2.5f, 2.5f, 3.0f, -5.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int32_t ids[2];
  float w[2];
  MoeRouteRef(Cfg(8, 2, 4, 1, true, false, 16.0f), logits, nullptr, 1, ids, w);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  EXPECT_NEAR(w[0], 16.0 * std::exp(3.0) / z, 1e-5);
  EXPECT_NEAR(w[1], 16.0 * std::exp(-5.0) / z, 1e-9);
}

TEST(MoeRouterRefTest, NegativeBiasedScoresStillExcludeDroppedGroups) {
  // With -inf masking a kept group's negative choice values still beat dropped groups' experts.
  const float logits[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const float bias[4] = {-2.0f, -2.0f, -3.0f, -0.1f};  // choice: -1.5 -1.5 | -2.5 0.4
  int32_t ids[2];
  float w[2];
  // Group sums: g0 -3.0, g1 -2.1 -> keep g1 only; both its experts are chosen.
  MoeRouteRef(Cfg(4, 2, 2, 1, false, true, 1.0f), logits, bias, 1, ids, w);
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 2);
}

TEST(MoeRouterRefTest, RouterLogitsFromBf16) {
  // hidden = [1, 2] (bf16 0x3f80, 0x4000); gate rows [0.5, -1], [3, 0.25].
  const uint16_t hidden[2] = {0x3f80, 0x4000};
  const uint16_t gate[4] = {0x3f00, 0xbf80, 0x4040, 0x3e80};
  float logits[2];
  MoeRouterLogitsRef(hidden, gate, 1, 2, 2, logits);
  EXPECT_EQ(logits[0], -1.5f);
  EXPECT_EQ(logits[1], 3.5f);
}

TEST(MoeRouterRefTest, ValidatesConfig) {
  EXPECT_TRUE(ValidateMoeRouterConfig(Cfg(256, 8, 8, 4, false, true, 2.5f)).ok());
  EXPECT_TRUE(ValidateMoeRouterConfig(Cfg(384, 8, 1, 1, false, true, 2.827f)).ok());
  EXPECT_FALSE(ValidateMoeRouterConfig(Cfg(256, 8, 7, 4, false, true, 1.0f)).ok());
  EXPECT_FALSE(ValidateMoeRouterConfig(Cfg(16, 8, 8, 2, false, true, 1.0f)).ok());  // 4 kept
  EXPECT_FALSE(ValidateMoeRouterConfig(Cfg(256, 8, 8, 9, false, true, 1.0f)).ok());
}

}  // namespace
}  // namespace mlaserve
