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

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/jinja_value.h"

namespace mlaserve::jinja {

struct Node;

// What one rendering may spend. Templates come from model folders, so a hostile or broken one
// (an unbounded macro recursion, range(10**12), a string doubled in a loop) must end with an
// error instead of hanging or exhausting the coordinator. The defaults are far above what a chat
// template does for a conversation that fits a model's context.
struct RenderLimits {
  // Statements run, for-loop iterations and list items made (range, list + and *), summed
  // over the whole rendering.
  int64_t max_steps = 20'000'000;
  // The rendered text, and any string made on the way (concatenation, *, captured blocks).
  uint64_t max_output_bytes = uint64_t{64} << 20;
  // Nested macro calls.
  int max_call_depth = 64;
  // Nested blocks, expressions and macro calls together. The renderer recurses once per level,
  // so this bounds its stack (~1.8 KiB a level: 256 levels take ~470 KiB in the -O2 build,
  // ~660 KiB under ASan): parsing bounds the nesting of one template, but macro calls multiply
  // it (62 calls deep through 45 nested ifs overflowed an 8 MiB stack). The chat templates of
  // DeepSeek-V3/V3.1 and Kimi-K2 reach 9-19 levels, with tools and tool calls.
  int max_depth = 256;
};

class Template {
 public:
  // Parses `source`; syntax errors, unknown tags, filters and tests are reported with a line.
  static absl::StatusOr<Template> Parse(std::string_view source);

  // Renders with `globals` as the template's variables.
  absl::StatusOr<std::string> Render(const Dict& globals, const RenderLimits& limits = {}) const;

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace mlaserve::jinja
