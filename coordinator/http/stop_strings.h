// Stop strings over the answer of a chat whose output the front end parses (tools or a
// reasoning parser): there the coordinator cannot cut the text (it sees tokens, not the answer
// the parsers extract), so mlaserve-openai submits the request without its stop strings and
// matches them here, on the answer's content only: not on the reasoning (which a stop string
// the client wrote for the visible answer must not end) nor on tool-call arguments. On a match
// the answer ends before the stop string (OpenAI excludes it), the request is aborted at the
// coordinator and its finish_reason is "stop".
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mlaserve::openai {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);

  // The text of `text` that can be released: all of it, less a tail that could be the start
  // of a stop string (held until the next call decides). After a match, the text before the
  // stop string, and stopped() is true; later calls return nothing.
  std::string Add(std::string_view text);
  // The end of the answer: the held tail (nothing after a match).
  std::string Finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace mlaserve::openai
