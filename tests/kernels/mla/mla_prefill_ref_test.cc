// CPU reference of the MLA chunked prefill (kernels/mla/mla_prefill_ref.h):
//  - against an independent fp64 oracle with an explicit causal mask over the whole sequence;
//  - chunking invariance: the last n queries of a T-token prompt computed as a chunk (context
//    T - n, keys = the same T rows) are bit-identical to those rows of the whole prompt computed
//    with no context (the prefix path runs exactly the no-prefix arithmetic, which is
//    CpuOps::MlaNaive's).
#include "kernels/mla/mla_prefill_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {
namespace {

struct Inputs {
  int heads, nope, rope, v;
  std::vector<int32_t> ctx, n;  // per sequence
  std::vector<int32_t> q_begin, kv_begin;
  std::vector<float> q, kv, k_rope;
};

Inputs MakeInputs(int heads, int nope, int rope, int v, std::vector<int32_t> ctx,
                  std::vector<int32_t> n, uint32_t seed) {
  Inputs in{heads, nope, rope, v, std::move(ctx), std::move(n), {0}, {0}, {}, {}, {}};
  for (size_t s = 0; s < in.n.size(); ++s) {
    in.q_begin.push_back(in.q_begin.back() + in.n[s]);
    in.kv_begin.push_back(in.kv_begin.back() + in.ctx[s] + in.n[s]);
  }
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, size_t count) {
    x.resize(count);
    for (float& e : x) e = normal(rng);
  };
  fill(in.q, size_t(in.q_begin.back()) * heads * (nope + rope));
  fill(in.kv, size_t(in.kv_begin.back()) * heads * (nope + v));
  fill(in.k_rope, size_t(in.kv_begin.back()) * rope);
  return in;
}

std::vector<float> RunRef(const Inputs& in, float scale) {
  std::vector<float> out(size_t(in.q_begin.back()) * in.heads * in.v, NAN);
  MlaPrefillRef(static_cast<int>(in.n.size()), in.heads, in.nope, in.rope, in.v, in.q.data(),
                in.kv.data(), in.k_rope.data(), in.q_begin.data(), in.kv_begin.data(),
                in.ctx.data(), scale, out.data());
  return out;
}

TEST(MlaPrefillRefTest, MatchesFp64OracleWithPrefixes) {
  const Inputs in = MakeInputs(3, 16, 64, 32, {0, 5, 130, 0}, {9, 1, 40, 0}, 1);
  const float scale = 1.3f / std::sqrt(80.0f);
  const std::vector<float> out = RunRef(in, scale);
  const int qk = in.nope + in.rope, cols = in.nope + in.v;
  double worst = 0;
  for (size_t s = 0; s < in.n.size(); ++s) {
    for (int i = 0; i < in.n[s]; ++i) {
      for (int h = 0; h < in.heads; ++h) {
        const float* qi = &in.q[(size_t(in.q_begin[s] + i) * in.heads + h) * qk];
        const int keys = in.ctx[s] + i + 1;
        std::vector<double> w(keys);
        double mx = -INFINITY, sum = 0, vmax = 0;
        for (int j = 0; j < keys; ++j) {
          const size_t row = size_t(in.kv_begin[s]) + j;
          double dot = 0;
          for (int d = 0; d < in.nope; ++d)
            dot += double(qi[d]) * in.kv[(row * in.heads + h) * cols + d];
          for (int d = 0; d < in.rope; ++d)
            dot += double(qi[in.nope + d]) * in.k_rope[row * in.rope + d];
          w[j] = dot * scale;
          mx = std::max(mx, w[j]);
        }
        for (double& x : w) sum += (x = std::exp(x - mx));
        for (int d = 0; d < in.v; ++d) {
          double o = 0;
          for (int j = 0; j < keys; ++j) {
            const float vj =
                in.kv[((size_t(in.kv_begin[s]) + j) * in.heads + h) * cols + in.nope + d];
            o += w[j] / sum * vj;
            vmax = std::max(vmax, std::fabs(double(vj)));
          }
          const float got = out[(size_t(in.q_begin[s] + i) * in.heads + h) * in.v + d];
          // fp32 vs fp64: the worst-case fp32 accumulation error of a sum of n terms is
          // n * 2^-24 relative to the sum of magnitudes; n <= 170 keys (and 80 dims per score,
          // scores ~1 after scaling) gives ~1e-5 * max|v|. Observed: ~2e-7 * max|v|.
          const double tol = 1e-5 * vmax;
          worst = std::max(worst, std::fabs(got - o) / tol);
          ASSERT_LE(std::fabs(got - o), tol) << "seq " << s << " query " << i << " head " << h
                                             << " d " << d << ": " << got << " vs " << o;
        }
      }
    }
  }
  std::printf("worst |err| / tol = %.3g\n", worst);
}

TEST(MlaPrefillRefTest, ChunkIsBitIdenticalToWholePrompt) {
  const int total = 150;
  for (int chunk : {1, 7, 64, 149}) {
    SCOPED_TRACE(chunk);
    const int heads = 2, nope = 32, rope = 64, v = 16;
    const Inputs whole = MakeInputs(heads, nope, rope, v, {0}, {total}, 7);
    // Same keys; only the last `chunk` queries, with total - chunk tokens of context.
    Inputs part = whole;
    part.ctx = {total - chunk};
    part.n = {chunk};
    part.q_begin = {0, chunk};
    const size_t q_row = size_t(heads) * (nope + rope);
    part.q.assign(whole.q.end() - size_t(chunk) * q_row, whole.q.end());
    const float scale = 0.9f / std::sqrt(96.0f);
    const std::vector<float> a = RunRef(whole, scale), b = RunRef(part, scale);
    ASSERT_EQ(b.size(), size_t(chunk) * heads * v);
    EXPECT_EQ(std::memcmp(a.data() + a.size() - b.size(), b.data(), b.size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace mlaserve
