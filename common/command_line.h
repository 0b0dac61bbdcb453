// The command-line parser of every mlaserve binary (issue 19).
//
// A binary defines its flags with ABSL_FLAG in its main file (typed value, default, help text)
// and calls ParseCommandLine first thing in main(). Flag names are C++ identifiers there
// (max_running) and are spelled with dashes on the command line (--max-running: the spelling the
// launcher, scripts, tests and README use; the underscore spelling is accepted too).
//
// Why not absl::ParseCommandLine: in abseil 20220623 (Debian 12) it accepts only the underscore
// spelling (--max-running is "Unknown command line flag"), and its --help prints that spelling
// and exits 1. So this parser maps the spelling and sets each flag through abseil's registry and
// marshalling (absl::FindCommandLineFlag, CommandLineFlag::ParseFrom): the types, parsing and
// defaults are abseil's.
//
// Accepted forms: --name=value and --name value; a bool flag alone (--json: true), as
// --name=true|false (abseil's spellings: true/false, yes/no, 1/0, t/f, y/n), or negated as
// --no-name; "--" ends the flags. An argument that does not start with "--" is positional (so is
// everything after "--"): they are returned in order. A flag given twice takes its last value,
// except a StringList flag, which keeps every occurrence.
//
// Errors: an unknown flag, a missing or unparsable value, or a failed check below prints
// "PROGRAM: MESSAGE (PROGRAM --help lists the flags)" on stderr and exits with status 2.
// --help (or -h) prints the usage line and every flag of the binary (type, default, help) on
// stdout and exits 0.
#ifndef MLASERVE_COMMON_COMMAND_LINE_H_
#define MLASERVE_COMMON_COMMAND_LINE_H_

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mlaserve {

// A value written on/off (--cuda-graphs on): the form the launcher and scripts pass.
struct OnOff {
  bool on = false;
};
bool AbslParseFlag(absl::string_view text, OnOff* value, std::string* error);
std::string AbslUnparseFlag(OnOff value);

// A flag that may be given several times (--stop A --stop B): every value, in order.
struct StringList {
  std::vector<std::string> values;
};
// The parser hands a StringList flag all its occurrences at once, each C-escaped and ended by
// '\n' (the only form it parses; a value itself may hold any byte).
bool AbslParseFlag(absl::string_view text, StringList* value, std::string* error);
std::string AbslUnparseFlag(const StringList& value);

// A comma-separated list of integers (--batches 1,8,64).
struct IntList {
  std::vector<int64_t> values;
};
bool AbslParseFlag(absl::string_view text, IntList* value, std::string* error);
std::string AbslUnparseFlag(const IntList& value);

// Parses argv[1..] into the binary's flags (see the top of this file) and returns the positional
// arguments. `usage` is the synopsis --help prints, e.g. "mlaserve-cli [flags] (health | info)".
// `quiet` (MPI ranks other than 0): errors and --help print nothing; the exit is the same.
std::vector<std::string> ParseCommandLine(int argc, char** argv, absl::string_view usage,
                                          bool quiet = false);

// ParseCommandLine for a binary that takes flags only: a positional argument is a usage error.
void ParseFlags(int argc, char** argv, absl::string_view usage, bool quiet = false);

// Prints "PROGRAM: MESSAGE (PROGRAM --help lists the flags)" (unless quiet) and exits 2.
[[noreturn]] void UsageError(absl::string_view message);

// The help ParseCommandLine prints for --help: the usage line and every flag of the binary.
std::string CommandLineHelp(absl::string_view program, absl::string_view usage);

// Whether the last ParseCommandLine set the flag (for flags that only some subcommands take).
bool FlagGiven(const absl::CommandLineFlag& flag);
template <typename T>
bool FlagGiven(const absl::Flag<T>& flag) {
  return FlagGiven(absl::GetFlagReflectionHandle(flag));
}

// A flag's name as the command line spells it: "--max-running".
std::string FlagName(const absl::CommandLineFlag& flag);
template <typename T>
std::string FlagName(const absl::Flag<T>& flag) {
  return FlagName(absl::GetFlagReflectionHandle(flag));
}

// The bounds' type is the flag's, not deduced from them (FlagInRange(FLAGS_ms, 1, kDayMs) with an
// int64_t flag). C++17's spelling of std::type_identity_t: the CUDA benchmarks build as C++17.
template <typename T>
struct FlagBound {
  using type = T;
};

// The flag's value; a usage error unless lo <= value <= hi (NaN is out of every range).
template <typename T>
T FlagInRange(const absl::Flag<T>& flag, typename FlagBound<T>::type lo,
              typename FlagBound<T>::type hi) {
  const T value = absl::GetFlag(flag);
  if (!(value >= lo && value <= hi)) {
    UsageError(absl::StrCat(FlagName(flag), " ", value, ": must be in [", lo, ", ", hi, "]"));
  }
  return value;
}

// The values of a list flag; a usage error unless each is in [lo, hi] and (unless allow_empty)
// there is at least one.
std::vector<int> FlagIntsInRange(const absl::Flag<IntList>& flag, int lo, int hi,
                                 bool allow_empty = false);

// The flag's value; a usage error unless it is one of `allowed`.
std::string FlagOneOf(const absl::Flag<std::string>& flag,
                      std::initializer_list<absl::string_view> allowed);

// The flag's value; a usage error if it is empty ("--model DIR is required").
std::string RequiredFlag(const absl::Flag<std::string>& flag, absl::string_view placeholder);

}  // namespace mlaserve

#endif  // MLASERVE_COMMON_COMMAND_LINE_H_
