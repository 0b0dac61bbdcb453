#include "coordinator/http/chat_prompt.h"

#include "absl/strings/str_cat.h"

namespace mlaserve::openai {
namespace {

using ojson = nlohmann::ordered_json;

constexpr char kThinkOpen[] = "<think>";
constexpr char kThinkClose[] = "</think>";

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::optional<bool> EndsInThinking(const std::string& prompt) {
  const size_t end = prompt.find_last_not_of(" \t\r\n");
  const std::string s = end == std::string::npos ? "" : prompt.substr(0, end + 1);
  if (EndsWith(s, kThinkOpen)) {
    return true;
  }
  if (EndsWith(s, kThinkClose)) {
    return false;
  }
  return std::nullopt;
}

}  // namespace

ChatPromptBuilder::ChatPromptBuilder(const ModelText& text, std::optional<ToolCallMarkers> markers)
    : text_(text), markers_(markers) {
  layout_ = DetectLayout();
}

std::string ChatPromptBuilder::TokenText(int32_t id) const {
  const int32_t one[] = {id};
  return text_.tokenizer->Decode(one, /*skip_special_tokens=*/false);
}

absl::StatusOr<std::string> ChatPromptBuilder::Render(const ojson& messages, const ojson& tools,
                                                      bool add_generation_prompt,
                                                      const ojson& kwargs) const {
  ojson msgs = ojson::array();
  for (const ojson& m : messages) {
    ojson o = m;
    // An assistant turn that only calls tools has no content: None, as OpenAI clients send it
    // and as DeepSeek's templates test it (`message['content'] is none` selects the tool-call
    // branch). Elsewhere a missing content renders as empty text.
    if (!o.contains("content") || o["content"].is_null()) {
      o["content"] = o.contains("tool_calls") ? ojson(nullptr) : ojson("");
    }
    msgs.push_back(std::move(o));
  }
  ojson context = {{"messages", std::move(msgs)},
                   {"add_generation_prompt", add_generation_prompt},
                   {"bos_token", text_.bos_token},
                   {"eos_token", text_.eos_token},
                   {"tools", tools.empty() ? ojson(nullptr) : tools},
                   {"documents", nullptr}};
  for (const auto& [k, v] : kwargs.items()) {
    context[k] = v;
  }
  return text_.chat_template->Render(context);
}

std::optional<ToolCallLayout> ChatPromptBuilder::DetectLayout() const {
  if (!markers_ || !text_.chat_template) {
    return std::nullopt;
  }
  if (markers_->format == ToolCallFormat::kKimiK2) {
    return ToolCallLayout::kKimiK2;
  }
  const ojson probe = ojson::parse(R"([{"role": "user", "content": "x"},
      {"role": "assistant", "tool_calls": [{"id": "call_0", "type": "function",
                                            "function": {"name": "probe_fn", "arguments": "{}"}}]}])");
  auto text = Render(probe, ojson::array(), false, ojson::object());
  if (!text.ok()) {
    return std::nullopt;
  }
  const std::string begin = TokenText(markers_->call_begin), sep = TokenText(markers_->separator);
  const size_t at = text->find(begin);
  if (at == std::string::npos) {
    return std::nullopt;
  }
  const std::string after = text->substr(at + begin.size());
  if (after.rfind("function" + sep + "probe_fn\n", 0) == 0) {
    return ToolCallLayout::kDeepSeekV3;
  }
  if (after.rfind("probe_fn" + sep, 0) == 0) {
    return ToolCallLayout::kDeepSeekV31;
  }
  return std::nullopt;
}

absl::StatusOr<ChatPrompt> ChatPromptBuilder::Build(const ParsedRequest& r,
                                                    bool add_generation_prompt) const {
  auto rendered = Render(r.messages, r.tools, add_generation_prompt, r.chat_template_kwargs);
  if (!rendered.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("chat template: ", rendered.status().message()));
  }
  std::string text = std::move(*rendered);
  ChatPrompt out;
  out.ends_in_thinking = EndsInThinking(text);
  std::string opening;
  const bool named = r.tool_choice == ToolChoice::kNamed;
  if (named || r.tool_choice == ToolChoice::kRequired) {
    if (!markers_ || !layout_) {
      return absl::InvalidArgumentError(
          "tool_choice \"required\" or a named function is enforced by opening the call in the "
          "model's own tool-call markers, and this model's tokenizer or chat template has none "
          "this server knows (Kimi-K2's or DeepSeek-V3/V3.1's); use \"auto\"");
    }
    if (out.ends_in_thinking == true) {
      text += kThinkClose;
      out.ends_in_thinking = false;
    }
    const ToolCallMarkers& m = *markers_;
    opening = TokenText(m.section_begin) + TokenText(m.call_begin);
    const std::string sep = TokenText(m.separator);
    // "required" with one tool leaves one name to call: it is written for the model too.
    const std::string name = named ? r.tool_choice_name
                             : r.tools.size() == 1
                                 ? r.tools[0]["function"]["name"].get<std::string>()
                                 : "";
    const bool has_name = !name.empty();
    switch (*layout_) {
      case ToolCallLayout::kKimiK2: {
        size_t earlier = 0;  // Kimi numbers a conversation's calls from 0
        for (const ojson& msg : r.messages) {
          if (msg.contains("tool_calls")) {
            earlier += msg["tool_calls"].size();
          }
        }
        opening += "functions.";
        if (has_name) {
          opening += name + ":" + std::to_string(earlier) + sep;
        }
        break;
      }
      case ToolCallLayout::kDeepSeekV31:
        if (has_name) {
          opening += name + sep;
        }
        break;
      case ToolCallLayout::kDeepSeekV3:
        opening += "function" + sep;
        if (has_name) {
          opening += name + "\n```json\n";
        }
        break;
    }
  }
  // The template writes BOS itself (as the coordinator tokenizes a rendered chat). The opening
  // starts with a special token, so tokenizing it apart gives the tokens of the whole text.
  out.ids = text_.tokenizer->Encode(text, /*add_special_tokens=*/false);
  if (!opening.empty()) {
    out.forced = text_.tokenizer->Encode(opening, /*add_special_tokens=*/false);
    out.ids.insert(out.ids.end(), out.forced.begin(), out.forced.end());
  }
  return out;
}

}  // namespace mlaserve::openai
