// A reasoning model's thinking, split from its answer: the text between <think> and </think>
// goes to `reasoning`, the rest to `content` (OpenAI-compatible servers return it as
// `reasoning_content` and `reasoning`).
//
// Where the thinking starts depends on the chat template and its variables:
//  - DeepSeek-R1 and DeepSeek-V3.1 with thinking on end the prompt with "<think>" (the V3.1
//    template: `{{'<｜Assistant｜>'}}{% if not thinking %}</think>{% else %}<think>`), so the
//    output starts inside the thinking and shows only "</think>"; a "<think>" the model repeats at
//    the very start is dropped;
//  - Kimi-K2-Thinking's generation prompt ends at "<|im_assistant|>assistant<|im_middle|>" and the
//    model writes "<think>" itself, possibly again after each tool result: the output starts in
//    the answer and every <think> ... </think> is thinking.
// Markers are matched on text (split anywhere across chunks); the token stream in front of this
// (ToolCallParser's verbatim ids) delivers them even when special tokens are skipped.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace mlaserve::openai {

enum class ReasoningFormat { kNone, kDeepSeekR1, kKimiK2 };

class ReasoningSplitter {
 public:
  struct Split {
    std::string reasoning, content;
  };
  // `starts_in_reasoning`: how the prompt ends, where the front end rendered it (chat_prompt.h:
  // "<think>" true, "</think>" false, e.g. DeepSeek-V3.1 with thinking on or off); nullopt: the
  // format's default above.
  explicit ReasoningSplitter(ReasoningFormat format,
                             std::optional<bool> starts_in_reasoning = std::nullopt);

  Split Add(std::string_view text);
  // Ends the stream: text held back as a possible marker prefix goes where it stood.
  Split Finish();

 private:
  ReasoningFormat format_;
  bool in_reasoning_;
  bool at_start_;        // DeepSeek: nothing emitted yet, a leading "<think>" is dropped
  std::string pending_;  // a suffix that may be the start of a marker
};

}  // namespace mlaserve::openai
