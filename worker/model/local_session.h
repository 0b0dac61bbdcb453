// One sequence at a time on one model shard, with its own blocks of the paged cache: what the
// generate tool and the model tests use before (and apart from) the coordinator's scheduler.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/sampling/sampling_ref.h"
#include "worker/model/deepseek_v3.h"

namespace mlaserve {

class LocalSession {
 public:
  explicit LocalSession(DeepseekV3Model& model) : model_(model) {}

  // Feeds `tokens` after what the sequence holds, `chunk` tokens per step (0: all at once);
  // returns the logits of every fed position ([tokens.size(), vocab]) if `all_logits`, else of
  // the last one.
  absl::StatusOr<std::vector<float>> Feed(const std::vector<int32_t>& tokens, bool all_logits,
                                          int chunk = 0);
  // Greedy or sampled continuation of `max_tokens` tokens after `prompt` (a fresh sequence);
  // stops early at an eos id of the config unless `ignore_eos`.
  absl::StatusOr<std::vector<int32_t>> Generate(const std::vector<int32_t>& prompt,
                                                int max_tokens, const SamplingRefParams& sampling,
                                                bool ignore_eos = false);
  void Reset() { length_ = 0; }
  int length() const { return length_; }

 private:
  DeepseekV3Model& model_;
  int length_ = 0;
};

}  // namespace mlaserve
