// ReasoningSplitter on synthetic outputs, fed as every split into one, two and three chunks (and
// one character at a time): the reasoning and content it returns must be the same for all.
#include "coordinator/http/reasoning_parser.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve::openai {
namespace {

struct Case {
  ReasoningFormat format;
  std::string output, reasoning, content;
};

std::pair<std::string, std::string> Feed(ReasoningFormat f, const std::vector<std::string>& parts) {
  ReasoningSplitter s(f);
  std::string reasoning, content;
  for (const std::string& p : parts) {
    auto o = s.Add(p);
    reasoning += o.reasoning;
    content += o.content;
  }
  auto o = s.Finish();
  return {reasoning + o.reasoning, content + o.content};
}

void CheckEverySplit(const Case& c) {
  const std::string& t = c.output;
  const std::pair<std::string, std::string> want{c.reasoning, c.content};
  EXPECT_EQ(Feed(c.format, {t}), want) << t;
  for (size_t i = 0; i <= t.size(); ++i) {
    for (size_t j = i; j <= t.size(); ++j) {
      ASSERT_EQ(Feed(c.format, {t.substr(0, i), t.substr(i, j - i), t.substr(j)}), want)
          << t << " split at " << i << ", " << j;
    }
  }
  std::vector<std::string> chars;
  for (char ch : t) chars.emplace_back(1, ch);
  EXPECT_EQ(Feed(c.format, chars), want) << t;
}

TEST(reasoningParserTest, DeepSeekStartsInsideTheThinking) {
  using F = ReasoningFormat;
  for (const Case& c : std::vector<Case>{
           {F::kDeepSeekR1, "Two plus two.</think>4", "Two plus two.", "4"},
           {F::kDeepSeekR1, "<think>Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "\n\n4"},
           {F::kDeepSeekR1, "still thinking <thi", "still thinking <thi", ""},
           {F::kDeepSeekR1, "<thin", "<thin", ""},
           {F::kDeepSeekR1, "a</think>b<think>c</think>", "a", "b<think>c</think>"},
           {F::kDeepSeekR1, "x <think> y</think>z", "x <think> y", "z"},
           {F::kDeepSeekR1, "</think>", "", ""},
       }) {
    CheckEverySplit(c);
  }
}

TEST(reasoningParserTest, KimiThinksBetweenItsOwnMarkers) {
  using F = ReasoningFormat;
  for (const Case& c : std::vector<Case>{
           {F::kKimiK2, "<think>plan</think>answer", "plan", "answer"},
           {F::kKimiK2, "no thinking at all", "", "no thinking at all"},
           {F::kKimiK2, "<think>a</think>b<think>c</think>d", "ac", "bd"},
           {F::kKimiK2, "ans <thi", "", "ans <thi"},
           {F::kKimiK2, "<think>cut off </thi", "cut off </thi", ""},
           {F::kKimiK2, "a</think>b", "", "a</think>b"},
           {F::kKimiK2, "<<think>>x</think><", ">x", "<<"},
       }) {
    CheckEverySplit(c);
  }
}

TEST(reasoningParserTest, NoneIsAllContent) {
  CheckEverySplit({ReasoningFormat::kNone, "<think>a</think>b", "", "<think>a</think>b"});
}

}  // namespace
}  // namespace mlaserve::openai
