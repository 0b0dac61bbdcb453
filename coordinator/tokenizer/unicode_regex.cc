#include "coordinator/tokenizer/unicode_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdio>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/string_view_bridge.h"

namespace mlaserve {
namespace {

// Per-thread match state: PCRE2 match data for group 0 only, and a JIT stack large enough for
// long runs of letters or whitespace (the default 32 KiB is not).
struct MatchScratch {
  MatchScratch()
      : data(pcre2_match_data_create(1, nullptr)),
        jit_stack(pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr)),
        context(pcre2_match_context_create(nullptr)) {
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
  pcre2_match_data* data;
  pcre2_jit_stack* jit_stack;
  pcre2_match_context* context;
};

MatchScratch& ThreadScratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

// Returns the index one past the `]` closing the class whose `[` is at `open`, honouring
// escapes and nested classes; npos when unterminated.
size_t ClassEnd(std::string_view p, size_t open) {
  size_t i = open + 1;
  if (i < p.size() && p[i] == '^') ++i;
  if (i < p.size() && p[i] == ']') ++i;  // a leading ] is a literal
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\') {
      i += 2;
    } else if (c == '[') {
      if (p.substr(i, 2) == "[:") {
        const size_t close = p.find(":]", i + 2);
        if (close == std::string_view::npos) return close;
        i = close + 2;
      } else {
        const size_t inner = ClassEnd(p, i);
        if (inner == std::string_view::npos) return inner;
        i = inner;
      }
    } else if (c == ']') {
      return i + 1;
    } else {
      ++i;
    }
  }
  return std::string_view::npos;
}

}  // namespace

absl::StatusOr<std::string> RewriteClassIntersections(std::string_view p) {
  if (p.find("&&") == std::string_view::npos) return std::string(p);
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\') {
      out.append(p.substr(i, 2));
      i += 2;
      continue;
    }
    if (c != '[') {
      out.push_back(c);
      ++i;
      continue;
    }
    const size_t end = ClassEnd(p, i);
    if (end == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("unterminated character class at offset ", i, " in pattern ", ToAbsl(p)));
    }
    std::string_view body = p.substr(i + 1, end - i - 2);
    // Split the body at top-level "&&".
    std::vector<std::string_view> operands;
    size_t start = 0, j = 0;
    while (j < body.size()) {
      if (body[j] == '\\') {
        j += 2;
      } else if (body[j] == '[') {
        const size_t inner = ClassEnd(body, j);
        if (inner == std::string_view::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("bad nested class in pattern ", ToAbsl(p)));
        }
        j = inner;
      } else if (body.substr(j, 2) == "&&") {
        operands.push_back(body.substr(start, j - start));
        j += 2;
        start = j;
      } else {
        ++j;
      }
    }
    operands.push_back(body.substr(start));
    if (operands.size() == 1) {
      out.append(p.substr(i, end - i));
    } else {
      const auto as_class = [](std::string_view operand) {
        if (!operand.empty() && operand.front() == '[' && ClassEnd(operand, 0) == operand.size()) {
          return std::string(operand);
        }
        return absl::StrCat("[", ToAbsl(operand), "]");
      };
      out.append("(?:");
      for (size_t k = 1; k < operands.size(); ++k)
        absl::StrAppend(&out, "(?=", as_class(operands[k]), ")");
      absl::StrAppend(&out, as_class(operands[0]), ")");
    }
    i = end;
  }
  return out;
}

std::string PortPatternToPcre2(std::string_view p) {
  // Two differences between PCRE2 and the engines the patterns were written for. PCRE2 (10.40+)
  // reads \p{Han} as Script_Extensions, which puts shared punctuation such as U+3001 "、" in Han;
  // Oniguruma, Rust's regex (tiktoken) and Python's regex read it as the Script property, which
  // PCRE2 spells \p{sc:Han}. General categories stay as they are.
  static const absl::flat_hash_set<std::string> kGeneralCategories = {
      "C",  "Cc", "Cf",  "Cn",  "Co",  "Cs",  "L",   "L&",  "Ll", "Lm",         "Lo", "Lt",
      "Lu", "M",  "Mc",  "Me",  "Mn",  "N",   "Nd",  "Nl",  "No", "P",          "Pc", "Pd",
      "Pe", "Pf", "Pi",  "Po",  "Ps",  "S",   "Sc",  "Sk",  "Sm", "So",         "Z",  "Zl",
      "Zp", "Zs", "Any", "Xan", "Xps", "Xsp", "Xwd", "Xuc", "LC", "White_Space"};
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] != '\\' || i + 1 >= p.size()) {
      out.push_back(p[i++]);
      continue;
    }
    const char kind = p[i + 1];
    if ((kind == 'p' || kind == 'P') && i + 2 < p.size() && p[i + 2] == '{') {
      const size_t close = p.find('}', i + 3);
      if (close != std::string_view::npos) {
        std::string name(p.substr(i + 3, close - i - 3));
        const bool negated = !name.empty() && name[0] == '^';
        const std::string bare = negated ? name.substr(1) : name;
        if (!kGeneralCategories.contains(bare) && bare.find_first_of(":=") == std::string::npos) {
          name = absl::StrCat(negated ? "^" : "", "sc:", bare);
        }
        absl::StrAppend(&out, "\\", std::string(1, kind), "{", name, "}");
        i = close + 1;
        continue;
      }
    }
    if (kind == 's' || kind == 'S') {
      // PCRE2's \s adds U+180E (no longer White_Space since Unicode 6.3) to White_Space;
      // the reference engines use White_Space exactly.
      out.append(kind == 's' ? "\\p{White_Space}" : "\\P{White_Space}");
      i += 2;
      continue;
    }
    out.append(p.substr(i, 2));
    i += 2;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<UnicodeRegex>> UnicodeRegex::Compile(std::string_view pattern) {
  absl::StatusOr<std::string> rewritten = RewriteClassIntersections(pattern);
  if (!rewritten.ok()) return rewritten.status();
  *rewritten = PortPatternToPcre2(*rewritten);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten->data()),
                                   rewritten->size(), PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(
        absl::StrCat("cannot compile pre-tokenizer regex ", ToAbsl(pattern), " (as ", *rewritten,
                     "): ", reinterpret_cast<const char*>(message), " at offset ", error_offset));
  }
  // JIT is an optimisation only: without it (e.g. a platform PCRE2 built without JIT) matching
  // falls back to the interpreter, with identical results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return std::unique_ptr<UnicodeRegex>(new UnicodeRegex(std::string(pattern), code));
}

UnicodeRegex::~UnicodeRegex() { pcre2_code_free(code_); }

void UnicodeRegex::FindAll(std::string_view subject, std::vector<Match>* matches) const {
  MatchScratch& scratch = ThreadScratch();
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t offset = 0;
  while (offset < subject.size()) {
    int rc = pcre2_match(code_, data, subject.size(), offset, PCRE2_NO_UTF_CHECK, scratch.data,
                         scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      // Resource limits (backtracking or stack) on pathological input. No valid UTF-8 input has
      // hit this with the patterns in use; report it rather than guessing a split.
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      std::fprintf(stderr, "mlaserve tokenizer: regex %s failed at offset %zu: %s\n",
                   pattern_.c_str(), offset, reinterpret_cast<const char*>(message));
      return;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {
      // Skip an empty match by one code point.
      offset = begin + 1;
      while (offset < subject.size() && (static_cast<uint8_t>(subject[offset]) & 0xC0) == 0x80)
        ++offset;
      continue;
    }
    matches->push_back({begin, end});
    offset = end;
  }
}

}  // namespace mlaserve
