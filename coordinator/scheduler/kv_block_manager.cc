#include "coordinator/scheduler/kv_block_manager.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace mlaserve {
namespace {

// 64x64 -> 128-bit multiply folded to 64 bits (the wyhash mixing step): every input bit reaches
// every output bit, so chained keys of different prefixes collide with probability ~2^-64.
inline uint64_t Mix(uint64_t a, uint64_t b) {
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
}

constexpr uint64_t kSecret0 = 0xa0761d6478bd642fULL;
constexpr uint64_t kSecret1 = 0xe7037ed1a0b428dbULL;
constexpr uint64_t kSecret2 = 0x8ebc6af09c88c6e3ULL;

}  // namespace

KvBlockManager::KvBlockManager(int32_t num_blocks, int32_t block_size, KvBlockHasher hasher)
    : block_size_(block_size),
      hasher_(hasher != nullptr ? hasher : &KvBlockManager::BlockHash),
      blocks_(num_blocks),
      block_tokens_(static_cast<size_t>(num_blocks) * block_size) {
  // Popped from the back, so fresh allocations hand out 0, 1, 2, ... (readable plans in tests).
  free_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  index_.reserve(num_blocks);
}

uint64_t KvBlockManager::BlockHash(uint64_t parent_hash, std::span<const int32_t> tokens) {
  uint64_t h = Mix(parent_hash ^ kSecret0, kSecret1 ^ tokens.size());
  size_t i = 0;
  for (; i + 1 < tokens.size(); i += 2) {
    const uint64_t word = (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) << 32) |
                          static_cast<uint32_t>(tokens[i + 1]);
    h = Mix(h ^ word ^ kSecret2, kSecret1);
  }
  if (i < tokens.size()) h = Mix(h ^ static_cast<uint32_t>(tokens[i]) ^ kSecret2, kSecret1);
  return Mix(h ^ kSecret0, kSecret2);
}

bool KvBlockManager::Matches(int32_t block, const PrefixChainTip& parent,
                             std::span<const int32_t> tokens) const {
  const Block& b = blocks_[block];
  if (!b.cached || b.parent_content_id != parent.content_id) return false;
  const std::span<const int32_t> stored = StoredTokens(block);
  return std::equal(stored.begin(), stored.end(), tokens.begin(), tokens.end());
}

PrefixMatch KvBlockManager::FindPrefix(std::span<const int32_t> tokens) const {
  PrefixMatch match;
  if (tokens.empty()) return match;
  const size_t max_blocks = (tokens.size() - 1) / block_size_;
  for (size_t i = 0; i < max_blocks; ++i) {
    const std::span<const int32_t> chunk = tokens.subspan(i * block_size_, block_size_);
    const auto it = index_.find(hasher_(match.tip.hash, chunk));
    if (it == index_.end() || !Matches(it->second, match.tip, chunk)) break;
    const Block& b = blocks_[it->second];
    match.blocks.push_back(it->second);
    match.tip = PrefixChainTip{b.hash, b.content_id, true};
    if (b.ref_count == 0) ++match.num_unreferenced;
  }
  return match;
}

void KvBlockManager::Acquire(int32_t block) {
  Block& b = blocks_[block];
  assert(b.cached && "only cached blocks are shared");
  if (b.ref_count == 0) {
    LruRemove(block);
    ++num_used_;
  }
  ++b.ref_count;
}

int32_t KvBlockManager::Allocate() {
  int32_t block = -1;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else if (lru_head_ >= 0) {
    block = lru_head_;
    LruRemove(block);
    Uncache(block);
    ++num_evictions_;
  } else {
    return -1;
  }
  blocks_[block].ref_count = 1;
  ++num_used_;
  return block;
}

void KvBlockManager::Release(int32_t block) {
  Block& b = blocks_[block];
  assert(b.ref_count > 0 && "double free of a KV block");
  if (--b.ref_count > 0) return;
  --num_used_;
  if (b.cached) {
    LruAppend(block);
  } else {
    free_.push_back(block);
  }
}

PrefixChainTip KvBlockManager::Register(int32_t block, const PrefixChainTip& parent,
                                        std::span<const int32_t> tokens) {
  assert(blocks_[block].ref_count > 0 && !blocks_[block].cached);
  assert(static_cast<int32_t>(tokens.size()) == block_size_);
  if (!parent.valid) return parent;
  const uint64_t hash = hasher_(parent.hash, tokens);
  const auto it = index_.find(hash);
  if (it != index_.end()) {
    const int32_t existing = it->second;
    if (Matches(existing, parent, tokens)) {
      // Same content computed twice (two requests prefilled the same prefix concurrently): keep
      // the cached copy canonical; this block is freed normally when its sequence ends.
      return PrefixChainTip{hash, blocks_[existing].content_id, true};
    }
    if (blocks_[existing].ref_count > 0) return PrefixChainTip{0, 0, false};
    // A free block under the same key with other content: a collision, or a child of a parent
    // that was evicted and recomputed (it can no longer be reached). Replace it.
    LruRemove(existing);
    Uncache(existing);
    free_.push_back(existing);
  }
  Block& b = blocks_[block];
  b.cached = true;
  b.hash = hash;
  b.content_id = next_content_id_++;
  b.parent_content_id = parent.content_id;
  std::copy(tokens.begin(), tokens.end(),
            block_tokens_.begin() + static_cast<size_t>(block) * block_size_);
  index_.emplace(hash, block);
  return PrefixChainTip{hash, b.content_id, true};
}

void KvBlockManager::Uncache(int32_t block) {
  Block& b = blocks_[block];
  index_.erase(b.hash);
  b.cached = false;
  b.hash = 0;
  b.content_id = 0;
  b.parent_content_id = 0;
}

void KvBlockManager::LruAppend(int32_t block) {
  Block& b = blocks_[block];
  b.lru_prev = lru_tail_;
  b.lru_next = -1;
  if (lru_tail_ >= 0) {
    blocks_[lru_tail_].lru_next = block;
  } else {
    lru_head_ = block;
  }
  lru_tail_ = block;
  ++lru_size_;
}

void KvBlockManager::LruRemove(int32_t block) {
  Block& b = blocks_[block];
  if (b.lru_prev >= 0) {
    blocks_[b.lru_prev].lru_next = b.lru_next;
  } else {
    lru_head_ = b.lru_next;
  }
  if (b.lru_next >= 0) {
    blocks_[b.lru_next].lru_prev = b.lru_prev;
  } else {
    lru_tail_ = b.lru_prev;
  }
  b.lru_prev = b.lru_next = -1;
  --lru_size_;
}

}  // namespace mlaserve
