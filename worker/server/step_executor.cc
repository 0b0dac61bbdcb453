#include "worker/server/step_executor.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"

namespace mlaserve {

absl::StatusOr<ExecutedStep> StepExecutor::Run(wire::StepPlan::Reader plan) {
  for (uint64_t id : plan.getRelease()) {
    history_.erase(id);
    sampling_.erase(id);
    tables_.erase(id);
  }
  ExecutedStep result;
  if (!plan.isStep()) return result;
  const auto seqs = plan.getStep();
  // Block ids count every rank's pool under decode context parallelism (ModelOptions::dcp).
  const int num_blocks = model_.options().num_kv_blocks * model_.options().dcp;
  const int vocab = model_.config().vocab_size;
  StepBatch batch;
  std::vector<int> sample_seq;  // index into seqs for each logits row
  for (uint32_t i = 0; i < seqs.size(); ++i) {
    const wire::StepSequence::Reader s = seqs[i];
    const auto tokens = s.getTokens();
    const uint64_t start = s.getStartPosition();
    if (tokens.size() == 0)
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.getSeqId(), ": no tokens"));
    // Positions are int32 in the step (and start + size must not wrap the uint64 sum, which
    // would pass the block-table check below and index the table with a negative position).
    if (start > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) - tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.getSeqId(), ": positions ",
                                                     start, " + ", tokens.size(),
                                                     " past the largest position ",
                                                     std::numeric_limits<int32_t>::max()));
    }
    const uint64_t end = start + tokens.size();
    // The block table: the entries kept from earlier steps up to blockTableFrom, then this
    // step's (a preempted sequence comes back with a new table from 0).
    std::vector<int32_t>& table = tables_[s.getSeqId()];
    const uint32_t from = s.getBlockTableFrom();
    if (from > table.size()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.getSeqId(),
                                                     ": block table continues at entry ", from,
                                                     " but only ", table.size(), " are known"));
    }
    table.resize(from);
    for (int32_t b : s.getBlockTable()) {
      if (b < 0 || b >= num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", s.getSeqId(), ": block ", b,
                                                       " outside the pool of ", num_blocks));
      }
      table.push_back(b);
    }
    if (end > static_cast<uint64_t>(table.size()) * kKvBlockTokens) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.getSeqId(), ": block table of ",
                                                     table.size(), " blocks cannot hold ", end,
                                                     " tokens"));
    }
    SequenceSlice slice;
    slice.token_begin = static_cast<int>(batch.tokens.size());
    slice.num_tokens = static_cast<int>(tokens.size());
    slice.context_len = static_cast<int>(start);
    slice.block_table = table;
    if (s.hasSampling()) {
      const wire::SamplingParams::Reader p = s.getSampling();
      SequenceSampling ss;
      ss.base.temperature = p.getTemperature();
      ss.base.top_k = p.getTopK();
      ss.base.top_p = p.getTopP();
      ss.base.min_p = p.getMinP();
      ss.base.seed = p.getSeed();
      ss.repetition_penalty = p.getRepetitionPenalty();
      ss.presence_penalty = p.getPresencePenalty();
      ss.frequency_penalty = p.getFrequencyPenalty();
      ss.min_tokens = static_cast<int>(p.getMinTokens());
      for (int32_t e : s.getEosIds()) ss.eos_ids.push_back(e);
      for (int32_t e : p.getStopTokenIds()) ss.stop_ids.push_back(e);
      ss.want_logprobs = p.getLogprobs();
      ss.top_logprobs = p.getLogprobs() ? static_cast<int>(p.getTopLogprobs()) : 0;
      sampling_[s.getSeqId()] = std::move(ss);
    } else if (s.getSample() && !sampling_.count(s.getSeqId())) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s.getSeqId(), ": sampling parameters were never sent"));
    }
    auto& hist = history_[s.getSeqId()];
    if (hist.size() > start) hist.resize(start);  // recompute after preemption restarts here
    for (uint32_t t = 0; t < tokens.size(); ++t) {
      const int32_t id = tokens[t];
      if (id < 0 || id >= vocab)
        return absl::InvalidArgumentError(absl::StrCat("token id ", id, " outside the vocabulary"));
      const int pos = static_cast<int>(start + t);
      batch.tokens.push_back(id);
      batch.positions.push_back(pos);
      batch.slots.push_back(static_cast<int64_t>(slice.block_table[pos / kKvBlockTokens]) *
                                kKvBlockTokens +
                            pos % kKvBlockTokens);
      hist.push_back(id);
    }
    if (s.getSample()) {
      batch.logits_rows.push_back(static_cast<int32_t>(batch.tokens.size()) - 1);
      sample_seq.push_back(static_cast<int>(i));
    }
    batch.seqs.push_back(std::move(slice));
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = model_.Forward(batch);
  if (!logits.ok()) return logits.status();
  result.tokens_fed = static_cast<int64_t>(batch.tokens.size());
  // The step's collectives first (a GPU communicator bounds the wait and names a dead peer),
  // then the rest of the device work.
  if (auto st = model_.comm().WaitForDevice(); !st.ok()) return st;
  if (!sample_here_) {
    // The other ranks wait for their step's device work too (its errors surface here).
    if (auto st = model_.ops().Synchronize(); !st.ok()) return st;
    result.forward_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }
  // Sampling runs on the logits' device; only ids and logprobs come back. The forward time
  // includes the device work queued before sampling (the GPU runs asynchronously).
  SamplingBatch sb;
  for (size_t r = 0; r < sample_seq.size(); ++r) {
    const wire::StepSequence::Reader s = seqs[sample_seq[r]];
    sb.rows.push_back({&sampling_.at(s.getSeqId()), &history_[s.getSeqId()],
                       static_cast<int>(s.getPromptLen()), static_cast<int>(s.getGenerated())});
  }
  if (auto st = model_.ops().Synchronize(); !st.ok()) return st;
  const auto t1 = std::chrono::steady_clock::now();
  result.forward_seconds = std::chrono::duration<double>(t1 - t0).count();
  std::vector<SampledOutput> sampled;
  if (auto st = model_.ops().Sample(*logits, sb, &sampled); !st.ok()) return st;
  for (size_t r = 0; r < sample_seq.size(); ++r) {
    const wire::StepSequence::Reader s = seqs[sample_seq[r]];
    ExecutedStep::Token tok;
    tok.seq_id = s.getSeqId();
    tok.want_logprobs = sampling_.at(s.getSeqId()).want_logprobs;
    tok.out = std::move(sampled[r]);
    result.tokens.push_back(std::move(tok));
  }
  result.sample_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  return result;
}

}  // namespace mlaserve
