// mlaserve-openai: the OpenAI-compatible HTTP API (issue 17) in front of a running coordinator.
//
//   mlaserve-openai --coordinator tcp://HOST:PORT --listen HOST:PORT [--api-key KEY]
//                   [--server-key FILE --client-key FILE] (a CURVE coordinator, deploy/README 7)
//                   [--served-model-name NAME] [--threads N] [--default-max-tokens N]
//                   [--request-timeout-s S] [--keep-alive-timeout-s S] [--client-timeout-s S]
//                   [--max-body-bytes N] [--model DIR] [--reasoning-parser deepseek|kimi|none]
//
// GET /health, GET /version, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
// (streaming as server-sent events with "stream": true), POST /tokenize, POST /detokenize.
//
// --model DIR (the folder the coordinator serves) loads the model's tokenizer and chat template
// here too: chat prompts are rendered here and sent as token ids (chat_prompt.h: with
// chat_template_kwargs, and with a tool call opened for tool_choice "required" or a named
// function), /tokenize and /detokenize answer, logprobs are named by each token's own string,
// and the model's output is parsed from its token ids (tool calls, tool_calls.h; thinking,
// reasoning_parser.h). Without it those answer 501 (the endpoints) or 400 (tools,
// chat_template_kwargs) saying the flag is needed, and the coordinator renders the chat.
// --reasoning-parser is a flag rather than read from the template: a template that never
// mentions <think> (DeepSeek-V3's) can sit in front of a model that thinks (R1). Where the
// rendered prompt ends in "<think>" or "</think>" (DeepSeek-V3.1 with thinking on or off), the
// output starts inside or after the thinking accordingly.
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
// them, default 1088: 1,024 streams and some room; an idle kept-alive connection holds one too,
// for --keep-alive-timeout-s). Every generation goes through one shared connection to the
// coordinator (coordinator_link.h: a thread owns the Client and routes each reply to its
// request's mailbox), so the coordinator packs all streams' tokens of a step into one frame. The
// HTTP threads run at a lower priority (nice +5, SCHED_BATCH) than that thread and the
// coordinator: under a flood of streams the HTTP side slows, not the scheduling. /health,
// /v1/models and /tokenize use a Client of their own per thread, connected on first use.
// Civetweb's threads have a small fixed stack: per-request state lives on the heap.
//
// A client that goes away mid-stream is noticed when a write fails (at the next token, or at
// the SSE comment a stream silent for a second gets) and its requests are aborted at once
// through Client::Abort. A non-streaming request's client going away is noticed only when its
// response is written.
#include <civetweb.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
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

#include "common/command_line.h"
#include "coordinator/client/client.h"
#include "coordinator/http/chat_prompt.h"
#include "coordinator/http/coordinator_link.h"
#include "coordinator/http/http_exchange.h"
#include "coordinator/http/large_stack.h"
#include "coordinator/http/openai_protocol.h"
#include "coordinator/http/reasoning_parser.h"
#include "coordinator/http/stop_strings.h"
#include "coordinator/http/tool_calls.h"
#include "coordinator/server/request_builder.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, coordinator, "",
          "The coordinator's client endpoint, tcp://HOST:PORT; required.");
ABSL_FLAG(std::string, listen, "127.0.0.1:8000",
          "HOST:PORT to serve HTTP on (civetweb's listening_ports).");
ABSL_FLAG(
    std::string, api_key, "",
    "Requests must carry Authorization: Bearer KEY (default: $MLASERVE_API_KEY; neither: open).");
ABSL_FLAG(std::string, server_key, "",
          "The coordinator's public key file, for a CURVE coordinator; with --client-key.");
ABSL_FLAG(std::string, client_key, "",
          "This front end's key pair file, for a CURVE coordinator; with --server-key.");
ABSL_FLAG(std::string, served_model_name, "",
          "The model's name in the API (default: the coordinator's model name).");
ABSL_FLAG(int32_t, threads, 1088,
          "HTTP threads: one per open stream or kept-alive connection, in [1, 65536].");
ABSL_FLAG(uint32_t, default_max_tokens, 256,
          "max_tokens of a request that gives none, in [1, 1048576].");
ABSL_FLAG(int32_t, request_timeout_s, 600,
          "A generation with no reply from the coordinator for this long is aborted (504), in [1, "
          "86400].");
ABSL_FLAG(int32_t, keep_alive_timeout_s, 5,
          "An idle kept-alive connection is closed after this, in [0, 3600] (0: no keep-alive).");
ABSL_FLAG(int32_t, client_timeout_s, 30,
          "A request's head and body must arrive, and a blocked write go out, within this, in [1, "
          "86400].");
ABSL_FLAG(uint64_t, max_body_bytes, 8u << 20, "Largest request body, in [1, 1073741824].");
ABSL_FLAG(std::string, model, "",
          "The model folder the coordinator serves: tokenizer and chat template here too (see the "
          "top of openai_main.cc).");
ABSL_FLAG(std::string, reasoning_parser, "none",
          "deepseek, kimi or none: where the model's thinking goes (needs --model).");

namespace mlaserve::openai {
namespace {

using nlohmann::json;

struct Options {
  std::string coordinator;
  // CURVE key files for a coordinator whose client socket requires them (deploy/README.md,
  // section 7): its public key and this front end's key pair. Both or neither.
  ClientSecurity security;
  std::string listen = "127.0.0.1:8000";
  std::string api_key;
  std::string served_model_name;
  // Civetweb serves a connection on one thread: an open stream, or an idle kept-alive connection
  // until --keep-alive-timeout-s, holds one. 1,024 streams plus room for other requests.
  int threads = 1088;
  uint32_t default_max_tokens = 256;
  int request_timeout_s = 600;
  int keep_alive_timeout_s = 5;
  // Slow clients: a request's head and body must arrive within this, and a write that cannot
  // go out for this long ends the connection.
  int client_timeout_s = 30;
  size_t max_body_bytes = 8u << 20;
  std::string model_dir;
  ReasoningFormat reasoning = ReasoningFormat::kNone;
};

// Nice increment of civetweb's worker threads (see Main).
constexpr int kHttpThreadNice = 5;

// How long a stream may stay silent before it gets an SSE comment (see Generation::Run).
constexpr std::chrono::milliseconds kHeartbeat{1000};

std::atomic<bool> g_stop{false};
const Options* g_options = nullptr;
// From --model: the tokenizer and chat template (null without the flag), the tool-call markers
// its tokenizer has, and the ids of <think> / </think> where they are single tokens.
const ModelText* g_text = nullptr;
std::optional<ToolCallMarkers> g_tool_markers;
// From --model with a chat template: chat prompts are rendered here (chat_prompt.h).
const ChatPromptBuilder* g_prompt = nullptr;
std::vector<int32_t> g_think_ids;

// Text of a JSON value, with invalid UTF-8 (a model can emit any bytes) replaced rather than
// throwing.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int WriteJson(HttpExchange& http, int status, const json& body) {
  return http.WriteJson(status, Dump(body));
}

int WriteError(HttpExchange& http, const ApiError& e) {
  return WriteJson(http, e.status, e.Body());
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

// A final with finish_reason error or abort: the coordinator aborts what it had in flight when
// it shuts down, and ends it with "worker job failed: ..." when its workers died (its messages,
// coordinator.cc); both are the server being unavailable, not a bad request.
ApiError GenerationEnded(const std::string& reason, const std::string& message) {
  const std::string why = "generation " + reason + (message.empty() ? "" : ": " + message);
  if (reason == "abort") {
    return Error(503, "service_unavailable", why, "draining");
  }
  if (message.rfind("worker job failed", 0) == 0) {
    return Error(503, "service_unavailable", why, "worker_failed");
  }
  return Error(500, "server_error", why);
}

ApiError Unavailable(const std::string& why) {
  return Error(503, "service_unavailable", "the coordinator is not available: " + why,
               "coordinator_unavailable");
}

// Whether the coordinator still answers, for requests waiting on it: a thread of its own asks
// for Health each second over its own Client. A request's replies can pause for long (queued
// behind others, a long prefill) while the coordinator is fine; when the coordinator itself is
// gone its requests are failed after kCoordinatorSilence instead of --request-timeout-s.
constexpr std::chrono::seconds kCoordinatorSilence{5};

class CoordinatorWatch {
 public:
  void Start() {
    thread_ = std::thread([this] {
      std::unique_ptr<Client> client;
      while (!stop_) {
        if (client == nullptr) {
          auto c = Client::Connect(g_options->coordinator, g_options->security);
          if (c.ok()) {
            client = std::move(*c);
          }
        }
        const auto asked = std::chrono::steady_clock::now();
        if (client != nullptr && client->Health(std::chrono::seconds(1)).ok()) {
          last_answer_ns_ = asked.time_since_epoch().count();
        }
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait_until(l, asked + std::chrono::seconds(1), [this] { return stop_.load(); });
      }
    });
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }
  // How long the coordinator has not answered (0 while it answers).
  std::chrono::steady_clock::duration Silence() const {
    const auto now = std::chrono::steady_clock::now();
    const auto last = std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_answer_ns_.load()));
    return now - last > std::chrono::seconds(2) ? now - last : std::chrono::seconds(0);
  }

 private:
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  // Starts "now": a front end started before its coordinator gives it time to come up.
  std::atomic<int64_t> last_answer_ns_{std::chrono::steady_clock::now().time_since_epoch().count()};
};
CoordinatorWatch g_watch;
// Every generation's submissions and replies (coordinator_link.h).
CoordinatorLink* g_link = nullptr;

// This thread's connection to the coordinator (see the top of the file).
Client* ThreadClient() {
  thread_local std::unique_ptr<Client> client;
  if (client == nullptr) {
    auto c = Client::Connect(g_options->coordinator, g_options->security);
    if (!c.ok()) {
      return nullptr;
    }
    client = std::move(*c);
  }
  return client.get();
}

// The model name clients must send: --served-model-name, or the coordinator's (from Info, once).
std::mutex g_model_mu;
std::string g_model_name;
uint32_t g_max_model_len = 0;

// Asks the coordinator (over this thread's Client) only until it has answered once: a thread
// that serves only generations never opens a Client of its own.
absl::StatusOr<std::string> ModelName() {
  {
    std::lock_guard<std::mutex> l(g_model_mu);
    if (!g_model_name.empty()) {
      return g_model_name;
    }
  }
  Client* c = ThreadClient();
  if (c == nullptr) {
    return absl::UnavailableError("cannot connect");
  }
  auto info = c->Info(std::chrono::seconds(5));
  if (!info.ok()) {
    return info.status();
  }
  json j = json::parse(info->text, nullptr, false);
  std::lock_guard<std::mutex> l(g_model_mu);
  if (j.is_object()) {
    g_max_model_len = j.value("max_model_len", 0u);
  }
  g_model_name = !g_options->served_model_name.empty() ? g_options->served_model_name
                 : j.is_object() && j.contains("name") && j["name"].is_string()
                     ? j["name"].get<std::string>()
                     : std::string("model");
  return g_model_name;
}

// Bearer token check in time independent of where the strings differ.
bool Authorized(mg_connection* conn) {
  const std::string& key = g_options->api_key;
  if (key.empty()) {
    return true;
  }
  const char* h = mg_get_header(conn, "Authorization");
  const std::string prefix = "Bearer ";
  if (h == nullptr || std::strncmp(h, prefix.c_str(), prefix.size()) != 0) {
    return false;
  }
  const std::string given(h + prefix.size());
  unsigned diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); ++i) {
    diff |= static_cast<unsigned char>(key[i]) ^
            static_cast<unsigned char>(i < given.size() ? given[i] : 0);
  }
  return diff == 0;
}

// Reads the request body, at most --max-body-bytes; false (and the error written) otherwise.
bool ReadBody(HttpExchange& http, std::string& body, int& status) {
  const size_t limit = g_options->max_body_bytes;
  switch (http.ReadBody(limit, body)) {
    case HttpExchange::Body::kOk:
      return true;
    case HttpExchange::Body::kTooLarge:
      status = WriteError(http, Error(413, "invalid_request_error",
                                      "request body exceeds " + std::to_string(limit) + " bytes",
                                      "body_too_large"));
      return false;
    case HttpExchange::Body::kIncomplete:
      status = WriteError(
          http, Error(400, "invalid_request_error",
                      "the request body ended before its Content-Length", "incomplete_body"));
      return false;
  }
  return false;
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
  json pending = json::object();    // stream: the forced call's opening, sent with the next delta
  // The request's stop strings, matched here on the answer's content (stop_strings.h); null
  // when it has none. `tokens`: completion tokens received; their count when a stop matched.
  std::unique_ptr<StopStringMatcher> stop;
  uint32_t tokens = 0;
  bool Stopped() const { return stop != nullptr && stop->stopped(); }
};

// One step of parsed output as a chat delta's fields (content, reasoning, tool_calls), merged
// into the choice's full-response parts too. Returns an empty object when nothing was added.
json ParsedFields(Choice& c, const ParsedDelta& d) {
  json delta = json::object();
  if (c.Stopped()) {
    return delta;  // the answer ended at a stop string
  }
  ReasoningSplitter::Split split = c.splitter->Add(d.content);
  if (c.stop != nullptr) {
    split.content = c.stop->Add(split.content);
  }
  if (!split.content.empty()) {
    delta["content"] = split.content;
  }
  if (!split.reasoning.empty()) {
    delta["reasoning_content"] = split.reasoning;
    delta["reasoning"] = split.reasoning;
  }
  c.content += split.content;
  c.reasoning += split.reasoning;
  json calls = json::array();
  for (const ToolCallDelta& t : d.tool_calls) {
    if (c.Stopped()) {
      break;  // what follows the stop string is not part of the answer
    }
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
  if (!calls.empty()) {
    delta["tool_calls"] = std::move(calls);
  }
  return delta;
}

// Appends the fields of `add` to `into` (text concatenated, tool-call deltas in order).
void MergeDelta(json& into, const json& add) {
  for (const auto& [k, v] : add.items()) {
    if (v.is_string()) {
      into[k] = into.value(k, "") + v.get<std::string>();
    } else {
      if (!into.contains(k)) {
        into[k] = json::array();
      }
      for (const json& e : v) {
        into[k].push_back(e);
      }
    }
  }
}

json FinishFields(Choice& c) {
  if (c.Stopped()) {
    return json::object();
  }
  json delta = ParsedFields(c, c.parser->Finish());
  if (c.Stopped()) {
    return delta;
  }
  ReasoningSplitter::Split tail = c.splitter->Finish();
  if (c.stop != nullptr) {
    tail.content = c.stop->Add(tail.content);
    if (!c.stop->stopped()) {
      tail.content += c.stop->Finish();
    }
  }
  if (!tail.content.empty()) {
    delta["content"] = delta.value("content", "") + tail.content;
  }
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
  // answer_stops: per choice, the stop strings matched here (parsed output) instead of by the
  // coordinator; empty otherwise.
  Generation(HttpExchange& http, const ParsedRequest& req, const ChatPrompt& prompt,
             std::string model, std::vector<std::vector<std::string>> answer_stops = {})
      : answer_stops_(std::move(answer_stops)),
        http_(http),
        req_(req),
        prompt_(prompt),
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
        choices_[i].splitter =
            std::make_unique<ReasoningSplitter>(g_options->reasoning, prompt_.ends_in_thinking);
        if (i < answer_stops_.size() && !answer_stops_[i].empty()) {
          choices_[i].stop = std::make_unique<StopStringMatcher>(answer_stops_[i]);
        }
        // The forced opening of a call (tool_choice required / named) is the parser's first
        // input, as if the model had written it: the call it starts is part of the answer.
        for (int32_t id : prompt_.forced) {
          MergeDelta(choices_[i].pending, ParsedFields(choices_[i], choices_[i].parser->Add(id)));
        }
      }
    }
    auto ids = g_link->Submit(req_.inputs, &mailbox_);
    if (!ids.ok()) {
      return WriteError(http_, Unavailable(std::string(ids.status().message())));
    }
    for (size_t i = 0; i < choices_.size(); ++i) {
      choices_[i].request_id = (*ids)[i];
      index_[(*ids)[i]] = i;
    }
    open_ = choices_.size();
    const auto timeout = std::chrono::seconds(g_options->request_timeout_s);
    auto silent_since = std::chrono::steady_clock::now();
    std::vector<Reply> batch;
    while (open_ > 0) {
      // Waits in slices: a stream silent for a slice gets an SSE comment, whose failed write is
      // how a client that went away while its request waits (queued, or in a long prefill) is
      // noticed; without it that is noticed only at the next token.
      batch.clear();
      if (!mailbox_.Wait(kHeartbeat, batch)) {
        if (g_watch.Silence() > kCoordinatorSilence) {
          AbortOpen();
          return Fail(Unavailable(
              "it stopped answering " +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::seconds>(g_watch.Silence()).count()) +
              " s ago, with this request unfinished"));
        }
        if (std::chrono::steady_clock::now() - silent_since >= timeout) {
          AbortOpen();
          return Fail(Error(
              504, "timeout",
              "no reply from the coordinator within " + std::to_string(timeout.count()) + " s"));
        }
        if (req_.stream && !http_.SendEvents(": waiting\n\n")) {
          AbortOpen();
          return 499;
        }
        continue;
      }
      silent_since = std::chrono::steady_clock::now();
      // Every reply that came is handled before anything is written: the events of several
      // steps (a client or this thread running behind) go out in one write.
      for (const Reply& r : batch) {
        if (auto end = OnReply(r)) {
          return *end;
        }
      }
      if (!FlushEvents()) {
        AbortOpen();
        return 499;
      }
    }
    return req_.stream ? EndStream() : WriteJson(http_, 200, FullResponse());
  }

  ~Generation() { AbortOpen(); }

 private:
  // One reply; the HTTP status when the request ends with it.
  std::optional<int> OnReply(const Reply& r) {
    auto it = index_.find(r.request_id);
    if (it == index_.end()) {
      return std::nullopt;
    }
    Choice& c = choices_[it->second];
    if (c.finished) {
      return std::nullopt;
    }
    if (r.kind == Reply::Kind::kError) {
      AbortOpen();
      return Fail(FromCoordinatorError(r.error_code, r.message));
    }
    if (r.kind == Reply::Kind::kChunk) {
      if (auto e = OnChunk(it->second, r); e.has_value()) {
        AbortOpen();
        return e->status == 499 ? 499 : Fail(*e);
      }
      return std::nullopt;
    }
    if (r.kind != Reply::Kind::kFinal) {
      return std::nullopt;
    }
    c.finished = true;
    --open_;
    if (r.finish_reason == "error" || r.finish_reason == "abort") {
      AbortOpen();
      return Fail(GenerationEnded(r.finish_reason, r.message));
    }
    c.finish_reason = FinishReasonName(r.finish_reason);
    if (parsed_) {
      final_delta_ = std::move(c.pending);
      c.pending = json::object();
      MergeDelta(final_delta_, FinishFields(c));
      if (c.parser->num_calls() > 0 && c.finish_reason == "stop") {
        c.finish_reason = "tool_calls";
      }
      if (auto e = UndeclaredCall(c)) {
        AbortOpen();
        return Fail(*e);
      }
    }
    c.text = r.text;
    c.prompt_tokens = r.prompt_tokens;
    c.completion_tokens = r.completion_tokens;
    c.cached_tokens = r.cached_tokens;
    if (req_.stream && !OnStreamFinal(it->second)) {
      AbortOpen();
      return 499;
    }
    return std::nullopt;
  }

  void AbortOpen() {
    std::vector<uint64_t> ids;
    for (Choice& c : choices_) {
      if (c.request_id != 0 && !c.finished) {
        ids.push_back(c.request_id);
        c.finished = true;
      }
    }
    g_link->Abort(ids, &mailbox_);
  }

  // An error before the stream's head is an HTTP error; after it, an SSE event.
  int Fail(const ApiError& e) {
    if (!http_.events_started() && out_.empty()) {
      return WriteError(http_, e);
    }
    out_ += "data: " + Dump(e.Body()) + "\n\ndata: [DONE]\n\n";
    if (FlushEvents()) {
      http_.EndEvents();
    }
    return 200;
  }

  // Events wait in out_ until the replies at hand are handled (or it holds 64 kB).
  bool SendEvent(const json& j) {
    out_ += "data: ";
    out_ += Dump(j);
    out_ += "\n\n";
    return out_.size() < (64u << 10) || FlushEvents();
  }
  bool FlushEvents() {
    if (out_.empty()) {
      return true;
    }
    const bool ok = http_.SendEvents(out_);
    out_.clear();
    return ok;
  }

  json ChunkEnvelope(json choice) const {
    return {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", model_},
            {"choices", json::array({std::move(choice)})}};
  }

  // Logprobs of this chunk's token, appended to the choice (non-streaming) or returned (stream).
  json ChunkLogprobs(Choice& c, const Reply& r) {
    if (!req_.logprobs || r.logprobs.empty()) {
      return nullptr;
    }
    if (chat_) {
      json content = json::array();
      for (const TokenLogprobInfo& lp : r.logprobs) {
        content.push_back(ChatLogprobEntry(lp, r.text, req_.top_logprobs, Tok()));
      }
      if (!req_.stream) {
        if (c.logprobs.is_null()) {
          c.logprobs = {{"content", json::array()}, {"refusal", nullptr}};
        }
        for (json& e : content) {
          c.logprobs["content"].push_back(std::move(e));
        }
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

  // nullopt, or why the request ends: status 499 when the HTTP client went away.
  std::optional<ApiError> OnChunk(size_t index, const Reply& r) {
    static const ApiError kGone = Error(499, "client_closed", "the client went away");
    Choice& c = choices_[index];
    json lp = ChunkLogprobs(c, r);
    c.text_bytes += r.text.size();
    if (parsed_) {
      json delta = std::move(c.pending);
      c.pending = json::object();
      for (int32_t id : r.token_ids) {
        if (c.Stopped()) {
          break;
        }
        ++c.tokens;
        MergeDelta(delta, ParsedFields(c, c.parser->Add(id)));
      }
      if (auto e = UndeclaredCall(c)) {
        return e;
      }
      if (c.Stopped()) {
        return FinishAtStop(index, std::move(delta), std::move(lp));
      }
      if (!req_.stream) {
        return std::nullopt;
      }
      if (c.started && delta.empty() && lp.is_null()) {
        return std::nullopt;
      }
      if (!SendParsedDelta(index, std::move(delta), std::move(lp))) {
        return kGone;
      }
      return std::nullopt;
    }
    if (!req_.stream) {
      return std::nullopt;
    }
    // Nothing to say: a token whose text the detokenizer holds back, after the first chunk.
    if (c.started && r.text.empty() && lp.is_null()) {
      return std::nullopt;
    }
    json choice = {{"index", index}, {"logprobs", std::move(lp)}, {"finish_reason", nullptr}};
    if (chat_) {
      json delta = {{"content", r.text}};
      if (!c.started) {
        delta["role"] = "assistant";
      }
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = r.text;
    }
    c.started = true;
    if (!SendEvent(ChunkEnvelope(std::move(choice)))) {
      return kGone;
    }
    return std::nullopt;
  }

  // A stop string ended the answer (parsed output): the request is aborted at the coordinator
  // (whose final then never comes: the link drops it) and the choice finishes here, with
  // finish_reason "stop" and the usage this side knows: the prompt it rendered, the tokens
  // received up to the match (cached_tokens is the coordinator's and stays 0).
  std::optional<ApiError> FinishAtStop(size_t index, json delta, json lp) {
    static const ApiError kGone = Error(499, "client_closed", "the client went away");
    Choice& c = choices_[index];
    g_link->Abort({c.request_id}, &mailbox_);
    c.finished = true;
    --open_;
    c.finish_reason = "stop";
    c.prompt_tokens = static_cast<uint32_t>(prompt_.ids.size());
    c.completion_tokens = c.tokens;
    if (!req_.stream) {
      return std::nullopt;
    }
    if ((!delta.empty() || !lp.is_null()) && !SendParsedDelta(index, std::move(delta), std::move(lp))) {
      return kGone;
    }
    final_delta_ = json::object();
    if (!OnStreamFinal(index)) {
      return kGone;
    }
    return std::nullopt;
  }

  // tool_choice "required": a call the model named after a function the request does not
  // declare breaks the promise of a call to one of them (the opening is forced, the name is
  // not constrained), and is an error rather than a response.
  std::optional<ApiError> UndeclaredCall(const Choice& c) const {
    if (req_.tool_choice != ToolChoice::kRequired) {
      return std::nullopt;
    }
    for (const json& call : c.tool_calls) {
      const std::string name = call["function"]["name"].get<std::string>();
      bool declared = false;
      for (const auto& t : req_.tools) {
        declared = declared || t["function"]["name"] == name;
      }
      if (!declared) {
        const std::string shown = name.size() > 64 ? name.substr(0, 64) + "..." : name;
        return Error(500, "server_error",
                     "tool_choice \"required\": the model called '" + shown +
                         "', which is not one of the request's tools (the call is opened for "
                         "the model; its name is the model's own choice, not constrained)",
                     "invalid_tool_call");
      }
    }
    return std::nullopt;
  }

  bool SendParsedDelta(size_t index, json delta, json lp) {
    Choice& c = choices_[index];
    if (!c.started) {
      delta["role"] = "assistant";
    }
    c.started = true;
    return SendEvent(ChunkEnvelope({{"index", index},
                                    {"delta", std::move(delta)},
                                    {"logprobs", std::move(lp)},
                                    {"finish_reason", nullptr}}));
  }

  bool OnStreamFinal(size_t index) {
    Choice& c = choices_[index];
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
    if (req_.include_usage) {
      SendEvent({{"id", id_},
                 {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
                 {"created", created_},
                 {"model", model_},
                 {"choices", json::array()},
                 {"usage", Usage()}});
    }
    out_ += "data: [DONE]\n\n";
    if (FlushEvents()) {
      http_.EndEvents();
    }
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
          if (c.content.empty()) {
            msg["content"] = nullptr;  // as OpenAI answers a call-only turn
          }
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

  const std::vector<std::vector<std::string>> answer_stops_;
  HttpExchange& http_;
  CoordinatorLink::Mailbox mailbox_;
  size_t open_ = 0;  // choices without their final
  std::string out_;  // stream events not yet written
  const ParsedRequest& req_;
  const ChatPrompt& prompt_;
  const std::string model_;
  const bool chat_;
  const std::string id_;
  const int64_t created_;
  std::vector<Choice> choices_;
  std::map<uint64_t, size_t> index_;
  const bool parsed_;  // chat output through ToolCallParser + ReasoningSplitter
  json final_delta_;   // what the last final's Finish() added, sent before its finish_reason
};

// Reads a JSON object body (in the client's key order); false (and the error written) otherwise.
bool ReadJsonObject(HttpExchange& http, nlohmann::ordered_json& body, int& status) {
  std::string text;
  if (!ReadBody(http, text, status)) {
    return false;
  }
  body = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    status = WriteError(http, Error(400, "invalid_request_error",
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

// The chat prompt of `req` rendered here (--model with a chat template; chat_prompt.h), its
// inputs turned into token ids; false (and the error written) when it cannot be.
bool BuildChatPrompt(HttpExchange& http, ParsedRequest& req, ChatPrompt& prompt, int& status) {
  // Rendering recurses with the template: not on civetweb's 100 KiB stack (large_stack.h).
  absl::StatusOr<ChatPrompt> built;
  const absl::Status ran = RunWithStack(kChatPromptStackBytes, [&] {
    built = g_prompt->Build(req, req.inputs.at(0).add_generation_prompt);
  });
  if (!ran.ok()) {
    status = WriteError(http, Error(503, "service_unavailable", std::string(ran.message())));
    return false;
  }
  if (!built.ok()) {
    status = WriteError(http, BadParam(req.tool_choice == ToolChoice::kRequired ||
                                               req.tool_choice == ToolChoice::kNamed
                                           ? "tool_choice"
                                           : "messages",
                                       std::string(built.status().message())));
    return false;
  }
  prompt = std::move(*built);
  for (GenerateInput& in : req.inputs) {
    in.chat.reset();
    in.tools_json.clear();
    in.token_ids = prompt.ids;
  }
  return true;
}

int HandleGenerate(HttpExchange& http, Endpoint endpoint) {
  int status = 0;
  nlohmann::ordered_json body;
  if (!ReadJsonObject(http, body, status)) {
    return status;
  }
  auto parsed = std::make_unique<ParseResult>(ParseRequest(
      endpoint, body,
      endpoint == Endpoint::kCompletions ? std::min<uint32_t>(16, g_options->default_max_tokens)
                                         : g_options->default_max_tokens));
  body = nullptr;
  if (!parsed->ok) {
    return WriteError(http, parsed->error);
  }
  ParsedRequest& req = parsed->request;
  if (!req.tools.empty()) {
    ApiError e = Error(400, "invalid_request_error", "");
    e.param = "tools";
    if (g_text == nullptr) {
      e.message =
          "'tools' needs mlaserve-openai --model DIR: the model's tool-call markers are found by "
          "the token ids of its tokenizer";
      return WriteError(http, e);
    }
    if (!g_tool_markers) {
      e.message =
          "this model's tokenizer has no known tool-call markers (Kimi-K2's or DeepSeek-V3's), so "
          "its tool calls cannot be parsed";
      return WriteError(http, e);
    }
    const std::string tools = req.tools.dump(-1, ' ', false, json::error_handler_t::replace);
    for (GenerateInput& in : req.inputs) {
      in.tools_json = tools;
    }
    // One call at most: generation stops at the end of the first. A named function gets one.
    if (!req.parallel_tool_calls || req.tool_choice == ToolChoice::kNamed) {
      for (GenerateInput& in : req.inputs) {
        in.sampling.stop_token_ids.push_back(g_tool_markers->call_end);
      }
    }
  }
  auto prompt = std::make_unique<ChatPrompt>();
  if (endpoint == Endpoint::kChat && g_prompt != nullptr) {
    if (!BuildChatPrompt(http, req, *prompt, status)) {
      return status;
    }
  } else if (endpoint == Endpoint::kChat && !req.chat_template_kwargs.empty()) {
    return WriteError(http, BadParam("chat_template_kwargs",
                                     "'chat_template_kwargs' needs mlaserve-openai --model DIR "
                                     "(the chat is then rendered here, with them)"));
  }
  const bool output_parsed = endpoint == Endpoint::kChat && g_text != nullptr &&
                             (!req.tools.empty() || g_options->reasoning != ReasoningFormat::kNone);
  // Parsed output: the stop strings end the answer's content here (stop_strings.h), not in
  // the coordinator, which sees only tokens. Usage then counts the prompt this side rendered.
  std::vector<std::vector<std::string>> answer_stops;
  if (output_parsed && req.has_stop_strings) {
    if (prompt->ids.empty()) {
      ApiError e = Error(400, "invalid_request_error",
                         "'stop' strings with tools or a reasoning parser need the chat rendered "
                         "here (mlaserve-openai --model DIR with a chat template)");
      e.param = "stop";
      return WriteError(http, e);
    }
    for (GenerateInput& in : req.inputs) {
      answer_stops.push_back(std::move(in.sampling.stop));
      in.sampling.stop.clear();
    }
  }
  auto model = ModelName();
  if (!model.ok()) {
    return WriteError(http, Unavailable(std::string(model.status().message())));
  }
  if (parsed->request.model != *model) {
    ApiError e = Error(404, "not_found_error",
                       "the model '" + parsed->request.model +
                           "' does not exist; this server "
                           "serves '" +
                           *model + "'",
                       "model_not_found");
    e.param = "model";
    return WriteError(http, e);
  }
  auto gen = std::make_unique<Generation>(http, parsed->request, *prompt, *model,
                                          std::move(answer_stops));
  return gen->Run();
}

int HandleHealth(HttpExchange& http) {
  Client* client = ThreadClient();
  if (client == nullptr) {
    return WriteError(http, Unavailable("cannot connect"));
  }
  auto h = client->Health(std::chrono::seconds(2));
  if (!h.ok()) {
    return WriteError(http, Unavailable(std::string(h.status().message())));
  }
  if (!h->ok) {
    return WriteError(http, Unavailable(h->text.empty() ? "unhealthy" : h->text));
  }
  return WriteJson(http, 200, {{"status", "ok"}});
}

int HandleModels(HttpExchange& http) {
  auto model = ModelName();
  if (!model.ok()) {
    return WriteError(http, Unavailable(std::string(model.status().message())));
  }
  uint32_t max_len;
  {
    std::lock_guard<std::mutex> l(g_model_mu);
    max_len = g_max_model_len;
  }
  json m = {{"id", *model}, {"object", "model"}, {"created", 0}, {"owned_by", "mlaserve"}};
  if (max_len > 0) {
    m["max_model_len"] = max_len;
  }
  return WriteJson(http, 200, {{"object", "list"}, {"data", json::array({m})}});
}

int NeedsModel(HttpExchange& http, const char* what) {
  return WriteError(
      http, Error(501, "invalid_request_error",
                  std::string(what) + " needs the model's tokenizer: start mlaserve-openai with "
                                      "--model DIR (the folder the coordinator serves)",
                  "tokenizer_not_loaded"));
}

// POST /tokenize: {"prompt": str [, "add_special_tokens": bool]} or {"messages": [...]
// [, "tools", "tool_choice", "add_generation_prompt", "chat_template_kwargs"]} -> {"tokens",
// "count", "max_model_len"}: the prompt a chat request with these fields is given.
int HandleTokenize(HttpExchange& http) {
  if (g_text == nullptr) {
    return NeedsModel(http, "/tokenize");
  }
  int status = 0;
  nlohmann::ordered_json body;
  if (!ReadJsonObject(http, body, status)) {
    return status;
  }
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    if (g_prompt == nullptr) {
      return WriteError(http, BadParam("messages", "this model folder has no chat template"));
    }
    nlohmann::ordered_json chat = body;
    chat["model"] = "-";
    chat.erase("max_model_len");
    auto parsed = std::make_unique<ParseResult>(ParseRequest(Endpoint::kChat, chat, 1));
    if (!parsed->ok) {
      return WriteError(http, parsed->error);
    }
    ChatPrompt prompt;
    if (!BuildChatPrompt(http, parsed->request, prompt, status)) {
      return status;
    }
    ids = std::move(prompt.ids);
  } else if (body.contains("prompt") && body["prompt"].is_string()) {
    bool add_special = true;  // as the coordinator encodes a completions prompt
    if (body.contains("add_special_tokens")) {
      if (!body["add_special_tokens"].is_boolean()) {
        return WriteError(http,
                          BadParam("add_special_tokens", "'add_special_tokens' must be a boolean"));
      }
      add_special = body["add_special_tokens"].get<bool>();
    }
    ids = g_text->tokenizer->Encode(body["prompt"].get<std::string>(), add_special);
  } else {
    return WriteError(http, BadParam("prompt", "give 'prompt' (a string) or 'messages'"));
  }
  json max_len = nullptr;
  if (ModelName().ok()) {
    std::lock_guard<std::mutex> l(g_model_mu);
    if (g_max_model_len > 0) {
      max_len = g_max_model_len;
    }
  }
  return WriteJson(http, 200, {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", max_len}});
}

// POST /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens written out so that
// /tokenize of the text gives the ids back.
int HandleDetokenize(HttpExchange& http) {
  if (g_text == nullptr) {
    return NeedsModel(http, "/detokenize");
  }
  int status = 0;
  nlohmann::ordered_json body;
  if (!ReadJsonObject(http, body, status)) {
    return status;
  }
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return WriteError(http, BadParam("tokens", "'tokens' must be an array of token ids"));
  }
  std::vector<int32_t> ids;
  const int vocab = g_text->tokenizer->vocab_size();
  for (const auto& t : body["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return WriteError(http, BadParam("tokens", "token ids must be integers in [0, " +
                                                     std::to_string(vocab) + ")"));
    }
    ids.push_back(t.get<int32_t>());
  }
  return WriteJson(http, 200,
                   {{"prompt", g_text->tokenizer->Decode(ids, /*skip_special_tokens=*/false)}});
}

// Every request comes here (registered for "/"): routes by exact path.
int Route(mg_connection* conn, void*) {
  const mg_request_info* ri = mg_get_request_info(conn);
  HttpExchange http(conn);
  const std::string uri = ri->local_uri != nullptr ? ri->local_uri : "";
  const std::string method = ri->request_method != nullptr ? ri->request_method : "";
  auto only = [&](const char* want, auto&& handler) {
    if (method != want) {
      return WriteError(http, Error(405, "invalid_request_error",
                                    method + " is not allowed on " + uri + " (use " + want + ")"));
    }
    return handler();
  };
  if (uri == "/health") {
    return only("GET", [&] { return HandleHealth(http); });
  }
  if (!Authorized(conn)) {
    return WriteError(http, Error(401, "authentication_error",
                                  "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                  "invalid_api_key"));
  }
  if (uri == "/v1/models") {
    return only("GET", [&] { return HandleModels(http); });
  }
  if (uri == "/version") {
    return only("GET", [&] { return WriteJson(http, 200, {{"version", MLASERVE_VERSION}}); });
  }
  if (uri == "/tokenize") {
    return only("POST", [&] { return HandleTokenize(http); });
  }
  if (uri == "/detokenize") {
    return only("POST", [&] { return HandleDetokenize(http); });
  }
  if (uri == "/v1/chat/completions") {
    return only("POST", [&] { return HandleGenerate(http, Endpoint::kChat); });
  }
  if (uri == "/v1/completions") {
    return only("POST", [&] { return HandleGenerate(http, Endpoint::kCompletions); });
  }
  return WriteError(
      http, Error(404, "not_found_error", "no route " + method + " " + uri, "route_not_found"));
}

constexpr char kUsage[] =
    "mlaserve-openai --coordinator tcp://HOST:PORT [--listen HOST:PORT] [flags]";

int Main(int argc, char** argv) {
  ParseFlags(argc, argv, kUsage);
  Options o;
  o.coordinator = RequiredFlag(FLAGS_coordinator, "tcp://HOST:PORT");
  o.listen = absl::GetFlag(FLAGS_listen);
  o.api_key = absl::GetFlag(FLAGS_api_key);
  o.security.server_key_file = absl::GetFlag(FLAGS_server_key);
  o.security.client_key_file = absl::GetFlag(FLAGS_client_key);
  o.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  o.threads = FlagInRange(FLAGS_threads, 1, 1 << 16);
  o.default_max_tokens = FlagInRange(FLAGS_default_max_tokens, 1, 1 << 20);
  o.request_timeout_s = FlagInRange(FLAGS_request_timeout_s, 1, 86400);
  o.keep_alive_timeout_s = FlagInRange(FLAGS_keep_alive_timeout_s, 0, 3600);
  o.client_timeout_s = FlagInRange(FLAGS_client_timeout_s, 1, 86400);
  o.max_body_bytes = FlagInRange(FLAGS_max_body_bytes, 1, 1 << 30);
  o.model_dir = absl::GetFlag(FLAGS_model);
  const std::string reasoning = FlagOneOf(FLAGS_reasoning_parser, {"deepseek", "kimi", "none"});
  o.reasoning = reasoning == "deepseek" ? ReasoningFormat::kDeepSeekR1
                : reasoning == "kimi"   ? ReasoningFormat::kKimiK2
                                        : ReasoningFormat::kNone;
  if (o.api_key.empty()) {
    if (const char* k = std::getenv("MLASERVE_API_KEY"); k != nullptr) {
      o.api_key = k;
    }
  }
  g_options = &o;
  std::unique_ptr<mlaserve::ModelText> text;
  std::unique_ptr<ChatPromptBuilder> prompt;
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
    if (text->chat_template) {
      prompt = std::make_unique<ChatPromptBuilder>(*text, g_tool_markers);
    }
    g_prompt = prompt.get();
    for (const char* m : {"<think>", "</think>"}) {
      if (auto id = text->tokenizer->TokenToId(m)) {
        g_think_ids.push_back(*id);
      }
    }
  } else if (o.reasoning != ReasoningFormat::kNone) {
    UsageError("--reasoning-parser needs --model DIR");
  }

  if (o.security.server_key_file.empty() != o.security.client_key_file.empty()) {
    UsageError("--server-key and --client-key go together");
  }
  auto link = CoordinatorLink::Start(o.coordinator, o.security);
  if (!link.ok()) {
    std::fprintf(stderr, "mlaserve-openai: --coordinator %s: %s\n", o.coordinator.c_str(),
                 std::string(link.status().message()).c_str());
    return 1;
  }
  g_link = link->get();

  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, [](int) { g_stop = true; });
  signal(SIGTERM, [](int) { g_stop = true; });

  mg_init_library(0);
  const std::string threads = std::to_string(o.threads);
  const std::string keep_alive_ms = std::to_string(o.keep_alive_timeout_s * 1000);
  const std::string client_ms = std::to_string(o.client_timeout_s * 1000);
  const std::string backlog = std::to_string(std::max(o.threads, 256));
  const char* civet_options[] = {
      "listening_ports", o.listen.c_str(), "num_threads", threads.c_str(),
      // Slow-loris clients: a request's head and body must arrive within this (and a blocked
      // write gives up after it); streams write, so they are not cut by it.
      "request_timeout_ms", client_ms.c_str(), "enable_keep_alive",
      o.keep_alive_timeout_s > 0 ? "yes" : "no", "keep_alive_timeout_ms", keep_alive_ms.c_str(),
      // Each event is one small write that must go out now, not wait for the last one's ACK.
      "tcp_nodelay", "1",
      // Many clients connecting at once (a benchmark's 1,024 streams) wait in the backlog for
      // the accept thread instead of seeing their SYN dropped and retried a second later.
      "listen_backlog", backlog.c_str(), nullptr};
  mg_callbacks callbacks{};
  // The HTTP threads run kHttpThreadNice below the rest: the link thread that feeds them all
  // (and the coordinator, when it shares the machine) is never starved by a thousand streams'
  // writes; a flood of HTTP clients then slows the HTTP clients.
  callbacks.init_thread = [](const mg_context*, int thread_type) -> void* {
    if (thread_type == 1) {
      const auto tid = static_cast<id_t>(syscall(SYS_gettid));
      errno = 0;
      const int nice = getpriority(PRIO_PROCESS, tid);
      if (errno == 0) {
        (void)setpriority(PRIO_PROCESS, tid, nice + kHttpThreadNice);
      }
      sched_param param{};
      (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
    }
    return nullptr;
  };
  mg_context* ctx = mg_start(&callbacks, nullptr, civet_options);
  if (ctx == nullptr) {
    std::fprintf(stderr, "mlaserve-openai: cannot listen on %s\n", o.listen.c_str());
    return 1;
  }
  mg_set_request_handler(ctx, "/", Route, nullptr);
  g_watch.Start();
  mg_server_port ports[4];
  const int nports = mg_get_server_ports(ctx, 4, ports);
  std::fprintf(stderr, "mlaserve-openai: coordinator %s, listening on port %d\n",
               o.coordinator.c_str(), nports > 0 ? ports[0].port : -1);
  std::fflush(stderr);
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  mg_stop(ctx);
  g_watch.Stop();
  mg_exit_library();
  return 0;
}

}  // namespace
}  // namespace mlaserve::openai

int main(int argc, char** argv) { return mlaserve::openai::Main(argc, argv); }
