#include "coordinator/scheduler/stop_strings.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace mlaserve {
namespace {

StopStringMatcher Make(std::vector<std::string> stops) {
  absl::StatusOr<StopStringMatcher> m = StopStringMatcher::Create(std::move(stops));
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

TEST(StopStringMatcherTest, HoldsBackAPossibleStartAndDropsTheStopString) {
  StopStringMatcher m = Make({"abc"});
  StopStringMatcher::Delta d = m.Add("xxa");
  EXPECT_EQ(d.text, "xx");
  EXPECT_FALSE(d.stopped);
  EXPECT_EQ(m.held_bytes(), 1u);
  EXPECT_EQ(m.Add("b").text, "");
  d = m.Add("cyy");
  EXPECT_EQ(d.text, "");
  EXPECT_TRUE(d.stopped);
  EXPECT_EQ(m.Add("more").text, "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, ReleasesHeldTextWhenTheMatchFails) {
  StopStringMatcher m = Make({"abc"});
  EXPECT_EQ(m.Add("1ab").text, "1");
  EXPECT_EQ(m.Add("d").text, "abd");
  EXPECT_EQ(m.Add("ab").text, "");
  EXPECT_EQ(m.Flush(), "ab");  // generation ended without a match
}

TEST(StopStringMatcherTest, EarliestOfSeveralStopsWins) {
  StopStringMatcher m = Make({"world", "lo w"});
  const StopStringMatcher::Delta d = m.Add("hello world");
  EXPECT_TRUE(d.stopped);
  EXPECT_EQ(d.text, "hel");
}

TEST(StopStringMatcherTest, MultiByteStopStringCutsAtACharacterBoundary) {
  StopStringMatcher m = Make({"。\n"});
  std::string out = m.Add("你好").text;
  out += m.Add("。").text;  // held: may be the start of the stop string
  EXPECT_EQ(out, "你好");
  const StopStringMatcher::Delta d = m.Add("\n再见");
  EXPECT_TRUE(d.stopped);
  EXPECT_EQ(out + d.text, "你好");
}

TEST(StopStringMatcherTest, NoStopStringsPassesEverythingThrough) {
  StopStringMatcher m = Make({});
  EXPECT_EQ(m.Add("abc").text, "abc");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, RejectsAnEmptyStopString) {
  absl::StatusOr<StopStringMatcher> m = StopStringMatcher::Create({"ok", ""});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("stop[1]"), std::string::npos);
}

// Random texts over a small alphabet (so stop strings and their prefixes occur often), cut into
// random deltas. Oracle: generation ends at the delta where a stop string first appears, and the
// text is cut before the earliest occurrence in the text at that point (a longer stop string that
// started earlier but was never completed does not count).
TEST(StopStringMatcherTest, StreamedTextEqualsFinalTextOnRandomCases) {
  std::mt19937 rng(7);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const std::string alphabet = "abc";
  auto random_string = [&](int len) {
    std::string s;
    for (int i = 0; i < len; ++i) s += alphabet[uniform(0, 2)];
    return s;
  };
  int stopped_cases = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<std::string> stops;
    for (int i = uniform(1, 3); i > 0; --i) stops.push_back(random_string(uniform(1, 5)));
    std::vector<std::string> deltas;
    for (int i = uniform(0, 12); i > 0; --i) deltas.push_back(random_string(uniform(0, 5)));

    StopStringMatcher m = Make(stops);
    std::string so_far, streamed;
    std::string expected;  // the text when the first stop string completes, cut before it
    bool stopped = false;
    for (const std::string& delta : deltas) {
      so_far += delta;
      const StopStringMatcher::Delta d = m.Add(delta);
      streamed += d.text;
      if (stopped) {
        ASSERT_TRUE(d.text.empty() && !d.stopped);
        continue;
      }
      size_t first = std::string::npos;
      for (const std::string& s : stops) first = std::min(first, so_far.find(s));
      // Stops exactly at the delta that completes the first match.
      ASSERT_EQ(d.stopped, first != std::string::npos) << "trial " << trial;
      if (d.stopped) {
        stopped = true;
        expected = so_far.substr(0, first);
        continue;
      }
      // Not over-holding: what is held is a proper prefix of some stop string (or nothing).
      ASSERT_EQ(streamed.size() + m.held_bytes(), so_far.size());
      const std::string held = so_far.substr(streamed.size());
      bool prefix_of_a_stop = held.empty();
      for (const std::string& s : stops) {
        prefix_of_a_stop |= s.size() > held.size() && s.compare(0, held.size(), held) == 0;
      }
      ASSERT_TRUE(prefix_of_a_stop) << "held '" << held << "' trial " << trial;
    }
    streamed += m.Flush();
    if (!stopped) expected = so_far;  // generation ended without a stop string
    ASSERT_EQ(streamed, expected) << "trial " << trial << " text " << so_far;
    stopped_cases += stopped;
  }
  EXPECT_GT(stopped_cases, 5000);  // both outcomes well covered
  EXPECT_LT(stopped_cases, 15000);
}

}  // namespace
}  // namespace mlaserve
