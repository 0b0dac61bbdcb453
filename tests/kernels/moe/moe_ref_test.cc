// The CPU routed-expert reference against a hand-worked example, and its NVFP4 path against the
// fp32 path on the dequantized weights.
#include "kernels/moe/moe_ref.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moe/nvfp4_ref.h"

namespace mlaserve {
namespace {

double Silu(double v) { return v / (1.0 + std::exp(-v)); }

TEST(MoeRefTest, HandWorkedTwoExperts) {
  // hidden 2, intermediate 1. Expert 5: gate [1, 0], up [0, 1], down [2, 3]^T.
  // Expert 6: gate [0, 1], up [1, 1], down [1, -1]^T. Expert 7 is not local.
  const float g5[2] = {1, 0}, u5[2] = {0, 1}, d5[2] = {2, 3};
  const float g6[2] = {0, 1}, u6[2] = {1, 1}, d6[2] = {1, -1};
  MoeExpertRef experts[2];
  experts[0].gate.f32 = g5;
  experts[0].up.f32 = u5;
  experts[0].down.f32 = d5;
  experts[1].gate.f32 = g6;
  experts[1].up.f32 = u6;
  experts[1].down.f32 = d6;
  const float x[2] = {1, 4};
  const int32_t ids[3] = {6, 7, 5};
  const float w[3] = {0.25f, 100.0f, 0.5f};
  float out[2] = {-9, -9};
  MoeExpertsRefParams p{1, 2, 1, 3, x, ids, w, 5, 2, experts, out};
  MoeExpertsRef(p);
  // Expert 5: g = 1, u = 4, h = silu(1) * 4, y = [2h, 3h]. Expert 6: g = 4, u = 5,
  // h = silu(4) * 5, y = [h, -h].
  const double h5 = Silu(1) * 4, h6 = Silu(4) * 5;
  EXPECT_NEAR(out[0], 0.25 * h6 + 0.5 * 2 * h5, 1e-5);
  EXPECT_NEAR(out[1], -0.25 * h6 + 0.5 * 3 * h5, 1e-5);
}

TEST(MoeRefTest, Nvfp4PathEqualsFp32OnDequantizedWeights) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  const int hidden = 32, inter = 16, tokens = 3, top_k = 2, ne = 3;
  struct Q {
    std::vector<uint8_t> p, s;
    float gs;
    std::vector<float> f;
  };
  auto quant = [&](int rows, int cols) {
    std::vector<float> w(rows * cols);
    for (float& v : w) v = nd(rng);
    Q q{std::vector<uint8_t>(rows * cols / 2), std::vector<uint8_t>(rows * cols / 16), 0,
        std::vector<float>(rows * cols)};
    QuantizeNvfp4(w.data(), rows, cols, q.p.data(), q.s.data(), &q.gs);
    DequantizeNvfp4(q.p.data(), q.s.data(), q.gs, rows, cols, q.f.data());
    return q;
  };
  std::vector<Q> qs;
  for (int e = 0; e < ne; ++e) {
    qs.push_back(quant(inter, hidden));
    qs.push_back(quant(inter, hidden));
    qs.push_back(quant(hidden, inter));
  }
  std::vector<MoeExpertRef> fp(ne), nv(ne);
  for (int e = 0; e < ne; ++e) {
    MoeLinearRef* f[3] = {&fp[e].gate, &fp[e].up, &fp[e].down};
    MoeLinearRef* n[3] = {&nv[e].gate, &nv[e].up, &nv[e].down};
    for (int i = 0; i < 3; ++i) {
      const Q& q = qs[3 * e + i];
      f[i]->f32 = q.f.data();
      n[i]->nvfp4_packed = q.p.data();
      n[i]->nvfp4_scale = q.s.data();
      n[i]->nvfp4_global_scale = q.gs;
    }
  }
  std::vector<float> x(tokens * hidden);
  for (float& v : x) v = nd(rng) * 20;
  const int32_t ids[6] = {0, 2, 1, 0, 2, 2};
  const float w[6] = {0.7f, 0.3f, 1.5f, -0.5f, 1.0f, 1.0f};
  std::vector<float> a(tokens * hidden), b(tokens * hidden);
  MoeExpertsRef({tokens, hidden, inter, top_k, x.data(), ids, w, 0, ne, fp.data(), a.data()});
  MoeExpertsRef({tokens, hidden, inter, top_k, x.data(), ids, w, 0, ne, nv.data(), b.data()});
  double norm = 0;
  for (int i = 0; i < tokens * hidden; ++i) {
    EXPECT_EQ(a[i], b[i]) << i;
    norm += std::fabs(a[i]);
  }
  EXPECT_GT(norm, 1e-3);  // not a vacuous comparison of zeros
}

}  // namespace
}  // namespace mlaserve
