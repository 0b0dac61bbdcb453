// Stop strings matched on streamed text, with partial-match hold-back.
//
// Fed the successive text deltas of one request (from the incremental detokenizer), it returns
// what is safe to stream now: everything except a trailing part that could still grow into a
// stop string. When a stop string appears, the text ends right before it (the stop string is not
// part of the output, as in OpenAI's API and vLLM's default) and the request should be finished.
// Everything returned by Add and Flush, concatenated, is exactly the final text.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace mlaserve {

class StopStringMatcher {
 public:
  // InvalidArgument for an empty stop string (it would match before any text).
  static absl::StatusOr<StopStringMatcher> Create(std::vector<std::string> stop_strings);

  struct Delta {
    std::string text;      // safe to stream now (may be empty)
    bool stopped = false;  // a stop string matched: `text` is the last of the output
  };

  // Appends `delta` to the text. After a match, further input is ignored (returns empty text).
  Delta Add(std::string_view delta);

  // End of generation without a match: returns the held-back text (empty after a match).
  std::string Flush();

  bool stopped() const { return stopped_; }
  size_t held_bytes() const { return held_.size(); }

 private:
  explicit StopStringMatcher(std::vector<std::string> stop_strings);

  std::vector<std::string> stops_;
  size_t max_stop_len_ = 0;
  std::string held_;  // not yet streamed: a suffix that is a proper prefix of some stop string
  bool stopped_ = false;
};

}  // namespace mlaserve
