// GPT-2's byte-level alphabet: each of the 256 byte values is written as one printable code
// point so that byte strings can be stored as text in tokenizer.json vocabularies and merges.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace mlaserve {

// The code point standing for `byte` (printable Latin-1 bytes stand for themselves, the others
// are moved to U+0100 and up, in byte order).
char32_t ByteLevelCodePoint(uint8_t byte);

// Maps byte-level text back to raw bytes; nullopt when some code point is not in the alphabet.
std::optional<std::string> ByteLevelToBytes(std::string_view byte_level_text);

// Raw bytes to byte-level text.
std::string BytesToByteLevel(std::string_view bytes);

}  // namespace mlaserve
