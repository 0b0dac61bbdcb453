#include "coordinator/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/string_view_bridge.h"

namespace mlaserve {
namespace {

// GPT-2's pattern, which the ByteLevel pre-tokenizer applies when "use_regex" is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::StatusOr<PreTokenizer::Delimiter> ParseDelimiter(const nlohmann::json& behavior) {
  const std::string name = behavior.is_string() ? behavior.get<std::string>() : "";
  if (name == "Removed") return PreTokenizer::Delimiter::kRemoved;
  if (name == "Isolated") return PreTokenizer::Delimiter::kIsolated;
  if (name == "MergedWithPrevious") return PreTokenizer::Delimiter::kMergedWithPrevious;
  if (name == "MergedWithNext") return PreTokenizer::Delimiter::kMergedWithNext;
  if (name == "Contiguous") return PreTokenizer::Delimiter::kContiguous;
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer.json: unknown Split behavior ", behavior.dump()));
}

// Escapes `literal` for use in a PCRE2 pattern (Split with a String pattern matches literally).
std::string QuoteLiteral(std::string_view literal) {
  std::string out;
  for (const char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

}  // namespace

absl::Status PreTokenizer::AddSteps(const nlohmann::json& config, PreTokenizer* out) {
  if (config.is_null()) return absl::OkStatus();
  const std::string type = config.value("type", "");
  if (out->byte_level_) {
    // Later steps would see byte-level text, which no supported model does.
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json: pre_tokenizer step \"", type,
                     "\" after ByteLevel is not supported (ByteLevel must come last)"));
  }
  if (type == "Sequence") {
    for (const nlohmann::json& child : config.at("pretokenizers")) {
      if (absl::Status status = AddSteps(child, out); !status.ok()) return status;
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    const nlohmann::json& pattern = config.at("pattern");
    std::string regex_source;
    if (pattern.contains("Regex")) {
      regex_source = pattern.at("Regex").get<std::string>();
    } else if (pattern.contains("String")) {
      regex_source = QuoteLiteral(pattern.at("String").get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json: Split pattern must be Regex or String: ", pattern.dump()));
    }
    absl::StatusOr<std::unique_ptr<UnicodeRegex>> regex = UnicodeRegex::Compile(regex_source);
    if (!regex.ok()) return regex.status();
    absl::StatusOr<Delimiter> delimiter = ParseDelimiter(config.at("behavior"));
    if (!delimiter.ok()) return delimiter.status();
    out->steps_.push_back({Step::Kind::kSplit, std::shared_ptr<UnicodeRegex>(std::move(*regex)),
                           *delimiter, config.value("invert", false)});
    return absl::OkStatus();
  }
  if (type == "Digits") {
    // tokenizers splits on char::is_numeric (general categories Nd, Nl, No = \p{N}).
    const bool individual = config.value("individual_digits", false);
    absl::StatusOr<std::unique_ptr<UnicodeRegex>> regex = UnicodeRegex::Compile(R"(\p{N})");
    if (!regex.ok()) return regex.status();
    out->steps_.push_back({Step::Kind::kSplit, std::shared_ptr<UnicodeRegex>(std::move(*regex)),
                           individual ? Delimiter::kIsolated : Delimiter::kContiguous, false});
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    out->byte_level_ = true;
    if (config.value("add_prefix_space", false))
      out->steps_.push_back({Step::Kind::kPrefixSpace, nullptr, Delimiter::kIsolated, false});
    if (config.value("use_regex", true)) {
      absl::StatusOr<std::unique_ptr<UnicodeRegex>> regex = UnicodeRegex::Compile(kGpt2Pattern);
      if (!regex.ok()) return regex.status();
      out->steps_.push_back({Step::Kind::kSplit, std::shared_ptr<UnicodeRegex>(std::move(*regex)),
                             Delimiter::kIsolated, false});
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer.json: pre_tokenizer type \"", type,
                   "\" is not supported (supported: Sequence, Split, ByteLevel, Digits)"));
}

absl::StatusOr<PreTokenizer> PreTokenizer::FromHuggingFaceJson(const nlohmann::json& config) {
  PreTokenizer out;
  if (absl::Status status = AddSteps(config, &out); !status.ok()) return status;
  return out;
}

absl::StatusOr<PreTokenizer> PreTokenizer::FromTiktokenPattern(std::string_view pat_str) {
  PreTokenizer out;
  absl::StatusOr<std::unique_ptr<UnicodeRegex>> regex = UnicodeRegex::Compile(pat_str);
  if (!regex.ok()) return regex.status();
  // Keeping only the matches = removing the inverted matches.
  out.steps_.push_back({Step::Kind::kSplit, std::shared_ptr<UnicodeRegex>(std::move(*regex)),
                        Delimiter::kRemoved, true});
  out.byte_level_ = false;
  return out;
}

void PreTokenizer::ApplySplit(const Step& step, std::string_view piece,
                              std::vector<std::string_view>* out,
                              std::vector<UnicodeRegex::Match>* matches) const {
  matches->clear();
  step.regex->FindAll(piece, matches);
  // (begin, end, is_match) covering the piece, as tokenizers' Pattern::find_matches returns.
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Span> spans;
  spans.reserve(matches->size() * 2 + 1);
  size_t prev = 0;
  for (const UnicodeRegex::Match& m : *matches) {
    if (m.begin != prev) spans.push_back({prev, m.begin, step.invert});
    spans.push_back({m.begin, m.end, !step.invert});
    prev = m.end;
  }
  if (prev != piece.size()) spans.push_back({prev, piece.size(), step.invert});

  std::vector<std::pair<size_t, size_t>> kept;
  kept.reserve(spans.size());
  switch (step.delimiter) {
    case Delimiter::kRemoved:
      for (const Span& s : spans) {
        if (!s.is_match) kept.emplace_back(s.begin, s.end);
      }
      break;
    case Delimiter::kIsolated:
      for (const Span& s : spans) kept.emplace_back(s.begin, s.end);
      break;
    case Delimiter::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !kept.empty()) {
          kept.back().second = s.end;
        } else {
          kept.emplace_back(s.begin, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Delimiter::kMergedWithNext: {
      bool previous_match = false;
      for (auto s = spans.rbegin(); s != spans.rend(); ++s) {
        if (s->is_match && !previous_match && !kept.empty()) {
          kept.back().first = s->begin;
        } else {
          kept.emplace_back(s->begin, s->end);
        }
        previous_match = s->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case Delimiter::kContiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !kept.empty()) {
          kept.back().second = s.end;
        } else {
          kept.emplace_back(s.begin, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  for (const auto& [begin, end] : kept) {
    if (end > begin) out->push_back(piece.substr(begin, end - begin));
  }
}

void PreTokenizer::Split(std::string_view text, std::vector<std::string_view>* pieces,
                         std::deque<std::string>* arena) const {
  pieces->clear();
  if (text.empty()) return;
  pieces->push_back(text);
  std::vector<std::string_view> next;
  std::vector<UnicodeRegex::Match> matches;
  for (const Step& step : steps_) {
    next.clear();
    for (std::string_view piece : *pieces) {
      if (step.kind == Step::Kind::kPrefixSpace) {
        if (piece.front() != ' ') {
          arena->push_back(absl::StrCat(" ", ToAbsl(piece)));
          piece = arena->back();
        }
        next.push_back(piece);
      } else {
        ApplySplit(step, piece, &next, &matches);
      }
    }
    pieces->swap(next);
  }
}

}  // namespace mlaserve
