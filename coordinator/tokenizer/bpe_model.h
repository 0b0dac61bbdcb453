// Byte-pair encoding over raw bytes, shared by Hugging Face BPE (merges list) and tiktoken
// (mergeable ranks) vocabularies.
//
// Both algorithms repeatedly merge the adjacent pair with the lowest rank, leftmost first, until
// no pair is mergeable. HF ranks a pair by its position in `merges`; tiktoken by the rank of the
// concatenated bytes. A tiktoken vocabulary is turned into a pair table holding, for each token,
// every split into two tokens, which reproduces its merge order exactly.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace mlaserve {

class BpeModel {
 public:
  // Hugging Face BPE. `vocab`: token bytes (already mapped back from byte-level text) and id;
  // `merges`: pairs of token bytes in priority order. `ignore_merges`: look a whole piece up in
  // the vocabulary before merging (tokenizer.json "ignore_merges").
  static absl::StatusOr<BpeModel> FromMerges(
      const std::vector<std::pair<std::string, int32_t>>& vocab,
      const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges);

  // tiktoken. `ranks[i]`: bytes of the token with rank (= id) i.
  static absl::StatusOr<BpeModel> FromRanks(const std::vector<std::string>& ranks);

  // Appends the ids of one pre-tokenized piece (raw bytes) to `ids`.
  void EncodePiece(std::string_view piece, std::vector<int32_t>* ids) const;

  // Bytes of token `id`; empty when `id` is not in the vocabulary.
  std::string_view TokenBytes(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_to_bytes_.size()
               ? std::string_view(id_to_bytes_[id])
               : std::string_view();
  }
  bool HasToken(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < has_id_.size() && has_id_[id];
  }
  int32_t max_id() const { return static_cast<int32_t>(id_to_bytes_.size()) - 1; }
  const absl::flat_hash_map<std::string, int32_t>& bytes_to_id() const { return bytes_to_id_; }

 private:
  struct MergeResult {
    int32_t rank;
    int32_t id;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  const MergeResult* FindMerge(int32_t left, int32_t right) const {
    auto it = merges_.find(PairKey(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }
  absl::Status SetVocab(const std::vector<std::pair<std::string, int32_t>>& vocab);
  void MergeShort(std::vector<int32_t>* symbols) const;
  void MergeLong(std::vector<int32_t>* symbols) const;

  std::vector<std::string> id_to_bytes_;
  std::vector<bool> has_id_;
  absl::flat_hash_map<std::string, int32_t> bytes_to_id_;
  int32_t byte_to_id_[256];
  absl::flat_hash_map<uint64_t, MergeResult> merges_;
  bool whole_piece_lookup_ = false;
};

}  // namespace mlaserve
