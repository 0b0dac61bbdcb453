// deploy/mlaserve-launch's worker restarts (issue 19), with a stand-in build folder: the real
// coordinator and a fake mlaserve-worker that exits at once, as a job that keeps crashing would,
// under a fake mpirun that runs one rank. The launcher restarts it after the backoff, doubled each
// time, up to --max-restarts times in a row, then gives up: it stops the coordinator (which was
// waiting for a worker) and exits 1, saying so. Bad values of the two flags are refused. The
// restart of a real job that lost a rank: tests/e2e/worker_restart_test.cc.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/model/golden_fixture.h"
#include "tests/shell_command.h"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class LauncherRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const std::string bin = dir_ / "bin";
    fs::create_directories(bin + "/coordinator/server");
    fs::create_directories(bin + "/worker");
    fs::create_symlink(MLASERVE_COORDINATOR_BIN, bin + "/coordinator/server/mlaserve-coordinator");
    // Each start leaves a line, then the "job" ends with status 3.
    Script(bin + "/worker/mlaserve-worker",
           "#!/usr/bin/env bash\necho start >>\"$FAKE_WORKER_STARTS\"\nexit 3\n");
    Script(dir_ / "mpirun", R"sh(#!/usr/bin/env bash
while (($#)) && [[ "$1" != */mlaserve-rank ]]; do shift; done
exec "$@"
)sh");
  }
  static void Script(const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
    fs::permissions(path, fs::perms::owner_all);
  }
  ShellOutcome Launch(const std::string& args) {
    const char* src = std::getenv("MLASERVE_SOURCE_DIR");
    return RunShell("env MLASERVE_MPIRUN=" + (dir_ / "mpirun") +
                    " FAKE_WORKER_STARTS=" + (dir_ / "starts") + " " + src +
                    "/deploy/mlaserve-launch --model " + FixtureDir("kimi-tiny") +
                    " --allow-no-tokenizer --cpu --bin " + (dir_ / "bin") + " --listen ipc://" +
                    (dir_ / "clients") + " --worker-port 0 --metrics off " + args);
  }
  int Starts() const {
    std::ifstream in(dir_ / "starts");
    int n = 0;
    for (std::string line; std::getline(in, line);) ++n;
    return n;
  }
  TempDir dir_;
};

TEST_F(LauncherRestartTest, RestartsWithGrowingBackoffThenGivesUpAndStopsTheCoordinator) {
  const auto t0 = Clock::now();
  ShellOutcome r =
      Launch("--max-restarts 2 --restart-backoff-s 0.3 -- --worker-start-timeout-ms 120000");
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(Starts(), 3) << r.out;  // the first start and two restarts
  EXPECT_TRUE(Has(r.out, "the worker job ended (status 3 after ")) << r.out;
  EXPECT_TRUE(Has(r.out, "while the coordinator serves; restart 1 of 2 in 0.3 s")) << r.out;
  EXPECT_TRUE(Has(r.out, "restart 2 of 2 in 0.6 s")) << r.out;
  EXPECT_TRUE(Has(r.out, "giving up after 2 restart(s)")) << r.out;
  // The coordinator was stopped while it waited for a worker, long before its own timeout.
  EXPECT_TRUE(Has(r.out, "asked to stop before a worker job connected")) << r.out;
  EXPECT_GE(took, 0.9);  // the two backoffs were waited out
  EXPECT_LT(took, 60.0);
  std::printf("[launcher] 2 restarts with backoff 0.3 s then 0.6 s, gave up after %.2f s\n", took);
}

TEST_F(LauncherRestartTest, NoRestartsWithZero) {
  ShellOutcome r = Launch("--max-restarts 0 -- --worker-start-timeout-ms 120000");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(Starts(), 1) << r.out;
  EXPECT_TRUE(Has(r.out, "giving up after 0 restart(s)")) << r.out;
}

TEST_F(LauncherRestartTest, BadValuesAreRefused) {
  ShellOutcome r = Launch("--max-restarts -1 --dry-run");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(Has(r.out, "--max-restarts must be a number")) << r.out;
  r = Launch("--restart-backoff-s soon --dry-run");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(Has(r.out, "--restart-backoff-s must be a number of seconds")) << r.out;
  r = Launch("--restart-backoff-s 1e9 --dry-run");
  EXPECT_EQ(r.rc, 2) << r.out;
}

}  // namespace
}  // namespace mlaserve
