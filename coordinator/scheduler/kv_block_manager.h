// Paged KV cache bookkeeping: a pool of fixed-size token blocks with reference counts and prefix
// reuse across requests.
//
// Block ids 0..num_blocks-1 index the workers' per-layer cache pools; every rank and layer uses
// the same table, so one manager in the coordinator describes the whole cache. A block is either
//   - in use (reference count > 0), held by one or more sequences;
//   - free and uncached (count 0, contents meaningless);
//   - free and cached (count 0, holding a full block of known tokens that a later request with the
//     same prefix may reuse); these are evicted least recently freed first, and only when a fresh
//     block is needed and no uncached free block is left.
//
// Prefix identity: a full block is keyed by a 64-bit hash chained over (parent block's hash, its
// block_size token ids). A hit is accepted only after comparing the stored token ids and the
// parent's content id (a number never reused within the process), so neither a hash collision
// nor a parent that was evicted and recomputed can alias a block to a different prefix.
#pragma once

#include "common/kv_block.h"
#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace mlaserve {

// Where a sequence's chain of registered full blocks ends; the parent of its next full block.
struct PrefixChainTip {
  uint64_t hash = 0;        // hash of the last registered block (0 for the empty prefix)
  uint64_t content_id = 0;  // content id of that block (0 for the empty prefix)
  bool valid = true;        // false once a block could not be cached: later blocks are not either
};

// Result of a prefix lookup; nothing is acquired until Acquire() is called for each block.
struct PrefixMatch {
  std::vector<int32_t> blocks;   // cached blocks covering tokens [0, blocks.size() * block_size)
  PrefixChainTip tip;            // chain tip after the last matched block
  int32_t num_unreferenced = 0;  // matched blocks now free (acquiring them shrinks the free pool)
};

// Hash of a full block given its parent's hash and its token ids.
using KvBlockHasher = uint64_t (*)(uint64_t parent_hash, std::span<const int32_t> tokens);

class KvBlockManager {
 public:
  // `num_blocks` > 0 and `block_size` > 0 (checked by the scheduler's config validation).
  // `hasher` null means BlockHash; tests pass a deliberately weak one to show that colliding
  // keys never alias different prefixes.
  explicit KvBlockManager(int32_t num_blocks, int32_t block_size = kKvBlockTokens,
                          KvBlockHasher hasher = nullptr);

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t block_size() const { return block_size_; }

  // Blocks a fresh allocation can obtain: uncached free blocks plus evictable cached ones.
  int32_t num_allocatable() const { return static_cast<int32_t>(free_.size()) + lru_size_; }
  int32_t num_used() const { return num_used_; }                              // count > 0
  int32_t num_free() const { return num_blocks() - num_used_; }               // count == 0
  int32_t num_cached() const { return static_cast<int32_t>(index_.size()); }  // used or free
  int32_t num_cached_free() const { return lru_size_; }                       // evictable
  int32_t ref_count(int32_t block) const { return blocks_[block].ref_count; }
  bool is_cached(int32_t block) const { return blocks_[block].cached; }

  // Prefix-reuse counters for metrics: tokens looked up and tokens served from the cache.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  int64_t num_evictions() const { return num_evictions_; }

  // Longest chain of cached full blocks that prefixes `tokens`, capped at
  // floor((tokens.size() - 1) / block_size) blocks: the position of the last known token is always
  // recomputed, because the step that computes it produces the logits to sample from. No side
  // effects.
  PrefixMatch FindPrefix(std::span<const int32_t> tokens) const;

  // Adds one to the counters above (called once per admitted sequence).
  void RecordPrefixQuery(int64_t query_tokens, int64_t hit_tokens) {
    prefix_query_tokens_ += query_tokens;
    prefix_hit_tokens_ += hit_tokens;
  }

  // Takes a reference on a block found by FindPrefix (removing it from the eviction order if it
  // was free).
  void Acquire(int32_t block);

  // A fresh block with reference count 1: an uncached free block if any, else the least recently
  // freed cached block (evicted from the prefix cache). -1 when every block is in use.
  int32_t Allocate();

  // Drops one reference. At zero a cached block becomes the most recently freed evictable block;
  // an uncached one returns to the free pool.
  void Release(int32_t block);

  // Records that `block` (held, fully written) holds `tokens` (block_size ids) after the prefix
  // ending at `parent`. Returns the tip to chain the next block to. If an identical block is
  // already cached, that one stays canonical and its tip is returned (so the chain continues);
  // if the key is taken by different content in use, the chain stops (tip.valid = false).
  PrefixChainTip Register(int32_t block, const PrefixChainTip& parent,
                          std::span<const int32_t> tokens);

  // Chained 64-bit block hash (exposed for tests).
  static uint64_t BlockHash(uint64_t parent_hash, std::span<const int32_t> tokens);

 private:
  struct Block {
    int32_t ref_count = 0;
    bool cached = false;
    uint64_t hash = 0;
    uint64_t content_id = 0;
    uint64_t parent_content_id = 0;
    // Links of the eviction list (free cached blocks, least recently freed first).
    int32_t lru_prev = -1;
    int32_t lru_next = -1;
  };

  std::span<const int32_t> StoredTokens(int32_t block) const {
    return {block_tokens_.data() + static_cast<size_t>(block) * block_size_,
            static_cast<size_t>(block_size_)};
  }
  bool Matches(int32_t block, const PrefixChainTip& parent, std::span<const int32_t> tokens) const;
  void LruAppend(int32_t block);
  void LruRemove(int32_t block);
  void Uncache(int32_t block);

  int32_t block_size_;
  KvBlockHasher hasher_;
  std::vector<Block> blocks_;
  std::vector<int32_t> block_tokens_;  // [num_blocks, block_size] token ids of cached blocks
  std::vector<int32_t> free_;          // uncached free blocks; popped from the back
  absl::flat_hash_map<uint64_t, int32_t> index_;  // block hash -> cached block
  int32_t lru_head_ = -1;
  int32_t lru_tail_ = -1;
  int32_t lru_size_ = 0;
  int32_t num_used_ = 0;
  uint64_t next_content_id_ = 1;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  int64_t num_evictions_ = 0;
};

}  // namespace mlaserve
