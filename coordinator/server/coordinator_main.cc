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
#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>

#include "common/command_line.h"
#include "coordinator/server/coordinator.h"

// Defaults are CoordinatorOptions' (coordinator.h); the ranges keep the scheduler's sizes
// positive (0 where it means "none" or "the model's").
ABSL_FLAG(std::string, model, "",
          "The model folder (config.json, safetensors, tokenizer files); required.");
ABSL_FLAG(std::string, listen, "tcp://127.0.0.1:5555", "The clients' ZeroMQ endpoint (ROUTER).");
ABSL_FLAG(std::string, worker_listen, "tcp://127.0.0.1:5556",
          "The endpoint worker rank 0 connects to.");
ABSL_FLAG(std::string, metrics, "127.0.0.1:9400",
          "HOST:PORT of the Prometheus /metrics endpoint (port 0: any free port; off: none).");
ABSL_FLAG(std::string, name, "",
          "The model name in metrics and model info (default: the folder's name).");
ABSL_FLAG(int32_t, max_running, 256, "Most sequences holding KV blocks at once, in [1, 65536].");
ABSL_FLAG(int32_t, max_step_tokens, 2048,
          "Most tokens computed per step (decodes and prefill chunks), in [1, 1048576].");
ABSL_FLAG(int32_t, max_waiting, 1024,
          "Queued requests beyond this are refused as overloaded, in [1, 1048576].");
ABSL_FLAG(int32_t, prefill_chunk, 512,
          "Most prompt tokens of one sequence per step, in [0, 1048576] (0: no limit).");
ABSL_FLAG(
    int32_t, max_model_len, 0,
    "Context length (prompt + output), in [0, 16777216] (0: the model's, capped by the KV cache).");
ABSL_FLAG(bool, prefix_cache, true,
          "Reuse the KV blocks of cached prompt prefixes (--no-prefix-cache: off).");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 10000,
          "A worker rank silent this long (its heartbeats stopped; a rank that dies is seen at "
          "once): the job has failed, in [1, 86400000].");
ABSL_FLAG(int64_t, client_backlog_limit_bytes, int64_t{16} << 20,
          "Replies held for one client beyond ZeroMQ's queue; past it the client's requests are "
          "aborted, in [1, 2^40].");
ABSL_FLAG(int64_t, step_timeout_ms, 120000,
          "A step without its result this long: the job has failed, in [1, 86400000].");
ABSL_FLAG(int64_t, drain_timeout_ms, 30000,
          "On SIGTERM/SIGINT, requests in flight get this long to finish, in [1, 86400000].");
ABSL_FLAG(int64_t, worker_start_timeout_ms, 300000,
          "How long the workers may take to load and say ready, in [1, 86400000].");
ABSL_FLAG(std::string, curve_secret_key, "",
          "The server's CURVE key pair file (mode 0600): the client socket authenticates and "
          "encrypts. Needs --curve-allowed-clients.");
ABSL_FLAG(std::string, curve_allowed_clients, "",
          "The clients' public keys, one a line: only they are served. Needs --curve-secret-key.");
ABSL_FLAG(
    std::string, worker_curve_key, "",
    "The job's CURVE key pair file for the worker socket (the workers' --coordinator-curve-key).");

namespace {
// The handlers are installed first thing in main, so a SIGTERM that arrives while the coordinator
// is still being built (a launcher giving up on a job within a second of starting it) is kept in
// g_stop_early and honoured once the coordinator exists, instead of killing the process by the
// default action with nothing said.
std::atomic<mlaserve::Coordinator*> g_coordinator{nullptr};
volatile std::sig_atomic_t g_stop_early = 0;
void OnSignal(int) {
  if (mlaserve::Coordinator* c = g_coordinator.load(); c != nullptr) {
    c->RequestShutdown();
  } else {
    g_stop_early = 1;
  }
}
constexpr char kUsage[] = "mlaserve-coordinator --model DIR [flags]";
}  // namespace

int main(int argc, char** argv) {
  using mlaserve::FlagInRange;
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  mlaserve::ParseFlags(argc, argv, kUsage);
  mlaserve::CoordinatorOptions o;
  o.model_dir = mlaserve::RequiredFlag(FLAGS_model, "DIR");
  o.client_endpoint = absl::GetFlag(FLAGS_listen);
  o.worker_endpoint = absl::GetFlag(FLAGS_worker_listen);
  o.metrics_address = absl::GetFlag(FLAGS_metrics);
  if (o.metrics_address == "off") o.metrics_address.clear();
  o.model_name = absl::GetFlag(FLAGS_name);
  o.curve_secret_key_file = absl::GetFlag(FLAGS_curve_secret_key);
  o.curve_allowed_clients_file = absl::GetFlag(FLAGS_curve_allowed_clients);
  o.worker_curve_key_file = absl::GetFlag(FLAGS_worker_curve_key);
  o.max_running_seqs = FlagInRange(FLAGS_max_running, 1, 1 << 16);
  o.max_tokens_per_step = FlagInRange(FLAGS_max_step_tokens, 1, 1 << 20);
  o.max_waiting = FlagInRange(FLAGS_max_waiting, 1, 1 << 20);
  o.max_prefill_chunk = FlagInRange(FLAGS_prefill_chunk, 0, 1 << 20);
  o.max_model_len = FlagInRange(FLAGS_max_model_len, 0, 1 << 24);
  o.prefix_caching = absl::GetFlag(FLAGS_prefix_cache);
  constexpr int64_t kDayMs = 86400000;
  o.heartbeat_timeout =
      std::chrono::milliseconds(FlagInRange(FLAGS_heartbeat_timeout_ms, 1, kDayMs));
  o.step_timeout = std::chrono::milliseconds(FlagInRange(FLAGS_step_timeout_ms, 1, kDayMs));
  o.drain_timeout = std::chrono::milliseconds(FlagInRange(FLAGS_drain_timeout_ms, 1, kDayMs));
  o.worker_start_timeout =
      std::chrono::milliseconds(FlagInRange(FLAGS_worker_start_timeout_ms, 1, kDayMs));
  o.client_backlog_limit_bytes = FlagInRange(FLAGS_client_backlog_limit_bytes, 1, int64_t{1} << 40);
  mlaserve::Coordinator coordinator(o);
  g_coordinator.store(&coordinator);
  if (g_stop_early != 0) coordinator.RequestShutdown();  // a signal before the store above
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
