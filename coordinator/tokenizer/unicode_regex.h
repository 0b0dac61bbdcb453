// Unicode-aware regular expressions for pre-tokenization, run by PCRE2 (UTF + UCP, JIT).
//
// Pre-tokenizer patterns (Hugging Face tokenizer.json, tiktoken pat_str) are written for
// Oniguruma / Rust's regex crate; PCRE2 with PCRE2_UCP gives the same meaning to \p{..}, \s,
// \w and lookaheads. The one syntax PCRE2 10.42 lacks is class intersection ([A&&[^B]], used by
// Kimi's pat_str); Compile() rewrites it into lookaheads with the same meaning.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

struct pcre2_real_code_8;

namespace mlaserve {

class UnicodeRegex {
 public:
  struct Match {
    size_t begin;  // byte offsets into the subject
    size_t end;
  };

  // Compiles `pattern`; the error names the pattern and the offset PCRE2 complained about.
  static absl::StatusOr<std::unique_ptr<UnicodeRegex>> Compile(std::string_view pattern);
  ~UnicodeRegex();
  UnicodeRegex(const UnicodeRegex&) = delete;
  UnicodeRegex& operator=(const UnicodeRegex&) = delete;

  // All non-overlapping matches, left to right, in `subject` (must be valid UTF-8). Empty matches
  // are skipped. Thread-safe.
  void FindAll(std::string_view subject, std::vector<Match>* matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  UnicodeRegex(std::string pattern, pcre2_real_code_8* code)
      : pattern_(std::move(pattern)), code_(code) {}
  std::string pattern_;
  pcre2_real_code_8* code_;
};

// Rewrites character-class intersections `[A&&B&&C]` (B, C: nested classes or class items) into
// `(?:(?=[B])(?=[C])[A])`, which PCRE2 understands. Patterns without `&&` come back unchanged.
absl::StatusOr<std::string> RewriteClassIntersections(std::string_view pattern);

// Rewrites what PCRE2 reads differently from Oniguruma / Rust regex / Python regex: script
// properties (\p{Han} -> \p{sc:Han}, Script rather than Script_Extensions) and \s / \S
// (-> \p{White_Space} / \P{White_Space}, without PCRE2's extra U+180E).
std::string PortPatternToPcre2(std::string_view pattern);

}  // namespace mlaserve
