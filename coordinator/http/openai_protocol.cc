#include "coordinator/http/openai_protocol.h"

#include <cmath>
#include <set>

namespace mlaserve::openai {
namespace {

using nlohmann::json;
// Request bodies keep the client's key order: tools and tool-call arguments are rendered into
// the prompt with tojson, whose output follows it (as Python dicts do in transformers / vLLM).
using ojson = nlohmann::ordered_json;

// Thrown inside ParseRequest only, turned into a ParseResult at its boundary.
struct ParseError {
  ApiError error;
};

[[noreturn]] void Fail(const std::string& param, const std::string& message) {
  ApiError e;
  e.param = param;
  e.message = message;
  throw ParseError{e};
}

bool Has(const ojson& body, const char* key) {
  auto it = body.find(key);
  return it != body.end() && !it->is_null();
}

double Number(const ojson& body, const char* key, double lo, double hi) {
  const ojson& v = body.at(key);
  if (!v.is_number()) {
    Fail(key, std::string("'") + key + "' must be a number");
  }
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) {
    Fail(key, std::string("'") + key + "' must be between " + std::to_string(lo) + " and " +
                  std::to_string(hi) + ", got " + v.dump());
  }
  return x;
}

int64_t Integer(const ojson& body, const char* key, int64_t lo, int64_t hi) {
  const ojson& v = body.at(key);
  if (!v.is_number_integer()) {
    Fail(key, std::string("'") + key + "' must be an integer");
  }
  const int64_t x =
      v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX ? INT64_MAX : v.get<int64_t>();
  if (x < lo || x > hi) {
    Fail(key, std::string("'") + key + "' must be between " + std::to_string(lo) + " and " +
                  std::to_string(hi) + ", got " + v.dump());
  }
  return x;
}

bool Bool(const ojson& body, const char* key) {
  const ojson& v = body.at(key);
  if (!v.is_boolean()) {
    Fail(key, std::string("'") + key + "' must be a boolean");
  }
  return v.get<bool>();
}

// Chat content: a string, or an array of {"type": "text", "text": ...} parts (concatenated).
std::string Content(const ojson& content, const std::string& param) {
  if (content.is_string()) {
    return content.get<std::string>();
  }
  if (!content.is_array()) {
    Fail(param, "message content must be a string or an array of parts");
  }
  std::string out;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string p = param + "[" + std::to_string(i) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      Fail(p, "a content part must be an object with a string 'type'");
    }
    const std::string type = part["type"].get<std::string>();
    if (type != "text") {
      Fail(p, "content parts of type '" + type + "' are not supported (text only)");
    }
    if (!part.contains("text") || !part["text"].is_string()) {
      Fail(p, "a text part needs a string 'text'");
    }
    out += part["text"].get<std::string>();
  }
  return out;
}

// An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
// "arguments"}}], arguments a JSON string as OpenAI sends them (an object is accepted too).
ojson ToolCalls(const ojson& calls, const std::string& param) {
  if (!calls.is_array()) {
    Fail(param, "tool_calls must be an array");
  }
  ojson out = ojson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    const ojson& tc = calls[i];
    const std::string p = param + "[" + std::to_string(i) + "]";
    if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object()) {
      Fail(p, "a tool call must be an object with a 'function' object");
    }
    const ojson& f = tc["function"];
    if (!f.contains("name") || !f["name"].is_string()) {
      Fail(p + ".function.name", "a tool call needs a string function name");
    }
    if (Has(f, "arguments") && !f["arguments"].is_string() && !f["arguments"].is_object()) {
      Fail(p + ".function.arguments", "arguments must be a JSON string (or an object)");
    }
    if (Has(tc, "id") && !tc["id"].is_string()) {
      Fail(p + ".id", "a tool call id must be a string");
    }
    out.push_back({{"id", Has(tc, "id") ? tc["id"] : ojson("")},
                   {"type", "function"},
                   {"function",
                    {{"name", f["name"]},
                     {"arguments", Has(f, "arguments") ? f["arguments"] : ojson("{}")}}}});
  }
  return out;
}

ojson Messages(const ojson& body) {
  if (!Has(body, "messages")) {
    Fail("messages", "'messages' is required");
  }
  const ojson& msgs = body["messages"];
  if (!msgs.is_array() || msgs.empty()) {
    Fail("messages", "'messages' must be a non-empty array");
  }
  static const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};
  ojson out = ojson::array();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) {
      Fail(p, "a message must be an object");
    }
    if (!m.contains("role") || !m["role"].is_string() ||
        !kRoles.count(m["role"].get<std::string>())) {
      Fail(p + ".role", "role must be one of system, developer, user, assistant, tool");
    }
    ojson o = {{"role", m["role"]}};
    // The chat templates know "system"; OpenAI's newer name for it is "developer".
    if (o["role"] == "developer") {
      o["role"] = "system";
    }
    if (Has(m, "content")) {
      o["content"] = Content(m["content"], p + ".content");
    } else if (o["role"] != "assistant") {
      Fail(p + ".content", "content is required for role " + o["role"].get<std::string>());
    }
    for (const char* k : {"name", "tool_call_id", "reasoning_content"}) {
      if (Has(m, k)) {
        if (!m[k].is_string()) {
          Fail(p + "." + k, std::string("'") + k + "' must be a string");
        }
        o[k] = m[k];
      }
    }
    if (Has(m, "tool_calls")) {
      o["tool_calls"] = ToolCalls(m["tool_calls"], p + ".tool_calls");
    }
    out.push_back(std::move(o));
  }
  return out;
}

// Completions prompts: a string, an array of strings, an array of token ids, or an array of
// arrays of token ids; each is a prompt of its own.
std::vector<GenerateInput> Prompts(const ojson& body) {
  if (!Has(body, "prompt")) {
    Fail("prompt", "'prompt' is required");
  }
  const ojson& p = body["prompt"];
  std::vector<GenerateInput> out;
  auto ids = [](const ojson& a) {
    std::vector<int32_t> v;
    for (const ojson& t : a) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
        Fail("prompt", "token ids must be non-negative integers");
      }
      v.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    return v;
  };
  if (p.is_string()) {
    out.emplace_back().text = p.get<std::string>();
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    out.emplace_back().token_ids = ids(p);
  } else if (p.is_array() && !p.empty()) {
    for (const ojson& e : p) {
      if (e.is_string()) {
        out.emplace_back().text = e.get<std::string>();
      } else if (e.is_array() && !e.empty()) {
        out.emplace_back().token_ids = ids(e);
      } else {
        Fail("prompt", "each prompt must be a string or a non-empty array of token ids");
      }
    }
  } else {
    Fail("prompt", "'prompt' must be a string, an array of strings or an array of token ids");
  }
  return out;
}

std::vector<std::string> Stops(const ojson& body) {
  const ojson& s = body["stop"];
  std::vector<std::string> out;
  if (s.is_string()) {
    out.push_back(s.get<std::string>());
  } else if (s.is_array()) {
    for (const ojson& e : s) {
      if (!e.is_string()) {
        Fail("stop", "'stop' must be a string or an array of strings");
      }
      out.push_back(e.get<std::string>());
    }
  } else {
    Fail("stop", "'stop' must be a string or an array of strings");
  }
  for (const std::string& x : out) {
    if (x.empty()) {
      Fail("stop", "stop strings must not be empty");
    }
  }
  return out;
}

// Chat tools: [{"type": "function", "function": {"name", ...}}]. `strict` function schemas are
// refused: they promise arguments that match the schema, which needs constrained decoding.
ojson Tools(const ojson& body) {
  const ojson& tools = body["tools"];
  if (!tools.is_array()) {
    Fail("tools", "'tools' must be an array");
  }
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string p = "tools[" + std::to_string(i) + "]";
    if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string()) {
      Fail(p, "a tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (t["function"].contains("strict") && t["function"]["strict"] == true) {
      Fail(p + ".function.strict",
           "'strict' function schemas are not supported: arguments that are sure to match the "
           "schema need constrained decoding, which this server does not have");
    }
  }
  return tools;
}

// tool_choice: "auto" (the default with tools), "none", "required", or
// {"type": "function", "function": {"name": NAME}} naming one of `tools`.
void ParseToolChoice(const ojson& body, const ojson& tools, ParsedRequest& r) {
  if (!Has(body, "tool_choice")) {
    return;
  }
  const ojson& tc = body["tool_choice"];
  if (tc == "auto") {
    r.tool_choice = ToolChoice::kAuto;
  } else if (tc == "none") {
    r.tool_choice = ToolChoice::kNone;
  } else if (tc == "required") {
    r.tool_choice = ToolChoice::kRequired;
  } else if (tc.is_object() && tc.value("type", "") == "function" && tc.contains("function") &&
             tc["function"].is_object() && tc["function"].contains("name") &&
             tc["function"]["name"].is_string()) {
    r.tool_choice = ToolChoice::kNamed;
    r.tool_choice_name = tc["function"]["name"].get<std::string>();
    bool declared = false;
    for (const ojson& t : tools) {
      declared = declared || t["function"]["name"] == r.tool_choice_name;
    }
    if (!declared) {
      Fail("tool_choice",
           "tool_choice names '" + r.tool_choice_name + "', which is not in 'tools'");
    }
  } else {
    Fail("tool_choice",
         "'tool_choice' must be \"auto\", \"none\", \"required\" or "
         "{\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  if ((r.tool_choice == ToolChoice::kRequired || r.tool_choice == ToolChoice::kNamed) &&
      tools.empty()) {
    Fail("tool_choice", "tool_choice \"required\" or a named function needs 'tools'");
  }
}

// Fields OpenAI (or its common extensions) define that this server does not honour yet: each
// is a 400 that says so unless its value is the default.
void RejectUnsupported(const ojson& body, Endpoint endpoint) {
  auto unsupported = [](const char* key, const std::string& why) {
    Fail(key, std::string("'") + key + "' is not supported by this server" +
                  (why.empty() ? "" : ": " + why));
  };
  if (Has(body, "functions") || Has(body, "function_call")) {
    unsupported("functions", "use 'tools' and 'tool_choice' (the legacy fields are not)");
  }
  if (Has(body, "response_format")) {
    const ojson& rf = body["response_format"];
    if (!rf.is_object() || rf.value("type", "") != "text") {
      unsupported("response_format",
                  "only {\"type\": \"text\"} (structured output is not implemented)");
    }
  }
  if (Has(body, "logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty())) {
    unsupported("logit_bias", "");
  }
  if (Has(body, "audio") || Has(body, "modalities")) {
    unsupported("modalities", "text only");
  }
  if (Has(body, "prediction")) {
    unsupported("prediction", "predicted outputs are not implemented");
  }
  if (Has(body, "web_search_options")) {
    unsupported("web_search_options", "");
  }
  if (Has(body, "store") && body["store"] != false) {
    unsupported("store", "completions are not stored");
  }
  if (Has(body, "reasoning_effort")) {
    unsupported("reasoning_effort",
                "turn thinking on or off with chat_template_kwargs where the model's template "
                "takes it (e.g. {\"thinking\": true})");
  }
  if (endpoint == Endpoint::kCompletions) {
    if (Has(body, "echo") && body["echo"] != false) {
      unsupported("echo", "");
    }
    if (Has(body, "suffix")) {
      unsupported("suffix", "");
    }
    if (Has(body, "best_of") && body["best_of"] != 1 &&
        !(Has(body, "n") && body["best_of"] == body["n"])) {
      unsupported("best_of", "");
    }
  } else {
    for (const char* k : {"prompt", "echo", "suffix", "best_of"}) {
      if (Has(body, k)) {
        Fail(k, std::string("'") + k + "' is a completions field");
      }
    }
  }
}

}  // namespace

json ApiError::Body() const {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

ParseResult ParseRequest(Endpoint endpoint, const ojson& body, uint32_t default_max_tokens) {
  ParseResult res;
  try {
    if (!body.is_object()) {
      Fail("", "the request body must be a JSON object");
    }
    RejectUnsupported(body, endpoint);
    ParsedRequest& r = res.request;
    r.endpoint = endpoint;
    if (!Has(body, "model") || !body["model"].is_string()) {
      Fail("model", "'model' is required and must be a string");
    }
    r.model = body["model"].get<std::string>();

    std::vector<GenerateInput> prompts;
    if (endpoint == Endpoint::kChat) {
      GenerateInput in;
      r.messages = Messages(body);
      in.chat = json::parse(r.messages.dump());
      if (Has(body, "add_generation_prompt")) {
        in.add_generation_prompt = Bool(body, "add_generation_prompt");
      }
      ojson tools = Has(body, "tools") ? Tools(body) : ojson::array();
      ParseToolChoice(body, tools, r);
      if (r.tool_choice != ToolChoice::kNone) {
        r.tools = std::move(tools);
      }
      if (Has(body, "parallel_tool_calls")) {
        r.parallel_tool_calls = Bool(body, "parallel_tool_calls");
      }
      if (Has(body, "chat_template_kwargs")) {
        if (!body["chat_template_kwargs"].is_object()) {
          Fail("chat_template_kwargs", "'chat_template_kwargs' must be an object");
        }
        r.chat_template_kwargs = body["chat_template_kwargs"];
        // The variables the server sets itself (transformers' apply_chat_template takes them as
        // its own arguments, not as template keywords).
        for (const char* k : {"messages", "tools", "documents", "add_generation_prompt",
                              "bos_token", "eos_token"}) {
          if (r.chat_template_kwargs.contains(k)) {
            Fail("chat_template_kwargs",
                 std::string("chat_template_kwargs must not set '") + k +
                     "' (give it as the request field, or it is the server's)");
          }
        }
      }
      prompts.push_back(std::move(in));
    } else {
      for (const char* k : {"messages", "tools", "tool_choice", "chat_template_kwargs"}) {
        if (Has(body, k)) {
          Fail(k, std::string("'") + k + "' is a chat completions field");
        }
      }
      prompts = Prompts(body);
    }

    ClientSampling s;
    s.temperature = 1.0f;  // OpenAI's default
    s.max_tokens = default_max_tokens;
    if (Has(body, "temperature")) {
      s.temperature = static_cast<float>(Number(body, "temperature", 0, 2));
    }
    if (Has(body, "top_p")) {
      s.top_p = static_cast<float>(Number(body, "top_p", 0, 1));
    }
    if (s.top_p <= 0) {
      Fail("top_p", "'top_p' must be greater than 0");
    }
    if (Has(body, "top_k")) {
      s.top_k = static_cast<int>(Integer(body, "top_k", -1, INT32_MAX));
    }
    if (s.top_k < 0) {
      s.top_k = 0;  // -1: vLLM's "no limit"
    }
    if (Has(body, "min_p")) {
      s.min_p = static_cast<float>(Number(body, "min_p", 0, 1));
    }
    if (Has(body, "presence_penalty")) {
      s.presence_penalty = static_cast<float>(Number(body, "presence_penalty", -2, 2));
    }
    if (Has(body, "frequency_penalty")) {
      s.frequency_penalty = static_cast<float>(Number(body, "frequency_penalty", -2, 2));
    }
    if (Has(body, "repetition_penalty")) {
      s.repetition_penalty = static_cast<float>(Number(body, "repetition_penalty", 0, 10));
      if (s.repetition_penalty <= 0) {
        Fail("repetition_penalty", "'repetition_penalty' must be > 0");
      }
    }
    if (Has(body, "seed")) {
      s.seed = static_cast<uint64_t>(Integer(body, "seed", INT64_MIN, INT64_MAX));
    }
    // max_completion_tokens is the newer name; when both are given it wins, as in OpenAI's API.
    for (const char* k : {"max_tokens", "max_completion_tokens"}) {
      if (Has(body, k)) {
        s.max_tokens = static_cast<uint32_t>(Integer(body, k, 1, UINT32_MAX >> 1));
      }
    }
    if (Has(body, "min_tokens")) {
      s.min_tokens = static_cast<uint32_t>(Integer(body, "min_tokens", 0, s.max_tokens));
    }
    if (Has(body, "stop")) {
      s.stop = Stops(body);
    }
    r.has_stop_strings = !s.stop.empty();
    if (Has(body, "stop_token_ids")) {
      if (!body["stop_token_ids"].is_array()) {
        Fail("stop_token_ids", "'stop_token_ids' must be an array");
      }
      for (const ojson& t : body["stop_token_ids"]) {
        if (!t.is_number_integer()) {
          Fail("stop_token_ids", "'stop_token_ids' must hold integers");
        }
        s.stop_token_ids.push_back(t.get<int32_t>());
      }
    }
    if (Has(body, "ignore_eos")) {
      s.ignore_eos = Bool(body, "ignore_eos");
    }
    if (Has(body, "skip_special_tokens")) {
      s.skip_special_tokens = Bool(body, "skip_special_tokens");
    }
    if (Has(body, "priority")) {
      s.priority = static_cast<int32_t>(Integer(body, "priority", INT32_MIN, INT32_MAX));
    }

    if (endpoint == Endpoint::kChat) {
      if (Has(body, "logprobs")) {
        r.logprobs = Bool(body, "logprobs");
      }
      if (Has(body, "top_logprobs")) {
        r.top_logprobs = static_cast<uint32_t>(Integer(body, "top_logprobs", 0, 20));
        if (!r.logprobs && r.top_logprobs > 0) {
          Fail("top_logprobs", "'top_logprobs' needs 'logprobs': true");
        }
      }
    } else if (Has(body, "logprobs")) {
      r.top_logprobs = static_cast<uint32_t>(Integer(body, "logprobs", 0, 20));
      r.logprobs = true;
    }
    s.logprobs = r.logprobs;
    s.top_logprobs = r.top_logprobs;

    if (Has(body, "stream")) {
      r.stream = Bool(body, "stream");
    }
    if (Has(body, "stream_options")) {
      const ojson& so = body["stream_options"];
      if (!so.is_object()) {
        Fail("stream_options", "'stream_options' must be an object");
      }
      if (!r.stream) {
        Fail("stream_options", "'stream_options' is only allowed with 'stream': true");
      }
      if (Has(so, "include_usage")) {
        r.include_usage = Bool(so, "include_usage");
      }
    }

    int64_t n = 1;
    if (Has(body, "n")) {
      n = Integer(body, "n", 1, 128);
    }
    if (n * static_cast<int64_t>(prompts.size()) > 128) {
      Fail("n", "at most 128 choices per request (n times the number of prompts)");
    }
    r.n = static_cast<int>(n);
    for (GenerateInput& p : prompts) {
      p.sampling = s;
      for (int64_t j = 0; j < n; ++j) {
        r.inputs.push_back(p);
        // n samples of one seeded request must differ from each other yet be reproducible.
        if (s.seed && j > 0) {
          r.inputs.back().sampling.seed = *s.seed + static_cast<uint64_t>(j);
        }
      }
    }
    res.ok = true;
  } catch (const ParseError& e) {
    res.error = e.error;
  } catch (const json::exception& e) {
    res.error.message = std::string("malformed request: ") + e.what();
  }
  return res;
}

ApiError FromCoordinatorError(const std::string& code, const std::string& message) {
  ApiError e;
  e.message = message;
  if (code == "invalidRequest") {
    e.status = 400;
  } else if (code == "promptTooLong") {
    e.status = 400;
    e.code = "context_length_exceeded";
    e.param = "messages";
  } else if (code == "overloaded") {
    e.status = 429;
    e.type = "rate_limit_error";
    e.code = "overloaded";
  } else if (code == "shuttingDown" || code == "workerFailed") {
    e.status = 503;
    e.type = "service_unavailable";
    e.code = code == "shuttingDown" ? "draining" : "worker_failed";
  } else if (code == "unavailable") {  // the front end's own link to the coordinator failed
    e.status = 503;
    e.type = "service_unavailable";
    e.code = "coordinator_unavailable";
  } else if (code == "notFound") {
    e.status = 404;
    e.type = "not_found_error";
  } else {
    e.status = 500;
    e.type = "internal_error";
    e.code = code;
  }
  return e;
}

namespace {

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) {
    b.push_back(static_cast<int>(c));
  }
  return b;
}

std::string IdName(int32_t id) { return "token_id:" + std::to_string(id); }

// The name of token `id` and its bytes: decoded by the tokenizer where there is one, else the
// chunk's text for the sampled token and "token_id:N" for the others.
std::pair<std::string, std::string> TokenName(int32_t id, const TokenLogprobInfo& lp,
                                              const std::string& token_text,
                                              const Tokenizer* tokenizer) {
  if (tokenizer != nullptr) {
    const int32_t one[] = {id};
    return {tokenizer->Decode(one, /*skip_special_tokens=*/false),
            tokenizer->DecodeBytes(one, /*skip_special_tokens=*/false)};
  }
  const std::string name = id == lp.token_id ? token_text : IdName(id);
  return {name, name};
}

}  // namespace

json ChatLogprobEntry(const TokenLogprobInfo& lp, const std::string& token_text,
                      uint32_t top_logprobs, const Tokenizer* tokenizer) {
  json top = json::array();
  for (size_t i = 0; i < lp.top.size() && i < top_logprobs; ++i) {
    const auto [name, bytes] = TokenName(lp.top[i].first, lp, token_text, tokenizer);
    top.push_back({{"token", name}, {"logprob", lp.top[i].second}, {"bytes", Bytes(bytes)}});
  }
  const auto [name, bytes] = TokenName(lp.token_id, lp, token_text, tokenizer);
  return {{"token", name},
          {"logprob", lp.logprob},
          {"bytes", Bytes(bytes)},
          {"top_logprobs", std::move(top)}};
}

json EmptyCompletionLogprobs() {
  return {{"tokens", json::array()},
          {"token_logprobs", json::array()},
          {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
}

void AppendCompletionLogprob(json& obj, const TokenLogprobInfo& lp, const std::string& token_text,
                             size_t offset, uint32_t top_logprobs, const Tokenizer* tokenizer) {
  obj["tokens"].push_back(TokenName(lp.token_id, lp, token_text, tokenizer).first);
  obj["token_logprobs"].push_back(lp.logprob);
  json top = json::object();
  for (size_t i = 0; i < lp.top.size() && i < top_logprobs; ++i) {
    top[TokenName(lp.top[i].first, lp, token_text, tokenizer).first] = lp.top[i].second;
  }
  obj["top_logprobs"].push_back(std::move(top));
  obj["text_offset"].push_back(offset);
}

std::string FinishReasonName(const std::string& r) { return r == "length" ? "length" : "stop"; }

}  // namespace mlaserve::openai
