// The command-line parser every binary uses (common/command_line.h): both value forms, the
// dashed and underscored spellings, bool forms, repeatable and list flags, positional arguments,
// and every usage error (message and exit status 2), --help's listing.
#include "common/command_line.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/reflection.h"

ABSL_FLAG(std::string, model, "", "The model folder.");
ABSL_FLAG(int32_t, max_running, 256, "Most sequences running at once.");
ABSL_FLAG(uint64_t, seed, 1, "Sampling seed.");
ABSL_FLAG(double, fraction, 0.9, "A fraction of the free memory.");
ABSL_FLAG(bool, json, false, "Print JSON.");
ABSL_FLAG(bool, prefix_cache, true, "Reuse cached prefixes.");
ABSL_FLAG(mlaserve::OnOff, graphs, mlaserve::OnOff{true}, "CUDA graphs.");
ABSL_FLAG(mlaserve::StringList, stop, {}, "A stop string (repeatable).");
ABSL_FLAG(mlaserve::IntList, batches, (mlaserve::IntList{{1, 8}}), "Batch sizes.");
ABSL_FLAG(std::string, device, "auto", "auto, cuda or cpu.");

namespace mlaserve {
namespace {

// Parses `args` (argv[0] added) and returns the positional arguments.
std::vector<std::string> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "/path/to/prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return ParseCommandLine(static_cast<int>(args.size()), argv.data(), "prog [flags] ARG");
}

class CommandLineTest : public ::testing::Test {
  absl::FlagSaver saver_;  // every test starts from the defaults
};

using CommandLineDeathTest = CommandLineTest;

TEST_F(CommandLineTest, BothValueFormsAndSpellings) {
  EXPECT_TRUE(Parse({"--model", "/m", "--max-running=4", "--seed", "18446744073709551615",
                     "--fraction=0.5"})
                  .empty());
  EXPECT_EQ(absl::GetFlag(FLAGS_model), "/m");
  EXPECT_EQ(absl::GetFlag(FLAGS_max_running), 4);
  EXPECT_EQ(absl::GetFlag(FLAGS_seed), 18446744073709551615ull);
  EXPECT_EQ(absl::GetFlag(FLAGS_fraction), 0.5);
  Parse({"--max_running", "7"});  // abseil's own spelling
  EXPECT_EQ(absl::GetFlag(FLAGS_max_running), 7);
  Parse({"--max-running", "5", "--max-running", "6"});  // the last one wins
  EXPECT_EQ(absl::GetFlag(FLAGS_max_running), 6);
  Parse({"--model="});  // an empty value, given explicitly
  EXPECT_EQ(absl::GetFlag(FLAGS_model), "");
  Parse({"--model", "--json"});  // a value is taken as it is, even one like a flag
  EXPECT_EQ(absl::GetFlag(FLAGS_model), "--json");
  EXPECT_FALSE(absl::GetFlag(FLAGS_json));
}

TEST_F(CommandLineTest, BoolFlags) {
  // A bool flag takes no following argument: "text" stays positional.
  EXPECT_EQ(Parse({"--json", "text"}), std::vector<std::string>{"text"});
  EXPECT_TRUE(absl::GetFlag(FLAGS_json));
  Parse({"--json=false", "--no-prefix-cache"});
  EXPECT_FALSE(absl::GetFlag(FLAGS_json));
  EXPECT_FALSE(absl::GetFlag(FLAGS_prefix_cache));
  Parse({"--prefix-cache=yes", "--no_json"});
  EXPECT_TRUE(absl::GetFlag(FLAGS_prefix_cache));
  EXPECT_FALSE(absl::GetFlag(FLAGS_json));
}

TEST_F(CommandLineTest, TypedValues) {
  Parse({"--graphs", "off", "--batches=2,4,64"});
  EXPECT_FALSE(absl::GetFlag(FLAGS_graphs).on);
  EXPECT_EQ(absl::GetFlag(FLAGS_batches).values, (std::vector<int64_t>{2, 4, 64}));
  EXPECT_EQ(absl::GetFlag(FLAGS_batches).values.size(), 3u);
  Parse({"--graphs=on"});
  EXPECT_TRUE(absl::GetFlag(FLAGS_graphs).on);
}

TEST_F(CommandLineTest, RepeatableFlagKeepsEveryValueExactly) {
  // Values with the bytes the encoding between parser and flag uses (newline, backslash, quote,
  // comma) and an empty one come back as given.
  Parse({"--stop", "a,b", "--stop=line\nbreak", "--stop", "", "--stop", "back\\slash\"q\x01"});
  EXPECT_EQ(absl::GetFlag(FLAGS_stop).values,
            (std::vector<std::string>{"a,b", "line\nbreak", "", "back\\slash\"q\x01"}));
}

TEST_F(CommandLineTest, PositionalArgumentsInOrder) {
  EXPECT_EQ(Parse({"chat", "--max-running", "3", "hello", "-", "-5", "--", "--json", "x"}),
            (std::vector<std::string>{"chat", "hello", "-", "-5", "--json", "x"}));
  EXPECT_EQ(absl::GetFlag(FLAGS_max_running), 3);
  EXPECT_FALSE(absl::GetFlag(FLAGS_json));  // after "--": positional
}

TEST_F(CommandLineTest, Checks) {
  Parse({"--max-running", "4", "--fraction", "1", "--model", "/m", "--device", "cpu"});
  EXPECT_EQ(FlagInRange(FLAGS_max_running, 1, 65536), 4);
  EXPECT_EQ(FlagInRange(FLAGS_fraction, 0.01, 1.0), 1.0);
  EXPECT_EQ(RequiredFlag(FLAGS_model, "DIR"), "/m");
  EXPECT_EQ(FlagOneOf(FLAGS_device, {"auto", "cuda", "cpu"}), "cpu");
  EXPECT_EQ(FlagName(FLAGS_max_running), "--max-running");
  Parse({"--batches", "2,64"});
  EXPECT_EQ(FlagIntsInRange(FLAGS_batches, 1, 64), (std::vector<int>{2, 64}));
  Parse({"--batches="});
  EXPECT_TRUE(FlagIntsInRange(FLAGS_batches, 1, 64, /*allow_empty=*/true).empty());
}

TEST_F(CommandLineDeathTest, UsageErrorsExitTwoWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto two = ::testing::ExitedWithCode(2);
  EXPECT_EXIT(Parse({"--max-runing", "4"}), two,
              "^prog: unknown flag --max-runing \\(prog --help lists the flags\\)");
  EXPECT_EXIT(Parse({"--max-running"}), two, "prog: --max-running needs a value");
  EXPECT_EXIT(Parse({"--max-running", "many"}), two,
              "prog: --max-running \"many\": expected a 32-bit integer");
  EXPECT_EXIT(Parse({"--max-running=99999999999"}), two, "expected a 32-bit integer");
  EXPECT_EXIT(Parse({"--seed", "-1"}), two, "--seed \"-1\": expected a non-negative 64-bit");
  EXPECT_EXIT(Parse({"--fraction", "half"}), two, "--fraction \"half\": expected a number");
  EXPECT_EXIT(Parse({"--json=maybe"}), two, "--json \"maybe\": expected true or false");
  EXPECT_EXIT(Parse({"--no-json=true"}), two, "--no-json takes no value");
  EXPECT_EXIT(Parse({"--no-model"}), two, "unknown flag --no-model");  // not a bool flag
  EXPECT_EXIT(Parse({"--graphs", "maybe"}), two, "--graphs \"maybe\": must be on or off");
  EXPECT_EXIT(Parse({"--batches", "1,x"}), two, "--batches \"1,x\": not an integer: \"x\"");
  EXPECT_EXIT(Parse({"--flagfile", "f"}), two, "unknown flag --flagfile");  // abseil's own
  EXPECT_EXIT(Parse({"--=x"}), two, "unknown flag -- \\(");
}

TEST_F(CommandLineDeathTest, ChecksExitTwoWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto two = ::testing::ExitedWithCode(2);
  EXPECT_EXIT((Parse({"--max-running", "0"}), FlagInRange(FLAGS_max_running, 1, 65536)), two,
              "prog: --max-running 0: must be in \\[1, 65536\\]");
  EXPECT_EXIT((Parse({"--fraction", "nan"}), FlagInRange(FLAGS_fraction, 0.01, 1.0)), two,
              "--fraction nan: must be in");
  EXPECT_EXIT((Parse({}), RequiredFlag(FLAGS_model, "DIR")), two, "--model DIR is required");
  EXPECT_EXIT((Parse({"--device", "tpu"}), FlagOneOf(FLAGS_device, {"auto", "cuda", "cpu"})), two,
              "--device tpu: must be auto, cuda, cpu");
  EXPECT_EXIT((Parse({"--batches", "1,65"}), FlagIntsInRange(FLAGS_batches, 1, 64)), two,
              "--batches 65: each value must be in \\[1, 64\\]");
  EXPECT_EXIT((Parse({"--batches="}), FlagIntsInRange(FLAGS_batches, 1, 64)), two,
              "--batches needs at least one value");
}

TEST_F(CommandLineDeathTest, HelpListsEveryFlagAndExitsZero) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string help = CommandLineHelp("prog", "prog [flags] ARG");
  EXPECT_NE(help.find("usage: prog [flags] ARG\n"), std::string::npos) << help;
  EXPECT_NE(
      help.find("  --max-running=INT  (default 256)\n      Most sequences running at once.\n"),
      std::string::npos)
      << help;
  EXPECT_NE(help.find("  --[no-]prefix-cache  (default true)"), std::string::npos) << help;
  EXPECT_NE(help.find("  --graphs=on|off  (default on)"), std::string::npos) << help;
  EXPECT_NE(help.find("  --stop=STRING (repeatable)\n"), std::string::npos) << help;
  EXPECT_NE(help.find("  --model=STRING  (default \"\")"), std::string::npos) << help;
  EXPECT_EQ(help.find("flagfile"), std::string::npos) << help;  // abseil's own are not offered
  EXPECT_EXIT(Parse({"--max-running", "4", "--help"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(Parse({"-h"}), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace mlaserve
