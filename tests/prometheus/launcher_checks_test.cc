// deploy/mlaserve-launch refuses to start, with the message deploy/README.md documents and exit
// status 2, when the model folder is wrong, a binary is missing, more ranks than GPUs are asked
// for, a GPU lacks the memory a rank needs, or it runs on a host that is not the hostfile's first.
// GPUs are simulated with a fake nvidia-smi on PATH (CI has none); --dry-run shows the GPU
// binding the launcher chose, and deploy/mlaserve-rank is run directly to check each rank's GPU.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/shell_command.h"

namespace {

namespace fs = std::filesystem;

using Outcome = mlaserve::ShellOutcome;

std::string SourceDir() { return std::getenv("MLASERVE_SOURCE_DIR"); }
std::string BinaryDir() { return std::getenv("MLASERVE_BINARY_DIR"); }
std::string Launcher() { return SourceDir() + "/deploy/mlaserve-launch"; }

Outcome Shell(const std::string& cmd) { return mlaserve::RunShell(cmd); }

class LauncherChecksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(std::getenv("MLASERVE_SOURCE_DIR"), nullptr);
    ASSERT_NE(std::getenv("MLASERVE_BINARY_DIR"), nullptr);
    dir_ = fs::temp_directory_path() / ("mlaserve-launch-test-" + std::to_string(getpid()));
    fs::create_directories(dir_ / "fakegpu");
    // nvidia-smi stand-in: FAKE_GPUS GPUs with FAKE_FREE_MIB MiB free each.
    std::ofstream(dir_ / "fakegpu/nvidia-smi") << R"sh(#!/usr/bin/env bash
n=${FAKE_GPUS:-2}; free=${FAKE_FREE_MIB:-90000}
if [[ "$1" == -L ]]; then for ((i=0;i<n;i++)); do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done; exit 0; fi
case "$*" in
  *index,memory.free*) for ((i=0;i<n;i++)); do echo "$i, $free, 97871, Fake GPU"; done ;;
  *index*) for ((i=0;i<n;i++)); do echo "$i"; done ;;
esac
)sh";
    fs::permissions(dir_ / "fakegpu/nvidia-smi", fs::perms::owner_all);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs the launcher with the real build and tiny model, plus `args`, under `env`.
  Outcome Launch(const std::string& args, const std::string& env = "", bool fake_gpus = false) {
    std::string cmd = "env -u CUDA_VISIBLE_DEVICES ";
    if (fake_gpus) cmd += "PATH=" + (dir_ / "fakegpu").string() + ":$PATH ";
    cmd += env + " " + Launcher() + " " + args;
    return Shell(cmd);
  }
  std::string Model() const { return MLASERVE_TINY_MODEL_DIR; }
  std::string Bin() const { return " --bin " + BinaryDir(); }

  fs::path dir_;
};

TEST_F(LauncherChecksTest, MissingModelFolder) {
  Outcome r = Launch("--model " + (dir_ / "nope").string() + Bin());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("mlaserve-launch: error: model folder " + (dir_ / "nope").string() +
                       " does not exist"),
            std::string::npos)
      << r.out;
}

TEST_F(LauncherChecksTest, FolderWithoutConfig) {
  fs::create_directories(dir_ / "empty");
  Outcome r = Launch("--model " + (dir_ / "empty").string() + Bin());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("has no config.json: not a Hugging Face checkpoint folder"),
            std::string::npos)
      << r.out;
}

TEST_F(LauncherChecksTest, FolderWithoutWeightsOrTokenizer) {
  fs::create_directories(dir_ / "m");
  fs::copy_file(Model() + "/config.json", dir_ / "m/config.json");
  Outcome r = Launch("--model " + (dir_ / "m").string() + Bin());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("has no .safetensors files"), std::string::npos) << r.out;
  fs::create_symlink(Model() + "/model.safetensors", dir_ / "m/model.safetensors");
  r = Launch("--model " + (dir_ / "m").string() + Bin());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("has neither tokenizer.json nor tiktoken.model"), std::string::npos)
      << r.out;
}

TEST_F(LauncherChecksTest, MissingBinaries) {
  Outcome r = Launch("--model " + Model() + " --bin " + (dir_ / "nobuild").string());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("missing binary " + (dir_ / "nobuild").string() +
                       "/coordinator/server/mlaserve-coordinator"),
            std::string::npos)
      << r.out;
  // The coordinator is there, the worker is not.
  fs::create_directories(dir_ / "half/coordinator/server");
  fs::create_symlink(BinaryDir() + "/coordinator/server/mlaserve-coordinator",
                     dir_ / "half/coordinator/server/mlaserve-coordinator");
  r = Launch("--model " + Model() + " --bin " + (dir_ / "half").string());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("missing binary " + (dir_ / "half").string() + "/worker/mlaserve-worker"),
            std::string::npos)
      << r.out;
  // No mpirun.
  r = Launch("--model " + Model() + Bin() + " --cpu", "MLASERVE_MPIRUN=/nonexistent/mpirun");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("mlaserve-launch: error: /nonexistent/mpirun not found"), std::string::npos)
      << r.out;
}

TEST_F(LauncherChecksTest, MoreRanksThanGpus) {
  Outcome r =
      Launch("--model " + Model() + Bin() + " --ranks 4", "FAKE_GPUS=2", /*fake_gpus=*/true);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("mlaserve-launch: error: 4 ranks but only 2 GPUs on this host"),
            std::string::npos)
      << r.out;
  // CUDA_VISIBLE_DEVICES narrows the GPUs the launcher may use.
  r = Launch("--model " + Model() + Bin() + " --ranks 3", "FAKE_GPUS=8 CUDA_VISIBLE_DEVICES=1,2",
             true);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("3 ranks but only 2 GPUs"), std::string::npos) << r.out;
}

TEST_F(LauncherChecksTest, NotEnoughFreeGpuMemory) {
  // The tiny model needs about 2 GiB a rank (its weights and KV cache are small; 2 GiB margin).
  Outcome r =
      Launch("--model " + Model() + Bin() + " --ranks 2", "FAKE_GPUS=2 FAKE_FREE_MIB=1000", true);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("mlaserve-launch: error: GPU 0 has 1000 MiB free but each rank needs about"),
            std::string::npos)
      << r.out;
  r = Launch("--model " + Model() + Bin() + " --ranks 2 --skip-memory-check --dry-run",
             "FAKE_GPUS=2 FAKE_FREE_MIB=1000", true);
  EXPECT_EQ(r.rc, 0) << r.out;
}

TEST_F(LauncherChecksTest, GpuBindingOneRankPerGpu) {
  Outcome r = Launch("--model " + Model() + Bin() + " --dry-run",
                     "FAKE_GPUS=8 CUDA_VISIBLE_DEVICES=4,6", true);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("2 rank(s), GPUs 4,6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2 "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("-x MLASERVE_GPUS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("deploy/mlaserve-rank " + BinaryDir() + "/worker/mlaserve-worker"),
            std::string::npos)
      << r.out;
  // Ranks default to the GPU count.
  r = Launch("--model " + Model() + Bin() + " --dry-run", "FAKE_GPUS=8", true);
  EXPECT_NE(r.out.find("mpirun -np 8 "), std::string::npos) << r.out;
  // NCCL settings in the environment reach every rank.
  r = Launch("--model " + Model() + Bin() + " --dry-run",
             "FAKE_GPUS=8 NCCL_P2P_LEVEL=SYS NCCL_PROTO=Simple", true);
  EXPECT_NE(r.out.find("-x NCCL_P2P_LEVEL"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("-x NCCL_PROTO"), std::string::npos) << r.out;
  // The per-rank wrapper gives local rank r the r-th listed GPU, and refuses a rank beyond them.
  const std::string rank = SourceDir() + "/deploy/mlaserve-rank";
  r = Shell("env OMPI_COMM_WORLD_LOCAL_RANK=1 MLASERVE_GPUS=4,6 " + rank +
            " printenv CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "6\n");
  r = Shell("env OMPI_COMM_WORLD_LOCAL_RANK=2 MLASERVE_GPUS=4,6 " + rank +
            " printenv CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("local rank 2"), std::string::npos) << r.out;
}

// The fp8 KV formats' attention form reaches every worker: on e4m3 tensor cores by default, the
// exact form with --mla-fp8-tensor-cores off; anything else is refused before any check runs.
TEST_F(LauncherChecksTest, Fp8TensorCoresSwitchReachesTheWorkers) {
  Outcome r = Launch("--model " + Model() + Bin() + " --dry-run", "FAKE_GPUS=2", true);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--mla-fp8-tensor-cores on"), std::string::npos) << r.out;
  r = Launch("--model " + Model() + Bin() + " --mla-fp8-tensor-cores off --dry-run", "FAKE_GPUS=2",
             true);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--mla-fp8-tensor-cores off"), std::string::npos) << r.out;
  r = Launch("--model " + Model() + Bin() + " --mla-fp8-tensor-cores maybe --dry-run",
             "FAKE_GPUS=2", true);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--mla-fp8-tensor-cores must be on or off"), std::string::npos) << r.out;
}

TEST_F(LauncherChecksTest, HostfileMustStartWithThisHost) {
  std::ofstream(dir_ / "hosts")
      << "# two boxes\ngpu-box-elsewhere.invalid slots=8\nlocalhost slots=8\n";
  Outcome r = Launch("--model " + Model() + Bin() + " --cpu --ranks 16 --hostfile " +
                     (dir_ / "hosts").string());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(
      r.out.find("run mlaserve-launch on the hostfile's first host (gpu-box-elsewhere.invalid)"),
      std::string::npos)
      << r.out;
  std::ofstream(dir_ / "hosts2") << "localhost slots=8\ngpu-box-elsewhere.invalid slots=8\n";
  r = Launch("--model " + Model() + Bin() + " --cpu --ranks 16 --dry-run --hostfile " +
             (dir_ / "hosts2").string());
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--hostfile " + (dir_ / "hosts2").string()), std::string::npos) << r.out;
}

}  // namespace
