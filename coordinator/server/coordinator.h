// The coordinator: one process that serves clients on a ZeroMQ ROUTER socket, prepares their
// requests (tokenizer, chat template), schedules them (continuous batching over the paged KV
// cache), sends one step plan at a time to worker rank 0, streams the sampled tokens back as
// text deltas, and exports Prometheus metrics.
//
// Worker jobs come and go under it. Every rank of the job beats on a socket of its own; a rank
// whose connection closes (its process died) or whose beats stop for --heartbeat-timeout-ms
// fails the job, named in the message: the requests in flight end with finish reason error and
// code workerFailed, health answers not ok and new requests get a workerFailed error, while the
// client socket stays up. The next job's rank 0 `ready` (a restart by deploy/mlaserve-launch)
// brings serving back with that job's KV capacity; clients keep their connections.
//
// A client that does not read its replies never blocks the loop: what ZeroMQ's queue for it
// cannot take waits in a per-client backlog; past client_backlog_limit_bytes its requests are
// aborted (their finals still queued: a final is never dropped).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
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
  // Per rank; beats come every 250 ms. A rank that dies is seen at once (its connection closes);
  // this bounds hangs and hosts that vanish without closing connections. Not lower by default:
  // on the loaded 2-core dev machine a healthy rank's beats stopped for up to 7.7 s (its thread
  // not run), and 1.5 s and 3 s both failed healthy jobs there (bench/RESULTS.md, issue 19).
  std::chrono::milliseconds heartbeat_timeout{10000};
  // Replies held for one client beyond ZeroMQ's queue (bytes); past it the client's requests
  // are aborted and, while it stays past it, new requests refused.
  int64_t client_backlog_limit_bytes = int64_t{16} << 20;
  std::chrono::milliseconds step_timeout{120000};
  std::chrono::milliseconds drain_timeout{30000};
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();

  // Binds the sockets and waits for worker rank 0's `ready` (or its load error).
  absl::Status Start();
  // Serves until shutdown, through worker job failures and restarts; returns 0 after a clean
  // drain, 1 when it stopped with no worker job serving.
  int Run();
  // Asks Run() to drain and stop (async-signal-safe: sets a flag).
  void RequestShutdown() { shutdown_requested_.store(true); }

  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Req;
  // The serving worker job: which ranks beat, when each last did, and which connection (file
  // descriptor, from ZMQ_SRCFD) carries each rank's messages, so that a closed connection names
  // its rank.
  struct WorkerJob {
    int ranks = 1;
    std::vector<int> heartbeat_ranks;            // ranks that said they would beat (ready message)
    std::map<int, Clock::time_point> last_beat;  // ranks watched: rank 0, and those seen beating
    std::map<int, int> fd_rank;
    int worker_fd = -1, heartbeat_fd = -1;  // rank 0's two connections (-1: not seen)
    Clock::time_point joined;
    bool warned_silent = false;  // a rank that said it would beat never did (logged once)
  };
  // A client's replies that ZeroMQ's queue for it could not take yet, oldest first.
  struct ClientBacklog {
    std::deque<std::string> frames;
    int64_t bytes = 0;
    Clock::time_point last_progress;  // created or last frame taken
    bool over_limit = false;
  };
  void HandleClientMessage(const std::string& identity, const std::string& bytes);
  void HandleWorkerMessage(const std::string& identity, const std::string& bytes, int fd);
  // A job's `ready` JSON: the first (Start) or a restarted one; sets up the scheduler for its
  // KV capacity. A job of another model (vocabulary, end tokens) is refused.
  absl::Status AcceptWorkerJob(const std::string& ready_json, int fd);
  // Connection events of the worker socket: a watched rank's connection closing fails the job.
  void ReadWorkerMonitor();
  // Notes that `fd` carries `rank`'s messages (after reading the pending connection events).
  void MapWorkerConnection(int fd, int rank);
  void CheckWorkerLiveness(Clock::time_point now);
  // Asks a job that is still up to exit (rank 0's main loop, and its heartbeat thread, which
  // ends the process if the main loop is stuck), so that the launcher can start another.
  void StopWorkerJob(bool to_main, bool to_heartbeat);
  void MaybeSendStep();
  void ProcessEvents(const std::vector<SeqEvent>& events,
                     const std::map<uint64_t, std::vector<uint8_t>>& logprob_blobs);
  // error_code (a wire::ErrorCode) goes with finish reason "error".
  void FinishRequest(Req& r, const std::string& reason, const std::string& message,
                     int error_code = -1);
  // Fails the serving worker job: every request in flight ends with workerFailed.
  void FailAll(const std::string& message);
  void SendReply(const std::string& identity, const std::string& bytes);
  // `stream`: a chunk or final of a request in flight (never dropped); otherwise (errors,
  // health, model info) dropped while the client's backlog is past its limit.
  void SendReplyBytes(const std::string& identity, const uint8_t* data, size_t size,
                      bool stream = false);
  enum class SendOutcome { kSent, kFull, kGone };
  SendOutcome TrySend(const std::string& identity, const uint8_t* data, size_t size);
  // The client went away (a send found no peer): its requests are aborted, its backlog freed.
  void ClientGone(const std::string& identity);
  // Sends what the backlogs hold as far as the clients' queues take it.
  void FlushBacklogs();
  // Aborts the requests of clients whose backlog passed the limit (deferred to the loop: the
  // send that finds it may be inside the handling of a step's results).
  void AbortSlowClients();
  bool ClientHasRequests(const std::string& identity) const;
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
  Clock::time_point failed_at_;
  WorkerJob job_;
  std::map<int, int> pending_beats_;  // rank -> connection of beats seen while none was watched
  std::unique_ptr<zmq::socket_t> worker_monitor_;  // ZMQ_EVENT_ACCEPTED / DISCONNECTED of worker_
  std::unordered_map<std::string, ClientBacklog> backlogs_;
  int64_t backlog_bytes_ = 0;
  int64_t backlog_peak_bytes_ = 0;
  std::vector<std::string> slow_clients_;  // past the backlog limit, requests not yet aborted
  std::atomic<bool> shutdown_requested_{false};
  bool draining_ = false;
  double pending_overhead_s_ = 0;
  int64_t seen_prefix_queries_ = 0;
  int64_t seen_prefix_hits_ = 0;
  std::chrono::steady_clock::time_point drain_deadline_;
};

}  // namespace mlaserve
