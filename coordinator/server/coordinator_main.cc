// mlaserve-coordinator: serves clients for one model replica whose workers run under mpirun.
//
//   mlaserve-coordinator --model DIR [--listen tcp://0.0.0.0:5555] [--worker-listen tcp://0.0.0.0:5556]
//       [--metrics 0.0.0.0:9400] [--name NAME] [--max-running N] [--max-step-tokens N]
//       [--max-waiting N] [--prefill-chunk N] [--max-model-len N] [--no-prefix-cache]
//       [--heartbeat-timeout-ms N] [--step-timeout-ms N] [--drain-timeout-ms N]
//       [--worker-start-timeout-ms N] [--client-backlog-limit-bytes N]
//       [--curve-secret-key FILE --curve-allowed-clients FILE] [--worker-curve-key FILE]
// SIGTERM/SIGINT drain in-flight requests up to the drain timeout, then abort the rest.
// A failed worker job (a rank died or hung) fails the requests in flight and the coordinator
// waits for a new job (deploy/mlaserve-launch restarts it); --heartbeat-timeout-ms (10000) is how
// long each rank may go without a beat. --client-backlog-limit-bytes (16 MiB): replies held for a
// client that does not read them, past which its requests are aborted.
// --curve-secret-key (the server's key pair, mode 0600) and --curve-allowed-clients (one client
// public key a line) make the client socket CURVE-authenticated and encrypted; --worker-curve-key
// does the same for the worker socket with the job's key pair (deploy/mlaserve-launch makes one
// when the worker socket is not on loopback). Key files: coordinator/auth/curve_keys.h.
#include <csignal>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "coordinator/server/coordinator.h"

namespace {
mlaserve::Coordinator* g_coordinator = nullptr;
void OnSignal(int) {
  if (g_coordinator != nullptr) g_coordinator->RequestShutdown();
}
int Usage(const std::string& why) {
  std::fprintf(stderr, "mlaserve-coordinator: %s (see the comment at the top of coordinator_main.cc or README.md)\n", why.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  mlaserve::CoordinatorOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-prefix-cache") {
      o.prefix_caching = false;
      continue;
    }
    if (i + 1 >= argc) return Usage(a + " needs a value");
    const std::string v = argv[++i];
    auto num = [&](auto* out) { return absl::SimpleAtoi(v, out); };
    auto ms = [&](std::chrono::milliseconds* out) {
      int64_t n;
      if (!absl::SimpleAtoi(v, &n) || n <= 0) return false;
      *out = std::chrono::milliseconds(n);
      return true;
    };
    bool ok = true;
    if (a == "--model") o.model_dir = v;
    else if (a == "--listen") o.client_endpoint = v;
    else if (a == "--worker-listen") o.worker_endpoint = v;
    else if (a == "--metrics") o.metrics_address = v == "off" ? "" : v;
    else if (a == "--name") o.model_name = v;
    else if (a == "--curve-secret-key") o.curve_secret_key_file = v;
    else if (a == "--curve-allowed-clients") o.curve_allowed_clients_file = v;
    else if (a == "--worker-curve-key") o.worker_curve_key_file = v;
    else if (a == "--max-running") ok = num(&o.max_running_seqs);
    else if (a == "--max-step-tokens") ok = num(&o.max_tokens_per_step);
    else if (a == "--max-waiting") ok = num(&o.max_waiting);
    else if (a == "--prefill-chunk") ok = num(&o.max_prefill_chunk);
    else if (a == "--max-model-len") ok = num(&o.max_model_len);
    else if (a == "--heartbeat-timeout-ms") ok = ms(&o.heartbeat_timeout);
    else if (a == "--step-timeout-ms") ok = ms(&o.step_timeout);
    else if (a == "--drain-timeout-ms") ok = ms(&o.drain_timeout);
    else if (a == "--worker-start-timeout-ms") ok = ms(&o.worker_start_timeout);
    else if (a == "--client-backlog-limit-bytes") ok = num(&o.client_backlog_limit_bytes) && o.client_backlog_limit_bytes > 0;
    else return Usage("unknown argument " + a);
    if (!ok) return Usage(a + ": bad value " + v);
  }
  if (o.model_dir.empty()) return Usage("--model DIR is required");
  mlaserve::Coordinator coordinator(o);
  g_coordinator = &coordinator;
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  if (auto s = coordinator.Start(); !s.ok()) {
    std::fprintf(stderr, "mlaserve-coordinator: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "mlaserve-coordinator: serving %s on %s%s (metrics on port %d)\n", o.model_dir.c_str(),
               o.client_endpoint.c_str(), o.curve_secret_key_file.empty() ? "" : " (CURVE)",
               coordinator.metrics_port());
  const int rc = coordinator.Run();
  std::fprintf(stderr, "mlaserve-coordinator: stopped (%s)\n", rc == 0 ? "clean" : "worker failed");
  return rc;
}
