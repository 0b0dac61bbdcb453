#include "coordinator/server/request_builder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

std::string TokenString(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return "";
  const auto& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

capnp::ReaderOptions ClientReaderOptions() {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = 8 * 1024 * 1024;  // 64 MiB
  o.nestingLimit = 16;
  return o;
}

absl::StatusOr<ModelText> ModelText::Load(const std::string& folder, int vocab_size,
                                          int max_model_len, std::vector<int32_t> eos_ids) {
  ModelText m;
  m.vocab_size = vocab_size;
  m.max_model_len = max_model_len;
  m.eos_ids = std::move(eos_ids);
  const bool has_tokenizer = fs::exists(fs::path(folder) / "tokenizer.json") ||
                             fs::exists(fs::path(folder) / "tiktoken.model");
  if (!has_tokenizer) return m;
  auto tok = Tokenizer::LoadFromModelDir(folder);
  if (!tok.ok()) return tok.status();
  m.tokenizer = std::move(*tok);
  if (m.eos_ids.empty() && m.tokenizer->eos_id()) m.eos_ids.push_back(*m.tokenizer->eos_id());
  const fs::path config_path = fs::path(folder) / "tokenizer_config.json";
  if (fs::exists(config_path)) {
    std::ifstream in(config_path);
    nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
    if (config.is_discarded()) return Invalid(absl::StrCat(config_path.string(), ": not valid JSON"));
    m.bos_token = TokenString(config, "bos_token");
    m.eos_token = TokenString(config, "eos_token");
    if (config.contains("chat_template")) {
      auto t = ChatTemplate::FromTokenizerConfig(config);
      if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": chat_template: ", t.status().message()));
      m.chat_template = std::move(*t);
    }
  }
  const fs::path jinja = fs::path(folder) / "chat_template.jinja";
  if (!m.chat_template && fs::exists(jinja)) {
    std::ifstream in(jinja);
    const std::string src((std::istreambuf_iterator<char>(in)), {});
    auto t = ChatTemplate::Parse(src);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(jinja.string(), ": ", t.status().message()));
    m.chat_template = std::move(*t);
  }
  return m;
}

absl::StatusOr<PreparedRequest> PrepareRequest(wire::GenerateRequest::Reader req, const ModelText& model) {
  PreparedRequest out;
  const wire::SamplingParams::Reader s = req.getSampling();
  // Parameter ranges (those of the OpenAI API and vLLM where they define one).
  const float t = s.getTemperature();
  if (!(t >= 0.0f && t <= 100.0f)) return Invalid(absl::StrCat("temperature ", t, " is outside [0, 100]"));
  if (!(s.getTopP() > 0.0f && s.getTopP() <= 1.0f)) return Invalid(absl::StrCat("top_p ", s.getTopP(), " is outside (0, 1]"));
  if (s.getTopK() < 0) return Invalid(absl::StrCat("top_k ", s.getTopK(), " is negative (0 turns it off)"));
  if (!(s.getMinP() >= 0.0f && s.getMinP() <= 1.0f)) return Invalid(absl::StrCat("min_p ", s.getMinP(), " is outside [0, 1]"));
  if (!(s.getRepetitionPenalty() > 0.0f && s.getRepetitionPenalty() <= 10.0f)) {
    return Invalid(absl::StrCat("repetition_penalty ", s.getRepetitionPenalty(), " is outside (0, 10]"));
  }
  for (float p : {s.getPresencePenalty(), s.getFrequencyPenalty()}) {
    if (!(p >= -2.0f && p <= 2.0f)) return Invalid(absl::StrCat("presence/frequency penalty ", p, " is outside [-2, 2]"));
  }
  if (s.getMaxTokens() < 1) return Invalid("max_tokens must be at least 1");
  if (s.getMinTokens() > s.getMaxTokens()) {
    return Invalid(absl::StrCat("min_tokens ", s.getMinTokens(), " exceeds max_tokens ", s.getMaxTokens()));
  }
  if (s.getTopLogprobs() > 20) return Invalid(absl::StrCat("top_logprobs ", s.getTopLogprobs(), " exceeds 20"));
  if (s.getStop().size() > 16) return Invalid("at most 16 stop strings");
  for (auto stop : s.getStop()) {
    if (stop.size() == 0 || stop.size() > 256) return Invalid("stop strings must be 1 to 256 bytes");
    out.stop.emplace_back(stop.cStr(), stop.size());
  }
  if (!out.stop.empty() && !model.tokenizer) return Invalid("stop strings need the model's tokenizer, which this model folder lacks");
  for (int32_t id : s.getStopTokenIds()) {
    if (id < 0 || id >= model.vocab_size) return Invalid(absl::StrCat("stop token id ", id, " is outside the vocabulary"));
    out.stop_token_ids.push_back(id);
  }
  out.sampling = {t, s.getTopP(), s.getTopK(), s.getMinP(), s.getRepetitionPenalty(),
                  s.getPresencePenalty(), s.getFrequencyPenalty(), s.getTopLogprobs()};
  out.max_tokens = s.getMaxTokens();
  out.min_tokens = s.getMinTokens();
  out.ignore_eos = s.getIgnoreEos();
  out.skip_special_tokens = s.getSkipSpecialTokens();
  out.logprobs = s.getLogprobs();
  out.priority = s.getPriority();
  out.seed = s.getSeed();
  out.has_seed = s.getHasSeed();

  auto input = req.getInput();
  switch (input.which()) {
    case wire::GenerateRequest::Input::TEXT: {
      if (!model.tokenizer) return Invalid("text prompts need the model's tokenizer, which this model folder lacks; send token ids");
      auto text = input.getText();
      out.prompt = model.tokenizer->Encode(std::string_view(text.cStr(), text.size()), /*add_special_tokens=*/true);
      break;
    }
    case wire::GenerateRequest::Input::TOKEN_IDS:
      for (int32_t id : input.getTokenIds()) {
        if (id < 0 || id >= model.vocab_size) return Invalid(absl::StrCat("token id ", id, " is outside the vocabulary of ", model.vocab_size));
        out.prompt.push_back(id);
      }
      break;
    case wire::GenerateRequest::Input::CHAT: {
      if (!model.tokenizer || !model.chat_template) {
        return Invalid("chat requests need the model's tokenizer and chat template, which this model folder lacks");
      }
      // Every message and tool call renders to at least one token, so a chat with more of them
      // than the context holds cannot fit. Checked before building anything: Cap'n Proto lets a
      // 64 MiB frame list millions of empty messages, each of which would become a JSON object.
      uint64_t parts = input.getChat().size();
      for (auto m : input.getChat()) parts += m.getToolCalls().size();
      if (parts > static_cast<uint64_t>(std::max(model.max_model_len, 1))) {
        return absl::OutOfRangeError(absl::StrCat("chat of ", parts, " messages and tool calls cannot fit the context of ",
                                                  model.max_model_len, " tokens"));
      }
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      for (auto m : input.getChat()) {
        const std::string role(m.getRole().cStr(), m.getRole().size());
        if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
          return Invalid(absl::StrCat("chat message role \"", role, "\" is not system, user, assistant or tool"));
        }
        nlohmann::ordered_json msg = {{"role", role}, {"content", std::string(m.getContent().cStr())}};
        if (m.hasName() && m.getName().size() > 0) msg["name"] = std::string(m.getName().cStr());
        if (m.hasToolCallId() && m.getToolCallId().size() > 0) msg["tool_call_id"] = std::string(m.getToolCallId().cStr());
        if (m.hasReasoningContent() && m.getReasoningContent().size() > 0) {
          msg["reasoning_content"] = std::string(m.getReasoningContent().cStr());
        }
        if (m.getToolCalls().size() > 0) {
          nlohmann::ordered_json calls = nlohmann::ordered_json::array();
          for (auto tc : m.getToolCalls()) {
            const std::string args(tc.getArguments().cStr());
            auto parsed = nlohmann::ordered_json::parse(args, nullptr, false);
            calls.push_back({{"id", std::string(tc.getId().cStr())}, {"type", "function"},
                             {"function", {{"name", std::string(tc.getName().cStr())},
                                           {"arguments", parsed.is_discarded() ? nlohmann::ordered_json(args) : parsed}}}});
          }
          msg["tool_calls"] = calls;
        }
        messages.push_back(std::move(msg));
      }
      if (messages.empty()) return Invalid("chat has no messages");
      nlohmann::ordered_json context = {{"messages", messages}, {"add_generation_prompt", req.getAddGenerationPrompt()},
                                        {"bos_token", model.bos_token}, {"eos_token", model.eos_token},
                                        {"tools", nullptr}, {"documents", nullptr}};
      const std::string tools(req.getTools().cStr());
      if (!tools.empty()) {
        auto parsed = nlohmann::ordered_json::parse(tools, nullptr, false);
        if (parsed.is_discarded() || !parsed.is_array()) return Invalid("tools must be a JSON array of tool definitions");
        context["tools"] = parsed;
      }
      auto rendered = model.chat_template->Render(context);
      if (!rendered.ok()) return Invalid(absl::StrCat("chat template: ", rendered.status().message()));
      // The template writes BOS itself: tokenize without adding special tokens (HF does the same).
      out.prompt = model.tokenizer->Encode(*rendered, /*add_special_tokens=*/false);
      break;
    }
  }
  if (out.prompt.empty()) return Invalid("the prompt is empty");
  if (static_cast<int64_t>(out.prompt.size()) + out.max_tokens > model.max_model_len) {
    return absl::OutOfRangeError(absl::StrCat("prompt of ", out.prompt.size(), " tokens + max_tokens ", out.max_tokens,
                                              " exceeds the context of ", model.max_model_len, " tokens"));
  }
  return out;
}

}  // namespace mlaserve
