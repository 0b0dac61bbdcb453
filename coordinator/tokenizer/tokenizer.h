// Text <-> token ids for the coordinator, exact against the model's reference tokenizer.
//
// Two vocabulary formats, both byte-level BPE:
//  - Hugging Face tokenizer.json (DeepSeek-V3/R1): added tokens matched first, then the
//    pre_tokenizer (Split / ByteLevel / Digits), then BPE with the merges list;
//  - tiktoken.model (Kimi-K2/K2.5): base64 token and rank per line, pieces cut by `pat_str`,
//    special tokens from tokenizer_config.json's added_tokens_decoder.
// tokenizer_config.json decides BOS/EOS insertion (add_bos_token / add_eos_token) as
// transformers' LlamaTokenizerFast does, overriding tokenizer.json's post_processor.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "coordinator/tokenizer/bpe_model.h"
#include "coordinator/tokenizer/pre_tokenizer.h"
#include "nlohmann/json.hpp"

namespace mlaserve {

// A token matched in raw text before pre-tokenization (tokenizer.json "added_tokens", or a
// tiktoken special token).
struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;     // skipped by Decode(skip_special_tokens = true)
  bool normalized = false;  // matched after normalization (second pass) rather than on raw text
};

class Tokenizer {
 public:
  // Loads tokenizer.json (preferred) or tiktoken.model, with tokenizer_config.json, from `dir`.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> LoadFromModelDir(const std::string& dir);

  // tokenizer.json contents; `config`: tokenizer_config.json contents or null.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromHuggingFaceJson(
      const nlohmann::json& tokenizer_json, const nlohmann::json& config);

  // tiktoken.model contents; `config`: tokenizer_config.json (added_tokens_decoder, bos/eos).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTiktoken(std::string_view tiktoken_model,
                                                                 std::string_view pat_str,
                                                                 const nlohmann::json& config);

  // Token ids of `text` (bytes; ill-formed UTF-8 is read as U+FFFD, as a decoded string would
  // be). Added/special tokens written in the text are recognised. `add_special_tokens`: prepend
  // BOS / append EOS as the model's configuration says.
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const;

  // UTF-8 text of `ids` (ill-formed byte sequences become U+FFFD). Unknown ids are skipped, as
  // Hugging Face's decode does.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Raw bytes of `ids`, before UTF-8 validation: what streaming decoders accumulate.
  std::string DecodeBytes(std::span<const int32_t> ids, bool skip_special_tokens) const;

  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  std::optional<int32_t> TokenToId(std::string_view token_text) const;
  bool IsSpecial(int32_t id) const;
  // One past the largest id (vocabulary and added tokens).
  int vocab_size() const { return vocab_size_; }

 private:
  Tokenizer() = default;
  struct Segment {
    std::string_view text;
    int32_t added_id;  // -1: plain text to pre-tokenize
  };
  // Splits `text` at the leftmost-longest occurrences of the added tokens of one pass.
  void SplitAddedTokens(std::string_view text, bool normalized_pass,
                        std::vector<Segment>* out) const;
  void EncodePlain(std::string_view text, std::vector<int32_t>* ids) const;
  absl::Status SetAddedTokens(std::vector<AddedToken> tokens);
  absl::Status ApplyConfig(const nlohmann::json& config);

  std::optional<BpeModel> bpe_;
  std::optional<PreTokenizer> pre_tokenizer_;
  std::vector<AddedToken> added_tokens_;
  // Per matching pass (raw text, then normalized): content -> id, lengths present, first bytes.
  struct AddedTokenPass {
    absl::flat_hash_map<std::string, int32_t> by_content;
    std::vector<size_t> lengths;  // descending
    bool first_byte[256] = {};
  };
  AddedTokenPass passes_[2];
  absl::flat_hash_map<int32_t, size_t> added_by_id_;  // id -> index in added_tokens_
  std::vector<std::string> added_decode_bytes_;       // by index in added_tokens_
  std::vector<int32_t> prefix_ids_, suffix_ids_;      // added when add_special_tokens
  // Vocabulary entries that are not byte-level text (decoded as their UTF-8).
  absl::flat_hash_map<int32_t, std::string> text_vocab_;
  std::optional<int32_t> bos_id_, eos_id_;
  int vocab_size_ = 0;
};

}  // namespace mlaserve
