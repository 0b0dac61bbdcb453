// UTF-8 handling shared by the tokenizers and the detokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mlaserve {

// Returns `bytes` with every ill-formed UTF-8 subsequence replaced by U+FFFD, one replacement per
// maximal subpart (Unicode 15 §3.9, "U+FFFD substitution of maximal subparts"). This is what
// Python's bytes.decode(errors="replace"), Node's Buffer.toString("utf8") and Rust's
// String::from_utf8_lossy produce, so a tokenizer fed raw bytes sees the same text as the
// reference implementations, which only ever receive decoded strings.
std::string ToValidUtf8(std::string_view bytes);

// Length of the longest prefix of `bytes` that is complete, well-formed UTF-8 except that the
// last incomplete sequence (if it could still become valid with more bytes) is held back.
// Used by streaming decoders that must not emit half a character.
size_t CompleteUtf8PrefixLength(std::string_view bytes);

// True when `bytes` is well-formed UTF-8.
bool IsValidUtf8(std::string_view bytes);

// Appends the UTF-8 encoding of code point `cp` (must be a scalar value) to `out`.
void AppendUtf8(char32_t cp, std::string* out);

// Decodes one code point from well-formed UTF-8 at `pos`, advancing `pos`.
char32_t DecodeUtf8At(std::string_view valid_utf8, size_t* pos);

}  // namespace mlaserve
