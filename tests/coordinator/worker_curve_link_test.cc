// The coordinator <-> worker rank 0 link under CURVE (issue 24), end to end with the real
// binaries on the CPU: deploy/mlaserve-launch starts the coordinator and `mpirun -np 2` CPU worker
// ranks of the tiny model with the worker socket off loopback (--worker-bind 0.0.0.0), so the
// launcher makes a per-job key pair and hands it to both sides (--worker-curve-key /
// --coordinator-curve-key), and with CURVE on the client socket. An allowed client gets a
// completion: its tokens crossed the worker link, which the coordinator serves with CURVE only;
// and the replica stays healthy for twice its heartbeat timeout, so rank 0's second socket (the
// heartbeat) is through as well. A client without keys is refused; the per-job key folder is gone
// once the launcher has exited.
// And a worker holding another job's key pair never becomes ready: a coordinator started with
// --worker-curve-key reports that no worker connected within its --worker-start-timeout-ms, while
// a coordinator holding the worker's own pair gets the same, already loaded, worker at once (so the
// refusal is the key's doing, not a slow or dead worker).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/auth/curve_keys.h"
#include "coordinator/client/client.h"
#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/process_group.h"

extern char** environ;

namespace mlaserve {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// True once GET http://127.0.0.1:port/metrics answers 200.
bool MetricsUp(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  std::string resp;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    (void)!write(fd, req.data(), req.size());
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) {
      resp.append(buf, n);
    }
  }
  close(fd);
  return resp.rfind("HTTP/1.", 0) == 0 && resp.size() > 12 && std::atoi(resp.c_str() + 9) == 200;
}

// The launcher's per-job key folders (mlaserve-job.*) in `dir`.
std::vector<std::string> JobFolders(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("mlaserve-job.", 0) == 0) {
      found.push_back(e.path());
    }
  }
  return found;
}

class WorkerCurveLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(CheckCurveSupport().ok()) << CheckCurveSupport();
    ASSERT_FALSE(dir_.path().empty());
    ASSERT_NE(std::getenv("MLASERVE_SOURCE_DIR"), nullptr);
    ASSERT_NE(std::getenv("MLASERVE_BINARY_DIR"), nullptr);
    std::srand(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(time(nullptr)));
  }

  void KeyPair(const std::string& who) {
    auto pair = GenerateCurveKeyPair();
    ASSERT_TRUE(pair.ok()) << pair.status();
    ASSERT_TRUE(WriteCurveKeyFiles(dir_ / who, *pair, who).ok());
  }

  std::string Logs(const std::vector<std::string>& names) const {
    std::string out;
    for (const auto& n : names) {
      out += "--- " + n + "\n" + ReadFile(dir_ / n);
    }
    return out;
  }

  TempDir dir_;
  std::set<int> taken_;
};

TEST_F(WorkerCurveLinkTest, LaunchedReplicaServesAnAllowedClientOverACurveWorkerLink) {
  // Rank 0 sends a heartbeat every 250 ms on its own socket; with no request in flight nothing
  // else reaches the coordinator, which fails the job after this long without one.
  constexpr int kHeartbeatTimeoutMs = 3000;  // 12 beats: a loaded CI machine misses a few
  KeyPair("server");
  KeyPair("alice");
  std::ofstream(dir_ / "allowed") << ReadFile(dir_ / "alice.pub");
  const int client_port = FreePort(taken_), worker_port = FreePort(taken_);
  ASSERT_TRUE(client_port && worker_port);
  const std::string src = std::getenv("MLASERVE_SOURCE_DIR");
  const std::string worker_listen = "tcp://0.0.0.0:" + std::to_string(worker_port);

  // TMPDIR: the launcher makes its per-job key folder here, where the test can watch it.
  Group launcher;
  launcher.pid = Spawn({"/bin/bash",
                        src + "/deploy/mlaserve-launch",
                        "--model",
                        MLASERVE_TINY_MODEL_DIR,
                        "--cpu",
                        "--ranks",
                        "2",
                        "--bin",
                        std::getenv("MLASERVE_BINARY_DIR"),
                        "--listen",
                        "tcp://0.0.0.0:" + std::to_string(client_port),
                        "--worker-bind",
                        "0.0.0.0",
                        "--worker-port",
                        std::to_string(worker_port),
                        "--metrics",
                        "off",
                        "--worker-metrics-port",
                        "0",
                        "--kv-blocks",
                        "16",
                        "--curve-secret-key",
                        dir_ / "server.key",
                        "--curve-allowed-clients",
                        dir_ / "allowed",
                        "--",
                        "--worker-start-timeout-ms",
                        "50000",
                        "--heartbeat-timeout-ms",
                        std::to_string(kHeartbeatTimeoutMs)},
                       dir_ / "launch.log", {"TMPDIR=" + dir_.path()});
  ASSERT_GT(launcher.pid, 0);

  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(client_port);
  auto client = Client::Connect(endpoint, {dir_ / "server.pub", dir_ / "alice.key"});
  ASSERT_TRUE(client.ok()) << client.status();
  bool healthy = false;
  for (const auto deadline = Clock::now() + 50s; !healthy && Clock::now() < deadline;) {
    auto h = (*client)->Health(500ms);
    healthy = h.ok() && h->ok;
    ASSERT_EQ(launcher.Exited(0ms), -1) << "the launcher exited\n" << Logs({"launch.log"});
  }
  ASSERT_TRUE(healthy) << Logs({"launch.log"});

  // The launcher chose CURVE for the worker socket, with a key pair of its own making.
  const std::string log = ReadFile(dir_ / "launch.log");
  EXPECT_TRUE(Has(log, "worker socket " + worker_listen + " (CURVE)")) << log;
  EXPECT_FALSE(Has(log, "not authenticated")) << log;  // no warning for either socket
  EXPECT_TRUE(Has(log, "accepted a CURVE peer from 127.0.0.1 on the workers socket: worker rank 0"))
      << log;  // the coordinator's ZAP handler admitted rank 0 by the job's public key
  const std::vector<std::string> jobs = JobFolders(dir_.path());
  ASSERT_EQ(jobs.size(), 1u) << log;
  EXPECT_TRUE(fs::exists(jobs[0] + "/worker-link.key")) << jobs[0];

  // A completion: every token was sampled by rank 0 and crossed the CURVE worker link.
  auto info = (*client)->Info(10s);
  ASSERT_TRUE(info.ok()) << info.status();
  const int vocab = nlohmann::json::parse(info->text).value("vocab_size", 0);
  ASSERT_GT(vocab, 0) << info->text;
  GenerateInput in;
  in.text = "The worker link of this job is encrypted";
  in.sampling.max_tokens = 6;
  in.sampling.ignore_eos = true;
  auto done = (*client)->Generate(
      in, [](const Reply&) {}, 30s);
  ASSERT_TRUE(done.ok()) << done.status() << Logs({"launch.log"});
  ASSERT_EQ(done->kind, Reply::Kind::kFinal) << done->message;
  EXPECT_EQ(done->finish_reason, "length");
  ASSERT_EQ(done->token_ids.size(), 6u);
  for (int32_t t : done->token_ids) {
    EXPECT_TRUE(t >= 0 && t < vocab) << t;
  }

  // Idle for twice the heartbeat timeout: only the heartbeat socket keeps the job alive now.
  for (const auto until = Clock::now() + std::chrono::milliseconds(2 * kHeartbeatTimeoutMs + 100);
       Clock::now() < until; std::this_thread::sleep_for(100ms)) {
    auto h = (*client)->Health(5s);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(h->ok) << h->text << "\n" << Logs({"launch.log"});
  }

  // The client socket is CURVE too: a client without keys is refused, at once and with a reason.
  auto plain = Client::Connect(endpoint);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto refused = (*plain)->Health(10s);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Has(std::string(refused.status().message()), "CURVE")) << refused.status();

  // SIGTERM: the coordinator drains, the workers stop, the launcher exits with the coordinator's
  // status and removes the job's key folder.
  EXPECT_EQ(launcher.Stop(30s), 0) << Logs({"launch.log"});
  EXPECT_TRUE(JobFolders(dir_.path()).empty()) << "per-job key left behind";
}

TEST_F(WorkerCurveLinkTest, WorkerWithAnotherJobsKeyNeverBecomesReady) {
  KeyPair("job");    // the coordinator's --worker-curve-key
  KeyPair("other");  // the worker's: another job's pair
  const int worker_port = FreePort(taken_), metrics_port = FreePort(taken_);
  ASSERT_TRUE(worker_port && metrics_port);
  const std::string model = MLASERVE_TINY_MODEL_DIR;

  // The worker first; it serves /metrics once it has loaded and queued its `ready` message, and
  // keeps reconnecting to the coordinator until it has one (or 60 s without one have passed).
  std::vector<std::string> worker = {MLASERVE_MPIEXEC,
                                     "-np",
                                     "1",
                                     "--oversubscribe",
                                     "--bind-to",
                                     "none",
                                     "--mca",
                                     "btl_vader_single_copy_mechanism",
                                     "none",
                                     "--mca",
                                     "mpi_yield_when_idle",
                                     "1"};
  if (geteuid() == 0) {
    worker.push_back("--allow-run-as-root");
  }
  for (const std::string& a :
       {std::string(MLASERVE_WORKER_BIN), std::string("--model"), model,
        std::string("--coordinator"), "tcp://127.0.0.1:" + std::to_string(worker_port),
        std::string("--coordinator-curve-key"), dir_ / "other.key", std::string("--device"),
        std::string("cpu"), std::string("--kv-blocks"), std::string("16"),
        std::string("--metrics-port"), std::to_string(metrics_port),
        std::string("--coordinator-timeout-s"), std::string("60")}) {
    worker.push_back(a);
  }
  Group workers;
  workers.pid = Spawn(worker, dir_ / "workers.log");
  ASSERT_GT(workers.pid, 0);
  bool loaded = false;
  for (const auto deadline = Clock::now() + 40s; !loaded && Clock::now() < deadline;
       std::this_thread::sleep_for(50ms)) {
    loaded = MetricsUp(metrics_port);
    ASSERT_EQ(workers.Exited(0ms), -1) << "the worker exited\n" << Logs({"workers.log"});
  }
  ASSERT_TRUE(loaded) << Logs({"workers.log"});

  // A coordinator of the other job: the worker, already trying to connect, is never admitted.
  // 3 s is many reconnect intervals (100 ms) of a worker that is up and waiting.
  const std::string worker_listen = "tcp://0.0.0.0:" + std::to_string(worker_port);
  auto coordinator = [&](const std::string& key, const std::string& timeout_ms,
                         const std::string& log) {
    return Spawn(
        {MLASERVE_COORDINATOR_BIN, "--model", model, "--listen", "ipc://" + (dir_ / "clients"),
         "--worker-listen", worker_listen, "--worker-curve-key", dir_ / key, "--metrics", "off",
         "--worker-start-timeout-ms", timeout_ms},
        dir_ / log);
  };
  {
    Group wrong;
    wrong.pid = coordinator("job.key", "3000", "coordinator-job.log");
    ASSERT_GT(wrong.pid, 0);
    EXPECT_EQ(wrong.Exited(20s), 1) << Logs({"coordinator-job.log", "workers.log"});
  }
  const std::string refused = ReadFile(dir_ / "coordinator-job.log");
  EXPECT_TRUE(Has(refused, "no worker connected to " + worker_listen + " within 3 s")) << refused;
  EXPECT_FALSE(Has(refused, "not authenticated")) << refused;  // the worker socket was CURVE

  // The control: a coordinator holding the worker's own pair gets that same worker within a
  // second or two, so the refusal above was the key's.
  ASSERT_EQ(workers.Exited(0ms), -1) << Logs({"workers.log"});
  Group right;
  right.pid = coordinator("other.key", "20000", "coordinator-other.log");
  ASSERT_GT(right.pid, 0);
  auto client = Client::Connect("ipc://" + (dir_ / "clients"));
  ASSERT_TRUE(client.ok()) << client.status();
  bool healthy = false;
  for (const auto deadline = Clock::now() + 60s; !healthy && Clock::now() < deadline;) {
    auto h = (*client)->Health(500ms);
    healthy = h.ok() && h->ok;
    ASSERT_EQ(right.Exited(0ms), -1) << Logs({"coordinator-other.log", "workers.log"});
  }
  EXPECT_TRUE(healthy) << Logs({"coordinator-other.log", "workers.log"});
  // Drained, the coordinator tells the worker to stop.
  EXPECT_EQ(right.Stop(20s), 0) << Logs({"coordinator-other.log"});
  EXPECT_EQ(workers.Exited(20s), 0) << Logs({"workers.log"});
}

}  // namespace
}  // namespace mlaserve
