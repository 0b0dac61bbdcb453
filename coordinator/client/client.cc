#include "coordinator/client/client.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "capnp/message.h"
#include "capnp/serialize.h"
#include "mlaserve.capnp.h"
#include "zmq.hpp"

namespace mlaserve {
namespace {

using wire::ClientRequest;
using wire::ErrorCode;
using wire::FinishReason;
using wire::ServerReply;

absl::Status SendMessage(zmq::socket_t& sock, capnp::MessageBuilder& msg) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
  auto bytes = words.asBytes();
  if (!sock.send(zmq::const_buffer(bytes.begin(), bytes.size()), zmq::send_flags::dontwait)) {
    return absl::UnavailableError("coordinator socket is not accepting messages");
  }
  return absl::OkStatus();
}

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

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& endpoint) {
  std::unique_ptr<Client> c(new Client());
  c->ctx_ = std::make_unique<zmq::context_t>(1);
  c->sock_ = std::make_unique<zmq::socket_t>(*c->ctx_, zmq::socket_type::dealer);
  c->sock_->set(zmq::sockopt::linger, 0);
  try {
    c->sock_->connect(endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", endpoint, ": ", e.what()));
  }
  return c;
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
  if (auto st = SendMessage(*sock_, msg); !st.ok()) return st;
  return id;
}

absl::Status Client::Abort(uint64_t request_id) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  req.setRequestId(request_id);
  req.setAbort();
  return SendMessage(*sock_, msg);
}

absl::Status Client::SendRaw(const std::string& bytes) {
  if (!sock_->send(zmq::buffer(bytes), zmq::send_flags::dontwait))
    return absl::UnavailableError("send failed");
  return absl::OkStatus();
}

absl::StatusOr<Reply> Client::Next(std::chrono::milliseconds timeout) {
  if (pending_.empty()) {
    zmq::pollitem_t item{sock_->handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, timeout) == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no reply from the coordinator within ", timeout.count(), " ms"));
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
  if (auto s = SendMessage(*sock_, msg); !s.ok()) return s;
  return Call(id, timeout);
}

absl::StatusOr<Reply> Client::Info(std::chrono::milliseconds timeout) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<ClientRequest>();
  const uint64_t id = next_id_++;
  req.setRequestId(id);
  req.setModelInfo();
  if (auto s = SendMessage(*sock_, msg); !s.ok()) return s;
  return Call(id, timeout);
}

}  // namespace mlaserve
