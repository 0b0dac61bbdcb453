#include "coordinator/http/reasoning_parser.h"

#include <algorithm>

namespace mlaserve::openai {
namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";

// Length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t PartialSuffix(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == marker.substr(0, n)) {
      return n;
    }
  }
  return 0;
}

}  // namespace

ReasoningSplitter::ReasoningSplitter(ReasoningFormat format,
                                     std::optional<bool> starts_in_reasoning)
    : format_(format),
      in_reasoning_(format != ReasoningFormat::kNone &&
                    starts_in_reasoning.value_or(format == ReasoningFormat::kDeepSeekR1)),
      at_start_(in_reasoning_) {}

ReasoningSplitter::Split ReasoningSplitter::Add(std::string_view text) {
  Split out;
  if (format_ == ReasoningFormat::kNone) {
    out.content = std::string(text);
    return out;
  }
  std::string s = pending_ + std::string(text);
  pending_.clear();
  for (;;) {
    if (at_start_ && format_ == ReasoningFormat::kDeepSeekR1) {
      if (s.size() < kOpen.size() && kOpen.substr(0, s.size()) == s) {
        pending_ = s;  // may still become the leading "<think>"
        return out;
      }
      at_start_ = false;
      if (s.rfind(kOpen, 0) == 0) {
        s.erase(0, kOpen.size());
      }
    }
    const std::string_view marker = in_reasoning_ ? kClose : kOpen;
    const bool can_switch = in_reasoning_ || format_ == ReasoningFormat::kKimiK2;
    std::string& sink = in_reasoning_ ? out.reasoning : out.content;
    const size_t at = can_switch ? s.find(marker) : std::string::npos;
    if (at == std::string::npos) {
      const size_t hold = can_switch ? PartialSuffix(s, marker) : 0;
      sink += s.substr(0, s.size() - hold);
      pending_ = s.substr(s.size() - hold);
      return out;
    }
    sink += s.substr(0, at);
    s.erase(0, at + marker.size());
    in_reasoning_ = !in_reasoning_;
  }
}

ReasoningSplitter::Split ReasoningSplitter::Finish() {
  Split out;
  (in_reasoning_ ? out.reasoning : out.content) = std::move(pending_);
  pending_.clear();
  at_start_ = false;
  return out;
}

}  // namespace mlaserve::openai
