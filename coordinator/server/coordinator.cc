#include "coordinator/server/coordinator.h"

#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capnp/message.h"
#include "capnp/serialize.h"
#include "coordinator/auth/curve_keys.h"
#include "coordinator/auth/zap_authenticator.h"
#include "mlaserve.capnp.h"
#include "nlohmann/json.hpp"
#include "schema/message_scratch.h"
#include "zmq.hpp"

namespace mlaserve {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string Bytes(capnp::MessageBuilder& msg) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
  auto b = words.asBytes();
  return std::string(reinterpret_cast<const char*>(b.begin()), b.size());
}

// Copies a frame into word-aligned memory; empty when it is not a whole number of words.
kj::Array<capnp::word> Words(const std::string& bytes) {
  if (bytes.empty() || bytes.size() % sizeof(capnp::word) != 0) return nullptr;
  auto words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  return words;
}

constexpr unsigned kReplyWords = 64;

// The rank a heartbeat socket's routing id names: "heartbeat" (rank 0, as it always was) or
// "heartbeat-R"; -1 for any other identity.
int HeartbeatRank(const std::string& identity) {
  if (identity == "heartbeat") return 0;
  constexpr char kPrefix[] = "heartbeat-";
  if (identity.rfind(kPrefix, 0) != 0) return -1;
  const std::string digits = identity.substr(sizeof(kPrefix) - 1);
  if (digits.empty() || digits.size() > 6 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoi(digits);
}

// A ZeroMQ routing id (5 random bytes unless the peer set one) in a log line.
std::string PrintableIdentity(const std::string& identity) {
  std::string out;
  for (unsigned char c : identity) absl::StrAppend(&out, absl::Hex(c, absl::kZeroPad2));
  return out;
}

// A frame's file descriptor (ZMQ_SRCFD): which connection it came over.
int SourceFd(zmq::message_t& m) {
  const int fd = zmq_msg_get(m.handle(), ZMQ_SRCFD);
  return fd < 0 ? -1 : fd;
}

// A client with backlogged replies that reads nothing for this long and has no request left
// loses them (counted in mlaserve_client_replies_dropped_total): nothing else bounds what
// clients that connect, ask and never read could make the coordinator hold.
constexpr std::chrono::seconds kIdleBacklogDrop{60};

wire::FinishReason WireReason(const std::string& reason) {
  if (reason == "stop") return wire::FinishReason::STOP;
  if (reason == "length") return wire::FinishReason::LENGTH;
  if (reason == "abort") return wire::FinishReason::ABORT;
  return wire::FinishReason::ERROR;
}

}  // namespace

struct Coordinator::Req {
  uint64_t seq_id = 0;
  std::string identity;
  uint64_t request_id = 0;
  PreparedRequest prep;
  std::unique_ptr<IncrementalDetokenizer> detok;
  std::unique_ptr<StopStringMatcher> stop;
  std::vector<int32_t> output;
  std::string text;
  uint32_t cached_tokens = 0;
  bool scheduled = false;
  Clock::time_point arrival, first_scheduled, first_token, last_token;
  bool has_first_token = false;
  bool stop_matched = false;
  bool params_sent = false;
  bool batched = false;             // replies may share frames (GenerateRequest.batchedReplies)
  std::vector<int32_t> sent_table;  // the block table the workers hold (plans send changes)
};

Coordinator::Coordinator(CoordinatorOptions options)
    : reply_scratch_(std::make_unique<MessageScratch>(kReplyWords)),
      plan_scratch_(std::make_unique<MessageScratch>(4096)),
      options_(std::move(options)) {
  if (options_.model_name.empty()) {
    options_.model_name = std::filesystem::path(options_.model_dir).filename().string();
    if (options_.model_name.empty()) options_.model_name = "model";
  }
}

Coordinator::~Coordinator() {
  // The worker socket's monitor is stopped before either socket closes, and the events it
  // already queued are read and freed. Closed the other way round (members die in reverse
  // order: the monitor's reader first), libzmq's internal monitor socket keeps sending into a
  // pipe nobody reads, and those event frames are never freed (LeakSanitizer found 77 bytes a
  // connection in every test that starts a coordinator).
  if (worker_ && worker_monitor_) {
    (void)zmq_socket_monitor(worker_->handle(), nullptr, 0);
    zmq::message_t frame;
    while (worker_monitor_->recv(frame, zmq::recv_flags::dontwait)) {
    }
  }
  worker_monitor_.reset();
  worker_.reset();
}

absl::Status Coordinator::BindSockets() {
  ctx_ = std::make_unique<zmq::context_t>(1);
  const bool client_curve =
      !options_.curve_secret_key_file.empty() || !options_.curve_allowed_clients_file.empty();
  const bool worker_curve = !options_.worker_curve_key_file.empty();
  if (!options_.curve_secret_key_file.empty() && options_.curve_allowed_clients_file.empty()) {
    return absl::InvalidArgumentError(
        "--curve-secret-key needs --curve-allowed-clients FILE (the public keys of the clients "
        "to serve)");
  }
  if (options_.curve_secret_key_file.empty() && !options_.curve_allowed_clients_file.empty()) {
    return absl::InvalidArgumentError(
        "--curve-allowed-clients needs --curve-secret-key FILE (the server's key pair)");
  }
  CurveKeyPair client_pair, worker_pair;
  std::map<std::string, std::vector<AllowedCurveKey>> domains;
  if (client_curve || worker_curve) {
    if (auto s = CheckCurveSupport(); !s.ok()) return s;
  }
  if (client_curve) {
    auto pair = LoadCurveKeyPair(options_.curve_secret_key_file);
    if (!pair.ok()) return pair.status();
    client_pair = std::move(*pair);
    auto allowed = LoadAllowedCurveKeys(options_.curve_allowed_clients_file);
    if (!allowed.ok()) return allowed.status();
    domains["clients"] = std::move(*allowed);
  }
  if (worker_curve) {
    auto pair = LoadCurveKeyPair(options_.worker_curve_key_file);
    if (!pair.ok()) return pair.status();
    worker_pair = std::move(*pair);
    // Rank 0 proves it holds the job's key pair: the same pair on both sides.
    domains["workers"] = {{worker_pair.public_key, "worker rank 0"}};
  }
  if (!domains.empty()) {
    auto zap = ZapAuthenticator::Start(*ctx_, domains, "mlaserve-coordinator");
    if (!zap.ok()) return zap.status();
    zap_ = std::move(*zap);
  }
  worker_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::router);
  worker_->set(zmq::sockopt::linger, 0);
  // Attached before binding, so that no connection of a rank goes unseen: a rank's process
  // that dies closes its connections at once, which names it faster than any heartbeat.
  const std::string monitor_endpoint = "inproc://mlaserve-worker-monitor";
  if (zmq_socket_monitor(worker_->handle(), monitor_endpoint.c_str(),
                         ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0) {
    return absl::InternalError(absl::StrCat("zmq_socket_monitor: ", zmq_strerror(zmq_errno())));
  }
  worker_monitor_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::pair);
  worker_monitor_->set(zmq::sockopt::linger, 0);
  worker_monitor_->connect(monitor_endpoint);
  if (worker_curve) {
    worker_->set(zmq::sockopt::curve_server, 1);
    worker_->set(zmq::sockopt::curve_secretkey, worker_pair.secret_key);
    worker_->set(zmq::sockopt::zap_domain, "workers");
  }
  clients_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::router);
  clients_->set(zmq::sockopt::linger, 0);
  // Sending to a client that went away fails instead of being dropped silently: that is how a
  // disconnect is noticed (its requests are aborted at once).
  clients_->set(zmq::sockopt::router_mandatory, 1);
  clients_->set(zmq::sockopt::maxmsgsize, int64_t{64} << 20);
  if (client_curve) {
    clients_->set(zmq::sockopt::curve_server, 1);
    clients_->set(zmq::sockopt::curve_secretkey, client_pair.secret_key);
    clients_->set(zmq::sockopt::zap_domain, "clients");
  }
  try {
    worker_->bind(options_.worker_endpoint);
    clients_->bind(options_.client_endpoint);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat("cannot bind ", options_.client_endpoint, " / ",
                                               options_.worker_endpoint, ": ", e.what()));
  }
  if (!client_curve && !IsLoopbackEndpoint(options_.client_endpoint)) {
    std::fprintf(stderr,
                 "mlaserve-coordinator: warning: clients on %s are not authenticated: anyone who "
                 "can reach it can submit work (CURVE: --curve-secret-key and "
                 "--curve-allowed-clients; deploy/README.md, Security)\n",
                 options_.client_endpoint.c_str());
  }
  if (!worker_curve && !IsLoopbackEndpoint(options_.worker_endpoint)) {
    std::fprintf(stderr,
                 "mlaserve-coordinator: warning: the worker socket %s is not on loopback and not "
                 "authenticated: anyone who can reach it can pose as the workers "
                 "(--worker-curve-key; deploy/README.md, Security)\n",
                 options_.worker_endpoint.c_str());
  }
  return absl::OkStatus();
}

absl::Status Coordinator::Start() {
  if (auto s = BindSockets(); !s.ok()) return s;
  // Wait for rank 0: `ready` with the model's facts, or the error that stopped loading.
  const auto deadline = Clock::now() + options_.worker_start_timeout;
  for (;;) {
    if (shutdown_requested_.load()) {
      return absl::CancelledError("asked to stop before a worker job connected");
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no worker connected to ", options_.worker_endpoint, " within ",
                       options_.worker_start_timeout.count() / 1000, " s"));
    }
    zmq::pollitem_t item{worker_->handle(), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1,
                    std::min<std::chrono::milliseconds>(left, std::chrono::milliseconds(500))) == 0)
        continue;
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;  // a signal (SIGTERM) interrupted the wait
      continue;
    }
    zmq::message_t id, body;
    if (!worker_->recv(id) || !worker_->recv(body)) continue;
    if (const int rank = HeartbeatRank(id.to_string()); rank >= 0) {
      pending_beats_[rank] = SourceFd(body);  // watched from the job's `ready` on
      continue;
    }
    if (id.to_string() != "worker") continue;
    auto words = Words(body.to_string());
    if (words.size() == 0) continue;
    capnp::FlatArrayMessageReader reader(words);
    auto r = reader.getRoot<wire::StepResult>();
    if (r.isError())
      return absl::FailedPreconditionError(
          absl::StrCat("worker failed to start: ", r.getError().cStr()));
    if (!r.isReady()) continue;
    return AcceptWorkerJob(r.getReady().cStr(), SourceFd(body));
  }
}

absl::Status Coordinator::AcceptWorkerJob(const std::string& ready_json, int fd) {
  nlohmann::json info = nlohmann::json::parse(ready_json, nullptr, false);
  if (info.is_discarded() || !info.contains("vocab_size") ||
      !info["vocab_size"].is_number_integer())
    return absl::InternalError("worker sent a malformed ready message");
  int ranks = 1, kv_blocks = 0, vocab = 0, max_position = 4096, dcp = 1;
  std::vector<int32_t> eos;
  std::vector<int> heartbeat_ranks;
  try {  // a field of the wrong type is a bad message, not a crash
    ranks = info.value("ranks", 1);
    kv_blocks = info.value("kv_blocks", 0);
    vocab = info["vocab_size"].get<int>();
    eos = info.value("eos_token_ids", std::vector<int32_t>{});
    max_position = info.value("max_position_embeddings", 4096);
    dcp = info.value("dcp", 1);
    heartbeat_ranks = info.value("heartbeat_ranks", std::vector<int>{0});
  } catch (const nlohmann::json::exception& e) {
    return absl::InternalError(absl::StrCat("worker sent a malformed ready message: ", e.what()));
  }
  if (ranks < 1 || ranks > (1 << 16))
    return absl::InternalError(
        absl::StrCat("worker sent a malformed ready message: ", ranks, " ranks"));
  int max_len = options_.max_model_len > 0 ? options_.max_model_len : max_position;
  max_len = std::min(max_len, kv_blocks * kKvBlockTokens);
  const bool first = scheduler_ == nullptr;
  if (first) {
    auto text = ModelText::Load(options_.model_dir, vocab, max_len, eos);
    if (!text.ok()) return text.status();
    text_ = std::move(*text);
  } else {
    // The tokenizer and chat template stay: a job of another model cannot replace this one.
    if (vocab != text_.vocab_size || eos != text_.eos_ids) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a worker job for another model connected (vocabulary ", vocab, ", expected ",
          text_.vocab_size, "; or other end-of-sequence tokens): refused; serve ",
          options_.model_dir, " with it"));
    }
  }
  SchedulerConfig sc;
  sc.num_blocks = kv_blocks;
  sc.max_running_seqs = options_.max_running_seqs;
  sc.max_tokens_per_step = options_.max_tokens_per_step;
  sc.max_model_len = max_len;
  sc.max_waiting = options_.max_waiting;
  sc.max_prefill_chunk = options_.max_prefill_chunk;
  sc.enable_prefix_caching = options_.prefix_caching;
  sc.vocab_size = text_.vocab_size;
  // Step ids continue the failed job's: its late results match no step of the new one.
  sc.first_step_id = first ? 0 : scheduler_->next_step_id();
  auto sched = Scheduler::Create(sc);
  if (!sched.ok()) return sched.status();
  scheduler_ = std::move(*sched);
  text_.max_model_len = max_len;  // this job's context (its KV capacity may differ)
  seen_prefix_queries_ = seen_prefix_hits_ = 0;
  ranks_ = ranks;
  if (first) {
    metrics_ =
        std::make_unique<CoordinatorMetrics>(options_.model_name, options_.metrics_address, ranks_);
  } else {
    metrics_->AddRanks(ranks_);
  }
  metrics_->kv_blocks_total->Set(kv_blocks);
  metrics_->kv_dcp_ranks->Set(dcp);
  metrics_->worker_up->Set(1);
  info["name"] = options_.model_name;
  info["max_model_len"] = max_len;
  info["max_running_seqs"] = sc.max_running_seqs;
  info["max_tokens_per_step"] = sc.max_tokens_per_step;
  info["tokenizer"] = text_.tokenizer != nullptr;
  info["chat_template"] = text_.chat_template.has_value();
  model_info_json_ = info.dump();
  const auto now = Clock::now();
  job_ = WorkerJob{};
  job_.ranks = ranks;
  job_.heartbeat_ranks = heartbeat_ranks;
  job_.joined = now;
  // Connections that closed before this `ready` are no longer anyone's (and their beats, seen
  // while no job was watched, are forgotten below).
  ReadWorkerMonitor();
  job_.last_beat[0] = now;  // rank 0 is watched from its `ready` on
  if (fd >= 0) job_.fd_rank[fd] = 0;
  job_.worker_fd = fd;
  // Ranks that beat before the `ready` reached us are watched from now on.
  for (const auto& [rank, beat_fd] : pending_beats_) {
    if (rank >= ranks) continue;
    job_.last_beat[rank] = now;
    if (beat_fd >= 0) job_.fd_rank[beat_fd] = rank;
    if (rank == 0) job_.heartbeat_fd = beat_fd;
  }
  pending_beats_.clear();
  last_heartbeat_ = now;
  last_ping_ = now;
  step_in_flight_ = false;
  if (!first) {
    metrics_->worker_restarts->Increment();
    metrics_->worker_restart_time->Observe(Seconds(now - failed_at_));
    std::fprintf(stderr,
                 "mlaserve-coordinator: a new worker job joined %.1f s after the failure: %d "
                 "rank(s), %d KV blocks; serving again\n",
                 Seconds(now - failed_at_), ranks, kv_blocks);
  }
  worker_failed_ = false;
  worker_failure_.clear();
  UpdateGauges();
  return absl::OkStatus();
}

void Coordinator::SendReply(const std::string& identity, const std::string& bytes) {
  SendReplyBytes(identity, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

Coordinator::SendOutcome Coordinator::TrySend(const std::string& identity, const uint8_t* data,
                                              size_t size) {
  try {
    // Both parts without waiting: with router_mandatory a full queue is EAGAIN on the first
    // part (a blocking send would stall the whole loop on one client that does not read).
    if (!clients_->send(zmq::buffer(identity),
                        zmq::send_flags::sndmore | zmq::send_flags::dontwait))
      return SendOutcome::kFull;
    // The queue's limit is checked on the first part only; the second always goes in.
    clients_->send(zmq::const_buffer(data, size), zmq::send_flags::dontwait);
    return SendOutcome::kSent;
  } catch (const zmq::error_t&) {
    return SendOutcome::kGone;  // EHOSTUNREACH: no such peer (router_mandatory)
  }
}

void Coordinator::SendReplyBytes(const std::string& identity, const uint8_t* data, size_t size,
                                 bool stream) {
  auto it = backlogs_.find(identity);
  if (it == backlogs_.end()) {
    switch (TrySend(identity, data, size)) {
      case SendOutcome::kSent:
        return;
      case SendOutcome::kGone:
        ClientGone(identity);
        return;
      case SendOutcome::kFull:
        break;
    }
    it = backlogs_.emplace(identity, ClientBacklog{}).first;
    it->second.last_progress = Clock::now();
  }
  // Behind what is already waiting, in order.
  ClientBacklog& q = it->second;
  if (!stream && q.bytes >= options_.client_backlog_limit_bytes) {
    metrics_->client_replies_dropped->Increment();  // an error or health answer nobody reads
    return;
  }
  q.frames.emplace_back(reinterpret_cast<const char*>(data), size);
  q.bytes += static_cast<int64_t>(size);
  backlog_bytes_ += static_cast<int64_t>(size);
  metrics_->client_backlog_bytes->Set(static_cast<double>(backlog_bytes_));
  if (q.bytes > backlog_peak_bytes_) {
    backlog_peak_bytes_ = q.bytes;
    metrics_->client_backlog_peak_bytes->Set(static_cast<double>(q.bytes));
  }
  if (!q.over_limit && q.bytes > options_.client_backlog_limit_bytes) {
    q.over_limit = true;
    slow_clients_.push_back(identity);
  }
}

void Coordinator::ClientGone(const std::string& identity) {
  std::vector<uint64_t> gone;
  for (auto it = by_client_.lower_bound({identity, 0});
       it != by_client_.end() && it->first.first == identity; ++it)
    gone.push_back(it->second);
  for (uint64_t seq : gone) {
    auto it = reqs_.find(seq);
    if (it == reqs_.end()) continue;
    (void)scheduler_->Abort(seq);
    metrics_->Finished("abort").Increment();
    by_client_.erase({it->second->identity, it->second->request_id});
    reqs_.erase(it);
  }
  auto b = backlogs_.find(identity);
  if (b != backlogs_.end()) {
    backlog_bytes_ -= b->second.bytes;
    metrics_->client_backlog_bytes->Set(static_cast<double>(backlog_bytes_));
    backlogs_.erase(b);
  }
}

bool Coordinator::ClientHasRequests(const std::string& identity) const {
  auto it = by_client_.lower_bound({identity, 0});
  return it != by_client_.end() && it->first.first == identity;
}

void Coordinator::FlushBacklogs() {
  if (backlogs_.empty()) return;
  const auto now = Clock::now();
  std::vector<std::string> gone, drained, idle;
  for (auto& [identity, q] : backlogs_) {
    bool progress = false;
    while (!q.frames.empty()) {
      const std::string& f = q.frames.front();
      const SendOutcome out =
          TrySend(identity, reinterpret_cast<const uint8_t*>(f.data()), f.size());
      if (out == SendOutcome::kFull) break;
      if (out == SendOutcome::kGone) {
        gone.push_back(identity);
        break;
      }
      q.bytes -= static_cast<int64_t>(f.size());
      backlog_bytes_ -= static_cast<int64_t>(f.size());
      q.frames.pop_front();
      progress = true;
    }
    if (progress) q.last_progress = now;
    if (q.bytes <= options_.client_backlog_limit_bytes) q.over_limit = false;
    if (q.frames.empty()) {
      drained.push_back(identity);
    } else if (now - q.last_progress > kIdleBacklogDrop && !ClientHasRequests(identity)) {
      idle.push_back(identity);
    }
  }
  for (const std::string& identity : drained) backlogs_.erase(identity);
  for (const std::string& identity : idle) {
    auto it = backlogs_.find(identity);
    if (it == backlogs_.end()) continue;
    std::fprintf(stderr,
                 "mlaserve-coordinator: client %s read nothing for %lld s: dropped its %zu "
                 "waiting replies (%lld bytes)\n",
                 PrintableIdentity(identity).c_str(),
                 static_cast<long long>(kIdleBacklogDrop.count()), it->second.frames.size(),
                 static_cast<long long>(it->second.bytes));
    metrics_->client_replies_dropped->Increment(static_cast<double>(it->second.frames.size()));
    backlog_bytes_ -= it->second.bytes;
    backlogs_.erase(it);
  }
  for (const std::string& identity : gone) ClientGone(identity);
  metrics_->client_backlog_bytes->Set(static_cast<double>(backlog_bytes_));
}

void Coordinator::AbortSlowClients() {
  std::vector<std::string> slow;
  slow.swap(slow_clients_);
  for (const std::string& identity : slow) {
    auto b = backlogs_.find(identity);
    if (b == backlogs_.end() || !b->second.over_limit) continue;  // drained meanwhile, or gone
    std::vector<uint64_t> seqs;
    for (auto it = by_client_.lower_bound({identity, 0});
         it != by_client_.end() && it->first.first == identity; ++it)
      seqs.push_back(it->second);
    if (seqs.empty()) continue;
    const std::string why =
        absl::StrCat("aborted: the client is not reading its replies (", b->second.bytes,
                     " bytes waiting for it, limit ", options_.client_backlog_limit_bytes, ")");
    std::fprintf(stderr, "mlaserve-coordinator: client %s: %s; aborting its %zu request(s)\n",
                 PrintableIdentity(identity).c_str(), why.c_str(), seqs.size());
    for (uint64_t seq : seqs) {
      auto it = reqs_.find(seq);
      if (it == reqs_.end()) continue;
      (void)scheduler_->Abort(seq);
      metrics_->client_backlog_aborts->Increment();
      FinishRequest(*it->second, "abort", why);  // the final joins the backlog, in order
    }
  }
}

void Coordinator::SendError(const std::string& identity, uint64_t request_id, int code,
                            const std::string& message) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<wire::ServerReply>();
  r.setRequestId(request_id);
  auto e = r.initError();
  e.setCode(static_cast<wire::ErrorCode>(code));
  e.setMessage(message);
  static const char* kNames[] = {"invalidRequest", "promptTooLong", "overloaded",  "notFound",
                                 "internal",       "workerFailed",  "shuttingDown"};
  metrics_->Rejected(kNames[code]).Increment();
  SendReply(identity, Bytes(msg));
}

void Coordinator::HandleClientMessage(const std::string& identity, const std::string& bytes) {
  auto words = Words(bytes);
  if (words.size() == 0) {
    SendError(
        identity, 0, static_cast<int>(wire::ErrorCode::INVALID_REQUEST),
        "malformed message: not a Cap'n Proto ClientRequest (length is not a multiple of 8 bytes)");
    return;
  }
  uint64_t request_id = 0;
  try {
    capnp::FlatArrayMessageReader reader(words, ClientReaderOptions());
    auto req = reader.getRoot<wire::ClientRequest>();
    request_id = req.getRequestId();
    switch (req.which()) {
      case wire::ClientRequest::HEALTH: {
        capnp::MallocMessageBuilder msg;
        auto r = msg.initRoot<wire::ServerReply>();
        r.setRequestId(request_id);
        auto h = r.initHealth();
        h.setOk(!worker_failed_ && !draining_);
        h.setDetail(
            worker_failed_
                ? absl::StrCat("worker job failed: ", worker_failure_, "; no worker job for ",
                               absl::StrFormat("%.1f", Seconds(Clock::now() - failed_at_)),
                               " s, waiting for a new one (the launcher restarts it)")
            : draining_
                ? std::string("shutting down")
                : absl::StrCat("running ", scheduler_->num_running(), ", waiting ",
                               scheduler_->num_waiting(), ", ranks ", ranks_, ", heartbeats from ",
                               job_.last_beat.size(), " of ", job_.heartbeat_ranks.size()));
        SendReply(identity, Bytes(msg));
        return;
      }
      case wire::ClientRequest::MODEL_INFO: {
        capnp::MallocMessageBuilder msg;
        auto r = msg.initRoot<wire::ServerReply>();
        r.setRequestId(request_id);
        r.initModelInfo().setJson(model_info_json_);
        SendReply(identity, Bytes(msg));
        return;
      }
      case wire::ClientRequest::ABORT: {
        auto it = by_client_.find({identity, request_id});
        if (it == by_client_.end()) {
          SendError(identity, request_id, static_cast<int>(wire::ErrorCode::NOT_FOUND),
                    absl::StrCat("no request ", request_id, " in flight for this client"));
          return;
        }
        auto rit = reqs_.find(it->second);
        if (rit != reqs_.end()) {
          (void)scheduler_->Abort(it->second);
          FinishRequest(*rit->second, "abort", "aborted by the client");
        }
        return;
      }
      case wire::ClientRequest::GENERATE:
        break;
      default:
        SendError(identity, request_id, static_cast<int>(wire::ErrorCode::INVALID_REQUEST),
                  "unknown request kind (client newer than server?)");
        return;
    }
    if (worker_failed_) {
      SendError(identity, request_id, static_cast<int>(wire::ErrorCode::WORKER_FAILED),
                absl::StrCat("worker job failed: ", worker_failure_,
                             "; no worker job is serving until a new one joins (the launcher "
                             "restarts it): retry in a few seconds"));
      return;
    }
    if (auto b = backlogs_.find(identity); b != backlogs_.end() && b->second.over_limit) {
      SendError(identity, request_id, static_cast<int>(wire::ErrorCode::OVERLOADED),
                "this client is not reading its replies: read them before asking for more");
      return;
    }
    if (draining_) {
      SendError(identity, request_id, static_cast<int>(wire::ErrorCode::SHUTTING_DOWN),
                "server is shutting down");
      return;
    }
    if (by_client_.count({identity, request_id})) {
      SendError(identity, request_id, static_cast<int>(wire::ErrorCode::INVALID_REQUEST),
                absl::StrCat("request id ", request_id, " is already in flight"));
      return;
    }
    auto prep = PrepareRequest(req.getGenerate(), text_);
    if (!prep.ok()) {
      const bool too_long = prep.status().code() == absl::StatusCode::kOutOfRange;
      SendError(identity, request_id,
                static_cast<int>(too_long ? wire::ErrorCode::PROMPT_TOO_LONG
                                          : wire::ErrorCode::INVALID_REQUEST),
                std::string(prep.status().message()));
      return;
    }
    auto r = std::make_unique<Req>();
    r->seq_id = next_seq_id_++;
    r->identity = identity;
    r->request_id = request_id;
    r->batched = req.getGenerate().getBatchedReplies();
    r->prep = std::move(*prep);
    r->arrival = Clock::now();
    if (!r->prep.has_seed) {
      r->prep.seed = r->seq_id * 0x9e3779b97f4a7c15ull ^
                     static_cast<uint64_t>(r->arrival.time_since_epoch().count());
    }
    if (text_.tokenizer) {
      r->detok =
          std::make_unique<IncrementalDetokenizer>(*text_.tokenizer, r->prep.skip_special_tokens);
    }
    auto matcher = StopStringMatcher::Create(r->prep.stop);
    if (!matcher.ok()) {
      SendError(identity, request_id, static_cast<int>(wire::ErrorCode::INVALID_REQUEST),
                std::string(matcher.status().message()));
      return;
    }
    r->stop = std::make_unique<StopStringMatcher>(std::move(*matcher));
    Request sreq;
    sreq.id = r->seq_id;
    sreq.prompt = r->prep.prompt;
    sreq.max_tokens = static_cast<int32_t>(r->prep.max_tokens);
    sreq.min_tokens = static_cast<int32_t>(r->prep.min_tokens);
    sreq.stop_token_ids = r->prep.stop_token_ids;
    sreq.eos_token_ids = text_.eos_ids;
    sreq.ignore_eos = r->prep.ignore_eos;
    sreq.priority = r->prep.priority;
    if (auto s = scheduler_->Add(sreq); !s.ok()) {
      const bool overloaded = s.code() == absl::StatusCode::kResourceExhausted;
      SendError(identity, request_id,
                static_cast<int>(overloaded ? wire::ErrorCode::OVERLOADED
                                            : wire::ErrorCode::INVALID_REQUEST),
                std::string(s.message()));
      return;
    }
    metrics_->prompt_tokens->Increment(r->prep.prompt.size());
    by_client_[{identity, request_id}] = r->seq_id;
    reqs_[r->seq_id] = std::move(r);
  } catch (const kj::Exception& e) {
    SendError(identity, request_id, static_cast<int>(wire::ErrorCode::INVALID_REQUEST),
              absl::StrCat("malformed message: ", e.getDescription().cStr()));
  }
}

void Coordinator::MaybeSendStep() {
  if (step_in_flight_ || worker_failed_ || !scheduler_->has_unfinished()) return;
  const auto t0 = Clock::now();
  auto plan = scheduler_->Schedule();
  if (!plan.ok()) {
    FailAll(absl::StrCat("scheduler: ", plan.status().message()));
    return;
  }
  if (plan->empty()) return;
  // First segment sized for the plan: ~40 words a sequence plus its tokens and blocks.
  capnp::MallocMessageBuilder msg(plan_scratch_->FirstSegment(
      64 + plan->seqs.size() * 40 + plan->token_ids.size() / 2 + plan->block_ids.size() / 2));
  auto p = msg.initRoot<wire::StepPlan>();
  p.setStepId(plan->step_id);
  auto rel = p.initRelease(plan->released.size());
  for (size_t i = 0; i < plan->released.size(); ++i) rel.set(i, plan->released[i]);
  auto seqs = p.initStep(plan->seqs.size());
  for (size_t i = 0; i < plan->seqs.size(); ++i) {
    const ScheduledSeq& s = plan->seqs[i];
    auto out = seqs[i];
    out.setSeqId(s.seq_id);
    const auto toks = plan->tokens(s);
    auto t = out.initTokens(toks.size());
    for (size_t j = 0; j < toks.size(); ++j) t.set(j, toks[j]);
    out.setStartPosition(s.start_pos);
    out.setPromptLen(s.prompt_len);
    out.setSample(s.sample);
    out.setGenerated(s.num_generated);
    // Block table: only the entries after the longest prefix the workers already hold (tables
    // grow by appending; a preempted sequence's new table differs from entry 0). Decode steps
    // send nothing or one new block instead of the whole table.
    const auto blocks = plan->blocks(s);
    auto it = reqs_.find(s.seq_id);
    size_t from = 0;
    if (it != reqs_.end()) {
      std::vector<int32_t>& sent = it->second->sent_table;
      const size_t common = std::min(sent.size(), blocks.size());
      while (from < common && sent[from] == blocks[from]) ++from;
      sent.resize(from);
      sent.insert(sent.end(), blocks.begin() + from, blocks.end());
    }
    out.setBlockTableFrom(static_cast<uint32_t>(from));
    auto b = out.initBlockTable(blocks.size() - from);
    for (size_t j = from; j < blocks.size(); ++j) b.set(j - from, blocks[j]);
    if (it != reqs_.end()) {
      Req& r = *it->second;
      if (!r.scheduled) {
        r.scheduled = true;
        r.first_scheduled = t0;
        r.cached_tokens = s.start_pos;
        metrics_->queue_time->Observe(Seconds(t0 - r.arrival));
      }
      if (r.params_sent) continue;  // the workers keep a sequence's parameters
      r.params_sent = true;
      auto sp = out.initSampling();
      const SamplingSettings& ss = r.prep.sampling;
      sp.setTemperature(ss.temperature);
      sp.setTopP(ss.top_p);
      sp.setTopK(ss.top_k);
      sp.setMinP(ss.min_p);
      sp.setRepetitionPenalty(ss.repetition_penalty);
      sp.setPresencePenalty(ss.presence_penalty);
      sp.setFrequencyPenalty(ss.frequency_penalty);
      sp.setSeed(r.prep.seed);
      sp.setHasSeed(true);
      sp.setMaxTokens(r.prep.max_tokens);
      sp.setMinTokens(r.prep.min_tokens);
      sp.setLogprobs(r.prep.logprobs);
      sp.setTopLogprobs(ss.top_logprobs);
      auto stop_ids = sp.initStopTokenIds(r.prep.stop_token_ids.size());
      for (size_t j = 0; j < stop_ids.size(); ++j) stop_ids.set(j, r.prep.stop_token_ids[j]);
      auto eos = out.initEosIds(r.prep.ignore_eos ? 0 : text_.eos_ids.size());
      for (size_t j = 0; j < eos.size(); ++j) eos.set(j, text_.eos_ids[j]);
    }
  }
  const auto plan_bytes = plan_scratch_->Flatten(msg);
  worker_->send(zmq::buffer(std::string("worker")), zmq::send_flags::sndmore);
  worker_->send(zmq::const_buffer(plan_bytes.begin(), plan_bytes.size()), zmq::send_flags::none);
  step_in_flight_ = true;
  in_flight_step_ = plan->step_id;
  step_sent_ = Clock::now();
  metrics_->preemptions->Increment(plan->preempted.size());
  metrics_->steps->Increment();
  metrics_->step_tokens->Observe(plan->num_tokens());
  // One observation per step: this step's scheduling and encoding plus the handling of the
  // previous step's result (which triggered it).
  metrics_->coordinator_time->Observe(Seconds(step_sent_ - t0) + pending_overhead_s_);
  pending_overhead_s_ = 0;
  UpdateGauges();
}

void Coordinator::HandleWorkerMessage(const std::string& identity, const std::string& bytes,
                                      int fd) {
  const auto t0 = Clock::now();
  if (const int rank = HeartbeatRank(identity); rank >= 0) {
    // While no job is watched, beats wait for the next job's `ready` (they may come first).
    if (worker_failed_) {
      pending_beats_[rank] = fd;
      return;
    }
    if (rank >= job_.ranks) return;
    job_.last_beat[rank] = t0;
    if (rank == 0) last_heartbeat_ = t0;
    MapWorkerConnection(fd, rank);
    if (rank == 0 && !worker_failed_) job_.heartbeat_fd = fd;
    return;
  }
  if (identity != "worker") return;
  auto words = Words(bytes);
  if (words.size() == 0) {
    if (!worker_failed_) FailAll("worker rank 0 sent a malformed step result");
    return;
  }
  capnp::FlatArrayMessageReader reader(words);
  auto r = reader.getRoot<wire::StepResult>();
  if (r.isReady()) {
    // A new job's rank 0. One that announces itself while a job serves means the serving job's
    // rank 0 is gone (its connection closed and this one took its name): its close is reported
    // by now, and names the rank.
    if (!worker_failed_) ReadWorkerMonitor();
    if (!worker_failed_) {
      FailAll(
          "worker rank 0 of a new worker job connected while the previous job was serving "
          "(the previous job is gone)");
    }
    if (auto s = AcceptWorkerJob(r.getReady().cStr(), fd); !s.ok()) {
      worker_failure_ = std::string(s.message());
      std::fprintf(stderr, "mlaserve-coordinator: %s\n", worker_failure_.c_str());
      StopWorkerJob(/*to_main=*/true, /*to_heartbeat=*/true);  // the refused job's own names
    }
    return;
  }
  if (worker_failed_) {
    // A restarted job that could not load says why; anything else is a failed job's leftover.
    if (r.isError() && r.getStepId() == 0) {
      worker_failure_ = absl::StrCat("a new worker job failed to start: ", r.getError().cStr());
      std::fprintf(stderr, "mlaserve-coordinator: %s\n", worker_failure_.c_str());
    }
    return;
  }
  last_heartbeat_ = t0;
  job_.last_beat[0] = t0;
  MapWorkerConnection(fd, 0);
  if (worker_failed_) return;  // the mapping found a closed connection of this job
  job_.worker_fd = fd;
  if (r.isError()) {
    FailAll(absl::StrCat("worker step failed: ", r.getError().cStr()));
    return;
  }
  if (!r.isSampled() || !step_in_flight_ || r.getStepId() != in_flight_step_) return;
  step_in_flight_ = false;
  metrics_->step_time->Observe(Seconds(t0 - step_sent_));
  const auto ranks = r.getRankSeconds();
  for (size_t i = 0; i < ranks.size() && i < metrics_->rank_forward.size(); ++i)
    metrics_->rank_forward[i]->Observe(ranks[i]);
  metrics_->sample_time->Observe(r.getSampleSeconds());
  std::vector<SampledToken> sampled;
  std::map<uint64_t, std::vector<uint8_t>> logprobs;
  for (auto s : r.getSampled()) {
    sampled.push_back({s.getSeqId(), s.getTokenId()});
    if (s.hasLogprob()) {
      capnp::MallocMessageBuilder copy;
      copy.setRoot(s.getLogprob());
      kj::Array<capnp::word> w = capnp::messageToFlatArray(copy);
      auto b = w.asBytes();
      logprobs[s.getSeqId()] = std::vector<uint8_t>(b.begin(), b.end());
    }
  }
  auto events = scheduler_->OnStepResult(sampled);
  if (!events.ok()) {
    FailAll(absl::StrCat("scheduler rejected the step result: ", events.status().message()));
    return;
  }
  ProcessEvents(*events, logprobs);
  pending_overhead_s_ = Seconds(Clock::now() - t0);
  MaybeSendStep();
}

void Coordinator::Emit(const std::string& identity, bool batched, const uint8_t* data,
                       size_t size) {
  if (!collecting_ || !batched) {
    SendReplyBytes(identity, data, size, /*stream=*/true);
    return;
  }
  std::vector<uint64_t>& frame = batches_[identity];
  const size_t old = frame.size();
  frame.resize(old + size / sizeof(uint64_t));  // flat messages are whole words
  std::memcpy(frame.data() + old, data, size);
}

void Coordinator::Emit(const std::string& identity, bool batched, const std::string& bytes) {
  Emit(identity, batched, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

void Coordinator::FlushBatches() {
  collecting_ = false;
  for (auto& [identity, frame] : batches_) {
    if (frame.empty()) continue;
    // A failed send (client gone) aborts that client's requests; batches_ is not touched.
    SendReplyBytes(identity, reinterpret_cast<const uint8_t*>(frame.data()),
                   frame.size() * sizeof(uint64_t), /*stream=*/true);
    frame.clear();
  }
  if (batches_.size() > 1024) batches_.clear();  // forget idle clients' buffers
}

void Coordinator::ProcessEvents(const std::vector<SeqEvent>& events,
                                const std::map<uint64_t, std::vector<uint8_t>>& logprob_blobs) {
  const auto now = Clock::now();
  collecting_ = true;  // replies of batched requests go out in one frame per client, below
  for (const SeqEvent& ev : events) {
    auto it = reqs_.find(ev.seq_id);
    if (it == reqs_.end()) continue;
    Req& r = *it->second;
    std::string reason = ev.finish == FinishReason::kNone ? "" : FinishReasonName(ev.finish);
    if (ev.has_token) {
      r.output.push_back(ev.token_id);
      metrics_->generation_tokens->Increment();
      if (!r.has_first_token) {
        r.has_first_token = true;
        r.first_token = now;
        metrics_->ttft->Observe(Seconds(now - r.arrival));
        metrics_->prefill_time->Observe(Seconds(now - r.first_scheduled));
      } else {
        metrics_->itl->Observe(Seconds(now - r.last_token));
      }
      r.last_token = now;
      std::string delta;
      bool stop_matched = false;
      if (r.detok) {
        const std::string piece = r.detok->Add(ev.token_id);
        auto out = r.stop->Add(piece);
        delta = out.text;
        stop_matched = out.stopped;
      }
      if (stop_matched) {
        r.stop_matched = true;
        if (reason.empty()) {
          (void)scheduler_->Finish(ev.seq_id, FinishReason::kStop);
          reason = "stop";
        }
      }
      r.text += delta;
      capnp::MallocMessageBuilder msg(reply_scratch_->FirstSegment());
      auto reply = msg.initRoot<wire::ServerReply>();
      reply.setRequestId(r.request_id);
      auto chunk = reply.initChunk();
      chunk.initTokenIds(1).set(0, ev.token_id);
      chunk.setText(delta);
      auto lp = logprob_blobs.find(ev.seq_id);
      if (lp != logprob_blobs.end()) {
        auto words = kj::heapArray<capnp::word>(lp->second.size() / sizeof(capnp::word));
        std::memcpy(words.begin(), lp->second.data(), lp->second.size());
        capnp::FlatArrayMessageReader lr(words);
        chunk.initLogprobs(1).setWithCaveats(0, lr.getRoot<wire::TokenLogprob>());
      }
      const auto bytes = reply_scratch_->Flatten(msg);
      Emit(r.identity, r.batched, bytes.begin(), bytes.size());
      if (reqs_.find(ev.seq_id) == reqs_.end()) continue;  // the client went away
    }
    if (!reason.empty()) FinishRequest(r, reason, "");
  }
  FlushBatches();
  UpdateGauges();
}

void Coordinator::FinishRequest(Req& r, const std::string& reason, const std::string& message,
                                int error_code) {
  const auto now = Clock::now();
  // Whatever the stop matcher held back is part of the text unless a stop string matched.
  std::string tail;
  if (r.detok && reason != "error" && !r.stop_matched) {
    tail = r.stop->Add(r.detok->Finish()).text;
    tail += r.stop->Flush();
  }
  if (!tail.empty()) {
    r.text += tail;
    capnp::MallocMessageBuilder msg;
    auto reply = msg.initRoot<wire::ServerReply>();
    reply.setRequestId(r.request_id);
    reply.initChunk().setText(tail);
    Emit(r.identity, r.batched, Bytes(msg));
  }
  capnp::MallocMessageBuilder msg;
  auto reply = msg.initRoot<wire::ServerReply>();
  reply.setRequestId(r.request_id);
  auto f = reply.initFinal();
  f.setFinishReason(WireReason(reason));
  f.setText(r.text);
  f.setMessage(message);
  if (error_code >= 0) f.setErrorCode(static_cast<wire::ErrorCode>(error_code));
  auto ids = f.initTokenIds(r.output.size());
  for (size_t i = 0; i < r.output.size(); ++i) ids.set(i, r.output[i]);
  auto u = f.initUsage();
  u.setPromptTokens(r.prep.prompt.size());
  u.setCompletionTokens(r.output.size());
  u.setCachedTokens(r.cached_tokens);
  u.setQueueSeconds(r.scheduled ? Seconds(r.first_scheduled - r.arrival)
                                : Seconds(now - r.arrival));
  u.setTtftSeconds(r.has_first_token ? Seconds(r.first_token - r.arrival) : 0.0);
  u.setTotalSeconds(Seconds(now - r.arrival));
  metrics_->Finished(reason).Increment();
  metrics_->e2e->Observe(Seconds(now - r.arrival));
  if (r.has_first_token) metrics_->decode_time->Observe(Seconds(r.last_token - r.first_token));
  metrics_->prompt_length->Observe(r.prep.prompt.size());
  metrics_->generation_length->Observe(r.output.size());
  const std::string identity = r.identity;
  const uint64_t seq = r.seq_id;
  const bool batched = r.batched;
  by_client_.erase({r.identity, r.request_id});
  const std::string bytes = Bytes(msg);
  reqs_.erase(seq);  // r is gone from here on
  Emit(identity, batched, bytes);
  UpdateGauges();
}

void Coordinator::FailAll(const std::string& message) {
  if (worker_failed_) return;
  worker_failed_ = true;
  failed_at_ = Clock::now();
  worker_failure_ = message;
  metrics_->worker_up->Set(0);
  metrics_->worker_failures->Increment();
  std::fprintf(stderr,
               "mlaserve-coordinator: worker job failed: %s; failing %zu request(s) in flight "
               "and waiting for a new worker job\n",
               message.c_str(), reqs_.size());
  std::vector<uint64_t> seqs;
  for (const auto& [seq, _] : reqs_) seqs.push_back(seq);
  for (uint64_t seq : seqs) {
    auto it = reqs_.find(seq);
    if (it == reqs_.end()) continue;
    (void)scheduler_->Abort(seq);
    FinishRequest(*it->second, "error", absl::StrCat("worker job failed: ", message),
                  static_cast<int>(wire::ErrorCode::WORKER_FAILED));
  }
  step_in_flight_ = false;
  // What is left of the job is told to stop through rank 0's connections that are still open:
  // a closed one's name may already be the next job's rank 0 (unknown ones are tried).
  ReadWorkerMonitor();
  auto open = [this](int fd) { return fd < 0 || job_.fd_rank.count(fd) > 0; };
  StopWorkerJob(open(job_.worker_fd), open(job_.heartbeat_fd));
  job_.fd_rank.clear();
  job_.last_beat.clear();
  pending_beats_.clear();
  UpdateGauges();
}

void Coordinator::StopWorkerJob(bool to_main, bool to_heartbeat) {
  capnp::MallocMessageBuilder msg(kReplyWords);
  auto p = msg.initRoot<wire::StepPlan>();
  p.setStepId(0);
  p.setShutdown();
  const std::string bytes = Bytes(msg);
  // To rank 0's main loop, and to its heartbeat thread (which ends the process when the main
  // loop does not: a rank stuck in a step). Peers that are gone take nothing.
  for (const char* to : {"worker", "heartbeat"}) {
    if (!(std::string(to) == "worker" ? to_main : to_heartbeat)) continue;
    worker_->send(zmq::buffer(std::string(to)), zmq::send_flags::sndmore);
    worker_->send(zmq::buffer(bytes), zmq::send_flags::dontwait);
  }
}

void Coordinator::MapWorkerConnection(int fd, int rank) {
  if (fd < 0) return;
  auto it = job_.fd_rank.find(fd);
  if (it != job_.fd_rank.end() && it->second == rank) return;
  // A connection not seen before. Its descriptor may be a closed connection's, reused: the
  // close (and this connection's accept) were reported before any of its messages could be
  // read, so reading the events now attributes that close to the connection it was for.
  ReadWorkerMonitor();
  if (!worker_failed_) job_.fd_rank[fd] = rank;
}

void Coordinator::ReadWorkerMonitor() {
  for (;;) {
    // A monitor event: one frame of a uint16 event and a uint32 value (the connection's file
    // descriptor), one frame of the endpoint.
    zmq::message_t event, address;
    if (!worker_monitor_->recv(event, zmq::recv_flags::dontwait)) return;
    if (worker_monitor_->get(zmq::sockopt::rcvmore)) (void)worker_monitor_->recv(address);
    if (event.size() < 6) continue;
    uint16_t kind;
    uint32_t value;
    std::memcpy(&kind, event.data(), sizeof(kind));
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, sizeof(value));
    if (kind != ZMQ_EVENT_DISCONNECTED) continue;  // an accept maps nothing by itself
    const int fd = static_cast<int>(value);
    for (auto p = pending_beats_.begin(); p != pending_beats_.end();) {
      p = p->second == fd ? pending_beats_.erase(p) : std::next(p);
    }
    auto it = job_.fd_rank.find(fd);
    if (it == job_.fd_rank.end()) continue;
    const int rank = it->second;
    job_.fd_rank.erase(it);
    if (!worker_failed_) {
      FailAll(absl::StrCat("worker rank ", rank,
                           " is gone: its connection to the coordinator closed (the process "
                           "died or was killed)"));
    }
  }
}

void Coordinator::CheckWorkerLiveness(Clock::time_point now) {
  if (worker_failed_) return;
  for (const auto& [rank, last] : job_.last_beat) {
    if (now - last > options_.heartbeat_timeout) {
      FailAll(
          absl::StrCat("no heartbeat from worker rank ", rank, " for ",
                       std::chrono::duration_cast<std::chrono::milliseconds>(now - last).count(),
                       " ms (the rank hung or its host is unreachable)"));
      return;
    }
  }
  if (step_in_flight_ && now - step_sent_ > options_.step_timeout) {
    FailAll(absl::StrCat("step ", in_flight_step_, " did not finish within ",
                         options_.step_timeout.count(), " ms (a rank stopped answering)"));
    return;
  }
  // A rank that said it would beat and never did is not watched (its beats may not reach this
  // host); its death is then seen through rank 0 only. Said once.
  if (!job_.warned_silent && now - job_.joined > 4 * options_.heartbeat_timeout) {
    job_.warned_silent = true;
    std::string silent;
    for (int rank : job_.heartbeat_ranks) {
      if (!job_.last_beat.count(rank)) absl::StrAppend(&silent, silent.empty() ? "" : ", ", rank);
    }
    if (!silent.empty()) {
      std::fprintf(stderr,
                   "mlaserve-coordinator: warning: worker rank(s) %s send no heartbeat (can they "
                   "reach %s?): a death there is seen only when rank 0 goes too\n",
                   silent.c_str(), options_.worker_endpoint.c_str());
    }
  }
}

void Coordinator::UpdateGauges() {
  metrics_->running->Set(scheduler_->num_running());
  metrics_->waiting->Set(scheduler_->num_waiting());
  const auto& b = scheduler_->blocks();
  metrics_->kv_usage->Set(b.num_blocks() > 0 ? static_cast<double>(b.num_used()) / b.num_blocks()
                                             : 0.0);
  // The block manager counts prefix lookups cumulatively; export the increments.
  metrics_->prefix_queries->Increment(
      static_cast<double>(b.prefix_query_tokens() - seen_prefix_queries_));
  metrics_->prefix_hits->Increment(static_cast<double>(b.prefix_hit_tokens() - seen_prefix_hits_));
  seen_prefix_queries_ = b.prefix_query_tokens();
  seen_prefix_hits_ = b.prefix_hit_tokens();
}

int Coordinator::Run() {
  for (;;) {
    zmq::pollitem_t items[] = {{clients_->handle(), 0, ZMQ_POLLIN, 0},
                               {worker_->handle(), 0, ZMQ_POLLIN, 0},
                               {worker_monitor_->handle(), 0, ZMQ_POLLIN, 0}};
    try {
      // Replies waiting for slow clients are retried often; otherwise nothing is due sooner.
      zmq::poll(items, 3, std::chrono::milliseconds(backlogs_.empty() ? 50 : 5));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;  // a signal (SIGTERM: drain) interrupted the wait
      items[0].revents = items[1].revents = items[2].revents = 0;
    }
    // Connection events before messages: a message read below may come from a connection that
    // replaced a closed one on the same descriptor, and must not be taken for the closed one.
    if (items[2].revents & ZMQ_POLLIN) ReadWorkerMonitor();
    if (items[1].revents & ZMQ_POLLIN) {
      // Worker first: results free blocks for the clients' new requests.
      // All that is there (results, beats: a few a second per rank), so that the liveness check
      // below never sees a beat still queued as missing.
      for (;;) {
        zmq::message_t id, body;
        if (!worker_->recv(id, zmq::recv_flags::dontwait)) break;
        if (!worker_->recv(body)) break;
        HandleWorkerMessage(id.to_string(), body.to_string(), SourceFd(body));
      }
    }
    // Right after reading the worker socket: a beat counts when it is read, so a long stretch of
    // client work below (a burst of requests to tokenize and render) must not pass for silence.
    CheckWorkerLiveness(Clock::now());
    if (items[0].revents & ZMQ_POLLIN) {
      for (int n = 0; n < 256; ++n) {
        zmq::message_t id;
        if (!clients_->recv(id, zmq::recv_flags::dontwait)) break;
        // A client frame may be split into several parts by a misbehaving peer: keep the last.
        std::string body;
        while (clients_->get(zmq::sockopt::rcvmore)) {
          zmq::message_t part;
          if (!clients_->recv(part)) break;
          body = part.to_string();
        }
        HandleClientMessage(id.to_string(), body);
      }
    }
    const auto now = Clock::now();
    AbortSlowClients();
    FlushBacklogs();
    MaybeSendStep();
    // While idle, a ping a second tells the workers the coordinator is alive: orphaned workers
    // (coordinator killed) stop by themselves after their --coordinator-timeout.
    if (!step_in_flight_ && !worker_failed_ && now - last_ping_ > std::chrono::seconds(1)) {
      capnp::MallocMessageBuilder msg(kReplyWords);
      auto p = msg.initRoot<wire::StepPlan>();
      p.setPing();
      kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
      auto b = words.asBytes();
      worker_->send(zmq::buffer(std::string("worker")), zmq::send_flags::sndmore);
      worker_->send(zmq::const_buffer(b.begin(), b.size()), zmq::send_flags::dontwait);
      last_ping_ = now;
    }
    if (shutdown_requested_.load() && !draining_) {
      draining_ = true;
      drain_deadline_ = now + options_.drain_timeout;
      std::fprintf(stderr, "mlaserve-coordinator: draining %zu requests (up to %lld s)\n",
                   reqs_.size(), static_cast<long long>(options_.drain_timeout.count() / 1000));
    }
    if (draining_ && (reqs_.empty() || now > drain_deadline_ || worker_failed_)) {
      std::vector<uint64_t> seqs;
      for (const auto& [seq, _] : reqs_) seqs.push_back(seq);
      for (uint64_t seq : seqs) {
        auto it = reqs_.find(seq);
        if (it == reqs_.end()) continue;
        (void)scheduler_->Abort(seq);
        FinishRequest(*it->second, "abort", "server shut down before the request finished");
      }
      break;
    }
  }
  // What the sockets take of the last replies (no wait for clients that do not read).
  FlushBacklogs();
  if (!worker_failed_) {
    capnp::MallocMessageBuilder msg;
    auto p = msg.initRoot<wire::StepPlan>();
    p.setStepId(0);
    p.setShutdown();
    const std::string bytes = Bytes(msg);
    worker_->send(zmq::buffer(std::string("worker")), zmq::send_flags::sndmore);
    worker_->send(zmq::buffer(bytes), zmq::send_flags::dontwait);
  }
  return worker_failed_ ? 1 : 0;
}

}  // namespace mlaserve
