#include "worker/model/local_session.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace mlaserve {

absl::StatusOr<std::vector<float>> LocalSession::Feed(const std::vector<int32_t>& tokens,
                                                      bool all_logits, int chunk) {
  const int vocab = model_.config().vocab_size;
  const int capacity = model_.options().num_kv_blocks * kKvBlockTokens;
  if (length_ + static_cast<int>(tokens.size()) > capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence of ", length_ + tokens.size(),
                                                     " tokens exceeds the cache of ", capacity));
  }
  // Blocks in a scattered order (the reverse), so that the paged indexing is exercised.
  const int num_blocks = model_.options().num_kv_blocks;
  std::vector<int32_t> table(num_blocks);
  for (int b = 0; b < num_blocks; ++b) table[b] = num_blocks - 1 - b;
  std::vector<float> out;
  const int n = static_cast<int>(tokens.size());
  const int step = chunk > 0 ? chunk : std::max(n, 1);
  for (int begin = 0; begin < n; begin += step) {
    const int count = std::min(step, n - begin);
    StepBatch batch;
    SequenceSlice seq;
    seq.token_begin = 0;
    seq.num_tokens = count;
    seq.context_len = length_;
    seq.block_table = table;
    for (int i = 0; i < count; ++i) {
      const int pos = length_ + i;
      batch.tokens.push_back(tokens[begin + i]);
      batch.positions.push_back(pos);
      batch.slots.push_back(static_cast<int64_t>(table[pos / kKvBlockTokens]) * kKvBlockTokens +
                            pos % kKvBlockTokens);
      if (all_logits || begin + i == n - 1) batch.logits_rows.push_back(i);
    }
    batch.seqs.push_back(std::move(seq));
    std::vector<float> logits;
    if (auto s = model_.Forward(batch, &logits); !s.ok()) return s;
    out.insert(out.end(), logits.begin(), logits.end());
    length_ += count;
  }
  (void)vocab;
  return out;
}

absl::StatusOr<std::vector<int32_t>> LocalSession::Generate(const std::vector<int32_t>& prompt,
                                                            int max_tokens,
                                                            const SamplingRefParams& sampling,
                                                            bool ignore_eos) {
  Reset();
  const int vocab = model_.config().vocab_size;
  auto logits = Feed(prompt, /*all_logits=*/false);
  if (!logits.ok()) return logits.status();
  std::vector<int32_t> out;
  const auto& eos = model_.config().eos_token_ids;
  for (int step = 0; step < max_tokens; ++step) {
    const int32_t next = SampleRef(logits->data() + logits->size() - vocab, vocab, sampling,
                                   static_cast<uint64_t>(step), nullptr);
    out.push_back(next);
    if (!ignore_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) break;
    if (step + 1 == max_tokens) break;
    logits = Feed({next}, /*all_logits=*/false);
    if (!logits.ok()) return logits.status();
  }
  return out;
}

}  // namespace mlaserve
