// Streaming detokenization: text for each generated token as soon as it forms whole characters.
//
// Byte-level tokens can end inside a UTF-8 character (a CJK character or an emoji often spans
// two or three tokens). The detokenizer holds back an incomplete trailing sequence (at most 3
// bytes) until the next token completes it or proves it ill-formed, so it never emits half a
// character, and the concatenation of everything it emits (including Finish()) equals
// Tokenizer::Decode of all the ids at once.
#pragma once

#include <cstdint>
#include <string>

#include "coordinator/tokenizer/tokenizer.h"

namespace mlaserve {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
      : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

  // Appends one token; returns the text completed by it (possibly empty).
  std::string Add(int32_t id);

  // Ends the stream: returns the held-back bytes, decoded with U+FFFD for what is incomplete.
  std::string Finish();

  // Bytes currently held back (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace mlaserve
