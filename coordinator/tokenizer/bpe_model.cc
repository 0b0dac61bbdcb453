#include "coordinator/tokenizer/bpe_model.h"

#include <climits>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/tokenizer/string_view_bridge.h"

namespace mlaserve {
namespace {

// Pieces longer than this are merged with a priority queue (O(n log n)) instead of repeated
// scans (O(n^2)), which matter for long runs of whitespace or repeated characters.
constexpr size_t kShortPieceBytes = 64;

}  // namespace

absl::Status BpeModel::SetVocab(const std::vector<std::pair<std::string, int32_t>>& vocab) {
  int32_t max_id = -1;
  for (const auto& [bytes, id] : vocab) {
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("negative token id ", id));
    max_id = std::max(max_id, id);
  }
  id_to_bytes_.assign(max_id + 1, std::string());
  has_id_.assign(max_id + 1, false);
  bytes_to_id_.reserve(vocab.size());
  for (const auto& [bytes, id] : vocab) {
    id_to_bytes_[id] = bytes;
    has_id_[id] = true;
    bytes_to_id_.emplace(bytes, id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id_.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "vocabulary has no token for byte 0x%02X; only byte-level BPE vocabularies (every byte "
          "a token) are supported",
          b));
    }
    byte_to_id_[b] = it->second;
  }
  return absl::OkStatus();
}

absl::StatusOr<BpeModel> BpeModel::FromMerges(
    const std::vector<std::pair<std::string, int32_t>>& vocab,
    const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges) {
  BpeModel model;
  if (absl::Status status = model.SetVocab(vocab); !status.ok()) return status;
  model.whole_piece_lookup_ = ignore_merges;
  model.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    auto l = model.bytes_to_id_.find(left), r = model.bytes_to_id_.find(right),
         m = model.bytes_to_id_.find(left + right);
    if (l == model.bytes_to_id_.end() || r == model.bytes_to_id_.end() ||
        m == model.bytes_to_id_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("merge #", rank, " refers to a token missing from the vocabulary"));
    }
    // The first occurrence of a pair wins, as in Hugging Face's BPE.
    model.merges_.emplace(PairKey(l->second, r->second),
                          MergeResult{static_cast<int32_t>(rank), m->second});
  }
  return model;
}

absl::StatusOr<BpeModel> BpeModel::FromRanks(const std::vector<std::string>& ranks) {
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) vocab.emplace_back(ranks[i], static_cast<int32_t>(i));
  BpeModel model;
  if (absl::Status status = model.SetVocab(vocab); !status.ok()) return status;
  if (model.bytes_to_id_.size() != ranks.size()) {
    return absl::InvalidArgumentError("tiktoken ranks contain the same bytes twice");
  }
  // tiktoken looks a whole piece up before merging.
  model.whole_piece_lookup_ = true;
  model.merges_.reserve(ranks.size() * 4);
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const std::string_view token = ranks[rank];
    for (size_t split = 1; split < token.size(); ++split) {
      auto l = model.bytes_to_id_.find(ToAbsl(token.substr(0, split)));
      if (l == model.bytes_to_id_.end()) continue;
      auto r = model.bytes_to_id_.find(ToAbsl(token.substr(split)));
      if (r == model.bytes_to_id_.end()) continue;
      model.merges_.emplace(PairKey(l->second, r->second),
                            MergeResult{static_cast<int32_t>(rank), static_cast<int32_t>(rank)});
    }
  }
  return model;
}

void BpeModel::EncodePiece(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    ids->push_back(byte_to_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (whole_piece_lookup_) {
    auto it = bytes_to_id_.find(ToAbsl(piece));
    if (it != bytes_to_id_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  std::vector<int32_t> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i)
    symbols[i] = byte_to_id_[static_cast<uint8_t>(piece[i])];
  if (piece.size() <= kShortPieceBytes) {
    MergeShort(&symbols);
  } else {
    MergeLong(&symbols);
  }
  ids->insert(ids->end(), symbols.begin(), symbols.end());
}

void BpeModel::MergeShort(std::vector<int32_t>* symbols) const {
  std::vector<int32_t>& s = *symbols;
  // ranks[i]: rank of merging s[i] and s[i+1], INT_MAX when not mergeable.
  std::vector<int32_t> ranks(s.size() - 1);
  std::vector<int32_t> merged(s.size() - 1);
  const auto evaluate = [&](size_t i) {
    const MergeResult* m = FindMerge(s[i], s[i + 1]);
    ranks[i] = m ? m->rank : INT_MAX;
    merged[i] = m ? m->id : -1;
  };
  for (size_t i = 0; i + 1 < s.size(); ++i) evaluate(i);
  while (!ranks.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i] < ranks[best]) best = i;
    }
    if (ranks[best] == INT_MAX) break;
    s[best] = merged[best];
    s.erase(s.begin() + best + 1);
    ranks.erase(ranks.begin() + best);
    merged.erase(merged.begin() + best);
    if (best > 0) evaluate(best - 1);
    if (best < ranks.size()) evaluate(best);
  }
}

void BpeModel::MergeLong(std::vector<int32_t>* symbols) const {
  std::vector<int32_t>& s = *symbols;
  const int n = static_cast<int>(s.size());
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    if (const MergeResult* m = FindMerge(s[left], s[next[left]]))
      queue.push({m->rank, left, m->id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (!alive[top.pos] || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    // Stale when either side changed since the candidate was queued.
    const MergeResult* m = FindMerge(s[top.pos], s[right]);
    if (m == nullptr || m->id != top.id || m->rank != top.rank) continue;
    s[top.pos] = top.id;
    alive[right] = false;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    push(prev[top.pos]);
    push(top.pos);
  }
  std::vector<int32_t> out;
  for (int i = 0; i >= 0; i = next[i]) out.push_back(s[i]);
  s = std::move(out);
}

}  // namespace mlaserve
