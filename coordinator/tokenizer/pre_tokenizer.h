// Pre-tokenization: cutting text into the pieces BPE runs on, as Hugging Face's pre_tokenizers
// (Sequence, Split, ByteLevel, Digits) and tiktoken's pat_str do it.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/tokenizer/unicode_regex.h"
#include "nlohmann/json.hpp"

namespace mlaserve {

class PreTokenizer {
 public:
  // What happens to the regex matches of a Split step (tokenizers' SplitDelimiterBehavior).
  enum class Delimiter { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

  // From tokenizer.json's "pre_tokenizer" (null: the whole text is one piece). Unsupported types
  // are an error naming the type.
  static absl::StatusOr<PreTokenizer> FromHuggingFaceJson(const nlohmann::json& config);

  // tiktoken: the pieces are exactly the matches of `pat_str`; text between matches is dropped.
  static absl::StatusOr<PreTokenizer> FromTiktokenPattern(std::string_view pat_str);

  // Splits valid UTF-8 `text` into pieces (views into `text` or into strings owned by `arena`).
  void Split(std::string_view text, std::vector<std::string_view>* pieces,
             std::deque<std::string>* arena) const;

  // True when the pieces are to be mapped to GPT-2's byte-level alphabet (a ByteLevel step).
  bool byte_level() const { return byte_level_; }

 private:
  struct Step {
    enum class Kind { kSplit, kPrefixSpace } kind;
    std::shared_ptr<UnicodeRegex> regex;  // kSplit
    Delimiter delimiter = Delimiter::kIsolated;
    bool invert = false;
  };
  static absl::Status AddSteps(const nlohmann::json& config, PreTokenizer* out);
  void ApplySplit(const Step& step, std::string_view piece, std::vector<std::string_view>* out,
                  std::vector<UnicodeRegex::Match>* matches) const;

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace mlaserve
