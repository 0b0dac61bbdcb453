// The KV cache formats through the whole model: decode over a bf16, fp8 (per-layer scale) or
// fp8_tiled cache against the lossless f32 cache, teacher-forced along the fixtures' greedy
// path (so every format sees the same tokens). Reported: logit cosine similarity, max |diff|
// relative to the logit scale, and top-1 agreement; asserted with bounds stated below.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"
#include "worker/model/local_session.h"

namespace mlaserve {
namespace {

struct FormatStats {
  double min_cosine = 1.0;
  double mean_cosine = 0.0;
  double max_relative = 0.0;
  int top1_agree = 0;
  int steps = 0;
};

// Logits of the prompt's last position and of each teacher-forced decode step.
std::vector<std::vector<float>> DecodePath(const std::string& dir, KvCacheFormat format,
                                           const std::vector<int32_t>& prompt,
                                           const std::vector<int32_t>& forced) {
  CpuOps ops(2);
  SingleRankCommunicator comm;
  ModelOptions options;
  options.kv_format = format;
  options.num_kv_blocks = 4;
  auto model = DeepseekV3Model::Load(dir, options, ops, comm);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<float>> out;
  if (!model.ok()) return out;
  LocalSession session(**model);
  auto logits = session.Feed(prompt, false);
  EXPECT_TRUE(logits.ok());
  out.push_back(*logits);
  for (size_t i = 0; i + 1 < forced.size(); ++i) {
    logits = session.Feed({forced[i]}, false);
    EXPECT_TRUE(logits.ok());
    out.push_back(*logits);
  }
  return out;
}

class KvFormatTest : public ::testing::TestWithParam<const char*> {};

TEST_P(KvFormatTest, LossyFormatsTrackTheLosslessCache) {
  const std::string dir = FixtureDir(GetParam());
  Golden golden(dir);
  ASSERT_TRUE(golden.ok());
  const auto prompt = golden.Get<int32_t>("p2.ids");
  const auto forced = golden.Get<int32_t>("p2.greedy");
  const auto exact = DecodePath(dir, KvCacheFormat::kF32, prompt, forced);
  ASSERT_EQ(exact.size(), forced.size());
  for (KvCacheFormat format : {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    const auto got = DecodePath(dir, format, prompt, forced);
    ASSERT_EQ(got.size(), exact.size());
    FormatStats s;
    for (size_t step = 0; step < got.size(); ++step) {
      const auto& a = got[step];
      const auto& b = exact[step];
      double dot = 0, na = 0, nb = 0, max_abs = 0, scale = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        dot += double(a[i]) * b[i];
        na += double(a[i]) * a[i];
        nb += double(b[i]) * b[i];
        max_abs = std::max(max_abs, double(std::abs(a[i] - b[i])));
        scale = std::max(scale, double(std::abs(b[i])));
      }
      const double cosine = dot / std::sqrt(na * nb);
      s.min_cosine = std::min(s.min_cosine, cosine);
      s.mean_cosine += cosine / got.size();
      s.max_relative = std::max(s.max_relative, max_abs / scale);
      s.top1_agree += (std::max_element(a.begin(), a.end()) - a.begin()) ==
                      (std::max_element(b.begin(), b.end()) - b.begin());
      ++s.steps;
    }
    std::printf("[kv-format] %s %s vs f32 cache over %d decode steps: cosine mean %.5f min %.5f, "
                "max |diff|/scale %.3g, top-1 agreement %d/%d\n",
                GetParam(), std::string(KvCacheFormatName(format)).c_str(), s.steps, s.mean_cosine,
                s.min_cosine, s.max_relative, s.top1_agree, s.steps);
    // Bounds. Per element, bf16 keeps 8 significant bits (relative error <= 2^-9), e4m3 4
    // (<= 2^-4, about 2% rms on a unit-scale latent; fp8_tiled's power-of-two tile scales keep
    // each 128-value tile inside e4m3's normal range). These random tiny models (weights of std
    // 0.2) amplify such perturbations chaotically: a near-tie in MoE routing flips an expert and
    // that token's logits move by tens of percent (measured on 2026-11-29: bf16 mean cosine
    // 0.9987-0.99998, top-1 29-32/32; fp8 and fp8_tiled mean cosine 0.949-0.995, top-1
    // 20-27/32). The bounds sit below those measurements; a wrong scale, layout or block index
    // gives cosines near 0 and fails them.
    const double mean_cosine_bound = format == KvCacheFormat::kBf16 ? 0.998 : 0.94;
    const int top1_bound = format == KvCacheFormat::kBf16 ? 28 : 18;
    EXPECT_GE(s.mean_cosine, mean_cosine_bound) << KvCacheFormatName(format);
    EXPECT_GE(s.top1_agree, top1_bound) << KvCacheFormatName(format);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, KvFormatTest,
                         ::testing::Values("dsv3-tiny", "kimi-tiny", "noqlora-tiny",
                                           "kimi-tiny-nvfp4"));

}  // namespace
}  // namespace mlaserve
