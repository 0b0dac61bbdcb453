// A Jinja2 subset interpreter sufficient for model chat templates (DeepSeek-V3/V3.1/R1,
// Kimi-K2/K2-Thinking), configured as Hugging Face's apply_chat_template configures jinja2:
// trim_blocks, lstrip_blocks, loop controls ({% break %}, {% continue %}), a json.dumps tojson,
// raise_exception() and strftime_now().
//
// Supported: {{ }}, {% %}, {# #} with -/+ whitespace control; if/elif/else, for (with loop.*,
// else, inline if filter), set (names, namespace attributes, blocks), macro, break, continue,
// raw, generation; Python expressions (literals, arithmetic, comparisons, in, is-tests, filters,
// slicing, conditional expressions, method calls on str/dict/list). Everything else is a parse
// error, so a template that would misrender fails when it is loaded.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/jinja_value.h"

namespace mlaserve::jinja {

struct Node;

class Template {
 public:
  // Parses `source`; syntax errors, unknown tags, filters and tests are reported with a line.
  static absl::StatusOr<Template> Parse(std::string_view source);

  // Renders with `globals` as the template's variables.
  absl::StatusOr<std::string> Render(const Dict& globals) const;

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace mlaserve::jinja
