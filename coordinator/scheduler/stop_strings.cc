#include "coordinator/scheduler/stop_strings.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mlaserve {

absl::StatusOr<StopStringMatcher> StopStringMatcher::Create(std::vector<std::string> stop_strings) {
  for (size_t i = 0; i < stop_strings.size(); ++i) {
    if (stop_strings[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "] is an empty string; remove it or give some text"));
    }
  }
  return StopStringMatcher(std::move(stop_strings));
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stop_strings)
    : stops_(std::move(stop_strings)) {
  for (const std::string& s : stops_) max_stop_len_ = std::max(max_stop_len_, s.size());
}

StopStringMatcher::Delta StopStringMatcher::Add(std::string_view delta) {
  Delta out;
  if (stopped_) return out;
  held_.append(delta);
  if (stops_.empty()) {
    out.text = std::move(held_);
    held_.clear();
    return out;
  }
  // Everything before held_ was streamed already and, by the hold-back below, cannot contain the
  // start of a match; so the earliest match, if any, lies within held_.
  size_t match = std::string::npos;
  for (const std::string& stop : stops_) match = std::min(match, held_.find(stop));
  if (match != std::string::npos) {
    out.text = held_.substr(0, match);
    out.stopped = true;
    stopped_ = true;
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string: it may still be
  // completed by the next delta. (With valid UTF-8 stop strings this cut is a character boundary.)
  size_t hold = 0;
  for (size_t k = std::min(held_.size(), max_stop_len_ - 1); k > 0 && hold == 0; --k) {
    const std::string_view suffix = std::string_view(held_).substr(held_.size() - k);
    for (const std::string& stop : stops_) {
      if (stop.size() > k && std::string_view(stop).substr(0, k) == suffix) {
        hold = k;
        break;
      }
    }
  }
  out.text = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringMatcher::Flush() {
  std::string rest = std::move(held_);
  held_.clear();
  return rest;
}

}  // namespace mlaserve
