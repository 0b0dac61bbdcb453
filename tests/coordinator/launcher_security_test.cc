// deploy/mlaserve-launch's security defaults (issue 24): the client socket, the coordinator's
// metrics and the worker ranks' metrics on 127.0.0.1 unless a flag names another address; a
// warning for a client socket off loopback without CURVE keys, none with them; the CURVE flags
// passed to the coordinator; a worker socket off loopback gets a per-job key pair, made in a
// private folder (0700, key 0600), given to both sides as a file path (the key never on a command
// line) and removed when the launcher exits.
// The launcher runs with a stand-in build folder: the real coordinator and CLI, a fake
// mlaserve-worker (a script that reports what it was given) and a fake mpirun that runs one rank.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/shell_command.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;

using Outcome = ShellOutcome;

Outcome Shell(const std::string& cmd) { return RunShell(cmd); }

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class LauncherSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const std::string bin = dir_ / "bin";
    fs::create_directories(bin + "/coordinator/server");
    fs::create_directories(bin + "/coordinator/client");
    fs::create_directories(bin + "/worker");
    fs::create_symlink(MLASERVE_COORDINATOR_BIN, bin + "/coordinator/server/mlaserve-coordinator");
    fs::create_symlink(MLASERVE_CLI_BIN, bin + "/coordinator/client/mlaserve-cli");
    // The fake worker writes down the key file it was given, its mode and its folder's mode, and
    // whether its own command line holds the secret key.
    Script(bin + "/worker/mlaserve-worker", R"sh(#!/usr/bin/env bash
report="$FAKE_WORKER_REPORT"
key=""
while (($#)); do [[ "$1" == --coordinator-curve-key ]] && key="$2"; shift; done
echo "key=$key" >"$report"
if [[ -n "$key" ]]; then
  echo "mode=$(stat -c %a "$key")" >>"$report"
  echo "dir_mode=$(stat -c %a "$(dirname "$key")")" >>"$report"
  secret=$(awk '$1 == "secret-key" {print $2}' "$key")
  echo "secret_length=${#secret}" >>"$report"
  grep -qF -- "$secret" /proc/$$/cmdline && echo "secret_on_command_line" >>"$report"
  for pid in $(pgrep -f mlaserve-coordinator); do
    grep -qF -- "$secret" /proc/$pid/cmdline 2>/dev/null && echo "secret_on_command_line" >>"$report"
  done
fi
exit 1
)sh");
    // One rank: drop mpirun's options, run the rank wrapper's command.
    Script(dir_ / "mpirun", R"sh(#!/usr/bin/env bash
while (($#)) && [[ "$1" != */mlaserve-rank ]]; do shift; done
exec "$@"
)sh");
  }

  static void Script(const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
    fs::permissions(path, fs::perms::owner_all);
  }

  Outcome Launch(const std::string& args) {
    const char* src = std::getenv("MLASERVE_SOURCE_DIR");
    return Shell("env MLASERVE_MPIRUN=" + (dir_ / "mpirun") +
                 " FAKE_WORKER_REPORT=" + (dir_ / "report") + " TMPDIR=" + dir_.path() + " " + src +
                 "/deploy/mlaserve-launch --model " + FixtureDir("kimi-tiny") +
                 " --allow-no-tokenizer --cpu --bin " + (dir_ / "bin") + " " + args);
  }

  TempDir dir_;
};

TEST_F(LauncherSecurityTest, EverythingOnLoopbackByDefault) {
  Outcome r = Launch("--dry-run");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(Has(r.out, "--listen tcp://127.0.0.1:5555")) << r.out;
  EXPECT_TRUE(Has(r.out, "--metrics 127.0.0.1:9400")) << r.out;
  EXPECT_TRUE(Has(r.out, "--worker-listen tcp://127.0.0.1:5556")) << r.out;
  EXPECT_TRUE(Has(r.out, "--metrics-host 127.0.0.1")) << r.out;
  EXPECT_FALSE(Has(r.out, "0.0.0.0")) << r.out;
  EXPECT_FALSE(Has(r.out, "warning")) << r.out;
  EXPECT_FALSE(Has(r.out, "curve-key")) << r.out;
}

TEST_F(LauncherSecurityTest, WarnsOfAnUnauthenticatedClientSocketOffLoopback) {
  for (const char* listen : {"tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555"}) {
    Outcome r = Launch(std::string("--dry-run --listen ") + listen);
    ASSERT_EQ(r.rc, 0) << r.out;
    EXPECT_TRUE(Has(r.out, std::string("mlaserve-launch: warning: clients on ") + listen +
                               " are not authenticated"))
        << r.out;
  }
  // With CURVE keys, no warning; the coordinator gets both flags.
  std::ofstream(dir_ / "server.key") << "";
  std::ofstream(dir_ / "allowed") << "";
  Outcome r = Launch("--dry-run --listen tcp://0.0.0.0:5555 --curve-secret-key " +
                     (dir_ / "server.key") + " --curve-allowed-clients " + (dir_ / "allowed"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_FALSE(Has(r.out, "warning")) << r.out;
  EXPECT_TRUE(Has(r.out, "--curve-secret-key " + (dir_ / "server.key") +
                             " --curve-allowed-clients " + (dir_ / "allowed")))
      << r.out;
  // Given through `--` to the coordinator, they count too.
  r = Launch("--dry-run --listen tcp://0.0.0.0:5555 -- --curve-secret-key " +
             (dir_ / "server.key") + " --curve-allowed-clients " + (dir_ / "allowed"));
  EXPECT_FALSE(Has(r.out, "warning")) << r.out;
  // Half the pair, or a missing file, stops it.
  r = Launch("--dry-run --curve-secret-key " + (dir_ / "server.key"));
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(Has(r.out, "--curve-secret-key needs --curve-allowed-clients")) << r.out;
  r = Launch("--dry-run --curve-secret-key " + (dir_ / "nope.key") + " --curve-allowed-clients " +
             (dir_ / "allowed"));
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(Has(r.out, "key file " + (dir_ / "nope.key") + " does not exist")) << r.out;
}

TEST_F(LauncherSecurityTest, WorkerSocketOffLoopbackGetsAPerJobKey) {
  Outcome r = Launch("--dry-run --worker-bind 0.0.0.0");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(Has(r.out, "--worker-curve-key <per-job key")) << r.out;
  EXPECT_TRUE(Has(r.out, "--coordinator-curve-key <per-job key")) << r.out;
  // The two halves started apart must share one key file.
  r = Launch("--dry-run --worker-bind 0.0.0.0 --only coordinator");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_TRUE(Has(r.out, "both halves need the same --worker-curve-key FILE")) << r.out;

  // A real start: the key pair is made, handed over as a path, and removed at exit. The fake
  // worker exits at once, so the coordinator gives up waiting for it after a second.
  r = Launch("--worker-bind 0.0.0.0 --worker-port 0 --listen ipc://" + (dir_ / "clients") +
             " --metrics off -- --worker-start-timeout-ms 1000");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(Has(r.out, "no worker connected")) << r.out;
  const std::string report = Read(dir_ / "report");
  EXPECT_TRUE(Has(report, "key=" + dir_.path() + "/mlaserve-job.")) << report << r.out;
  EXPECT_TRUE(Has(report, "mode=600")) << report;
  EXPECT_TRUE(Has(report, "dir_mode=700")) << report;
  EXPECT_TRUE(Has(report, "secret_length=40")) << report;
  EXPECT_FALSE(Has(report, "secret_on_command_line")) << report;
  for (const auto& e : fs::directory_iterator(dir_.path())) {
    EXPECT_EQ(e.path().filename().string().rfind("mlaserve-job.", 0), std::string::npos)
        << e.path() << " left behind";
  }
}

}  // namespace
}  // namespace mlaserve
