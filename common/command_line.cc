#include "common/command_line.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/reflection.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace mlaserve {
namespace {

// Set by ParseCommandLine for the messages of UsageError.
std::string g_program = "mlaserve";
bool g_quiet = false;
// The flags the last ParseCommandLine set (never destroyed: flags outlive main).
absl::flat_hash_set<const absl::CommandLineFlag*>& Given() {
  static auto* given = new absl::flat_hash_set<const absl::CommandLineFlag*>;
  return *given;
}

// The binary's own flags: abseil registers a few of its own (--flagfile, --fromenv, ... where
// absl/flags/parse.cc is linked in), which are not offered.
bool IsOurs(const absl::CommandLineFlag& flag) {
  return !flag.IsRetired() && !absl::StrContains(flag.Filename(), "absl/flags/");
}

absl::CommandLineFlag* FindOurs(absl::string_view name) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && IsOurs(*flag) ? flag : nullptr;
}

// What --help shows after the name: the value's form.
std::string ValueForm(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "";
  if (flag.IsOfType<OnOff>()) return "=on|off";
  if (flag.IsOfType<StringList>()) return "=STRING (repeatable)";
  if (flag.IsOfType<IntList>()) return "=INT,INT,...";
  if (flag.IsOfType<std::vector<std::string>>()) return "=STRING,STRING,...";
  if (flag.IsOfType<std::string>()) return "=STRING";
  if (flag.IsOfType<double>() || flag.IsOfType<float>()) return "=NUMBER";
  if (flag.IsOfType<uint32_t>() || flag.IsOfType<uint64_t>()) return "=UINT";
  return "=INT";
}

// What a flag's value must be, for the message of a value that does not parse.
std::string Expected(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<bool>()) return "true or false";
  if (flag.IsOfType<int32_t>()) return "a 32-bit integer";
  if (flag.IsOfType<int64_t>()) return "a 64-bit integer";
  if (flag.IsOfType<uint32_t>()) return "a non-negative 32-bit integer";
  if (flag.IsOfType<uint64_t>()) return "a non-negative 64-bit integer";
  if (flag.IsOfType<double>() || flag.IsOfType<float>()) return "a number";
  return "a valid value";
}

// Words of `text` in lines of at most `width` characters, each after `indent`.
std::string Wrap(absl::string_view text, size_t indent, size_t width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

}  // namespace

bool AbslParseFlag(absl::string_view text, OnOff* value, std::string* error) {
  if (text == "on" || text == "off") {
    value->on = text == "on";
    return true;
  }
  *error = "must be on or off";
  return false;
}

std::string AbslUnparseFlag(OnOff value) { return value.on ? "on" : "off"; }

bool AbslParseFlag(absl::string_view text, StringList* value, std::string* error) {
  value->values.clear();
  for (absl::string_view item : absl::StrSplit(text, '\n')) {
    if (item.data() == text.data() + text.size()) break;  // after the last '\n'
    std::string unescaped;
    if (!absl::CUnescape(item, &unescaped, error)) return false;
    value->values.push_back(std::move(unescaped));
  }
  return true;
}

std::string AbslUnparseFlag(const StringList& value) {
  std::string out;
  for (const std::string& v : value.values) absl::StrAppend(&out, absl::CEscape(v), "\n");
  return out;
}

bool AbslParseFlag(absl::string_view text, IntList* value, std::string* error) {
  value->values.clear();
  if (text.empty()) return true;  // no values
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    int64_t n;
    if (!absl::SimpleAtoi(item, &n)) {
      *error = absl::StrCat("not an integer: \"", item, "\"");
      return false;
    }
    value->values.push_back(n);
  }
  return true;
}

std::string AbslUnparseFlag(const IntList& value) { return absl::StrJoin(value.values, ","); }

bool FlagGiven(const absl::CommandLineFlag& flag) { return Given().contains(&flag); }

std::string FlagName(const absl::CommandLineFlag& flag) {
  return absl::StrCat("--", absl::StrReplaceAll(flag.Name(), {{"_", "-"}}));
}

void UsageError(absl::string_view message) {
  if (!g_quiet) {
    std::fprintf(stderr, "%s: %.*s (%s --help lists the flags)\n", g_program.c_str(),
                 static_cast<int>(message.size()), message.data(), g_program.c_str());
  }
  std::exit(2);
}

std::string CommandLineHelp(absl::string_view program, absl::string_view usage) {
  std::map<std::string, const absl::CommandLineFlag*> sorted;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsOurs(*flag)) sorted.emplace(FlagName(*flag), flag);
  }
  std::string out =
      absl::StrCat("usage: ", usage, "\n\nflags (", program, "; --name=value or --name value):\n");
  for (const auto& [name, flag] : sorted) {
    std::string head = flag->IsOfType<bool>() ? absl::StrCat("  --[no-]", name.substr(2))
                                              : absl::StrCat("  ", name, ValueForm(*flag));
    const std::string def = flag->DefaultValue();
    if (flag->IsOfType<StringList>()) {
      // The default is the escaped form; every StringList here starts empty.
    } else if (flag->IsOfType<std::string>()) {
      absl::StrAppend(&head, "  (default \"", absl::CHexEscape(def), "\")");
    } else {
      absl::StrAppend(&head, "  (default ", def, ")");
    }
    absl::StrAppend(&out, head, "\n", Wrap(flag->Help(), 6, 94));
  }
  return out;
}

std::vector<std::string> ParseCommandLine(int argc, char** argv, absl::string_view usage,
                                          bool quiet) {
  if (argc > 0 && argv[0] != nullptr) {
    const absl::string_view path = argv[0];
    g_program = std::string(path.substr(path.rfind('/') + 1));
  }
  g_quiet = quiet;
  Given().clear();
  std::vector<std::string> positional;
  // Every occurrence of a StringList flag, set at the end in one ParseFrom.
  std::map<std::string, std::pair<absl::CommandLineFlag*, StringList>> lists;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) positional.emplace_back(argv[i]);
      break;
    }
    if (arg == "--help" || arg == "-h") {
      if (!quiet) std::fputs(CommandLineHelp(g_program, usage).c_str(), stdout);
      std::exit(0);
    }
    if (!absl::StartsWith(arg, "--")) {
      positional.emplace_back(arg);
      continue;
    }
    const absl::string_view body = arg.substr(2);
    const size_t eq = body.find('=');
    const absl::string_view spelled = body.substr(0, eq);
    const std::string name = absl::StrReplaceAll(spelled, {{"-", "_"}});
    std::string value;
    bool has_value = eq != absl::string_view::npos;
    if (has_value) value = std::string(body.substr(eq + 1));
    absl::CommandLineFlag* flag = name.empty() ? nullptr : FindOurs(name);
    if (flag == nullptr && absl::StartsWith(name, "no_")) {
      // --no-name: a bool flag's false.
      absl::CommandLineFlag* positive = FindOurs(name.substr(3));
      if (positive != nullptr && positive->IsOfType<bool>()) {
        if (has_value) UsageError(absl::StrCat("--", spelled, " takes no value"));
        flag = positive;
        value = "false";
        has_value = true;
      }
    }
    if (flag == nullptr) UsageError(absl::StrCat("unknown flag --", spelled));
    if (!has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        UsageError(absl::StrCat(FlagName(*flag), " needs a value"));
      }
    }
    Given().insert(flag);
    if (flag->IsOfType<StringList>()) {
      auto& entry = lists[std::string(flag->Name())];
      entry.first = flag;
      entry.second.values.push_back(std::move(value));
      continue;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      // abseil's message names the flag with underscores ("Illegal value 'x' specified for flag
      // 'max_running'"), then its parser's reason, if any, after "; ".
      const size_t reason = error.find("; ");
      UsageError(absl::StrCat(
          FlagName(*flag), " \"", absl::CHexEscape(value), "\": ",
          reason == std::string::npos ? "expected " + Expected(*flag) : error.substr(reason + 2)));
    }
  }
  for (auto& [name, entry] : lists) {
    std::string error;
    if (!entry.first->ParseFrom(AbslUnparseFlag(entry.second), &error)) {
      UsageError(absl::StrCat(FlagName(*entry.first), ": ", error));  // not reached: any bytes
    }
  }
  return positional;
}

void ParseFlags(int argc, char** argv, absl::string_view usage, bool quiet) {
  const std::vector<std::string> positional = ParseCommandLine(argc, argv, usage, quiet);
  if (!positional.empty()) {
    UsageError(absl::StrCat("unexpected argument \"", absl::CHexEscape(positional[0]),
                            "\" (this program takes flags only)"));
  }
}

std::vector<int> FlagIntsInRange(const absl::Flag<IntList>& flag, int lo, int hi,
                                 bool allow_empty) {
  std::vector<int> out;
  for (int64_t v : absl::GetFlag(flag).values) {
    if (v < lo || v > hi) {
      UsageError(
          absl::StrCat(FlagName(flag), " ", v, ": each value must be in [", lo, ", ", hi, "]"));
    }
    out.push_back(static_cast<int>(v));
  }
  if (out.empty() && !allow_empty) UsageError(FlagName(flag) + " needs at least one value");
  return out;
}

std::string FlagOneOf(const absl::Flag<std::string>& flag,
                      std::initializer_list<absl::string_view> allowed) {
  std::string value = absl::GetFlag(flag);
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    UsageError(
        absl::StrCat(FlagName(flag), " ", value, ": must be ", absl::StrJoin(allowed, ", ")));
  }
  return value;
}

std::string RequiredFlag(const absl::Flag<std::string>& flag, absl::string_view placeholder) {
  std::string value = absl::GetFlag(flag);
  if (value.empty()) UsageError(absl::StrCat(FlagName(flag), " ", placeholder, " is required"));
  return value;
}

}  // namespace mlaserve
