#include "coordinator/client/client.h"

#include <zmq.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capnp/message.h"
#include "capnp/serialize.h"
#include "coordinator/auth/curve_keys.h"
#include "mlaserve.capnp.h"
#include "zmq.hpp"

namespace mlaserve {
namespace {

using wire::ClientRequest;
using wire::ErrorCode;
using wire::FinishReason;
using wire::ServerReply;

const char* FinishName(FinishReason r) {
  switch (r) {
    case FinishReason::STOP:
      return "stop";
    case FinishReason::LENGTH:
      return "length";
    case FinishReason::ABORT:
      return "abort";
    case FinishReason::ERROR:
      return "error";
  }
  return "?";
}

const char* ErrorName(ErrorCode c) {
  switch (c) {
    case ErrorCode::INVALID_REQUEST:
      return "invalidRequest";
    case ErrorCode::PROMPT_TOO_LONG:
      return "promptTooLong";
    case ErrorCode::OVERLOADED:
      return "overloaded";
    case ErrorCode::NOT_FOUND:
      return "notFound";
    case ErrorCode::INTERNAL:
      return "internal";
    case ErrorCode::WORKER_FAILED:
      return "workerFailed";
    case ErrorCode::SHUTTING_DOWN:
      return "shuttingDown";
  }
  return "?";
}

}  // namespace

Client::~Client() = default;

// Handshakes the server closed without a reason, in a row, before a call gives up: a wrong
// server key looks like that every time; a server restarting mid-handshake, once. Attempts
// follow each other at ZeroMQ's reconnect interval (100 ms).
constexpr int kSilentHandshakeFailures = 3;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& endpoint,
                                                        const ClientSecurity& security) {
  std::unique_ptr<Client> c(new Client());
  c->endpoint_ = endpoint;
  if (security.server_key_file.empty() != security.client_key_file.empty()) {
    return absl::InvalidArgumentError(
        "CURVE needs both the server's public key (--server-key FILE) and this client's key "
        "pair (--client-key FILE)");
  }
  c->ctx_ = std::make_unique<zmq::context_t>(1);
  c->sock_ = std::make_unique<zmq::socket_t>(*c->ctx_, zmq::socket_type::dealer);
  c->sock_->set(zmq::sockopt::linger, 0);
  if (!security.server_key_file.empty()) {
    auto server_key = LoadCurvePublicKey(security.server_key_file);
    if (!server_key.ok()) return server_key.status();
    auto pair = LoadCurveKeyPair(security.client_key_file);
    if (!pair.ok()) return pair.status();
    c->sock_->set(zmq::sockopt::curve_serverkey, *server_key);
    c->sock_->set(zmq::sockopt::curve_publickey, pair->public_key);
    c->sock_->set(zmq::sockopt::curve_secretkey, pair->secret_key);
    c->curve_ = true;
  }
  // The monitor is attached before connecting, so that no handshake event is missed.
  const std::string monitor_endpoint = "inproc://mlaserve-client-monitor";
  if (zmq_socket_monitor(c->sock_->handle(), monitor_endpoint.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0) {
    return absl::InternalError(absl::StrCat("zmq_socket_monitor: ", zmq_strerror(zmq_errno())));
  }
  c->monitor_ = std::make_unique<zmq::socket_t>(*c->ctx_, zmq::socket_type::pair);
  c->monitor_->set(zmq::sockopt::linger, 0);
  c->monitor_->connect(monitor_endpoint);
  try {
    c->sock_->connect(endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", endpoint, ": ", e.what()));
  }
  return c;
}

absl::Status Client::SendMessage(capnp::MessageBuilder& msg) {
  if (!handshake_error_.ok()) return handshake_error_;
  kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
  auto bytes = words.asBytes();
  if (!sock_->send(zmq::const_buffer(bytes.begin(), bytes.size()), zmq::send_flags::dontwait)) {
    // A refused handshake closes the pipe for good: say why, rather than that it is full.
    if (auto s = ReadHandshakeEvents(); !s.ok()) return s;
    return absl::UnavailableError("coordinator socket is not accepting messages");
  }
  return absl::OkStatus();
}

absl::Status Client::ReadHandshakeEvents() {
  for (;;) {
    // A monitor event: one frame of a uint16 event and a uint32 value, one frame of the endpoint.
    zmq::message_t event, address;
    if (!monitor_->recv(event, zmq::recv_flags::dontwait)) return absl::OkStatus();
    if (monitor_->get(zmq::sockopt::rcvmore)) (void)monitor_->recv(address);
    if (event.size() < 6) continue;
    uint16_t kind;
    uint32_t value;
    std::memcpy(&kind, event.data(), sizeof(kind));
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, sizeof(value));
    switch (kind) {
      case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        handshake_succeeded_ = true;
        silent_failures_ = 0;
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        silent_failures_ = 0;
        return handshake_error_ = absl::PermissionDeniedError(absl::StrCat(
                   "the coordinator at ", endpoint_, " refused this client (ZAP status ", value,
                   "): its public key (--client-key) is not in the server's "
                   "--curve-allowed-clients"));
      case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        silent_failures_ = 0;
        if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
          return handshake_error_ = absl::UnauthenticatedError(
                     curve_ ? absl::StrCat("the coordinator at ", endpoint_,
                                           " does not use CURVE, but this client was given keys "
                                           "(--server-key, --client-key): drop them, or start the "
                                           "server with --curve-secret-key")
                            : absl::StrCat("the coordinator at ", endpoint_,
                                           " requires CURVE authentication: give --server-key (its "
                                           "public key) and --client-key (a key pair it allows)"));
        }
        return handshake_error_ = absl::UnauthenticatedError(absl::StrFormat(
                   "the ZeroMQ handshake with the coordinator at %s failed: protocol "
                   "error 0x%08x (zmq.h ZMQ_PROTOCOL_ERROR_*)%s",
                   endpoint_, value,
                   curve_ ? "; check that --server-key is this server's public key" : ""));
      case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if (++silent_failures_ < kSilentHandshakeFailures) break;
        silent_failures_ = 0;
        return absl::UnauthenticatedError(
            curve_ ? absl::StrCat("the CURVE handshake with the coordinator at ", endpoint_,
                                  " failed ", kSilentHandshakeFailures,
                                  " times in a row (the server closed the connection): "
                                  "--server-key is not this server's public key, or the "
                                  "server does not use CURVE")
                   : absl::StrCat("the coordinator at ", endpoint_,
                                  " closed the connection during the ZeroMQ handshake ",
                                  kSilentHandshakeFailures,
                                  " times in a row: it most likely requires CURVE "
                                  "authentication: give --server-key (its public key) and "
                                  "--client-key (a key pair it allows)"));
      default:
        break;
    }
  }
}

absl::StatusOr<uint64_t> Client::Submit(const GenerateInput& in) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  const uint64_t id = next_id_++;
  req.setRequestId(id);
  auto g = req.initGenerate();
  const int given = in.text.has_value() + in.token_ids.has_value() + in.chat.has_value();
  if (given != 1) return absl::InvalidArgumentError("give exactly one of text, token_ids, chat");
  if (in.text) {
    g.getInput().setText(*in.text);
  } else if (in.token_ids) {
    auto ids = g.getInput().initTokenIds(in.token_ids->size());
    for (size_t i = 0; i < in.token_ids->size(); ++i) ids.set(i, (*in.token_ids)[i]);
  } else {
    if (!in.chat->is_array())
      return absl::InvalidArgumentError("chat must be a JSON array of messages");
    auto msgs = g.getInput().initChat(in.chat->size());
    for (size_t i = 0; i < in.chat->size(); ++i) {
      const auto& m = (*in.chat)[i];
      msgs[i].setRole(m.value("role", ""));
      if (m.contains("content") && m["content"].is_string())
        msgs[i].setContent(m["content"].get<std::string>());
      if (m.contains("name") && m["name"].is_string())
        msgs[i].setName(m["name"].get<std::string>());
      if (m.contains("tool_call_id") && m["tool_call_id"].is_string())
        msgs[i].setToolCallId(m["tool_call_id"].get<std::string>());
      if (m.contains("reasoning_content") && m["reasoning_content"].is_string()) {
        msgs[i].setReasoningContent(m["reasoning_content"].get<std::string>());
      }
      if (m.contains("tool_calls") && m["tool_calls"].is_array()) {
        auto calls = msgs[i].initToolCalls(m["tool_calls"].size());
        for (size_t j = 0; j < m["tool_calls"].size(); ++j) {
          const auto& tc = m["tool_calls"][j];
          calls[j].setId(tc.value("id", ""));
          const auto fn = tc.contains("function") ? tc["function"] : tc;
          calls[j].setName(fn.value("name", ""));
          const auto& args = fn.contains("arguments") ? fn["arguments"] : nlohmann::json::object();
          calls[j].setArguments(args.is_string() ? args.get<std::string>() : args.dump());
        }
      }
    }
  }
  g.setTools(in.tools_json);
  g.setAddGenerationPrompt(in.add_generation_prompt);
  g.setBatchedReplies(true);  // Next() reads multi-message frames
  auto s = g.initSampling();
  const ClientSampling& cs = in.sampling;
  s.setTemperature(cs.temperature);
  s.setTopP(cs.top_p);
  s.setTopK(cs.top_k);
  s.setMinP(cs.min_p);
  s.setRepetitionPenalty(cs.repetition_penalty);
  s.setPresencePenalty(cs.presence_penalty);
  s.setFrequencyPenalty(cs.frequency_penalty);
  if (cs.seed) {
    s.setSeed(*cs.seed);
    s.setHasSeed(true);
  }
  s.setMaxTokens(cs.max_tokens);
  s.setMinTokens(cs.min_tokens);
  auto stop = s.initStop(cs.stop.size());
  for (size_t i = 0; i < cs.stop.size(); ++i) stop.set(i, cs.stop[i]);
  auto stop_ids = s.initStopTokenIds(cs.stop_token_ids.size());
  for (size_t i = 0; i < cs.stop_token_ids.size(); ++i) stop_ids.set(i, cs.stop_token_ids[i]);
  s.setIgnoreEos(cs.ignore_eos);
  s.setLogprobs(cs.logprobs);
  s.setTopLogprobs(cs.top_logprobs);
  s.setSkipSpecialTokens(cs.skip_special_tokens);
  s.setPriority(cs.priority);
  if (auto st = SendMessage(msg); !st.ok()) return st;
  return id;
}

absl::Status Client::Abort(uint64_t request_id) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  req.setRequestId(request_id);
  req.setAbort();
  return SendMessage(msg);
}

absl::Status Client::SendRaw(const std::string& bytes) {
  if (!sock_->send(zmq::buffer(bytes), zmq::send_flags::dontwait))
    return absl::UnavailableError("send failed");
  return absl::OkStatus();
}

absl::StatusOr<Reply> Client::Next(std::chrono::milliseconds timeout) {
  if (pending_.empty()) {
    if (!handshake_error_.ok()) return handshake_error_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      zmq::pollitem_t items[] = {{sock_->handle(), 0, ZMQ_POLLIN, 0},
                                 {monitor_->handle(), 0, ZMQ_POLLIN, 0}};
      // Polled at least once, without waiting once the time is up: a reply already here is
      // returned even with a timeout of 0 or 1 ms.
      if (zmq::poll(items, 2, std::max(left, std::chrono::milliseconds(0))) == 0) {
        if (auto s = ReadHandshakeEvents(); !s.ok()) return s;
        return absl::DeadlineExceededError(absl::StrCat(
            "no reply from the coordinator within ", timeout.count(), " ms",
            handshake_succeeded_ ? ""
                                 : absl::StrCat(" (no connection to ", endpoint_,
                                                " completed its handshake: is the coordinator "
                                                "running there?)")));
      }
      if (items[0].revents & ZMQ_POLLIN) break;  // a reply first, events after
      if (auto s = ReadHandshakeEvents(); !s.ok()) return s;
    }
    zmq::message_t m;
    if (!sock_->recv(m, zmq::recv_flags::none)) return absl::UnavailableError("receive failed");
    if (m.size() == 0 || m.size() % sizeof(capnp::word) != 0) {
      return absl::DataLossError("reply is not a Cap'n Proto message");
    }
    kj::Array<capnp::word> words = kj::heapArray<capnp::word>(m.size() / sizeof(capnp::word));
    std::memcpy(words.begin(), m.data(), m.size());
    // A frame holds one ServerReply, or several back to back for requests sent with
    // batchedReplies (which Submit sets): each is read up to its own end.
    kj::ArrayPtr<const capnp::word> rest = words.asPtr();
    try {
      while (rest.size() > 0) {
        capnp::FlatArrayMessageReader reader(rest);
        Reply out;
        ServerReply::Reader r = reader.getRoot<ServerReply>();
        out.request_id = r.getRequestId();
        switch (r.which()) {
          case ServerReply::CHUNK: {
            out.kind = Reply::Kind::kChunk;
            auto c = r.getChunk();
            for (int32_t t : c.getTokenIds()) out.token_ids.push_back(t);
            out.text = c.getText();
            for (auto lp : c.getLogprobs()) {
              TokenLogprobInfo info{lp.getTokenId(), lp.getLogprob(), {}};
              for (auto t : lp.getTop()) info.top.emplace_back(t.getTokenId(), t.getLogprob());
              out.logprobs.push_back(std::move(info));
            }
            break;
          }
          case ServerReply::FINAL: {
            out.kind = Reply::Kind::kFinal;
            auto f = r.getFinal();
            out.finish_reason = FinishName(f.getFinishReason());
            out.text = f.getText();
            out.message = f.getMessage();
            if (f.getFinishReason() == FinishReason::ERROR)
              out.error_code = ErrorName(f.getErrorCode());
            for (int32_t t : f.getTokenIds()) out.token_ids.push_back(t);
            auto u = f.getUsage();
            out.prompt_tokens = u.getPromptTokens();
            out.completion_tokens = u.getCompletionTokens();
            out.cached_tokens = u.getCachedTokens();
            out.queue_seconds = u.getQueueSeconds();
            out.ttft_seconds = u.getTtftSeconds();
            out.total_seconds = u.getTotalSeconds();
            break;
          }
          case ServerReply::ERROR:
            out.kind = Reply::Kind::kError;
            out.error_code = ErrorName(r.getError().getCode());
            out.message = r.getError().getMessage();
            break;
          case ServerReply::HEALTH:
            out.kind = Reply::Kind::kHealth;
            out.ok = r.getHealth().getOk();
            out.text = r.getHealth().getDetail();
            break;
          case ServerReply::MODEL_INFO:
            out.kind = Reply::Kind::kModelInfo;
            out.text = r.getModelInfo().getJson();
            break;
          case ServerReply::ACCEPTED:
            out.kind = Reply::Kind::kAccepted;
            break;
        }
        pending_.push_back(std::move(out));
        rest = kj::arrayPtr(reader.getEnd(), rest.end());
      }
    } catch (const kj::Exception& e) {
      pending_.clear();
      return absl::DataLossError(absl::StrCat("malformed reply: ", e.getDescription().cStr()));
    }
  }
  Reply out = std::move(pending_.front());
  pending_.pop_front();
  return out;
}

absl::StatusOr<Reply> Client::Call(uint64_t id, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return absl::DeadlineExceededError("no reply from the coordinator");
    auto r = Next(left);
    if (!r.ok()) return r.status();
    if (r->request_id == id) return r;
  }
}

absl::StatusOr<Reply> Client::Generate(const GenerateInput& input,
                                       const std::function<void(const Reply&)>& on_chunk,
                                       std::chrono::milliseconds timeout) {
  auto id = Submit(input);
  if (!id.ok()) return id.status();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return absl::DeadlineExceededError("generate: no final reply in time");
    auto r = Call(*id, left);
    if (!r.ok()) return r.status();
    if (r->kind == Reply::Kind::kChunk) {
      if (on_chunk) on_chunk(*r);
      continue;
    }
    return r;
  }
}

absl::StatusOr<Reply> Client::Health(std::chrono::milliseconds timeout) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  const uint64_t id = next_id_++;
  req.setRequestId(id);
  req.setHealth();
  if (auto s = SendMessage(msg); !s.ok()) return s;
  return Call(id, timeout);
}

absl::StatusOr<Reply> Client::Info(std::chrono::milliseconds timeout) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  const uint64_t id = next_id_++;
  req.setRequestId(id);
  req.setModelInfo();
  if (auto s = SendMessage(msg); !s.ok()) return s;
  return Call(id, timeout);
}

}  // namespace mlaserve
