// Fuzzes the Jinja chat-template engine (coordinator/chat_template/): the input is a template,
// then after a line "#messages" a JSON value given as `messages` (DeepSeek-V3.1's and Kimi's
// templates are in the seed corpus, so conversations against real templates are fuzzed too).
// Parse must reject what it cannot render; Render must end every template, hostile ones
// included, within its limits (jinja_template.h), with a string or an error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "coordinator/chat_template/chat_template.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSeparator = "\n#messages\n";
  const size_t split = input.find(kSeparator);
  auto t = mlaserve::ChatTemplate::Parse(input.substr(0, split));
  if (!t.ok()) return 0;
  nlohmann::ordered_json messages = nlohmann::ordered_json::array(
      {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi"}}});
  if (split != std::string_view::npos) {
    auto parsed = nlohmann::ordered_json::parse(input.substr(split + kSeparator.size()), nullptr,
                                                /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) messages = std::move(parsed);
  }
  nlohmann::ordered_json context = {{"messages", messages},
                                    {"tools", nullptr},
                                    {"add_generation_prompt", true},
                                    {"bos_token", "<s>"},
                                    {"eos_token", "</s>"}};
  // Smaller limits than the defaults, so that a runaway template ends well inside libFuzzer's
  // per-input timeout under ASan; what is tested is that the limits end it.
  mlaserve::jinja::RenderLimits limits;
  limits.max_steps = 200'000;
  limits.max_output_bytes = 1 << 20;
  (void)t->Render(context, limits);
  return 0;
}
