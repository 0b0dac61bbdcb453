// Worker death and restart end to end (issue 19): deploy/mlaserve-launch runs the coordinator and
// `mpirun -np 2` CPU worker ranks of the tiny model; rank 1 is killed (SIGKILL) while a request
// streams. Checked: the request ends within 2 s of the kill with finish reason error, code
// workerFailed and a message naming rank 1; the coordinator stays up, answers health as failed
// (naming rank 1) and new requests with a workerFailed error; the launcher restarts the job
// (mlaserve_worker_restarts_total 1) and the same client connection is served again, with the
// greedy output it had before; the launcher then stops cleanly. And a rank that hangs (SIGSTOP)
// is named after the heartbeat timeout and its job replaced the same way. Detection and restart
// times are printed (bench/RESULTS.md, "Worker death and restart").
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client/client.h"
#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/metrics_scrape.h"
#include "tests/model/golden_fixture.h"
#include "tests/process_group.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

GenerateInput Greedy(std::vector<int32_t> ids, uint32_t max_tokens) {
  GenerateInput in;
  in.token_ids = std::move(ids);
  in.sampling.max_tokens = max_tokens;
  in.sampling.ignore_eos = true;
  return in;
}

// The pid of worker rank `rank` of the job whose ranks connect to `coordinator` (argv[0] is the
// worker binary, the command line names the endpoint, the environment the rank); -1 if none.
pid_t RankPid(const std::string& worker_bin, const std::string& coordinator, int rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmd = ReadFile(e.path() / "cmdline");
    if (cmd.compare(0, cmd.find('\0'), worker_bin) != 0) continue;
    if (!Has(cmd, std::string("--coordinator") + '\0' + coordinator + '\0')) continue;
    const std::string env = ReadFile(e.path() / "environ");
    if (Has(env, std::string(1, '\0') + "OMPI_COMM_WORLD_RANK=" + std::to_string(rank) + '\0')) {
      return static_cast<pid_t>(std::stol(name));
    }
  }
  return -1;
}

// Health on `c` until it is `ok`; false after the timeout.
bool WaitHealthy(Client& c, std::chrono::seconds timeout, std::string* detail) {
  for (const auto deadline = Clock::now() + timeout; Clock::now() < deadline;) {
    auto h = c.Health(1s);
    if (h.ok()) {
      *detail = h->text;
      if (h->ok) return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

// Below the default (10 s) for the hang test's sake; above the few seconds a healthy rank's beats
// were seen to stall on the loaded 2-core machine.
constexpr int kHeartbeatTimeoutMs = 4000;

// The launcher with 2 CPU ranks of kimi-tiny (f32 cache: greedy outputs compare exactly), a
// client connected and a greedy reference output taken before anything is killed.
class E2eWorkerRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const char* src = std::getenv("MLASERVE_SOURCE_DIR");
    const char* bin = std::getenv("MLASERVE_BINARY_DIR");
    ASSERT_TRUE(src != nullptr && bin != nullptr);
    bin_ = bin;
    std::srand(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(time(nullptr)));
    std::set<int> taken;
    const int worker_port = FreePort(taken);
    metrics_port_ = FreePort(taken);
    ASSERT_TRUE(worker_port && metrics_port_);
    const std::string endpoint = "ipc://" + (dir_ / "clients");
    worker_connect_ = "tcp://127.0.0.1:" + std::to_string(worker_port);
    launcher_.pid = Spawn({"/bin/bash",
                           std::string(src) + "/deploy/mlaserve-launch",
                           "--model",
                           FixtureDir("kimi-tiny"),
                           "--allow-no-tokenizer",
                           "--cpu",
                           "--ranks",
                           "2",
                           "--bin",
                           bin_,
                           "--listen",
                           endpoint,
                           "--worker-port",
                           std::to_string(worker_port),
                           "--metrics",
                           "127.0.0.1:" + std::to_string(metrics_port_),
                           "--worker-metrics-port",
                           "0",
                           "--kv-format",
                           "f32",
                           "--kv-blocks",
                           "64",
                           "--restart-backoff-s",
                           "1",
                           "--",
                           "--heartbeat-timeout-ms",
                           std::to_string(kHeartbeatTimeoutMs)},
                          dir_ / "launch.log");
    ASSERT_GT(launcher_.pid, 0);
    auto c = Client::Connect(endpoint);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    std::string detail;
    ASSERT_TRUE(WaitHealthy(*client_, 90s, &detail)) << detail << Log();
    // Every rank's first beat seen, so that the rank killed below is one the coordinator watches
    // (under load a beat can come after the job's `ready`).
    for (const auto deadline = Clock::now() + 30s;
         !Has(detail, "heartbeats from 2 of 2") && Clock::now() < deadline;) {
      std::this_thread::sleep_for(50ms);
      ASSERT_TRUE(WaitHealthy(*client_, 30s, &detail)) << detail << Log();
    }
    ASSERT_TRUE(Has(detail, "heartbeats from 2 of 2")) << detail << Log();
    auto before = client_->Generate(Greedy({5, 6, 7}, 12), nullptr, 60s);
    ASSERT_TRUE(before.ok()) << before.status();
    ASSERT_EQ(before->finish_reason, "length");
    reference_ = before->token_ids;
  }
  std::string Log() const { return ReadFile(dir_ / "launch.log"); }
  pid_t Rank(int rank) const {
    return RankPid(bin_ + "/worker/mlaserve-worker", worker_connect_, rank);
  }
  // Submits a long request and reads a few of its chunks: the state a rank is then taken from.
  uint64_t StreamMidway() {
    auto id = client_->Submit(Greedy({1, 2, 3, 4}, 2000));
    EXPECT_TRUE(id.ok());
    for (int chunks = 0; chunks < 3;) {
      auto r = client_->Next(30s);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) break;
      EXPECT_EQ(r->kind, Reply::Kind::kChunk) << r->message;
      ++chunks;
    }
    return id.ok() ? *id : 0;
  }
  // The request's final (chunks skipped).
  Reply FinalOf(uint64_t id) {
    for (;;) {
      auto r = client_->Next(30s);
      EXPECT_TRUE(r.ok()) << r.status() << Log();
      if (!r.ok()) return Reply{};
      if (r->request_id == id && r->kind != Reply::Kind::kChunk) return *r;
    }
  }
  // Down until the launcher's new job joins; then the reference output again. Returns the
  // seconds from `since` to healthy.
  double ExpectServedAgain(Clock::time_point since) {
    std::string detail;
    EXPECT_TRUE(WaitHealthy(*client_, 90s, &detail)) << detail << Log();
    const double s = Since(since);
    auto after = client_->Generate(Greedy({5, 6, 7}, 12), nullptr, 60s);
    EXPECT_TRUE(after.ok()) << after.status();
    if (after.ok()) EXPECT_EQ(after->token_ids, reference_);
    return s;
  }

  TempDir dir_;
  std::string bin_, worker_connect_;
  int metrics_port_ = 0;
  Group launcher_;
  std::unique_ptr<Client> client_;
  std::vector<int32_t> reference_;
};

TEST_F(E2eWorkerRestartTest, KilledRankIsNamedItsRequestFailsAndTheLauncherRestartsTheJob) {
  Client& client = *client_;
  // Mid-stream: a long request has streamed a few tokens when rank 1 dies.
  const uint64_t id = StreamMidway();
  const pid_t rank1 = Rank(1);
  ASSERT_GT(rank1, 0) << "rank 1 not found";
  const auto killed = Clock::now();
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  const Reply final = FinalOf(id);
  const double detect_s = Since(killed);
  ASSERT_EQ(final.kind, Reply::Kind::kFinal);
  EXPECT_EQ(final.finish_reason, "error");
  EXPECT_EQ(final.error_code, "workerFailed");
  EXPECT_TRUE(Has(final.message, "worker job failed: worker rank 1 is gone")) << final.message;
  EXPECT_GE(final.token_ids.size(), 3u);
  EXPECT_LT(detect_s, 2.0);  // issue 19: detection within 2 s of the rank's death

  // While the launcher restarts the job: health failed and why, new requests refused.
  auto h = client.Health(5s);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->ok);
  EXPECT_TRUE(Has(h->text, "worker rank 1")) << h->text;
  auto refused = client.Generate(Greedy({1, 2}, 4), nullptr, 10s);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->kind, Reply::Kind::kError);
  EXPECT_EQ(refused->error_code, "workerFailed");
  EXPECT_TRUE(Has(refused->message, "worker rank 1")) << refused->message;

  // Served again on the same connection, as before.
  const double restart_s = ExpectServedAgain(killed);
  const std::string metrics = ScrapeMetrics(metrics_port_);
  EXPECT_EQ(MetricSample(metrics, "mlaserve_worker_restarts_total"), 1.0) << metrics;
  EXPECT_EQ(MetricSample(metrics, "mlaserve_worker_failures_total"), 1.0) << metrics;
  EXPECT_EQ(MetricSample(metrics, "mlaserve_worker_up"), 1.0) << metrics;
  const double failure_to_ready = MetricSample(metrics, "mlaserve_worker_restart_seconds_sum");
  std::printf(
      "[e2e] rank 1 killed mid-stream: request failed (workerFailed) after %.3f s; serving again "
      "%.2f s after the kill (coordinator: failure to the new job's ready %.2f s; launcher "
      "backoff 1 s)\n",
      detect_s, restart_s, failure_to_ready);
  const std::string log = Log();
  EXPECT_TRUE(Has(log, "restart 1 of 5 in 1 s")) << log;
  EXPECT_TRUE(Has(log, "a new worker job joined")) << log;
  EXPECT_EQ(launcher_.Stop(30s), 0) << Log();
}

// A rank that hangs (SIGSTOP: alive, connected, silent) is named once its beats are overdue;
// the coordinator tells the job to stop, rank 0 (stuck in the step with it) exits 5 s later, and
// mpirun ends the rest, so the launcher can start a new job.
TEST_F(E2eWorkerRestartTest, HungRankIsNamedAfterTheHeartbeatTimeoutAndItsJobReplaced) {
  const uint64_t id = StreamMidway();
  const pid_t rank1 = Rank(1);
  ASSERT_GT(rank1, 0) << "rank 1 not found";
  const auto stopped = Clock::now();
  ASSERT_EQ(kill(rank1, SIGSTOP), 0);
  const Reply final = FinalOf(id);
  const double detect_s = Since(stopped);
  EXPECT_EQ(final.error_code, "workerFailed");
  EXPECT_TRUE(Has(final.message, "no heartbeat from worker rank 1")) << final.message;
  EXPECT_GT(detect_s, kHeartbeatTimeoutMs / 1000.0 - 0.5);  // not before its beats were due
  const double restart_s = ExpectServedAgain(stopped);
  std::printf(
      "[e2e] rank 1 stopped (SIGSTOP) mid-stream: request failed after %.2f s; serving "
      "again %.2f s after the stop\n",
      detect_s, restart_s);
  EXPECT_TRUE(Has(Log(), "the coordinator ended this job and the rank did not stop within 5 s"))
      << Log();
  EXPECT_EQ(MetricSample(ScrapeMetrics(metrics_port_), "mlaserve_worker_restarts_total"), 1.0);
  EXPECT_EQ(launcher_.Stop(30s), 0) << Log();
}

}  // namespace
}  // namespace mlaserve
