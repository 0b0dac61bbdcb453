// The deterministic mode on the CPU backend (issue 23): a sequence's logits are bit-identical
// alone, recomputed by a prefill (whole or chunked, as after preemption) and in mixed batches,
// on every fixture (tests/model/determinism_checks.h). The default mode is run too and its
// differences printed: its prefill reads fresh keys through another attention path, so recompute
// rounds differently there, which is what the deterministic mode exists to remove.
#include <algorithm>
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/model/determinism_checks.h"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"

namespace mlaserve {
namespace {

class DeterministicTest : public ::testing::TestWithParam<const char*> {};

TEST_P(DeterministicTest, LogitsDoNotDependOnBatchOrRecompute) {
  const std::string dir = FixtureDir(GetParam());
  Golden golden(dir);
  ASSERT_TRUE(golden.ok()) << dir;
  const auto prompt = golden.Get<int32_t>("p2.ids");
  const auto other = golden.Get<int32_t>("p1.ids");
  CpuOps ops(2);
  SingleRankCommunicator comm;
  for (bool deterministic : {true, false}) {
    ModelOptions o;
    o.kv_format = KvCacheFormat::kBf16;
    o.num_kv_blocks = 20;
    o.deterministic = deterministic;
    auto m = DeepseekV3Model::Load(dir, o, ops, comm);
    ASSERT_TRUE(m.ok()) << m.status();
    const determinism::Report r = determinism::Check(**m, prompt, other, 24);
    std::printf("[deterministic] %s cpu %s: %s\n", GetParam(),
                deterministic ? "deterministic" : "default", r.Describe().c_str());
    if (deterministic) determinism::ExpectNoneDiffer(r);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeterministicTest,
                         ::testing::Values("dsv3-tiny", "kimi-tiny", "kimi-tiny-nvfp4",
                                           "noqlora-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace mlaserve
