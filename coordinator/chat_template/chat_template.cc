#include "coordinator/chat_template/chat_template.h"

#include "absl/strings/str_cat.h"

namespace mlaserve {

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  absl::StatusOr<jinja::Template> t = jinja::Template::Parse(source);
  if (!t.ok()) return t.status();
  return ChatTemplate(std::move(*t));
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTokenizerConfig(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("chat_template")) {
    return absl::NotFoundError("tokenizer_config.json has no chat_template");
  }
  const nlohmann::json& value = config.at("chat_template");
  if (value.is_string()) return Parse(value.get<std::string>());
  if (value.is_array()) {
    for (const nlohmann::json& entry : value) {
      if (entry.value("name", "") == "default")
        return Parse(entry.at("template").get<std::string>());
    }
  }
  return absl::InvalidArgumentError(
      "tokenizer_config.json: chat_template is neither a string nor a list with a \"default\" "
      "entry");
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context,
                                                 const jinja::RenderLimits& limits) const {
  if (!context.is_object())
    return absl::InvalidArgumentError("chat template context must be a JSON object");
  jinja::Dict globals;
  try {
    for (const auto& [key, value] : context.items())
      globals.emplace_back(key, jinja::Value::FromJson(value));
  } catch (const jinja::RenderError& e) {
    return absl::InvalidArgumentError(absl::StrCat("chat template context: ", e.what()));
  }
  return template_.Render(globals, limits);
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& context,
                                                 const jinja::RenderLimits& limits) const {
  return Render(nlohmann::ordered_json::parse(context.dump()), limits);
}

}  // namespace mlaserve
