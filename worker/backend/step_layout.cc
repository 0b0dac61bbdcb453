#include "worker/backend/step_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/kv_block.h"

namespace mlaserve {

absl::StatusOr<StepLayout> BuildStepLayout(const StepBatch& batch, const StepLayoutOptions& o) {
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  if (batch.positions.size() != batch.tokens.size() || batch.slots.size() != batch.tokens.size()) {
    return absl::InvalidArgumentError("step batch: tokens, positions and slots differ in length");
  }
  for (int32_t id : batch.tokens) {
    if (id < 0 || id >= o.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary of ", o.vocab_size));
    }
  }
  for (int64_t s : batch.slots) {
    if (s < 0 || s >= o.num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("cache slot ", s, " is outside the pool"));
    }
  }
  // Every row belongs to exactly one sequence; tables cover the sequence; blocks in the pool.
  std::vector<int> owner(T, -1);
  int max_blocks = 1;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SequenceSlice& s = batch.seqs[i];
    if (s.num_tokens <= 0 || s.token_begin < 0 ||
        static_cast<int64_t>(s.token_begin) + s.num_tokens > T ||
        s.context_len < 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": rows ", s.token_begin, "+",
                                                     s.num_tokens, " outside the step of ", T));
    }
    const int64_t len = static_cast<int64_t>(s.context_len) + s.num_tokens;
    if (len > static_cast<int64_t>(s.block_table.size()) * kKvBlockTokens) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": block table of ",
                                                     s.block_table.size(), " blocks cannot hold ",
                                                     len, " tokens"));
    }
    for (int32_t b : s.block_table) {
      if (b < 0 || b >= o.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", i, ": block ", b, " outside the pool of ", o.num_blocks));
      }
    }
    for (int r = s.token_begin; r < s.token_begin + s.num_tokens; ++r) {
      if (owner[r] != -1) {
        return absl::InvalidArgumentError(absl::StrCat("step row ", r, " is in two sequences"));
      }
      owner[r] = static_cast<int>(i);
      if (batch.positions[r] != s.context_len + (r - s.token_begin)) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", i, ": row ", r, " has position ", batch.positions[r],
                         ", expected ", s.context_len + (r - s.token_begin)));
      }
    }
    max_blocks = std::max(max_blocks, static_cast<int>(s.block_table.size()));
  }
  for (int64_t r = 0; r < T; ++r) {
    if (owner[r] == -1) {
      return absl::InvalidArgumentError(absl::StrCat("step row ", r, " belongs to no sequence"));
    }
  }
  for (int32_t row : batch.logits_rows) {
    if (row < 0 || row >= T) return absl::InvalidArgumentError("logits row outside the step");
  }
  if (o.per_token_attention || o.dcp_size > 1) {
    // Built directly (the batch is validated above): one one-token sequence per row, in row
    // order, all in one decode group, its table the blocks up to the token's position (so the
    // table width, and a graph's bucket, follow the longest context as in a decode step). Under
    // DCP only this rank's blocks and keys; without it (N = 1) every block is the rank's own.
    const int N = std::max(o.dcp_size, 1);
    if (o.dcp_rank < 0 || o.dcp_rank >= N) {
      return absl::InvalidArgumentError(
          absl::StrCat("DCP rank ", o.dcp_rank, " outside 0..", N - 1));
    }
    StepLayout L;
    L.num_tokens = static_cast<int>(T);
    L.num_seqs = static_cast<int>(T);
    L.tokens = batch.tokens;
    L.positions = batch.positions;
    L.logits_rows = batch.logits_rows;
    L.slots.resize(batch.slots.size());
    for (size_t r = 0; r < batch.slots.size(); ++r) {
      const int64_t g = batch.slots[r] / kKvBlockTokens, off = batch.slots[r] % kKvBlockTokens;
      L.slots[r] = g % N == o.dcp_rank ? (g / N) * kKvBlockTokens + off : -1;
    }
    int width = 1;
    for (int64_t r = 0; r < T; ++r) {
      const SequenceSlice& s = batch.seqs[owner[r]];
      const int p = batch.positions[r], pb = p / kKvBlockTokens;
      SequenceSlice one;
      one.token_begin = static_cast<int>(r);
      one.num_tokens = 1;
      int keys = 0;
      for (int j = 0; j <= pb; ++j) {
        const int32_t g = s.block_table[j];
        if (g % N != o.dcp_rank) continue;
        one.block_table.push_back(g / N);
        keys += j < pb ? kKvBlockTokens : p % kKvBlockTokens + 1;
      }
      if (one.block_table.empty()) one.block_table.push_back(0);  // never read: no keys
      one.context_len = std::max(keys - 1, 0);  // the local view's own length (table-consistent)
      width = std::max(width, static_cast<int>(one.block_table.size()));
      if (N > 1) L.attend_lens.push_back(keys);
      L.seq_lens.push_back(one.context_len + 1);
      L.context_lens.push_back(one.context_len);
      L.seqs.push_back(std::move(one));
    }
    L.max_blocks = width;
    L.block_tables.assign(static_cast<size_t>(T) * width, 0);
    for (int64_t c = 0; c < T; ++c) {
      std::copy(L.seqs[c].block_table.begin(), L.seqs[c].block_table.end(),
                L.block_tables.begin() + c * width);
    }
    if (T > 0) L.decode.push_back({1, 0, static_cast<int>(T), 0});
    return L;
  }
  // Canonical order: decode groups by s_q ascending, then prefills; stable within a group.
  auto decode_sq = [&](const SequenceSlice& s) {
    if (o.force_absorbed) return s.num_tokens;
    return s.context_len > 0 && s.num_tokens <= kMaxDecodeTokens ? s.num_tokens : 0;
  };
  std::vector<int> order(batch.seqs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const int qa = decode_sq(batch.seqs[a]), qb = decode_sq(batch.seqs[b]);
    // 0 (prefill) sorts last.
    const int ka = qa == 0 ? 1 << 30 : qa, kb = qb == 0 ? 1 << 30 : qb;
    return ka < kb;
  });

  StepLayout L;
  L.num_tokens = static_cast<int>(T);
  L.num_seqs = static_cast<int>(batch.seqs.size());
  L.max_blocks = max_blocks;
  L.block_tables.assign(static_cast<size_t>(L.num_seqs) * max_blocks, 0);
  std::vector<int32_t> new_row(T, -1);
  int row = 0;
  for (int c = 0; c < L.num_seqs; ++c) {
    const SequenceSlice& s = batch.seqs[order[c]];
    SequenceSlice cs = s;
    cs.token_begin = row;
    for (int i = 0; i < s.num_tokens; ++i) {
      const int src = s.token_begin + i;
      new_row[src] = row;
      L.tokens.push_back(batch.tokens[src]);
      L.positions.push_back(batch.positions[src]);
      L.slots.push_back(batch.slots[src]);
      ++row;
    }
    std::copy(s.block_table.begin(), s.block_table.end(),
              L.block_tables.begin() + static_cast<size_t>(c) * max_blocks);
    L.seq_lens.push_back(s.context_len + s.num_tokens);
    L.context_lens.push_back(s.context_len);
    const int q = decode_sq(s);
    if (q > 0) {
      if (L.decode.empty() || L.decode.back().s_q != q) {
        L.decode.push_back({q, c, 0, cs.token_begin});
      }
      ++L.decode.back().num_seqs;
    } else {
      StepLayout::PrefillGroup& p = L.prefill;
      if (p.num_seqs == 0) {
        p.seq_begin = c;
        p.row_begin = cs.token_begin;
        p.q_begin.push_back(0);
        p.kv_begin.push_back(0);
      }
      ++p.num_seqs;
      p.num_rows += s.num_tokens;
      p.total_kv += s.context_len + s.num_tokens;
      p.max_q_len = std::max(p.max_q_len, s.num_tokens);
      p.q_begin.push_back(p.num_rows);
      p.kv_begin.push_back(p.total_kv);
    }
    L.seqs.push_back(std::move(cs));
  }
  for (int32_t r : batch.logits_rows) L.logits_rows.push_back(new_row[r]);
  return L;
}

bool IsSingleTokenDecode(const StepLayout& L) {
  return L.num_seqs > 0 && L.prefill.num_seqs == 0 && L.decode.size() == 1 && L.decode[0].s_q == 1;
}

void PadDecodeLayout(StepLayout* L, int batch, int width) {
  const int S = L->num_seqs;
  std::vector<int32_t> tables(static_cast<size_t>(batch) * width, 0);
  for (int s = 0; s < S; ++s) {
    std::copy(L->block_tables.begin() + static_cast<size_t>(s) * L->max_blocks,
              L->block_tables.begin() + static_cast<size_t>(s + 1) * L->max_blocks,
              tables.begin() + static_cast<size_t>(s) * width);
  }
  L->block_tables = std::move(tables);
  L->max_blocks = width;
  for (int s = S; s < batch; ++s) {
    SequenceSlice pad;
    pad.token_begin = L->num_tokens;
    pad.num_tokens = 1;
    pad.context_len = 0;
    pad.block_table = {0};
    L->seqs.push_back(std::move(pad));
    L->tokens.push_back(0);
    L->positions.push_back(0);
    L->slots.push_back(-1);
    L->seq_lens.push_back(1);
    L->context_lens.push_back(0);
    ++L->num_tokens;
  }
  L->num_seqs = batch;
  L->decode[0].num_seqs = batch;
  while (static_cast<int>(L->logits_rows.size()) < batch) L->logits_rows.push_back(0);
}

}  // namespace mlaserve
