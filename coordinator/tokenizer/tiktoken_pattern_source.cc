#include "coordinator/tokenizer/tiktoken_pattern_source.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlaserve {
namespace {

void SkipSpace(std::string_view s, size_t* pos) {
  while (*pos < s.size()) {
    const char c = s[*pos];
    if (c == '#') {
      while (*pos < s.size() && s[*pos] != '\n') ++*pos;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\\') {
      ++*pos;
    } else {
      return;
    }
  }
}

// Parses one Python string literal at `*pos`. Raw literals are taken verbatim; non-raw ones must
// not contain escapes (a regex written without r"" would need Python's escape rules).
absl::StatusOr<std::string> ParseLiteral(std::string_view s, size_t* pos) {
  bool raw = false;
  if (*pos < s.size() && (s[*pos] == 'r' || s[*pos] == 'R')) {
    raw = true;
    ++*pos;
  }
  if (*pos >= s.size() || (s[*pos] != '"' && s[*pos] != '\'')) {
    return absl::InvalidArgumentError(absl::StrCat("expected a string literal at offset ", *pos));
  }
  const std::string quote = s.substr(*pos, 3) == std::string(3, s[*pos]) ? std::string(3, s[*pos])
                                                                         : std::string(1, s[*pos]);
  const size_t begin = *pos + quote.size();
  size_t end = begin;
  while (true) {
    end = s.find(quote, end);
    if (end == std::string_view::npos)
      return absl::InvalidArgumentError("unterminated string literal");
    // A quote preceded by an odd number of backslashes is escaped (also in raw literals).
    size_t backslashes = 0;
    while (end - backslashes > begin && s[end - backslashes - 1] == '\\') ++backslashes;
    if (backslashes % 2 == 0) break;
    ++end;
  }
  std::string value(s.substr(begin, end - begin));
  if (!raw && value.find('\\') != std::string::npos) {
    return absl::InvalidArgumentError(
        "pat_str literal with escapes must be a raw string (r\"...\")");
  }
  *pos = end + quote.size();
  return value;
}

}  // namespace

absl::StatusOr<std::string> ExtractPythonPatStr(std::string_view src) {
  size_t pos = 0;
  while (true) {
    pos = src.find("pat_str", pos);
    if (pos == std::string_view::npos) return absl::NotFoundError("no `pat_str = ...` assignment");
    size_t p = pos + 7;
    while (p < src.size() && (src[p] == ' ' || src[p] == '\t')) ++p;
    if (p < src.size() && src[p] == '=' && (p + 1 >= src.size() || src[p + 1] != '=')) {
      pos = p + 1;
      break;
    }
    pos = p;
  }
  SkipSpace(src, &pos);
  constexpr std::string_view kJoin = "\"|\".join(";
  if (src.substr(pos, kJoin.size()) != kJoin) return ParseLiteral(src, &pos);
  pos += kJoin.size();
  SkipSpace(src, &pos);
  const bool list = pos < src.size() && (src[pos] == '[' || src[pos] == '(');
  if (list) ++pos;
  std::vector<std::string> parts;
  while (true) {
    SkipSpace(src, &pos);
    if (pos >= src.size()) return absl::InvalidArgumentError("unterminated \"|\".join(...)");
    if (src[pos] == ']' || src[pos] == ')') break;
    absl::StatusOr<std::string> part = ParseLiteral(src, &pos);
    if (!part.ok()) return part.status();
    parts.push_back(std::move(*part));
    SkipSpace(src, &pos);
    if (pos < src.size() && src[pos] == ',') ++pos;
  }
  std::string joined;
  for (size_t i = 0; i < parts.size(); ++i) absl::StrAppend(&joined, i ? "|" : "", parts[i]);
  return joined;
}

absl::StatusOr<std::string> FindTiktokenPattern(const std::string& model_dir,
                                                const nlohmann::json& config) {
  if (config.is_object() && config.contains("pat_str") && config.at("pat_str").is_string()) {
    return config.at("pat_str").get<std::string>();
  }
  std::string module;
  if (config.is_object() && config.contains("auto_map") && config.at("auto_map").is_object() &&
      config.at("auto_map").contains("AutoTokenizer")) {
    const nlohmann::json& entry = config.at("auto_map").at("AutoTokenizer");
    const nlohmann::json& name = entry.is_array() && !entry.empty() ? entry.at(0) : entry;
    if (name.is_string()) module = name.get<std::string>();
  }
  const size_t dot = module.rfind('.');
  if (dot == std::string::npos) {
    return absl::NotFoundError(absl::StrCat(
        model_dir,
        ": tiktoken.model needs a pre-tokenization pattern: add \"pat_str\" to "
        "tokenizer_config.json, or an auto_map.AutoTokenizer module defining pat_str"));
  }
  const std::string path = absl::StrCat(model_dir, "/", module.substr(0, dot), ".py");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path, " (named by auto_map)"));
  std::ostringstream source;
  source << in.rdbuf();
  absl::StatusOr<std::string> pat = ExtractPythonPatStr(source.str());
  if (!pat.ok())
    return absl::Status(pat.status().code(), absl::StrCat(path, ": ", pat.status().message()));
  return pat;
}

}  // namespace mlaserve
