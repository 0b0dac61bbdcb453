#include "coordinator/tokenizer/incremental_detokenizer.h"

#include "coordinator/tokenizer/utf8.h"

namespace mlaserve {

std::string IncrementalDetokenizer::Add(int32_t id) {
  const int32_t ids[1] = {id};
  pending_.append(tokenizer_.DecodeBytes(ids, skip_special_tokens_));
  const size_t complete = CompleteUtf8PrefixLength(pending_);
  std::string text = ToValidUtf8(std::string_view(pending_).substr(0, complete));
  pending_.erase(0, complete);
  return text;
}

std::string IncrementalDetokenizer::Finish() {
  std::string text = ToValidUtf8(pending_);
  pending_.clear();
  return text;
}

}  // namespace mlaserve
