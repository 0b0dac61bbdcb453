// The chat prompt as mlaserve-openai builds it when it has the model's tokenizer and chat
// template (--model): the template rendered over the request's messages, tools and
// chat_template_kwargs (e.g. DeepSeek-V3.1's {"thinking": true}), tokenized as the coordinator
// tokenizes a rendered chat, and sent as token ids. Rendering here rather than in the
// coordinator carries what its ZeroMQ API has no field for (template keywords, a forced tool
// call), lets the output parsers know how the prompt ends, and keeps the template's work off the
// scheduler's thread.
//
// tool_choice "required" or a named function: the prompt ends with the opening of a tool call in
// the model's own markers, as its template writes an assistant's call (for a named function, up
// to where the arguments begin), so the model continues inside a call:
//  - Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.[NAME:IDX
//    <|tool_call_argument_begin|>], IDX counting the conversation's earlier calls (Kimi's ids);
//  - DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>[NAME<｜tool▁sep｜>];
//  - DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>[NAME
//    "\n```json\n"].
// This forces a call (to that function, when named, or when "required" leaves one tool to
// call) without constrained decoding: the name under "required" with several tools and the
// arguments are still the model's, not checked against the schemas.
// A prompt that ends inside the thinking (`<think>`) is closed first (`</think>`): the call
// comes at once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/http/openai_protocol.h"
#include "coordinator/http/tool_calls.h"
#include "coordinator/server/request_builder.h"
#include "nlohmann/json.hpp"

namespace mlaserve::openai {

// How the template writes one call between <tool_call_begin> and <tool_call_end>.
enum class ToolCallLayout {
  kKimiK2,       // ID <|tool_call_argument_begin|> ARGS, ID = functions.NAME:IDX
  kDeepSeekV31,  // NAME <｜tool▁sep｜> ARGS
  kDeepSeekV3,   // function <｜tool▁sep｜> NAME "\n```json\n" ARGS "\n```"
};

struct ChatPrompt {
  std::vector<int32_t> ids;     // the whole prompt
  std::vector<int32_t> forced;  // its tail that opens a tool call (empty unless forced)
  // Whether the prompt before `forced` ends inside the thinking: its last non-space text is
  // "<think>" (true) or "</think>" (false); nullopt when neither.
  std::optional<bool> ends_in_thinking;
};

class ChatPromptBuilder {
 public:
  // `text` must have a tokenizer and a chat template; `markers` are its tool-call markers.
  ChatPromptBuilder(const ModelText& text, std::optional<ToolCallMarkers> markers);

  // The template rendered as transformers' apply_chat_template renders it: messages (an
  // assistant's tool_calls with their arguments as given, content null when it has none),
  // tools (null when none), add_generation_prompt, bos_token, eos_token, documents (null) and
  // `kwargs` as further variables.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& messages,
                                     const nlohmann::ordered_json& tools,
                                     bool add_generation_prompt,
                                     const nlohmann::ordered_json& kwargs) const;

  // The request's prompt: rendered, tokenized, and with tool_choice "required" or a named
  // function the opening of a call appended. An error names what the client can change (a
  // template error, a forced tool choice this model's template gives no way to open).
  absl::StatusOr<ChatPrompt> Build(const ParsedRequest& request, bool add_generation_prompt) const;

  // Found by rendering a call through the template (Kimi's markers need no probe); nullopt:
  // the template writes DeepSeek's calls in a way not listed above, or none at all.
  std::optional<ToolCallLayout> layout() const { return layout_; }

 private:
  std::string TokenText(int32_t id) const;
  std::optional<ToolCallLayout> DetectLayout() const;

  const ModelText& text_;
  std::optional<ToolCallMarkers> markers_;
  std::optional<ToolCallLayout> layout_;
};

}  // namespace mlaserve::openai
