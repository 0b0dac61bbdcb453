#include "coordinator/tokenizer/utf8.h"

namespace mlaserve {
namespace {

// Length of the well-formed sequence starting at `pos`, or 0 when ill-formed. When ill-formed,
// `*maximal_subpart` is the number of bytes to replace by one U+FFFD (at least 1), and
// `*truncated` tells whether the sequence was only cut short by the end of input.
size_t SequenceLength(std::string_view s, size_t pos, size_t* maximal_subpart, bool* truncated) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(pos);
  *truncated = false;
  *maximal_subpart = 1;
  if (b0 < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;  // no overlong forms
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (pos + k >= s.size()) {
      *truncated = true;
      *maximal_subpart = k;
      return 0;
    }
    const uint8_t b = byte(pos + k);
    const uint8_t min = k == 1 ? lo : 0x80;
    const uint8_t max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) {
      *maximal_subpart = k;
      return 0;
    }
  }
  return need + 1;
}

}  // namespace

std::string ToValidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t subpart;
    bool truncated;
    const size_t len = SequenceLength(bytes, pos, &subpart, &truncated);
    if (len > 0) {
      out.append(bytes.substr(pos, len));
      pos += len;
    } else {
      out.append("\xEF\xBF\xBD");
      pos += subpart;
    }
  }
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t subpart;
    bool truncated;
    const size_t len = SequenceLength(bytes, pos, &subpart, &truncated);
    if (len == 0) return false;
    pos += len;
  }
  return true;
}

size_t CompleteUtf8PrefixLength(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t subpart;
    bool truncated;
    const size_t len = SequenceLength(bytes, pos, &subpart, &truncated);
    if (len > 0) {
      pos += len;
    } else if (truncated) {
      return pos;  // may complete with the next bytes
    } else {
      pos += subpart;  // ill-formed for good: it will decode to U+FFFD whatever follows
    }
  }
  return pos;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

char32_t DecodeUtf8At(std::string_view s, size_t* pos) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(s[i])); };
  const char32_t b0 = b(*pos);
  if (b0 < 0x80) {
    *pos += 1;
    return b0;
  }
  if (b0 < 0xE0) {
    const char32_t cp = ((b0 & 0x1F) << 6) | (b(*pos + 1) & 0x3F);
    *pos += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const char32_t cp = ((b0 & 0x0F) << 12) | ((b(*pos + 1) & 0x3F) << 6) | (b(*pos + 2) & 0x3F);
    *pos += 3;
    return cp;
  }
  const char32_t cp = ((b0 & 0x07) << 18) | ((b(*pos + 1) & 0x3F) << 12) |
                      ((b(*pos + 2) & 0x3F) << 6) | (b(*pos + 3) & 0x3F);
  *pos += 4;
  return cp;
}

}  // namespace mlaserve
