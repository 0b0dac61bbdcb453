// Multi-rank execution over MPI on the CPU backend: the tests launch `mpirun -np N` themselves
// (mpi_model_check, label mpi) and check that N = 1, 2, 3, 4 ranks in both MoE modes reproduce
// transformers' logits (<= 1e-4 of their scale; the only difference from one rank is the order
// of fp32 partial sums) and greedy tokens, and that a rank that fails or dies ends the job with
// an error naming it instead of a hang.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string output;
};

// `timeout` guards against a hung job only (a run ends as soon as it is done): 300 s, as a 4-rank
// DCP run of the sanitizer build took over 120 s on a 2-core box loaded by other jobs.
RunResult RunMpi(int ranks, const std::string& args) {
  std::string cmd = std::string("timeout 300 ") + MLASERVE_MPIEXEC + " -np " +
                    std::to_string(ranks) +
                    " --oversubscribe --mca btl_vader_single_copy_mechanism none";
  if (geteuid() == 0) cmd += " --allow-run-as-root";
  cmd += std::string(" ") + MLASERVE_MPI_CHECK + " " + args + " 2>&1";
  RunResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  while (fgets(buf.data(), buf.size(), pipe) != nullptr) r.output += buf.data();
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

struct Case {
  const char* model;
  int ranks;
  const char* moe;
};

class MpiModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(MpiModelTest, MatchesGolden) {
  const Case c = GetParam();
  const RunResult r = RunMpi(c.ranks, "--model " + FixtureDir(c.model) + " --moe " + c.moe);
  std::printf("%s", r.output.c_str());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("greedy identical"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, MpiModelTest,
    ::testing::Values(Case{"kimi-tiny", 1, "expert"}, Case{"kimi-tiny", 2, "expert"},
                      Case{"kimi-tiny", 2, "tensor"}, Case{"kimi-tiny", 3, "expert"},
                      Case{"kimi-tiny", 3, "tensor"}, Case{"kimi-tiny", 4, "expert"},
                      Case{"kimi-tiny", 4, "tensor"}, Case{"dsv3-tiny", 2, "expert"},
                      Case{"dsv3-tiny", 4, "tensor"}, Case{"noqlora-tiny", 3, "expert"},
                      Case{"kimi-tiny-nvfp4", 2, "expert"}, Case{"kimi-tiny-nvfp4", 2, "tensor"},
                      Case{"kimi-tiny-nvfp4", 4, "expert"}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name = std::string(info.param.model) + "_" + std::to_string(info.param.ranks) +
                         "_" + info.param.moe;
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

// Decode context parallelism (issue 20): the cache split by blocks over the ranks, every format;
// against transformers in f32 and against one rank of the same model in every format
// (mpi_model_check --dcp says what is compared).
struct DcpCase {
  const char* model;
  int ranks;
  const char* kv;
  int dcp = 0;  // 0: the rank count
};

class MpiDcpTest : public ::testing::TestWithParam<DcpCase> {};

TEST_P(MpiDcpTest, MatchesOneRank) {
  const DcpCase c = GetParam();
  const RunResult r = RunMpi(c.ranks, "--model " + FixtureDir(c.model) + " --kv " + c.kv +
                                          " --dcp " + std::to_string(c.dcp > 0 ? c.dcp : c.ranks));
  std::printf("%s", r.output.c_str());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("greedy 64 identical"), std::string::npos) << r.output;
  if (std::string(c.kv) == "f32") {
    EXPECT_NE(r.output.find("greedy identical"), std::string::npos) << r.output;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, MpiDcpTest,
    ::testing::Values(DcpCase{"kimi-tiny", 2, "f32"}, DcpCase{"kimi-tiny", 4, "f32"},
                      DcpCase{"kimi-tiny", 2, "bf16"}, DcpCase{"kimi-tiny", 2, "fp8"},
                      DcpCase{"kimi-tiny", 4, "fp8_tiled"}, DcpCase{"dsv3-tiny", 2, "f32"},
                      DcpCase{"noqlora-tiny", 3, "bf16"}, DcpCase{"kimi-tiny-nvfp4", 2, "f32"},
                      // Groups of 2 within 4 ranks: two replicas of a split cache.
                      DcpCase{"kimi-tiny", 4, "f32", 2}, DcpCase{"dsv3-tiny", 4, "fp8_tiled", 2}),
    [](const ::testing::TestParamInfo<DcpCase>& info) {
      std::string name = std::string(info.param.model) + "_" + std::to_string(info.param.ranks) +
                         "_" + info.param.kv +
                         (info.param.dcp > 0 ? "_dcp" + std::to_string(info.param.dcp) : "");
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

TEST(MpiFailureTest, DcpThatDoesNotDivideTheRanksIsAClearError) {
  const RunResult r = RunMpi(2, "--model " + FixtureDir("kimi-tiny") + " --dcp 3");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("must divide the rank count"), std::string::npos) << r.output;
}

TEST(MpiFailureTest, Nvfp4TensorSplitOffScaleBlocksIsAClearError) {
  // 32-wide expert intermediate over 3 ranks: slices of 11/11/10 columns of down_proj do not
  // fall on NVFP4's 16-value scale blocks.
  const RunResult r = RunMpi(3, "--model " + FixtureDir("kimi-tiny-nvfp4") + " --moe tensor");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("do not fall on 16-value scale blocks"), std::string::npos) << r.output;
}

TEST(MpiFailureTest, RankThatFailsToLoadStopsTheJobNamingIt) {
  const RunResult r = RunMpi(2, "--model " + FixtureDir("kimi-tiny") + " --fail-rank 1");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1: injected load failure"), std::string::npos) << r.output;
}

TEST(MpiFailureTest, MissingModelFolderIsAnErrorOnEveryRank) {
  const RunResult r = RunMpi(2, "--model /nonexistent/model");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 0: /nonexistent/model"), std::string::npos) << r.output;
}

TEST(MpiFailureTest, RankThatDiesEndsTheJobInsteadOfHanging) {
  const RunResult r = RunMpi(2, "--model " + FixtureDir("kimi-tiny") + " --crash-rank 1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out: the job hung\n" << r.output;
  EXPECT_NE(r.output.find("rank 1 aborting"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace mlaserve
