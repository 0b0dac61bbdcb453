// Fuzzes the worker's validation of a step (worker/backend/step_layout.h): a StepBatch and
// StepLayoutOptions drawn from the input, with any counts, offsets and ids. BuildStepLayout must
// refuse what is inconsistent; a layout it accepts must keep every index in range, which this
// target checks (a violation aborts).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "worker/backend/step_layout.h"

namespace {

template <typename T>
T Draw(FuzzedDataProvider& in, T small_max) {
  // Mostly small values (consistent steps), sometimes anything (overflow, negatives).
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) return in.ConsumeIntegral<T>();
  return in.ConsumeIntegralInRange<T>(0, small_max);
}

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  mlaserve::StepLayoutOptions options;
  options.vocab_size = Draw<int>(in, 1000);
  options.num_blocks = Draw<int>(in, 64);
  options.num_slots = in.ConsumeBool() ? int64_t{options.num_blocks} * 64 : Draw<int64_t>(in, 4096);
  options.force_absorbed = in.ConsumeBool();
  options.per_token_attention = in.ConsumeBool();

  mlaserve::StepBatch batch;
  const int num_tokens = in.ConsumeIntegralInRange<int>(0, 128);
  for (int t = 0; t < num_tokens; ++t) {
    batch.tokens.push_back(Draw<int32_t>(in, 1000));
    batch.positions.push_back(Draw<int32_t>(in, 512));
    batch.slots.push_back(Draw<int64_t>(in, 4096));
  }
  // Arrays of unequal lengths too.
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) batch.positions.push_back(0);
  const int num_seqs = in.ConsumeIntegralInRange<int>(0, 16);
  for (int s = 0; s < num_seqs; ++s) {
    mlaserve::SequenceSlice slice;
    slice.token_begin = Draw<int>(in, 128);
    slice.num_tokens = Draw<int>(in, 16);
    slice.context_len = Draw<int>(in, 512);
    const int blocks = in.ConsumeIntegralInRange<int>(0, 12);
    for (int b = 0; b < blocks; ++b) slice.block_table.push_back(Draw<int32_t>(in, 64));
    batch.seqs.push_back(std::move(slice));
  }
  const int rows = in.ConsumeIntegralInRange<int>(0, 16);
  for (int r = 0; r < rows; ++r) batch.logits_rows.push_back(Draw<int32_t>(in, 128));

  auto layout = mlaserve::BuildStepLayout(batch, options);
  if (!layout.ok()) return 0;
  const mlaserve::StepLayout& l = *layout;
  Check(l.num_tokens == static_cast<int>(l.tokens.size()));
  Check(l.positions.size() == l.tokens.size() && l.slots.size() == l.tokens.size());
  for (int32_t tok : l.tokens) Check(tok >= 0 && tok < options.vocab_size);
  for (int64_t slot : l.slots) Check(slot >= 0 && slot < options.num_slots);
  for (int32_t r : l.logits_rows) Check(r >= 0 && r < l.num_tokens);
  Check(l.max_blocks >= 1);
  Check(l.block_tables.size() == static_cast<size_t>(l.num_seqs) * l.max_blocks);
  for (int32_t b : l.block_tables) Check(b >= 0 && b < options.num_blocks);
  for (const auto& g : l.decode) {
    Check(g.seq_begin >= 0 && g.num_seqs >= 0 && g.seq_begin + g.num_seqs <= l.num_seqs);
    Check(g.row_begin >= 0 && g.row_begin + int64_t{g.num_seqs} * g.s_q <= l.num_tokens);
  }
  Check(l.prefill.row_begin >= 0 && l.prefill.row_begin + l.prefill.num_rows <= l.num_tokens);
  if (mlaserve::IsSingleTokenDecode(l)) {
    mlaserve::StepLayout padded = l;
    const int bucket = l.num_seqs + in.ConsumeIntegralInRange<int>(0, 8);
    const int width = l.max_blocks + in.ConsumeIntegralInRange<int>(0, 8);
    mlaserve::PadDecodeLayout(&padded, bucket, width);
  }
  return 0;
}
