// The deterministic mode's promise (ModelOptions::deterministic, issue 23), checked on any
// backend: a sequence's logits are the same bits whether its tokens are decoded one per step,
// prefilled at once, prefilled in chunks (a recompute after preemption is such a prefill), or run
// in steps shared with other sequences (decodes of other lengths and prefills). The oracle is the
// same model's own run of the sequence alone, one token per step: nothing here is approximate,
// every comparison is bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/kv_block.h"
#include "gtest/gtest.h"
#include "worker/model/deepseek_v3.h"

namespace mlaserve::determinism {

// One sequence's blocks and length in a step-by-step test.
struct Seq {
  std::vector<int32_t> table;
  int len = 0;
};

// A step feeding toks[i] to seqs[i] (each wants the logits of its last token).
inline StepBatch MakeStep(const std::vector<std::vector<int32_t>>& toks, std::vector<Seq*> seqs,
                          bool all_rows = false) {
  StepBatch b;
  for (size_t i = 0; i < toks.size(); ++i) {
    Seq& s = *seqs[i];
    SequenceSlice sl;
    sl.token_begin = static_cast<int>(b.tokens.size());
    sl.num_tokens = static_cast<int>(toks[i].size());
    sl.context_len = s.len;
    sl.block_table = s.table;
    for (size_t t = 0; t < toks[i].size(); ++t) {
      const int pos = s.len + static_cast<int>(t);
      b.tokens.push_back(toks[i][t]);
      b.positions.push_back(pos);
      b.slots.push_back(int64_t{s.table[pos / kKvBlockTokens]} * kKvBlockTokens +
                        pos % kKvBlockTokens);
      if (all_rows || t + 1 == toks[i].size()) {
        b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
      }
    }
    b.seqs.push_back(std::move(sl));
    s.len += static_cast<int>(toks[i].size());
  }
  return b;
}

inline std::vector<float> Row(const std::vector<float>& logits, int row, int vocab) {
  return std::vector<float>(logits.begin() + static_cast<size_t>(row) * vocab,
                            logits.begin() + static_cast<size_t>(row + 1) * vocab);
}

inline int32_t Argmax(const std::vector<float>& row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

inline size_t Differ(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// What the checks found: how many logits rows differed from the sequence-alone reference in
// each scenario (all zero is the deterministic mode's promise).
struct Report {
  int rows = 0;  // rows compared per scenario
  int prefill_differ = 0, chunked_differ = 0, batched_differ = 0;
  std::string Describe() const {
    return "of " + std::to_string(rows) + " rows: whole-prefill recompute " +
           std::to_string(prefill_differ) + " differ, chunked(7) recompute " +
           std::to_string(chunked_differ) + ", in mixed batches " + std::to_string(batched_differ);
  }
};

// The deterministic mode's promise: no row differed in any scenario.
inline void ExpectNoneDiffer(const Report& r) {
  EXPECT_EQ(r.prefill_differ, 0) << r.Describe();
  EXPECT_EQ(r.chunked_differ, 0) << r.Describe();
  EXPECT_EQ(r.batched_differ, 0) << r.Describe();
}

// `model` needs >= 20 KV blocks; prompt + steps <= 256 tokens, other + steps <= 128. `prompt` (>= 8 tokens) is prefilled, then `steps` greedy tokens
// are decoded alone (the reference); then the same positions are recomputed and run in batches.
inline Report Check(DeepseekV3Model& model, const std::vector<int32_t>& prompt,
                    const std::vector<int32_t>& other, int steps) {
  const int vocab = model.config().vocab_size;
  Report r;
  r.rows = steps;
  // Reference: prompt prefilled, then one token per step; ref[i] = logits after token i of the
  // continuation's inputs (i = 0: the prompt's last token).
  std::vector<std::vector<float>> ref;
  std::vector<int32_t> fed = prompt;  // every input token, prompt then generated
  {
    Seq a{{0, 1, 2, 3}, 0};
    std::vector<float> l;
    EXPECT_TRUE(model.Forward(MakeStep({prompt}, {&a}), &l).ok());
    ref.push_back(l);
    for (int i = 1; i < steps; ++i) {
      const int32_t next = Argmax(ref.back());
      fed.push_back(next);
      EXPECT_TRUE(model.Forward(MakeStep({{next}}, {&a}), &l).ok());
      ref.push_back(l);
    }
  }
  const int n0 = static_cast<int>(prompt.size());
  // Recompute at once (blocks 4..7): rows n0 - 1 .. n0 + steps - 2 of one prefill.
  {
    Seq b{{4, 5, 6, 7}, 0};
    std::vector<float> l;
    EXPECT_TRUE(model.Forward(MakeStep({fed}, {&b}, /*all_rows=*/true), &l).ok());
    for (int i = 0; i < steps; ++i) r.prefill_differ += Differ(Row(l, n0 - 1 + i, vocab), ref[i]) > 0;
  }
  // Recompute in chunks of 7 (blocks 8..11).
  {
    Seq c{{8, 9, 10, 11}, 0};
    std::vector<float> all;
    for (size_t at = 0; at < fed.size(); at += 7) {
      const std::vector<int32_t> chunk(fed.begin() + at, fed.begin() + std::min(fed.size(), at + 7));
      std::vector<float> l;
      EXPECT_TRUE(model.Forward(MakeStep({chunk}, {&c}, /*all_rows=*/true), &l).ok());
      all.insert(all.end(), l.begin(), l.end());
    }
    for (int i = 0; i < steps; ++i) r.chunked_differ += Differ(Row(all, n0 - 1 + i, vocab), ref[i]) > 0;
  }
  // Mixed batches: the sequence again (blocks 12..15) with its prompt prefilled beside another
  // prompt's (O, blocks 16, 17), then decoded beside O's decode (another length), at step 3
  // beside a third sequence's fresh prefill instead (P, blocks 18, 19), at step 5 with all three
  // (P first). The batch, its size and the sequence's row change from step to step.
  {
    Seq a{{12, 13, 14, 15}, 0}, o{{16, 17}, 0}, p{{18, 19}, 0};
    std::vector<float> l;
    EXPECT_TRUE(model.Forward(MakeStep({other, prompt}, {&o, &a}), &l).ok());
    r.batched_differ += Differ(Row(l, 1, vocab), ref[0]) > 0;
    for (int i = 1; i < steps; ++i) {
      const int32_t mine = fed[n0 + i - 1];
      const int32_t theirs = other[i % other.size()];
      int row = 1;
      if (i == 3) {
        const std::vector<int32_t> fresh(other.begin(), other.begin() + 5);
        EXPECT_TRUE(model.Forward(MakeStep({{mine}, fresh}, {&a, &p}), &l).ok());
        row = 0;
      } else if (i == 5) {
        EXPECT_TRUE(model.Forward(MakeStep({{theirs}, {theirs}, {mine}}, {&p, &o, &a}), &l).ok());
        row = 2;
      } else {
        EXPECT_TRUE(model.Forward(MakeStep({{theirs}, {mine}}, {&o, &a}), &l).ok());
      }
      r.batched_differ += Differ(Row(l, row, vocab), ref[i]) > 0;
    }
  }
  return r;
}

}  // namespace mlaserve::determinism
