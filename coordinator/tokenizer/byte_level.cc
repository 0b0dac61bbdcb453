#include "coordinator/tokenizer/byte_level.h"

#include <array>
#include <cstdint>

#include "coordinator/tokenizer/utf8.h"

namespace mlaserve {
namespace {

struct ByteLevelAlphabet {
  ByteLevelAlphabet() {
    const auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) code_point[b] = printable(b) ? b : next++;
    byte_of.fill(-1);
    for (int b = 0; b < 256; ++b) byte_of[code_point[b]] = b;
  }
  std::array<char32_t, 256> code_point;
  std::array<int, 324> byte_of;  // indexed by code point (all are below 256 + 68)
};

const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

}  // namespace

char32_t ByteLevelCodePoint(uint8_t byte) { return Alphabet().code_point[byte]; }

std::optional<std::string> ByteLevelToBytes(std::string_view text) {
  const ByteLevelAlphabet& alphabet = Alphabet();
  if (!IsValidUtf8(text)) return std::nullopt;
  std::string bytes;
  bytes.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const char32_t cp = DecodeUtf8At(text, &pos);
    if (cp >= alphabet.byte_of.size() || alphabet.byte_of[cp] < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(alphabet.byte_of[cp]));
  }
  return bytes;
}

std::string BytesToByteLevel(std::string_view bytes) {
  std::string text;
  for (const char c : bytes) AppendUtf8(ByteLevelCodePoint(static_cast<uint8_t>(c)), &text);
  return text;
}

}  // namespace mlaserve
