// Where a tiktoken.model checkpoint keeps its pre-tokenization pattern.
//
// tiktoken.model holds only ranks. Kimi-K2/K2.5 ship the pattern in their tokenizer code
// (tokenization_kimi.py: `pat_str = "|".join([r"""...""", ...])`), named by tokenizer_config.json's
// auto_map; other exports write it as tokenizer_config.json "pat_str". Both are read from the
// model's own files so that no pattern is hand-kept here.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace mlaserve {

// tokenizer_config.json "pat_str", else the pat_str assignment in the Python module named by
// auto_map.AutoTokenizer.
absl::StatusOr<std::string> FindTiktokenPattern(const std::string& model_dir,
                                                const nlohmann::json& config);

// The value of the first `pat_str = ...` assignment in Python source: one string literal, or
// `"|".join([...])` of string literals.
absl::StatusOr<std::string> ExtractPythonPatStr(std::string_view python_source);

}  // namespace mlaserve
