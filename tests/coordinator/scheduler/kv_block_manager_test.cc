#include "coordinator/scheduler/kv_block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace mlaserve {
namespace {

constexpr int32_t kBs = 4;  // small blocks keep the token lists readable

std::vector<int32_t> Iota(int32_t n, int32_t first) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Allocates and registers blocks for every full block of `tokens`, as the scheduler does after
// computing them. Returns the block table (reference count 1 each).
std::vector<int32_t> Prefill(KvBlockManager& m, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> table;
  PrefixChainTip tip;
  for (size_t i = 0; i + kBs <= tokens.size(); i += kBs) {
    const int32_t b = m.Allocate();
    EXPECT_GE(b, 0);
    tip = m.Register(b, tip, std::span<const int32_t>(tokens).subspan(i, kBs));
    table.push_back(b);
  }
  return table;
}

TEST(KvBlockManagerTest, AllocatesEveryBlockOnceAndCountsReferences) {
  KvBlockManager m(5, kBs);
  std::vector<int32_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(m.Allocate());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(m.Allocate(), -1);
  EXPECT_EQ(m.num_used(), 5);
  EXPECT_EQ(m.num_free(), 0);
  m.Release(3);
  EXPECT_EQ(m.num_used(), 4);
  EXPECT_EQ(m.num_allocatable(), 1);
  EXPECT_EQ(m.Allocate(), 3);
  EXPECT_EQ(m.ref_count(3), 1);
}

TEST(KvBlockManagerTest, ReusesAtMostTheBlocksBeforeTheLastToken) {
  KvBlockManager m(8, kBs);
  const std::vector<int32_t> tokens = Iota(12, 100);  // 3 full blocks
  const std::vector<int32_t> table = Prefill(m, tokens);
  ASSERT_EQ(table.size(), 3u);
  EXPECT_EQ(m.num_cached(), 3);

  // 12 tokens: the block holding token 11 must be recomputed -> floor(11 / 4) = 2 blocks.
  PrefixMatch match = m.FindPrefix(tokens);
  EXPECT_EQ(match.blocks, (std::vector<int32_t>{table[0], table[1]}));
  EXPECT_EQ(match.num_unreferenced, 0);  // still held by the first sequence
  // 13 tokens with the same start: all 3 blocks.
  std::vector<int32_t> longer = tokens;
  longer.push_back(7);
  EXPECT_EQ(m.FindPrefix(longer).blocks, table);
  // Diverging in the second block: only the first.
  std::vector<int32_t> diverging = longer;
  diverging[5] = 9999;
  EXPECT_EQ(m.FindPrefix(diverging).blocks, (std::vector<int32_t>{table[0]}));
  // Same second block after a different first block: no reuse (chained hash).
  std::vector<int32_t> other_head = longer;
  other_head[0] = 9999;
  EXPECT_TRUE(m.FindPrefix(other_head).blocks.empty());
  EXPECT_TRUE(m.FindPrefix(Iota(4, 100)).blocks.empty());  // 4 tokens: floor(3 / 4) = 0
}

TEST(KvBlockManagerTest, FreedCachedBlocksAreReusedThenEvictedLeastRecentlyFreedFirst) {
  KvBlockManager m(4, kBs);
  const std::vector<int32_t> a = Iota(9, 0), b = Iota(9, 50);
  const std::vector<int32_t> ta = Prefill(m, a), tb = Prefill(m, b);  // blocks 0,1 and 2,3
  // Freed in this order: 1, 0, 3, 2 (a sequence frees its tail first).
  m.Release(ta[1]);
  m.Release(ta[0]);
  m.Release(tb[1]);
  m.Release(tb[0]);
  EXPECT_EQ(m.num_used(), 0);
  EXPECT_EQ(m.num_cached_free(), 4);
  EXPECT_EQ(m.num_allocatable(), 4);

  // A hit takes the blocks out of the eviction order.
  PrefixMatch hit = m.FindPrefix(b);
  ASSERT_EQ(hit.blocks, tb);
  EXPECT_EQ(hit.num_unreferenced, 2);
  for (int32_t blk : hit.blocks) m.Acquire(blk);
  EXPECT_EQ(m.ref_count(tb[0]), 1);
  EXPECT_EQ(m.num_allocatable(), 2);

  // Fresh allocations evict a's blocks, least recently freed first: 1 then 0.
  EXPECT_EQ(m.Allocate(), ta[1]);
  EXPECT_FALSE(m.is_cached(ta[1]));
  EXPECT_TRUE(m.is_cached(ta[0]));
  EXPECT_EQ(m.num_evictions(), 1);
  // a's head is still cached and found (a's second block is gone).
  EXPECT_EQ(m.FindPrefix(a).blocks, (std::vector<int32_t>{ta[0]}));
  EXPECT_EQ(m.Allocate(), ta[0]);
  EXPECT_EQ(m.Allocate(), -1);
  EXPECT_TRUE(m.FindPrefix(a).blocks.empty());
  EXPECT_EQ(m.num_cached(), 2);
}

TEST(KvBlockManagerTest, DuplicateContentKeepsOneCanonicalBlockAndTheChainContinues) {
  KvBlockManager m(8, kBs);
  const std::vector<int32_t> t = Iota(13, 0);
  const std::vector<int32_t> first = Prefill(m, t);
  const std::vector<int32_t> second = Prefill(m, t);  // computed concurrently, same content
  EXPECT_EQ(m.num_cached(), 3);
  for (int32_t blk : second) EXPECT_FALSE(m.is_cached(blk));
  EXPECT_EQ(m.FindPrefix(t).blocks, first);
  for (int32_t blk : second) m.Release(blk);
  EXPECT_EQ(m.num_cached_free(), 0);  // uncached duplicates go straight back to the free pool
}

// Every key collides: only the stored tokens and the parent's content id tell blocks apart.
uint64_t ConstantHash(uint64_t, std::span<const int32_t>) { return 42; }

TEST(KvBlockManagerTest, HashCollisionsNeverAlias) {
  KvBlockManager m(8, kBs, &ConstantHash);
  const std::vector<int32_t> a = Iota(9, 0), b = Iota(9, 500);
  const std::vector<int32_t> ta = Prefill(m, a);
  // Only a's first block got the key; its second block collided with it (in use) -> not cached.
  EXPECT_EQ(m.num_cached(), 1);
  EXPECT_TRUE(m.is_cached(ta[0]));
  EXPECT_EQ(m.FindPrefix(a).blocks, (std::vector<int32_t>{ta[0]}));
  // b collides with a's block on every key and must find nothing.
  EXPECT_TRUE(m.FindPrefix(b).blocks.empty());
  const std::vector<int32_t> tb = Prefill(m, b);  // key held by a block in use: b not cached
  EXPECT_FALSE(m.is_cached(tb[0]));
  for (int32_t blk : ta) m.Release(blk);
  // Now a's block is free: b's next registration replaces it rather than alias.
  const std::vector<int32_t> tb2 = Prefill(m, b);
  EXPECT_TRUE(m.is_cached(tb2[0]));
  EXPECT_FALSE(m.is_cached(ta[0]));
  EXPECT_TRUE(m.FindPrefix(a).blocks.empty());
  EXPECT_EQ(m.FindPrefix(b).blocks, (std::vector<int32_t>{tb2[0]}));
}

TEST(KvBlockManagerTest, ChildOfAnEvictedParentIsNeverReachedThroughARecomputedParent) {
  KvBlockManager m(3, kBs);
  const std::vector<int32_t> t = Iota(9, 0);
  const std::vector<int32_t> table = Prefill(m, t);  // blocks 0 (head), 1 (child)
  m.Release(table[0]);                               // head freed first -> evicted first
  m.Release(table[1]);
  EXPECT_EQ(m.Allocate(), 2);         // the uncached block goes first
  EXPECT_EQ(m.Allocate(), table[0]);  // evicts the head; the child stays cached but unreachable
  EXPECT_TRUE(m.is_cached(table[1]));
  EXPECT_TRUE(m.FindPrefix(t).blocks.empty());
  m.Release(2);
  m.Release(table[0]);
  // Recompute the prefix: the new head has a new content id; the stale child (same key) is
  // replaced by the recomputed one instead of being matched.
  const std::vector<int32_t> again = Prefill(m, t);
  EXPECT_EQ(again, (std::vector<int32_t>{table[0], 2}));
  EXPECT_EQ(m.FindPrefix(t).blocks, again);
  EXPECT_FALSE(m.is_cached(table[1]));
  EXPECT_EQ(m.num_cached(), 2);
  EXPECT_EQ(m.num_allocatable(), 1);
}

TEST(KvBlockManagerTest, HashDependsOnParentAndEveryToken) {
  const std::vector<int32_t> t = Iota(64, 3);
  const uint64_t h = KvBlockManager::BlockHash(0, t);
  EXPECT_NE(h, KvBlockManager::BlockHash(1, t));
  for (size_t i = 0; i < t.size(); ++i) {
    std::vector<int32_t> u = t;
    u[i] ^= 1;
    EXPECT_NE(h, KvBlockManager::BlockHash(0, u)) << i;
  }
}

}  // namespace
}  // namespace mlaserve
