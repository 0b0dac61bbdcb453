// The model's own chat template (tokenizer_config.json "chat_template", Jinja2), rendered as
// Hugging Face's apply_chat_template renders it.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/jinja_template.h"
#include "nlohmann/json.hpp"

namespace mlaserve {

class ChatTemplate {
 public:
  // Parses the template; bad syntax, unknown tags, filters or tests fail here, at load time.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  // The chat_template of a tokenizer_config.json (a string, or a list of {name, template} of
  // which "default" is taken).
  static absl::StatusOr<ChatTemplate> FromTokenizerConfig(const nlohmann::json& config);

  // Renders with the variables apply_chat_template passes: messages, tools,
  // add_generation_prompt, bos_token, eos_token, and any extra keyword (e.g. thinking).
  // transformers passes tools and documents as None when there are none: give them as JSON null
  // (not absent) to render as it does, since templates test both `is defined` and `is none`.
  // ordered_json keeps the client's key order, which tojson output depends on (Python dicts
  // preserve insertion order); a plain nlohmann::json has its keys sorted.
  // `limits` bound what a hostile template may spend (jinja_template.h).
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context,
                                     const jinja::RenderLimits& limits = {}) const;
  absl::StatusOr<std::string> Render(const nlohmann::json& context,
                                     const jinja::RenderLimits& limits = {}) const;

 private:
  explicit ChatTemplate(jinja::Template t) : template_(std::move(t)) {}
  jinja::Template template_;
};

}  // namespace mlaserve
