// Fuzzes the model configuration parser (common/model_config.h) on a config.json and, after a
// line "#hf_quant_config.json", an hf_quant_config.json: the documents LoadModelConfig reads
// from a model folder. A parsed configuration's derived values are computed too.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/model_config.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSeparator = "\n#hf_quant_config.json\n";
  const size_t split = input.find(kSeparator);
  const std::string_view config_text = input.substr(0, split);
  nlohmann::json config = nlohmann::json::parse(config_text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return 0;
  nlohmann::json quant;
  bool has_quant = false;
  if (split != std::string_view::npos) {
    quant = nlohmann::json::parse(input.substr(split + kSeparator.size()), nullptr, false);
    if (quant.is_discarded()) return 0;
    has_quant = true;
  }
  auto c = mlaserve::ParseModelConfig(config, has_quant ? &quant : nullptr);
  if (c.ok()) {
    (void)c->SoftmaxScale();
    (void)c->RopeAttentionScaling();
    (void)c->RopeInvFreq();
  }
  return 0;
}
