// Starts a real coordinator and `mpirun -np N` workers for end-to-end tests, on ipc:// endpoints
// in a private temporary folder, and stops them.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client/client.h"
#include "tests/metrics_scrape.h"

extern char** environ;

namespace mlaserve {

// MLASERVE_E2E_DEVICE=cuda runs the same tests against one GPU worker rank (ranks 1, and the
// lossless f32 cache, a CPU-only format, becomes bf16) in the deterministic mode (--deterministic
// on: the invariants below compare a request with itself in other batches, which the GPU's
// default kernels do not promise); unset or cpu: the CPU backend.
inline std::string E2eDevice() {
  const char* d = std::getenv("MLASERVE_E2E_DEVICE");
  return d != nullptr && std::string(d) == "cuda" ? "cuda" : "cpu";
}
inline bool E2eOnGpu() { return E2eDevice() == "cuda"; }
// The model the suites serve: kimi-tiny (on the CPU exact against its golden continuation; on a
// GPU, in bf16, its own continuation run alone is the reference).
inline const char* E2eModel() { return "kimi-tiny"; }
// The binaries: the build's, unless the environment names others (a copy of the build run on
// another machine, as the GPU check does).
inline std::string E2eBin(const char* env, const char* built) {
  const char* v = std::getenv(env);
  return v != nullptr && *v != 0 ? v : built;
}

struct ServerOptions {
  std::string model_dir;
  int ranks = 2;
  std::string kv_format = "f32";
  int kv_blocks = 64;
  std::vector<std::string> coordinator_args;
  std::vector<std::string> worker_args;
  ClientSecurity client_security;  // keys for the readiness check (a CURVE coordinator)
};

class ServerProcesses {
 public:
  ~ServerProcesses() { Kill(); }

  // Returns "" on success, else what went wrong (with the processes' logs).
  std::string Start(const ServerOptions& o) {
    namespace fs = std::filesystem;
    dir_ = fs::temp_directory_path() / ("mlaserve-e2e-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    fs::create_directories(dir_);
    client_endpoint_ = "ipc://" + (dir_ / "clients").string();
    const std::string worker_endpoint = "ipc://" + (dir_ / "worker").string();
    std::vector<std::string> coord = {E2eBin("MLASERVE_COORDINATOR_BIN", MLASERVE_COORDINATOR_BIN), "--model", o.model_dir, "--listen", client_endpoint_,
                                      "--worker-listen", worker_endpoint, "--metrics", "127.0.0.1:0",
                                      "--worker-start-timeout-ms", "60000"};
    coord.insert(coord.end(), o.coordinator_args.begin(), o.coordinator_args.end());
    coordinator_ = Spawn(coord, (dir_ / "coordinator.log").string());
    const bool gpu = E2eOnGpu();
    const int ranks = gpu ? 1 : o.ranks;
    const std::string kv_format = gpu && o.kv_format == "f32" ? "bf16" : o.kv_format;
    std::vector<std::string> workers = {E2eBin("MLASERVE_MPIEXEC", MLASERVE_MPIEXEC), "-np", std::to_string(ranks), "--oversubscribe",
                                        "--mca", "btl_vader_single_copy_mechanism", "none",
                                        "--mca", "mpi_yield_when_idle", "1"};
    if (geteuid() == 0) workers.push_back("--allow-run-as-root");
    for (const std::string& s : {E2eBin("MLASERVE_WORKER_BIN", MLASERVE_WORKER_BIN), std::string("--model"), o.model_dir,
                                 std::string("--coordinator"), worker_endpoint, std::string("--kv-format"),
                                 kv_format, std::string("--kv-blocks"), std::to_string(o.kv_blocks),
                                 std::string("--device"), E2eDevice()}) {
      workers.push_back(s);
    }
    if (gpu) {
      workers.push_back("--deterministic");
      workers.push_back("on");
    }
    workers.insert(workers.end(), o.worker_args.begin(), o.worker_args.end());
    worker_command_ = workers;
    workers_ = Spawn(workers, (dir_ / "workers.log").string());
    // Ready when health answers ok.
    auto c = Client::Connect(client_endpoint_, o.client_security);
    if (!c.ok()) return std::string(c.status().message());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    while (std::chrono::steady_clock::now() < deadline) {
      auto h = (*c)->Health(std::chrono::milliseconds(500));
      if (h.ok() && h->ok) {
        metrics_port_ = ParseMetricsPort();
        return "";
      }
      if (Exited(coordinator_)) break;
    }
    return "server did not become healthy\n" + Logs();
  }

  // SIGTERM to the coordinator (drain), then waits for both; returns the coordinator's exit code.
  int Stop(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    if (coordinator_ <= 0) return -1;
    kill(coordinator_, SIGTERM);
    const int rc = Wait(coordinator_, timeout);
    if (rc == -1) {
      kill(coordinator_, SIGKILL);
      Wait(coordinator_, std::chrono::seconds(5));
    }
    coordinator_ = -1;
    if (Wait(workers_, std::chrono::seconds(20)) == -1) KillWorkers();  // never leave ranks behind
    Wait(workers_, std::chrono::seconds(5));
    workers_ = -1;
    return rc;
  }

  // Kills the worker job (all of mpirun's processes), as a crash would.
  void KillWorkers() {
    if (workers_ > 0) kill(workers_, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    // mpirun's children are orphaned by SIGKILL to mpirun: kill them by name.
    std::system(("pkill -9 -f '" + E2eBin("MLASERVE_WORKER_BIN", MLASERVE_WORKER_BIN) + ".*" + dir_.filename().string() + "' >/dev/null 2>&1").c_str());
  }

  // Starts the worker job again (after it died), as a launcher would; the coordinator takes
  // its `ready`. The old job's mpirun is reaped first.
  void RestartWorkers() {
    if (workers_ > 0 && Wait(workers_, std::chrono::seconds(20)) == -1) KillWorkers();
    Wait(workers_, std::chrono::seconds(5));
    workers_ = Spawn(worker_command_, (dir_ / "workers-restarted.log").string());
  }

  // SIGKILL to worker rank `rank` alone (found by its OMPI_COMM_WORLD_RANK), as a crash or the
  // OOM killer would; returns false when no such rank runs.
  bool KillRank(int rank) {
    for (pid_t pid : WorkerPids()) {
      std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
      const std::string env((std::istreambuf_iterator<char>(in)), {});
      const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
      for (size_t at = 0; at < env.size();) {
        const size_t end = env.find('\0', at);
        if (env.compare(at, (end == std::string::npos ? env.size() : end) - at, want) == 0) {
          return kill(pid, SIGKILL) == 0;
        }
        if (end == std::string::npos) break;
        at = end + 1;
      }
    }
    return false;
  }

  // The worker ranks' process ids: processes whose argv[0] is the worker binary and whose
  // command line names this server's folder (mpirun's own command line names both, but not as
  // argv[0]).
  std::vector<pid_t> WorkerPids() const {
    namespace fs = std::filesystem;
    const std::string bin = E2eBin("MLASERVE_WORKER_BIN", MLASERVE_WORKER_BIN);
    std::vector<pid_t> pids;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc", ec)) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream in(e.path() / "cmdline");
      const std::string cmd((std::istreambuf_iterator<char>(in)), {});
      const bool is_worker = cmd.compare(0, cmd.find('\0'), bin) == 0;
      if (is_worker && cmd.find(dir_.filename().string()) != std::string::npos) {
        pids.push_back(static_cast<pid_t>(std::stol(name)));
      }
    }
    return pids;
  }

  int WaitCoordinator(std::chrono::seconds timeout) {
    const int rc = Wait(coordinator_, timeout);
    if (rc != -1) coordinator_ = -1;
    return rc;
  }

  void Kill() {
    if (coordinator_ > 0) {
      kill(coordinator_, SIGKILL);
      Wait(coordinator_, std::chrono::seconds(5));
      coordinator_ = -1;
    }
    if (workers_ > 0) {
      KillWorkers();
      Wait(workers_, std::chrono::seconds(5));
      workers_ = -1;
    }
  }

  const std::string& endpoint() const { return client_endpoint_; }
  pid_t coordinator_pid() const { return coordinator_; }
  int metrics_port() const { return metrics_port_; }

  std::string Logs() const {
    std::string out;
    for (const char* f : {"coordinator.log", "workers.log", "workers-restarted.log"}) {
      std::ifstream in(dir_ / f);
      out += std::string("--- ") + f + "\n" + std::string((std::istreambuf_iterator<char>(in)), {});
    }
    return out;
  }

  // GET /metrics from the coordinator's exposer.
  std::string Metrics() const { return ScrapeMetrics(metrics_port_); }

  // The value of the first sample of `name` (exact series name, e.g. "mlaserve_preemptions_total").
  double MetricValue(const std::string& name) const { return MetricSample(Metrics(), name); }

 private:
  static pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_t pid = -1;
    posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    return pid;
  }
  static bool Exited(pid_t pid) {
    int status;
    return waitpid(pid, &status, WNOHANG) == pid;
  }
  static int Wait(pid_t pid, std::chrono::seconds timeout) {
    if (pid <= 0) return -1;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      const pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (r < 0) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  int ParseMetricsPort() const {
    std::ifstream in(dir_ / "coordinator.log");
    const std::string log((std::istreambuf_iterator<char>(in)), {});
    std::smatch m;
    if (std::regex_search(log, m, std::regex("metrics on port ([0-9]+)"))) return std::stoi(m[1].str());
    return 0;
  }

  static inline int counter_ = 0;
  std::filesystem::path dir_;
  std::string client_endpoint_;
  pid_t coordinator_ = -1;
  pid_t workers_ = -1;
  std::vector<std::string> worker_command_;
  int metrics_port_ = 0;
};

}  // namespace mlaserve
