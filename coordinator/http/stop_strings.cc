#include "coordinator/http/stop_strings.h"

#include <algorithm>
#include <utility>

namespace mlaserve::openai {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

std::string StopStringMatcher::Add(std::string_view text) {
  if (stopped_) return {};
  std::string buf = std::move(held_);
  held_.clear();
  buf.append(text);
  // The earliest complete stop string.
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, buf.find(s));
  if (first != std::string::npos) {
    stopped_ = true;
    buf.resize(first);
    return buf;
  }
  // The longest tail that is a proper prefix of some stop string stays held.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, buf.size()); len > keep; --len) {
      if (buf.compare(buf.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  held_ = buf.substr(buf.size() - keep);
  buf.resize(buf.size() - keep);
  return buf;
}

std::string StopStringMatcher::Finish() {
  if (stopped_) return {};
  return std::exchange(held_, std::string());
}

}  // namespace mlaserve::openai
