#include "coordinator/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/byte_level.h"
#include "coordinator/tokenizer/string_view_bridge.h"
#include "coordinator/tokenizer/tiktoken_pattern_source.h"
#include "coordinator/tokenizer/utf8.h"

namespace mlaserve {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  return json;
}

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

// tokenizer_config.json writes tokens either as a string or as an AddedToken object.
std::optional<std::string> ConfigTokenContent(const nlohmann::json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return std::nullopt;
  const nlohmann::json& value = config.at(key);
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value.at("content").is_string()) {
    return value.at("content").get<std::string>();
  }
  return std::nullopt;
}

absl::Status CheckNormalizerIsIdentity(const nlohmann::json& normalizer) {
  if (normalizer.is_null()) return absl::OkStatus();
  if (normalizer.value("type", "") == "Sequence") {
    for (const nlohmann::json& child : normalizer.at("normalizers")) {
      if (absl::Status status = CheckNormalizerIsIdentity(child); !status.ok()) return status;
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer.json: normalizer ", normalizer.dump(),
                   " is not supported (the DeepSeek family uses none / an empty Sequence)"));
}

absl::Status CheckDecoderIsByteLevel(const nlohmann::json& decoder) {
  const std::string type = decoder.is_object() ? decoder.value("type", "") : "";
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence" && decoder.at("decoders").size() == 1) {
    return CheckDecoderIsByteLevel(decoder.at("decoders")[0]);
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: decoder ", decoder.dump(),
                                                 " is not supported (expected ByteLevel)"));
}

}  // namespace

absl::Status Tokenizer::SetAddedTokens(std::vector<AddedToken> tokens) {
  added_tokens_ = std::move(tokens);
  for (size_t i = 0; i < added_tokens_.size(); ++i) {
    const AddedToken& token = added_tokens_[i];
    if (token.content.empty()) return absl::InvalidArgumentError("empty added token");
    added_by_id_[token.id] = i;
    AddedTokenPass& pass = passes_[token.normalized ? 1 : 0];
    pass.by_content.emplace(token.content, token.id);
    pass.first_byte[static_cast<uint8_t>(token.content[0])] = true;
    if (std::find(pass.lengths.begin(), pass.lengths.end(), token.content.size()) ==
        pass.lengths.end()) {
      pass.lengths.push_back(token.content.size());
    }
    vocab_size_ = std::max(vocab_size_, token.id + 1);
    // Hugging Face's ByteLevel decoder maps a token through the byte-level alphabet when every
    // code point belongs to it, and otherwise passes its UTF-8 through unchanged. tiktoken
    // special tokens are plain UTF-8.
    std::optional<std::string> bytes;
    if (pre_tokenizer_->byte_level()) bytes = ByteLevelToBytes(token.content);
    added_decode_bytes_.push_back(bytes ? *bytes : token.content);
  }
  for (AddedTokenPass& pass : passes_) std::sort(pass.lengths.rbegin(), pass.lengths.rend());
  return absl::OkStatus();
}

absl::Status Tokenizer::ApplyConfig(const nlohmann::json& config) {
  if (std::optional<std::string> bos = ConfigTokenContent(config, "bos_token")) {
    bos_id_ = TokenToId(*bos);
    if (!bos_id_)
      return absl::InvalidArgumentError(absl::StrCat("bos_token ", *bos, " is not a token"));
  }
  if (std::optional<std::string> eos = ConfigTokenContent(config, "eos_token")) {
    eos_id_ = TokenToId(*eos);
    if (!eos_id_)
      return absl::InvalidArgumentError(absl::StrCat("eos_token ", *eos, " is not a token"));
  }
  // transformers' LlamaTokenizerFast (DeepSeek's tokenizer_class) rebuilds the post-processor
  // from these two flags, so they win over tokenizer.json's post_processor when present.
  const auto flag = [&](const char* key) -> std::optional<bool> {
    if (config.is_object() && config.contains(key) && config.at(key).is_boolean()) {
      return config.at(key).get<bool>();
    }
    return std::nullopt;
  };
  const std::optional<bool> add_bos = flag("add_bos_token"), add_eos = flag("add_eos_token");
  if (add_bos || add_eos) {
    prefix_ids_.clear();
    suffix_ids_.clear();
    if (add_bos.value_or(false)) {
      if (!bos_id_)
        return absl::InvalidArgumentError("add_bos_token is true but bos_token is unset");
      prefix_ids_.push_back(*bos_id_);
    }
    if (add_eos.value_or(false)) {
      if (!eos_id_)
        return absl::InvalidArgumentError("add_eos_token is true but eos_token is unset");
      suffix_ids_.push_back(*eos_id_);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromHuggingFaceJson(
    const nlohmann::json& tj, const nlohmann::json& config) {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  try {
    const nlohmann::json& model = tj.at("model");
    if (model.value("type", "") != "BPE") {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: model type \"",
                                                     model.value("type", ""),
                                                     "\" is not supported (expected BPE)"));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
      if (model.contains(key) && !model.at(key).is_null()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.json: BPE option ", key, " is not supported"));
      }
    }
    if (model.value("byte_fallback", false)) {
      return absl::InvalidArgumentError("tokenizer.json: BPE byte_fallback is not supported");
    }
    if (absl::Status s = CheckNormalizerIsIdentity(tj.value("normalizer", nlohmann::json()));
        !s.ok()) {
      return s;
    }
    absl::StatusOr<PreTokenizer> pre =
        PreTokenizer::FromHuggingFaceJson(tj.value("pre_tokenizer", nlohmann::json()));
    if (!pre.ok()) return pre.status();
    if (!pre->byte_level()) {
      return absl::InvalidArgumentError(
          "tokenizer.json: only byte-level BPE (a ByteLevel pre_tokenizer) is supported");
    }
    tok->pre_tokenizer_ = std::move(*pre);
    if (absl::Status s = CheckDecoderIsByteLevel(tj.value("decoder", nlohmann::json())); !s.ok())
      return s;

    std::vector<std::pair<std::string, int32_t>> vocab;
    vocab.reserve(model.at("vocab").size());
    for (const auto& [text, id] : model.at("vocab").items()) {
      std::optional<std::string> bytes = ByteLevelToBytes(text);
      if (!bytes) {
        // E.g. DeepSeek's special tokens, also listed in the vocabulary. BPE never produces
        // them; the ByteLevel decoder passes their UTF-8 through unchanged.
        tok->text_vocab_.emplace(id.get<int32_t>(), text);
        continue;
      }
      vocab.emplace_back(std::move(*bytes), id.get<int32_t>());
    }
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(model.at("merges").size());
    for (const nlohmann::json& merge : model.at("merges")) {
      std::string left, right;
      if (merge.is_string()) {
        const std::string line = merge.get<std::string>();
        const size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("tokenizer.json: bad merge \"", line, "\""));
        }
        left = line.substr(0, space);
        right = line.substr(space + 1);
      } else {
        left = merge.at(0).get<std::string>();
        right = merge.at(1).get<std::string>();
      }
      std::optional<std::string> l = ByteLevelToBytes(left), r = ByteLevelToBytes(right);
      if (!l || !r)
        return absl::InvalidArgumentError("tokenizer.json: merge is not byte-level text");
      merges.emplace_back(std::move(*l), std::move(*r));
    }
    absl::StatusOr<BpeModel> bpe =
        BpeModel::FromMerges(vocab, merges, model.value("ignore_merges", false));
    if (!bpe.ok()) return bpe.status();
    tok->bpe_ = std::move(*bpe);
    tok->vocab_size_ = tok->bpe_->max_id() + 1;
    for (const auto& [id, text] : tok->text_vocab_)
      tok->vocab_size_ = std::max(tok->vocab_size_, id + 1);

    std::vector<AddedToken> added;
    for (const nlohmann::json& a : tj.value("added_tokens", nlohmann::json::array())) {
      for (const char* key : {"lstrip", "rstrip", "single_word"}) {
        if (a.value(key, false)) {
          return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: added token ", a.dump(),
                                                         ": option ", key, " is not supported"));
        }
      }
      added.push_back({a.at("content").get<std::string>(), a.at("id").get<int32_t>(),
                       a.value("special", false), a.value("normalized", false)});
    }
    if (absl::Status s = tok->SetAddedTokens(std::move(added)); !s.ok()) return s;

    // post_processor: ByteLevel only trims offsets; TemplateProcessing adds special tokens.
    std::vector<nlohmann::json> processors;
    const nlohmann::json post = tj.value("post_processor", nlohmann::json());
    if (!post.is_null()) {
      if (post.value("type", "") == "Sequence") {
        for (const nlohmann::json& p : post.at("processors")) processors.push_back(p);
      } else {
        processors.push_back(post);
      }
    }
    for (const nlohmann::json& p : processors) {
      const std::string type = p.value("type", "");
      if (type == "ByteLevel") continue;
      if (type != "TemplateProcessing") {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.json: post_processor type \"", type, "\" is not supported"));
      }
      bool before_sequence = true;
      for (const nlohmann::json& item : p.at("single")) {
        if (item.contains("Sequence")) {
          before_sequence = false;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        for (const nlohmann::json& id : p.at("special_tokens").at(name).at("ids")) {
          (before_sequence ? tok->prefix_ids_ : tok->suffix_ids_).push_back(id.get<int32_t>());
        }
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json: unexpected layout: ", e.what()));
  }
  if (absl::Status s = tok->ApplyConfig(config); !s.ok()) return s;
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTiktoken(std::string_view model_text,
                                                                   std::string_view pat_str,
                                                                   const nlohmann::json& config) {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  std::vector<std::string> ranks;
  size_t line_no = 0;
  for (size_t pos = 0; pos < model_text.size();) {
    size_t end = model_text.find('\n', pos);
    if (end == std::string_view::npos) end = model_text.size();
    std::string_view line = model_text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    std::string bytes;
    int64_t rank = -1;
    if (space == std::string_view::npos ||
        !absl::Base64Unescape(ToAbsl(line.substr(0, space)), &bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiktoken.model line ", line_no, ": expected \"<base64> <rank>\""));
    }
    try {
      rank = std::stoll(std::string(line.substr(space + 1)));
    } catch (...) {
      rank = -1;
    }
    if (rank != static_cast<int64_t>(ranks.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiktoken.model line ", line_no, ": rank ", ToAbsl(line.substr(space + 1)),
                       ", expected ", ranks.size(), " (ranks must be 0, 1, 2, ...)"));
    }
    ranks.push_back(std::move(bytes));
  }
  absl::StatusOr<BpeModel> bpe = BpeModel::FromRanks(ranks);
  if (!bpe.ok()) return bpe.status();
  tok->bpe_ = std::move(*bpe);
  tok->vocab_size_ = tok->bpe_->max_id() + 1;
  absl::StatusOr<PreTokenizer> pre = PreTokenizer::FromTiktokenPattern(pat_str);
  if (!pre.ok()) return pre.status();
  tok->pre_tokenizer_ = std::move(*pre);

  std::vector<AddedToken> specials;
  if (config.is_object() && config.contains("added_tokens_decoder")) {
    for (const auto& [id_text, entry] : config.at("added_tokens_decoder").items()) {
      AddedToken token;
      token.id = std::stoi(id_text);
      token.content = entry.at("content").get<std::string>();
      token.special = entry.value("special", true);
      specials.push_back(std::move(token));
    }
  }
  std::sort(specials.begin(), specials.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  if (absl::Status s = tok->SetAddedTokens(std::move(specials)); !s.ok()) return s;
  if (absl::Status s = tok->ApplyConfig(config); !s.ok()) return s;
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::LoadFromModelDir(const std::string& dir) {
  const std::string config_path = dir + "/tokenizer_config.json";
  nlohmann::json config;
  if (FileExists(config_path)) {
    absl::StatusOr<nlohmann::json> parsed = ReadJsonFile(config_path);
    if (!parsed.ok()) return parsed.status();
    config = std::move(*parsed);
  }
  const std::string json_path = dir + "/tokenizer.json";
  if (FileExists(json_path)) {
    absl::StatusOr<nlohmann::json> tj = ReadJsonFile(json_path);
    if (!tj.ok()) return tj.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromHuggingFaceJson(*tj, config);
    if (!tok.ok())
      return absl::Status(tok.status().code(),
                          absl::StrCat(json_path, ": ", tok.status().message()));
    return tok;
  }
  const std::string tiktoken_path = dir + "/tiktoken.model";
  if (FileExists(tiktoken_path)) {
    absl::StatusOr<std::string> model = ReadFile(tiktoken_path);
    if (!model.ok()) return model.status();
    absl::StatusOr<std::string> pat_str = FindTiktokenPattern(dir, config);
    if (!pat_str.ok()) return pat_str.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromTiktoken(*model, *pat_str, config);
    if (!tok.ok())
      return absl::Status(tok.status().code(),
                          absl::StrCat(tiktoken_path, ": ", tok.status().message()));
    return tok;
  }
  return absl::NotFoundError(absl::StrCat(dir, " has neither tokenizer.json nor tiktoken.model"));
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token_text) const {
  for (const AddedTokenPass& pass : passes_) {
    auto it = pass.by_content.find(ToAbsl(token_text));
    if (it != pass.by_content.end()) return it->second;
  }
  // Vocabulary entries are keyed by raw bytes; tokenizer.json spells them in byte-level text.
  std::string bytes(token_text);
  if (pre_tokenizer_->byte_level()) {
    std::optional<std::string> raw = ByteLevelToBytes(token_text);
    bytes = raw ? std::move(*raw) : std::string();
  }
  auto it = bpe_->bytes_to_id().find(bytes);
  if (it != bpe_->bytes_to_id().end()) return it->second;
  for (const auto& [id, text] : text_vocab_) {
    if (text == token_text) return id;
  }
  return std::nullopt;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = added_by_id_.find(id);
  return it != added_by_id_.end() && added_tokens_[it->second].special;
}

void Tokenizer::SplitAddedTokens(std::string_view text, bool normalized_pass,
                                 std::vector<Segment>* out) const {
  const AddedTokenPass& pass = passes_[normalized_pass ? 1 : 0];
  if (pass.by_content.empty()) {
    out->push_back({text, -1});
    return;
  }
  size_t plain_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    if (!pass.first_byte[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    // Leftmost-longest, as tokenizers' AddedVocabulary (aho-corasick LeftmostLongest).
    int32_t id = -1;
    size_t length = 0;
    for (const size_t len : pass.lengths) {
      if (pos + len > text.size()) continue;
      auto it = pass.by_content.find(ToAbsl(text.substr(pos, len)));
      if (it != pass.by_content.end()) {
        id = it->second;
        length = len;
        break;
      }
    }
    if (id < 0) {
      ++pos;
      continue;
    }
    if (pos > plain_start) out->push_back({text.substr(plain_start, pos - plain_start), -1});
    out->push_back({text.substr(pos, length), id});
    pos += length;
    plain_start = pos;
  }
  if (plain_start < text.size()) out->push_back({text.substr(plain_start), -1});
}

void Tokenizer::EncodePlain(std::string_view text, std::vector<int32_t>* ids) const {
  std::vector<std::string_view> pieces;
  std::deque<std::string> arena;
  pre_tokenizer_->Split(text, &pieces, &arena);
  for (std::string_view piece : pieces) bpe_->EncodePiece(piece, ids);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    repaired = ToValidUtf8(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  std::vector<Segment> raw_segments, segments;
  SplitAddedTokens(text, /*normalized_pass=*/false, &raw_segments);
  for (const Segment& segment : raw_segments) {
    if (segment.added_id >= 0) {
      ids.push_back(segment.added_id);
      continue;
    }
    segments.clear();
    SplitAddedTokens(segment.text, /*normalized_pass=*/true, &segments);
    for (const Segment& inner : segments) {
      if (inner.added_id >= 0) {
        ids.push_back(inner.added_id);
      } else {
        EncodePlain(inner.text, &ids);
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::string Tokenizer::DecodeBytes(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    auto added = added_by_id_.find(id);
    if (added != added_by_id_.end()) {
      if (skip_special_tokens && added_tokens_[added->second].special) continue;
      bytes.append(added_decode_bytes_[added->second]);
    } else if (bpe_->HasToken(id)) {
      bytes.append(bpe_->TokenBytes(id));
    } else if (auto text = text_vocab_.find(id); text != text_vocab_.end()) {
      bytes.append(text->second);
    }
  }
  return bytes;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return ToValidUtf8(DecodeBytes(ids, skip_special_tokens));
}

}  // namespace mlaserve
