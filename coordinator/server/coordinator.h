// The coordinator: one process that serves clients on a ZeroMQ ROUTER socket, prepares their
// requests (tokenizer, chat template), schedules them (continuous batching over the paged KV
// cache), sends one step plan at a time to worker rank 0, streams the sampled tokens back as
// text deltas, and exports Prometheus metrics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduler/stop_strings.h"
#include "coordinator/server/metrics.h"
#include "coordinator/server/request_builder.h"
#include "coordinator/tokenizer/incremental_detokenizer.h"

namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq

namespace mlaserve {

class MessageScratch;
class ZapAuthenticator;

struct CoordinatorOptions {
  std::string model_dir;
  std::string model_name;  // metrics label and model info; default: folder name
  std::string client_endpoint = "tcp://127.0.0.1:5555";
  std::string worker_endpoint = "tcp://127.0.0.1:5556";
  std::string metrics_address = "127.0.0.1:9400";  // empty: no HTTP endpoint
  // CURVE on the client socket (coordinator/auth/curve_keys.h: file formats): the server's key
  // pair and the public keys of the clients it serves. Both or neither; neither: any peer that
  // reaches the endpoint is served (fine on loopback or ipc://).
  std::string curve_secret_key_file;
  std::string curve_allowed_clients_file;
  // CURVE on the worker socket: one key pair (the launcher makes one per job) that the
  // coordinator serves with and worker rank 0 connects with. Empty: NULL mechanism (loopback).
  std::string worker_curve_key_file;
  int32_t max_running_seqs = 256;
  int32_t max_tokens_per_step = 2048;
  int32_t max_waiting = 1024;
  int32_t max_prefill_chunk = 512;
  int32_t max_model_len = 0;  // 0: the model's max_position_embeddings, capped by the cache
  bool prefix_caching = true;
  std::chrono::milliseconds worker_start_timeout{300000};
  std::chrono::milliseconds heartbeat_timeout{3000};
  std::chrono::milliseconds step_timeout{120000};
  std::chrono::milliseconds drain_timeout{30000};
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();

  // Binds the sockets and waits for worker rank 0's `ready` (or its load error).
  absl::Status Start();
  // Serves until shutdown; returns 0 after a clean drain, 1 when the worker job failed.
  int Run();
  // Asks Run() to drain and stop (async-signal-safe: sets a flag).
  void RequestShutdown() { shutdown_requested_.store(true); }

  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

 private:
  struct Req;
  void HandleClientMessage(const std::string& identity, const std::string& bytes);
  void HandleWorkerMessage(const std::string& identity, const std::string& bytes);
  void MaybeSendStep();
  void ProcessEvents(const std::vector<SeqEvent>& events,
                     const std::map<uint64_t, std::vector<uint8_t>>& logprob_blobs);
  void FinishRequest(Req& r, const std::string& reason, const std::string& message);
  void FailAll(const std::string& message);
  void SendReply(const std::string& identity, const std::string& bytes);
  void SendReplyBytes(const std::string& identity, const uint8_t* data, size_t size);
  // Sends one flat ServerReply to `identity`, or, while a step result is processed and the
  // request takes batched replies, appends it to that client's frame for this step.
  void Emit(const std::string& identity, bool batched, const uint8_t* data, size_t size);
  void Emit(const std::string& identity, bool batched, const std::string& bytes);
  void FlushBatches();
  // Scratch for the per-token replies and the step plans (no heap traffic per message).
  std::unique_ptr<MessageScratch> reply_scratch_, plan_scratch_;
  // Frames being collected for clients with batched requests (word-aligned bytes), by identity.
  std::unordered_map<std::string, std::vector<uint64_t>> batches_;
  bool collecting_ = false;
  void SendError(const std::string& identity, uint64_t request_id, int code,
                 const std::string& message);
  void UpdateGauges();

  // Binds the sockets, with CURVE and the ZAP handler where the options ask for it.
  absl::Status BindSockets();

  CoordinatorOptions options_;
  std::unique_ptr<zmq::context_t> ctx_;
  // Declared after the context and before the sockets: it outlives the CURVE sockets (libzmq
  // accepts every CURVE peer when no ZAP handler is bound) and goes before the context.
  std::unique_ptr<ZapAuthenticator> zap_;
  std::unique_ptr<zmq::socket_t> clients_;
  std::unique_ptr<zmq::socket_t> worker_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  ModelText text_;
  std::string model_info_json_;
  int ranks_ = 1;

  std::map<uint64_t, std::unique_ptr<Req>> reqs_;                   // by sequence id
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_client_;  // (identity, request id) -> seq
  uint64_t next_seq_id_ = 1;
  bool step_in_flight_ = false;
  uint64_t in_flight_step_ = 0;
  std::chrono::steady_clock::time_point step_sent_;
  std::chrono::steady_clock::time_point last_heartbeat_;
  std::chrono::steady_clock::time_point last_ping_;
  bool worker_failed_ = false;
  std::string worker_failure_;
  std::atomic<bool> shutdown_requested_{false};
  bool draining_ = false;
  double pending_overhead_s_ = 0;
  int64_t seen_prefix_queries_ = 0;
  int64_t seen_prefix_hits_ = 0;
  std::chrono::steady_clock::time_point drain_deadline_;
};

}  // namespace mlaserve
