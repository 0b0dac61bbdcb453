// mlaserve-openai: the OpenAI-compatible HTTP API (issue 17) in front of a running coordinator.
//
//   mlaserve-openai --coordinator tcp://HOST:PORT --listen HOST:PORT [--api-key KEY]
//                   [--served-model-name NAME] [--threads N] [--default-max-tokens N]
//                   [--request-timeout-s S] [--model DIR] [--reasoning-parser deepseek|kimi|none]
//
// GET /health, GET /version, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
// (streaming as server-sent events with "stream": true), POST /tokenize, POST /detokenize.
//
// --model DIR (the folder the coordinator serves) loads the model's tokenizer and chat template
// here too: /tokenize and /detokenize, logprobs named by each token's own string, and the
// model's output parsed from its token ids (tool calls, tool_calls.h; thinking,
// reasoning_parser.h). Without it those answer 501 (the endpoints) or 400 (tools) saying the flag
// is needed.
// --reasoning-parser is a flag rather than read from the template: whether the output starts
// inside the thinking depends on the rendered prompt (DeepSeek-V3.1 thinks only with
// thinking=true; R1 always), which the coordinator renders, not this process, and a template
// that never mentions <think> (DeepSeek-V3's) can sit in front of a model that thinks.
//
// Why a process of its own rather than `--http` inside the coordinator: it speaks the
// coordinator's ZeroMQ API through the same Client every other caller uses and shares nothing
// internal with it, so a crash here, or a slow HTTP client holding a connection, cannot stall
// the scheduler's loop; it can be restarted, upgraded or run N times in front of one coordinator
// on its own; and the ZeroMQ API stays the one contract (anything the HTTP API needs that the
// ZeroMQ API lacks is added there, for every client). The cost is one more hop per message (a
// local socket and a Cap'n Proto decode); it is to be measured against the ZeroMQ path in
// bench/ (issue 17's "Speed" part).
//
// Concurrency: civetweb serves each connection on one of its worker threads (--threads of
// them), and each thread owns one Client, connected on first use (ZeroMQ sockets are not
// thread-safe; a socket per thread needs no locks and no dispatcher queues). A thread handles
// one HTTP request at a time, so its Client's replies belong to that request's choices or to
// an earlier request it aborted, which are skipped by id. Open streams are thus bounded by
// --threads. Civetweb's threads have a small fixed stack: per-request state lives on the heap.
//
// A client that goes away mid-stream is noticed when a write fails (at the next token) and its
// requests are aborted at once through Client::Abort.
#include <civetweb.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "coordinator/client/client.h"
#include "coordinator/http/openai_protocol.h"
#include "coordinator/http/reasoning_parser.h"
#include "coordinator/http/tool_calls.h"
#include "coordinator/server/request_builder.h"
#include "nlohmann/json.hpp"

namespace mlaserve::openai {
namespace {

using nlohmann::json;

struct Options {
  std::string coordinator;
  std::string listen = "127.0.0.1:8000";
  std::string api_key;
  std::string served_model_name;
  int threads = 128;
  uint32_t default_max_tokens = 256;
  int request_timeout_s = 600;
  size_t max_body_bytes = 8u << 20;
  std::string model_dir;
  ReasoningFormat reasoning = ReasoningFormat::kNone;
};

std::atomic<bool> g_stop{false};
const Options* g_options = nullptr;
// From --model: the tokenizer and chat template (null without the flag), the tool-call markers
// its tokenizer has, and the ids of <think> / </think> where they are single tokens.
const ModelText* g_text = nullptr;
std::optional<ToolCallMarkers> g_tool_markers;
std::vector<int32_t> g_think_ids;

// Text of a JSON value, with invalid UTF-8 (a model can emit any bytes) replaced rather than
// throwing.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

const char* StatusText(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 501:
      return "Not Implemented";
    case 429:
      return "Too Many Requests";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return status >= 500 ? "Internal Server Error" : "Error";
  }
}

int WriteJson(mg_connection* conn, int status, const json& body) {
  const std::string text = Dump(body);
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            status, StatusText(status), text.size());
  mg_write(conn, text.data(), text.size());
  return status;
}

int WriteError(mg_connection* conn, const ApiError& e) {
  return WriteJson(conn, e.status, e.Body());
}

ApiError Error(int status, const std::string& type, const std::string& message,
               const std::string& code = "") {
  ApiError e;
  e.status = status;
  e.type = type;
  e.message = message;
  e.code = code;
  return e;
}

ApiError Unavailable(const std::string& why) {
  return Error(503, "service_unavailable", "the coordinator is not available: " + why,
               "coordinator_unavailable");
}

// This thread's connection to the coordinator (see the top of the file).
Client* ThreadClient() {
  thread_local std::unique_ptr<Client> client;
  if (client == nullptr) {
    auto c = Client::Connect(g_options->coordinator);
    if (!c.ok()) return nullptr;
    client = std::move(*c);
  }
  return client.get();
}

// The model name clients must send: --served-model-name, or the coordinator's (from Info, once).
std::mutex g_model_mu;
std::string g_model_name;
uint32_t g_max_model_len = 0;

absl::StatusOr<std::string> ModelName(Client& c) {
  {
    std::lock_guard<std::mutex> l(g_model_mu);
    if (!g_model_name.empty()) return g_model_name;
  }
  auto info = c.Info(std::chrono::seconds(5));
  if (!info.ok()) return info.status();
  json j = json::parse(info->text, nullptr, false);
  std::lock_guard<std::mutex> l(g_model_mu);
  if (j.is_object()) g_max_model_len = j.value("max_model_len", 0u);
  g_model_name = !g_options->served_model_name.empty() ? g_options->served_model_name
                 : j.is_object() && j.contains("name") && j["name"].is_string()
                     ? j["name"].get<std::string>()
                     : std::string("model");
  return g_model_name;
}

// Bearer token check in time independent of where the strings differ.
bool Authorized(mg_connection* conn) {
  const std::string& key = g_options->api_key;
  if (key.empty()) return true;
  const char* h = mg_get_header(conn, "Authorization");
  const std::string prefix = "Bearer ";
  if (h == nullptr || std::strncmp(h, prefix.c_str(), prefix.size()) != 0) return false;
  const std::string given(h + prefix.size());
  unsigned diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); ++i) {
    diff |= static_cast<unsigned char>(key[i]) ^
            static_cast<unsigned char>(i < given.size() ? given[i] : 0);
  }
  return diff == 0;
}

// Reads the request body, at most max_body_bytes; false (and the error written) otherwise.
bool ReadBody(mg_connection* conn, std::string& body, int& status) {
  const mg_request_info* ri = mg_get_request_info(conn);
  const size_t limit = g_options->max_body_bytes;
  auto too_large = [&] {
    status = WriteError(
        conn, Error(413, "invalid_request_error",
                    "request body exceeds " + std::to_string(limit) + " bytes", "body_too_large"));
    return false;
  };
  if (ri->content_length > static_cast<long long>(limit)) return too_large();
  if (ri->content_length > 0) body.reserve(static_cast<size_t>(ri->content_length));
  std::string buf(64 << 10, '\0');
  for (;;) {
    const int n = mg_read(conn, buf.data(), buf.size());
    if (n <= 0) break;
    body.append(buf.data(), static_cast<size_t>(n));
    if (body.size() > limit) return too_large();
  }
  return true;
}

std::string RandomId(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return std::string(prefix) + hex;
}

// Per-choice state while the replies of one HTTP request come in.
struct Choice {
  uint64_t request_id = 0;
  bool started = false;  // streaming: the first chunk (with the role) went out
  bool finished = false;
  std::string text;  // non-streaming: the final's whole text
  std::string finish_reason;
  json logprobs;          // non-streaming: chat {"content": [...]} or the completions object
  size_t text_bytes = 0;  // completions: text_offset of the next token
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  // Chat with the output parsed (tools or --reasoning-parser): the parts of the answer.
  std::unique_ptr<ToolCallParser> parser;
  std::unique_ptr<ReasoningSplitter> splitter;
  std::string content, reasoning;
  json tool_calls = json::array();  // full response: [{id, type, function: {name, arguments}}]
};

// One step of parsed output as a chat delta's fields (content, reasoning, tool_calls), merged
// into the choice's full-response parts too. Returns an empty object when nothing was added.
json ParsedFields(Choice& c, const ParsedDelta& d) {
  const ReasoningSplitter::Split split = c.splitter->Add(d.content);
  json delta = json::object();
  if (!split.content.empty()) delta["content"] = split.content;
  if (!split.reasoning.empty()) {
    delta["reasoning_content"] = split.reasoning;
    delta["reasoning"] = split.reasoning;
  }
  c.content += split.content;
  c.reasoning += split.reasoning;
  json calls = json::array();
  for (const ToolCallDelta& t : d.tool_calls) {
    json call = {{"index", t.index}};
    if (!t.id.empty() || !t.name.empty()) {
      call["id"] = t.id;
      call["type"] = "function";
      call["function"] = {{"name", t.name}, {"arguments", t.arguments}};
      c.tool_calls.push_back({{"id", t.id},
                              {"type", "function"},
                              {"function", {{"name", t.name}, {"arguments", ""}}}});
    } else {
      call["function"] = {{"arguments", t.arguments}};
    }
    if (t.index < static_cast<int>(c.tool_calls.size())) {
      json& args = c.tool_calls[t.index]["function"]["arguments"];
      args = args.get<std::string>() + t.arguments;
    }
    calls.push_back(std::move(call));
  }
  if (!calls.empty()) delta["tool_calls"] = std::move(calls);
  return delta;
}

// Appends the fields of `add` to `into` (text concatenated, tool-call deltas in order).
void MergeDelta(json& into, const json& add) {
  for (const auto& [k, v] : add.items()) {
    if (v.is_string()) {
      into[k] = into.value(k, "") + v.get<std::string>();
    } else {
      if (!into.contains(k)) into[k] = json::array();
      for (const json& e : v) into[k].push_back(e);
    }
  }
}

json FinishFields(Choice& c) {
  json delta = ParsedFields(c, c.parser->Finish());
  const ReasoningSplitter::Split tail = c.splitter->Finish();
  if (!tail.content.empty()) delta["content"] = delta.value("content", "") + tail.content;
  if (!tail.reasoning.empty()) {
    delta["reasoning_content"] = delta.value("reasoning_content", "") + tail.reasoning;
    delta["reasoning"] = delta["reasoning_content"];
  }
  c.content += tail.content;
  c.reasoning += tail.reasoning;
  return delta;
}

class Generation {
 public:
  Generation(mg_connection* conn, Client& client, const ParsedRequest& req, std::string model)
      : conn_(conn),
        client_(client),
        req_(req),
        model_(std::move(model)),
        chat_(req.endpoint == Endpoint::kChat),
        id_(RandomId(chat_ ? "chatcmpl-" : "cmpl-")),
        created_(static_cast<int64_t>(std::time(nullptr))),
        parsed_(chat_ && g_text != nullptr &&
                (!req.tools.empty() || g_options->reasoning != ReasoningFormat::kNone)) {}

  int Run() {
    choices_.resize(req_.inputs.size());
    if (parsed_) {
      for (size_t i = 0; i < choices_.size(); ++i) {
        choices_[i].parser = std::make_unique<ToolCallParser>(
            *g_text->tokenizer, req_.tools.empty() ? std::nullopt : g_tool_markers,
            req_.inputs[i].sampling.skip_special_tokens,
            g_options->reasoning == ReasoningFormat::kNone ? std::vector<int32_t>{} : g_think_ids,
            RandomId("call_").substr(0, 29) + "_");
        choices_[i].splitter = std::make_unique<ReasoningSplitter>(g_options->reasoning);
      }
    }
    for (size_t i = 0; i < req_.inputs.size(); ++i) {
      auto id = client_.Submit(req_.inputs[i]);
      if (!id.ok()) {
        AbortOpen();
        return WriteError(conn_, Unavailable(std::string(id.status().message())));
      }
      choices_[i].request_id = *id;
      index_[*id] = i;
    }
    size_t open = choices_.size();
    const auto timeout = std::chrono::seconds(g_options->request_timeout_s);
    while (open > 0) {
      auto r = client_.Next(timeout);
      if (!r.ok()) {
        AbortOpen();
        return Fail(Error(504, "timeout",
                          "no reply from the coordinator within " +
                              std::to_string(timeout.count()) +
                              " s: " + std::string(r.status().message())));
      }
      auto it = index_.find(r->request_id);
      if (it == index_.end()) continue;  // an earlier, aborted request of this thread
      Choice& c = choices_[it->second];
      if (c.finished) continue;
      if (r->kind == Reply::Kind::kError) {
        AbortOpen();
        return Fail(FromCoordinatorError(r->error_code, r->message));
      }
      if (r->kind == Reply::Kind::kChunk) {
        if (!OnChunk(it->second, *r)) {
          AbortOpen();  // the HTTP client went away
          return 499;
        }
        continue;
      }
      if (r->kind != Reply::Kind::kFinal) continue;
      c.finished = true;
      --open;
      if (r->finish_reason == "error" || r->finish_reason == "abort") {
        AbortOpen();
        return Fail(Error(
            r->finish_reason == "abort" ? 503 : 500, "server_error",
            "generation " + r->finish_reason + (r->message.empty() ? "" : ": " + r->message)));
      }
      c.finish_reason = FinishReasonName(r->finish_reason);
      if (parsed_) {
        final_delta_ = FinishFields(c);
        if (c.parser->num_calls() > 0 && c.finish_reason == "stop") c.finish_reason = "tool_calls";
      }
      c.text = r->text;
      c.prompt_tokens = r->prompt_tokens;
      c.completion_tokens = r->completion_tokens;
      c.cached_tokens = r->cached_tokens;
      if (req_.stream && !OnStreamFinal(it->second)) {
        AbortOpen();
        return 499;
      }
    }
    return req_.stream ? EndStream() : WriteJson(conn_, 200, FullResponse());
  }

 private:
  void AbortOpen() {
    for (Choice& c : choices_) {
      if (c.request_id != 0 && !c.finished) {
        (void)client_.Abort(c.request_id);
        c.finished = true;
      }
    }
  }

  // An error before the stream's headers is an HTTP error; after them, an SSE event.
  int Fail(const ApiError& e) {
    if (!headers_sent_) return WriteError(conn_, e);
    Send("data: " + Dump(e.Body()) + "\n\ndata: [DONE]\n\n");
    return 200;
  }

  bool Send(const std::string& s) {
    return mg_write(conn_, s.data(), s.size()) == static_cast<int>(s.size());
  }

  bool SendHeaders() {
    if (headers_sent_) return true;
    headers_sent_ = true;
    static const char kHeaders[] =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        "Connection: close\r\n\r\n";
    return Send(kHeaders);
  }

  bool SendEvent(const json& j) { return Send("data: " + Dump(j) + "\n\n"); }

  json ChunkEnvelope(json choice) const {
    return {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", model_},
            {"choices", json::array({std::move(choice)})}};
  }

  // Logprobs of this chunk's token, appended to the choice (non-streaming) or returned (stream).
  json ChunkLogprobs(Choice& c, const Reply& r) {
    if (!req_.logprobs || r.logprobs.empty()) return nullptr;
    if (chat_) {
      json content = json::array();
      for (const TokenLogprobInfo& lp : r.logprobs) {
        content.push_back(ChatLogprobEntry(lp, r.text, req_.top_logprobs, Tok()));
      }
      if (!req_.stream) {
        if (c.logprobs.is_null()) c.logprobs = {{"content", json::array()}, {"refusal", nullptr}};
        for (json& e : content) c.logprobs["content"].push_back(std::move(e));
        return nullptr;
      }
      return {{"content", std::move(content)}, {"refusal", nullptr}};
    }
    json obj = EmptyCompletionLogprobs();
    json& into = req_.stream ? obj : (c.logprobs.is_null() ? c.logprobs = obj : c.logprobs);
    for (const TokenLogprobInfo& lp : r.logprobs) {
      AppendCompletionLogprob(into, lp, r.text, c.text_bytes, req_.top_logprobs, Tok());
    }
    return req_.stream ? obj : json(nullptr);
  }

  static const Tokenizer* Tok() { return g_text != nullptr ? g_text->tokenizer.get() : nullptr; }

  bool OnChunk(size_t index, const Reply& r) {
    Choice& c = choices_[index];
    json lp = ChunkLogprobs(c, r);
    c.text_bytes += r.text.size();
    if (parsed_) {
      json delta = json::object();
      for (int32_t id : r.token_ids) MergeDelta(delta, ParsedFields(c, c.parser->Add(id)));
      if (!req_.stream) return true;
      if (c.started && delta.empty() && lp.is_null()) return true;
      return SendParsedDelta(index, std::move(delta), std::move(lp));
    }
    if (!req_.stream) return true;
    // Nothing to say: a token whose text the detokenizer holds back, after the first chunk.
    if (c.started && r.text.empty() && lp.is_null()) return true;
    if (!SendHeaders()) return false;
    json choice = {{"index", index}, {"logprobs", std::move(lp)}, {"finish_reason", nullptr}};
    if (chat_) {
      json delta = {{"content", r.text}};
      if (!c.started) delta["role"] = "assistant";
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = r.text;
    }
    c.started = true;
    return SendEvent(ChunkEnvelope(std::move(choice)));
  }

  bool SendParsedDelta(size_t index, json delta, json lp) {
    Choice& c = choices_[index];
    if (!SendHeaders()) return false;
    if (!c.started) delta["role"] = "assistant";
    c.started = true;
    return SendEvent(ChunkEnvelope({{"index", index},
                                    {"delta", std::move(delta)},
                                    {"logprobs", std::move(lp)},
                                    {"finish_reason", nullptr}}));
  }

  bool OnStreamFinal(size_t index) {
    Choice& c = choices_[index];
    if (!SendHeaders()) return false;
    if (parsed_ && !final_delta_.empty() && !SendParsedDelta(index, final_delta_, nullptr)) {
      return false;
    }
    json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", c.finish_reason}};
    if (chat_) {
      choice["delta"] = c.started ? json::object() : json{{"role", "assistant"}, {"content", ""}};
    } else {
      choice["text"] = "";
    }
    c.started = true;
    return SendEvent(ChunkEnvelope(std::move(choice)));
  }

  json Usage() const {
    uint32_t prompt = 0, completion = 0, cached = 0;
    for (size_t i = 0; i < choices_.size(); ++i) {
      completion += choices_[i].completion_tokens;
      // The n choices of one prompt share it: count it once.
      if (i % static_cast<size_t>(req_.n) == 0) {
        prompt += choices_[i].prompt_tokens;
        cached += choices_[i].cached_tokens;
      }
    }
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  int EndStream() {
    SendHeaders();
    if (req_.include_usage) {
      SendEvent({{"id", id_},
                 {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
                 {"created", created_},
                 {"model", model_},
                 {"choices", json::array()},
                 {"usage", Usage()}});
    }
    Send("data: [DONE]\n\n");
    return 200;
  }

  json FullResponse() const {
    json choices = json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const Choice& c = choices_[i];
      json lp = c.logprobs;
      if (req_.logprobs && lp.is_null()) {
        lp = chat_ ? json{{"content", json::array()}, {"refusal", nullptr}}
                   : EmptyCompletionLogprobs();
      }
      json choice = {{"index", i}, {"logprobs", lp}, {"finish_reason", c.finish_reason}};
      if (chat_ && parsed_) {
        json msg = {{"role", "assistant"}, {"content", c.content}};
        if (!c.reasoning.empty()) {
          msg["reasoning_content"] = c.reasoning;
          msg["reasoning"] = c.reasoning;
        }
        if (!c.tool_calls.empty()) {
          msg["tool_calls"] = c.tool_calls;
          if (c.content.empty()) msg["content"] = nullptr;  // as OpenAI answers a call-only turn
        }
        choice["message"] = std::move(msg);
      } else if (chat_) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      } else {
        choice["text"] = c.text;
      }
      choices.push_back(std::move(choice));
    }
    return {{"id", id_},
            {"object", chat_ ? "chat.completion" : "text_completion"},
            {"created", created_},
            {"model", model_},
            {"choices", std::move(choices)},
            {"usage", Usage()}};
  }

  mg_connection* conn_;
  Client& client_;
  const ParsedRequest& req_;
  const std::string model_;
  const bool chat_;
  const std::string id_;
  const int64_t created_;
  std::vector<Choice> choices_;
  std::map<uint64_t, size_t> index_;
  bool headers_sent_ = false;
  const bool parsed_;  // chat output through ToolCallParser + ReasoningSplitter
  json final_delta_;   // what the last final's Finish() added, sent before its finish_reason
};

int HandleGenerate(mg_connection* conn, Endpoint endpoint) {
  int status = 0;
  auto body_text = std::make_unique<std::string>();
  if (!ReadBody(conn, *body_text, status)) return status;
  json body = json::parse(*body_text, nullptr, /*allow_exceptions=*/false);
  body_text.reset();
  if (body.is_discarded()) {
    return WriteError(conn, Error(400, "invalid_request_error",
                                  "the request body is not valid JSON", "invalid_json"));
  }
  auto parsed = std::make_unique<ParseResult>(ParseRequest(
      endpoint, body,
      endpoint == Endpoint::kCompletions ? std::min<uint32_t>(16, g_options->default_max_tokens)
                                         : g_options->default_max_tokens));
  if (!parsed->ok) return WriteError(conn, parsed->error);
  ParsedRequest& req = parsed->request;
  if (!req.tools.empty()) {
    ApiError e = Error(400, "invalid_request_error", "");
    e.param = "tools";
    if (g_text == nullptr) {
      e.message =
          "'tools' needs mlaserve-openai --model DIR: the model's tool-call markers are found by "
          "the token ids of its tokenizer";
      return WriteError(conn, e);
    }
    if (!g_tool_markers) {
      e.message =
          "this model's tokenizer has no known tool-call markers (Kimi-K2's or DeepSeek-V3's), so "
          "its tool calls cannot be parsed";
      return WriteError(conn, e);
    }
    const std::string tools = Dump(req.tools);
    for (GenerateInput& in : req.inputs) in.tools_json = tools;
  }
  const bool output_parsed = endpoint == Endpoint::kChat && g_text != nullptr &&
                             (!req.tools.empty() || g_options->reasoning != ReasoningFormat::kNone);
  if (output_parsed && req.has_stop_strings) {
    ApiError e = Error(400, "invalid_request_error",
                       "'stop' strings cannot be combined with tools or a reasoning parser yet: "
                       "the coordinator cuts its own text at a stop string, and parsed output is "
                       "decoded here from the token ids (use stop_token_ids)");
    e.param = "stop";
    return WriteError(conn, e);
  }
  Client* client = ThreadClient();
  if (client == nullptr) return WriteError(conn, Unavailable("cannot connect"));
  auto model = ModelName(*client);
  if (!model.ok()) return WriteError(conn, Unavailable(std::string(model.status().message())));
  if (parsed->request.model != *model) {
    ApiError e = Error(404, "not_found_error",
                       "the model '" + parsed->request.model +
                           "' does not exist; this server "
                           "serves '" +
                           *model + "'",
                       "model_not_found");
    e.param = "model";
    return WriteError(conn, e);
  }
  auto gen = std::make_unique<Generation>(conn, *client, parsed->request, *model);
  return gen->Run();
}

int HandleHealth(mg_connection* conn) {
  Client* client = ThreadClient();
  if (client == nullptr) return WriteError(conn, Unavailable("cannot connect"));
  auto h = client->Health(std::chrono::seconds(2));
  if (!h.ok()) return WriteError(conn, Unavailable(std::string(h.status().message())));
  if (!h->ok) return WriteError(conn, Unavailable(h->text.empty() ? "unhealthy" : h->text));
  return WriteJson(conn, 200, {{"status", "ok"}});
}

int HandleModels(mg_connection* conn) {
  Client* client = ThreadClient();
  if (client == nullptr) return WriteError(conn, Unavailable("cannot connect"));
  auto model = ModelName(*client);
  if (!model.ok()) return WriteError(conn, Unavailable(std::string(model.status().message())));
  uint32_t max_len;
  {
    std::lock_guard<std::mutex> l(g_model_mu);
    max_len = g_max_model_len;
  }
  json m = {{"id", *model}, {"object", "model"}, {"created", 0}, {"owned_by", "mlaserve"}};
  if (max_len > 0) m["max_model_len"] = max_len;
  return WriteJson(conn, 200, {{"object", "list"}, {"data", json::array({m})}});
}

int NeedsModel(mg_connection* conn, const char* what) {
  return WriteError(
      conn, Error(501, "invalid_request_error",
                  std::string(what) + " needs the model's tokenizer: start mlaserve-openai with "
                                      "--model DIR (the folder the coordinator serves)",
                  "tokenizer_not_loaded"));
}

// Reads a JSON object body; false (and the error written) otherwise.
bool ReadJsonObject(mg_connection* conn, json& body, int& status) {
  std::string text;
  if (!ReadBody(conn, text, status)) return false;
  body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    status = WriteError(conn, Error(400, "invalid_request_error",
                                    "the request body must be a JSON object", "invalid_json"));
    return false;
  }
  return true;
}

ApiError BadParam(const std::string& param, const std::string& message) {
  ApiError e = Error(400, "invalid_request_error", message);
  e.param = param;
  return e;
}

// The chat prompt as the coordinator renders it (coordinator/server/request_builder.cc, whose
// message fields and their order this follows: tojson output depends on key order).
absl::StatusOr<std::string> RenderChat(const json& messages, const json& tools,
                                       bool add_generation_prompt) {
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  for (const json& m : messages) {
    nlohmann::ordered_json o = {{"role", m["role"]}, {"content", m.value("content", "")}};
    for (const char* k : {"name", "tool_call_id", "reasoning_content"}) {
      if (m.contains(k) && !m[k].get<std::string>().empty()) o[k] = m[k];
    }
    if (m.contains("tool_calls") && !m["tool_calls"].empty()) {
      nlohmann::ordered_json calls = nlohmann::ordered_json::array();
      for (const json& tc : m["tool_calls"]) {
        const json f = tc.value("function", json::object());
        const std::string args = f.value("arguments", "");
        auto parsed = nlohmann::ordered_json::parse(args, nullptr, false);
        calls.push_back(
            {{"id", tc.value("id", "")},
             {"type", "function"},
             {"function",
              {{"name", f.value("name", "")},
               {"arguments", parsed.is_discarded() ? nlohmann::ordered_json(args) : parsed}}}});
      }
      o["tool_calls"] = std::move(calls);
    }
    msgs.push_back(std::move(o));
  }
  nlohmann::ordered_json context = {{"messages", msgs},
                                    {"add_generation_prompt", add_generation_prompt},
                                    {"bos_token", g_text->bos_token},
                                    {"eos_token", g_text->eos_token},
                                    {"tools", nullptr},
                                    {"documents", nullptr}};
  if (!tools.empty()) context["tools"] = nlohmann::ordered_json::parse(Dump(tools));
  return g_text->chat_template->Render(context);
}

// POST /tokenize: {"prompt": str [, "add_special_tokens": bool]} or {"messages": [...]
// [, "tools", "add_generation_prompt"]} -> {"tokens", "count", "max_model_len"}.
int HandleTokenize(mg_connection* conn) {
  if (g_text == nullptr) return NeedsModel(conn, "/tokenize");
  int status = 0;
  json body;
  if (!ReadJsonObject(conn, body, status)) return status;
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    if (!g_text->chat_template) {
      return WriteError(conn, BadParam("messages", "this model folder has no chat template"));
    }
    json chat = body;
    chat["model"] = "-";
    chat.erase("max_model_len");
    auto parsed = ParseRequest(Endpoint::kChat, chat, 1);
    if (!parsed.ok) return WriteError(conn, parsed.error);
    const GenerateInput& in = parsed.request.inputs.at(0);
    absl::StatusOr<std::string> text;
    try {
      text = RenderChat(*in.chat, parsed.request.tools, in.add_generation_prompt);
    } catch (const json::exception& e) {  // e.g. a tool_calls entry that is not an object
      return WriteError(conn, BadParam("messages", std::string("malformed message: ") + e.what()));
    }
    if (!text.ok()) {
      return WriteError(
          conn, BadParam("messages", "chat template: " + std::string(text.status().message())));
    }
    // The template writes BOS itself, as the coordinator tokenizes it.
    ids = g_text->tokenizer->Encode(*text, /*add_special_tokens=*/false);
  } else if (body.contains("prompt") && body["prompt"].is_string()) {
    bool add_special = true;  // as the coordinator encodes a completions prompt
    if (body.contains("add_special_tokens")) {
      if (!body["add_special_tokens"].is_boolean()) {
        return WriteError(conn,
                          BadParam("add_special_tokens", "'add_special_tokens' must be a boolean"));
      }
      add_special = body["add_special_tokens"].get<bool>();
    }
    ids = g_text->tokenizer->Encode(body["prompt"].get<std::string>(), add_special);
  } else {
    return WriteError(conn, BadParam("prompt", "give 'prompt' (a string) or 'messages'"));
  }
  json max_len = nullptr;
  if (Client* client = ThreadClient(); client != nullptr && ModelName(*client).ok()) {
    std::lock_guard<std::mutex> l(g_model_mu);
    if (g_max_model_len > 0) max_len = g_max_model_len;
  }
  return WriteJson(conn, 200, {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", max_len}});
}

// POST /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens written out so that
// /tokenize of the text gives the ids back.
int HandleDetokenize(mg_connection* conn) {
  if (g_text == nullptr) return NeedsModel(conn, "/detokenize");
  int status = 0;
  json body;
  if (!ReadJsonObject(conn, body, status)) return status;
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return WriteError(conn, BadParam("tokens", "'tokens' must be an array of token ids"));
  }
  std::vector<int32_t> ids;
  const int vocab = g_text->tokenizer->vocab_size();
  for (const json& t : body["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return WriteError(conn, BadParam("tokens", "token ids must be integers in [0, " +
                                                     std::to_string(vocab) + ")"));
    }
    ids.push_back(t.get<int32_t>());
  }
  return WriteJson(conn, 200,
                   {{"prompt", g_text->tokenizer->Decode(ids, /*skip_special_tokens=*/false)}});
}

// Every request comes here (registered for "/"): routes by exact path.
int Route(mg_connection* conn, void*) {
  const mg_request_info* ri = mg_get_request_info(conn);
  const std::string uri = ri->local_uri != nullptr ? ri->local_uri : "";
  const std::string method = ri->request_method != nullptr ? ri->request_method : "";
  auto only = [&](const char* want, auto&& handler) {
    if (method != want) {
      return WriteError(conn, Error(405, "invalid_request_error",
                                    method + " is not allowed on " + uri + " (use " + want + ")"));
    }
    return handler();
  };
  if (uri == "/health") return only("GET", [&] { return HandleHealth(conn); });
  if (!Authorized(conn)) {
    return WriteError(conn, Error(401, "authentication_error",
                                  "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                  "invalid_api_key"));
  }
  if (uri == "/v1/models") return only("GET", [&] { return HandleModels(conn); });
  if (uri == "/version") {
    return only("GET", [&] { return WriteJson(conn, 200, {{"version", MLASERVE_VERSION}}); });
  }
  if (uri == "/tokenize") return only("POST", [&] { return HandleTokenize(conn); });
  if (uri == "/detokenize") return only("POST", [&] { return HandleDetokenize(conn); });
  if (uri == "/v1/chat/completions") {
    return only("POST", [&] { return HandleGenerate(conn, Endpoint::kChat); });
  }
  if (uri == "/v1/completions") {
    return only("POST", [&] { return HandleGenerate(conn, Endpoint::kCompletions); });
  }
  return WriteError(
      conn, Error(404, "not_found_error", "no route " + method + " " + uri, "route_not_found"));
}

int Usage() {
  std::fprintf(stderr,
               "usage: mlaserve-openai --coordinator tcp://HOST:PORT --listen HOST:PORT "
               "[--api-key KEY]\n"
               "       [--served-model-name NAME] [--threads N] [--default-max-tokens N] "
               "[--request-timeout-s S]\n"
               "       [--model DIR] [--reasoning-parser deepseek|kimi|none]\n");
  return 2;
}

}  // namespace
}  // namespace mlaserve::openai

int main(int argc, char** argv) {
  using namespace mlaserve::openai;
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return Usage();
    const std::string v = argv[++i];
    bool ok = true;
    if (a == "--coordinator") {
      o.coordinator = v;
    } else if (a == "--listen") {
      o.listen = v;
    } else if (a == "--api-key") {
      o.api_key = v;
    } else if (a == "--served-model-name") {
      o.served_model_name = v;
    } else if (a == "--threads") {
      ok = absl::SimpleAtoi(v, &o.threads) && o.threads > 0;
    } else if (a == "--default-max-tokens") {
      ok = absl::SimpleAtoi(v, &o.default_max_tokens) && o.default_max_tokens > 0;
    } else if (a == "--model") {
      o.model_dir = v;
    } else if (a == "--reasoning-parser") {
      ok = v == "deepseek" || v == "kimi" || v == "none";
      o.reasoning = v == "deepseek" ? ReasoningFormat::kDeepSeekR1
                    : v == "kimi"   ? ReasoningFormat::kKimiK2
                                    : ReasoningFormat::kNone;
    } else if (a == "--request-timeout-s") {
      ok = absl::SimpleAtoi(v, &o.request_timeout_s) && o.request_timeout_s > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "mlaserve-openai: bad argument %s %s\n", a.c_str(), v.c_str());
      return Usage();
    }
  }
  if (o.coordinator.empty()) return Usage();
  if (o.api_key.empty()) {
    if (const char* k = std::getenv("MLASERVE_API_KEY"); k != nullptr) o.api_key = k;
  }
  g_options = &o;
  std::unique_ptr<mlaserve::ModelText> text;
  if (!o.model_dir.empty()) {
    auto t = mlaserve::ModelText::Load(o.model_dir, 0, 0, {});
    if (!t.ok() || t->tokenizer == nullptr) {
      std::fprintf(stderr, "mlaserve-openai: --model %s: %s\n", o.model_dir.c_str(),
                   t.ok() ? "no tokenizer.json or tiktoken.model there"
                          : std::string(t.status().message()).c_str());
      return 1;
    }
    text = std::make_unique<mlaserve::ModelText>(std::move(*t));
    g_text = text.get();
    g_tool_markers = ToolCallMarkers::FromTokenizer(*text->tokenizer);
    for (const char* m : {"<think>", "</think>"}) {
      if (auto id = text->tokenizer->TokenToId(m)) g_think_ids.push_back(*id);
    }
  } else if (o.reasoning != ReasoningFormat::kNone) {
    std::fprintf(stderr, "mlaserve-openai: --reasoning-parser needs --model DIR\n");
    return Usage();
  }

  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, [](int) { g_stop = true; });
  signal(SIGTERM, [](int) { g_stop = true; });

  mg_init_library(0);
  const std::string threads = std::to_string(o.threads);
  const char* civet_options[] = {"listening_ports", o.listen.c_str(), "num_threads",
                                 threads.c_str(),
                                 // Slow-loris clients: a request's headers and body must arrive
                                 // within this; streams write, so they are not cut by it.
                                 "request_timeout_ms", "30000", nullptr};
  mg_callbacks callbacks{};
  mg_context* ctx = mg_start(&callbacks, nullptr, civet_options);
  if (ctx == nullptr) {
    std::fprintf(stderr, "mlaserve-openai: cannot listen on %s\n", o.listen.c_str());
    return 1;
  }
  mg_set_request_handler(ctx, "/", Route, nullptr);
  mg_server_port ports[4];
  const int nports = mg_get_server_ports(ctx, 4, ports);
  std::fprintf(stderr, "mlaserve-openai: coordinator %s, listening on port %d\n",
               o.coordinator.c_str(), nports > 0 ? ports[0].port : -1);
  std::fflush(stderr);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  mg_stop(ctx);
  mg_exit_library();
  return 0;
}
