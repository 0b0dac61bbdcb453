// StopStringMatcher (coordinator/http/stop_strings.h): the answer's text cut before the first
// stop string, whatever the chunking; a possible stop prefix held back, released when it turns
// out not to be one.
#include "coordinator/http/stop_strings.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve::openai {
namespace {

// Feeds `text` in chunks of `step` bytes; returns what was released and whether it stopped.
std::pair<std::string, bool> Feed(const std::vector<std::string>& stops, const std::string& text,
                                  size_t step) {
  StopStringMatcher m(stops);
  std::string out;
  for (size_t i = 0; i < text.size(); i += step) out += m.Add(text.substr(i, step));
  out += m.Finish();
  return {out, m.stopped()};
}

TEST(StopStrings, CutsBeforeTheFirstStopInEveryChunking) {
  const std::string text = "The answer is 42. END of story. END";
  for (size_t step = 1; step <= text.size(); ++step) {
    SCOPED_TRACE(step);
    const auto [out, stopped] = Feed({"END"}, text, step);
    EXPECT_EQ(out, "The answer is 42. ");
    EXPECT_TRUE(stopped);
  }
}

TEST(StopStrings, EarliestOfSeveralAndOverlappingPrefixes) {
  for (size_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(step);
    EXPECT_EQ(Feed({"world", "lo w"}, "hello world", step).first, "hel");
    // "aab" after "aaa...": a held prefix that fails must release all but the new candidate.
    EXPECT_EQ(Feed({"aab"}, "aaaaab!", step).first, "aaa");
    EXPECT_EQ(Feed({"ab"}, "aaaa", step), std::make_pair(std::string("aaaa"), false));
  }
}

TEST(StopStrings, NoMatchReleasesEverythingAndEmptyStopsAreIgnored) {
  for (size_t step = 1; step <= 4; ++step) {
    EXPECT_EQ(Feed({"xyz", ""}, "xy xy x", step), std::make_pair(std::string("xy xy x"), false));
  }
  StopStringMatcher none({});
  EXPECT_EQ(none.Add("anything"), "anything");
}

TEST(StopStrings, MultiByteTextIsCutOnlyAtTheStop) {
  const std::string text = "caf\xc3\xa9 \xe2\x80\x94 done";  // "café — done"
  for (size_t step = 1; step <= 4; ++step) {
    EXPECT_EQ(Feed({"\xe2\x80\x94"}, text, step).first, "caf\xc3\xa9 ");
  }
}

TEST(StopStrings, NothingAfterTheStop) {
  StopStringMatcher m({"."});
  EXPECT_EQ(m.Add("One. Two."), "One");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Add("more"), "");
  EXPECT_EQ(m.Finish(), "");
}

}  // namespace
}  // namespace mlaserve::openai
