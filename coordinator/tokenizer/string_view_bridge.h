// Debian 12's abseil (20220623) is built with its own absl::string_view, not an alias of
// std::string_view, so absl containers and StrCat need an explicit conversion.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace mlaserve {

inline absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace mlaserve
