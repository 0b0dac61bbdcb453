// The OpenAI API's request and response JSON, translated to and from the coordinator client's
// GenerateInput / Reply (coordinator/client/client.h). No I/O here: mlaserve-openai
// (openai_main.cc) reads the HTTP bodies and writes what these functions build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/client/client.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace mlaserve::openai {

// An error as the OpenAI API returns it: HTTP status and {"error": {message, type, param, code}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field, or empty
  std::string code;   // e.g. "context_length_exceeded", or empty

  nlohmann::json Body() const;
};

enum class Endpoint { kChat, kCompletions };

// tool_choice: the model decides (auto), no tools (none), a call to one of the tools (required)
// or to the one named.
enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

// One parsed request: the inputs to submit (n per prompt, choice index = prompt * n + j) and what
// the response needs.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;
  std::vector<GenerateInput> inputs;  // one per choice
  int n = 1;                          // choices per prompt
  bool stream = false;
  bool include_usage = false;
  // Chat: logprobs (bool) + top_logprobs; completions: logprobs (int) is top_logprobs.
  bool logprobs = false;
  uint32_t top_logprobs = 0;
  // Chat: the messages as the chat template sees them (content parts joined, "developer" as
  // "system", tool_calls normalized), in the client's key order; inputs[i].chat holds the same.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  // Chat: the tool definitions (a JSON array; empty when none or tool_choice is "none").
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // kNamed: the function's name (one of `tools`)
  bool parallel_tool_calls = true;
  // Chat: extra variables for the chat template (e.g. {"thinking": true}).
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool has_stop_strings = false;
};

// Parses a /v1/chat/completions or /v1/completions body. Fields OpenAI defines that this server
// cannot honour are errors (400), never silently ignored. `default_max_tokens` applies when the
// body has neither max_tokens nor max_completion_tokens.
struct ParseResult {
  bool ok = false;
  ParsedRequest request;
  ApiError error;
};
ParseResult ParseRequest(Endpoint endpoint, const nlohmann::ordered_json& body,
                         uint32_t default_max_tokens);

// The coordinator's error reply (code, message) as an HTTP error.
ApiError FromCoordinatorError(const std::string& code, const std::string& message);

// Logprobs of one token, in the chat format ({"token", "logprob", "bytes", "top_logprobs"}).
// With the model's tokenizer (mlaserve-openai --model) each token, sampled or alternative, is
// its own decoded string and `bytes` its raw bytes (a token that ends inside a UTF-8 character
// reads U+FFFD in `token`, its true bytes in `bytes`). Without it the coordinator's chunk is all
// there is: `token` is the chunk's text delta (one token per chunk; "" where the detokenizer held
// a partial character back), and alternatives are named "token_id:N" (vLLM's convention).
nlohmann::json ChatLogprobEntry(const TokenLogprobInfo& lp, const std::string& token_text,
                                uint32_t top_logprobs, const Tokenizer* tokenizer);

// Appends one token to a completions-format logprobs object
// ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}); `offset` is in bytes.
void AppendCompletionLogprob(nlohmann::json& obj, const TokenLogprobInfo& lp,
                             const std::string& token_text, size_t offset, uint32_t top_logprobs,
                             const Tokenizer* tokenizer);
nlohmann::json EmptyCompletionLogprobs();

// "stop" / "length" as OpenAI spells them (the coordinator's names are the same).
std::string FinishReasonName(const std::string& coordinator_reason);

}  // namespace mlaserve::openai
