// Runs coordinator step plans on one model shard: builds the step batch from the plan, runs the
// forward pass on every rank, samples on rank 0 with each request's parameters, and keeps the
// per-sequence token history that penalties need.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "mlaserve.capnp.h"
#include "worker/model/deepseek_v3.h"
#include "worker/model/sampler.h"

namespace mlaserve {

struct ExecutedStep {
  struct Token {
    uint64_t seq_id;
    SampledOutput out;
    bool want_logprobs;
  };
  std::vector<Token> tokens;
  double forward_seconds = 0;
  int64_t tokens_fed = 0;
  double sample_seconds = 0;
};

class StepExecutor {
 public:
  explicit StepExecutor(DeepseekV3Model& model, bool sample_here)
      : model_(model), sample_here_(sample_here) {}
  // Validates the plan against the model (ids in range, block tables inside the pool, positions
  // consistent) before touching the cache: a bad plan is an error, not a crash.
  absl::StatusOr<ExecutedStep> Run(wire::StepPlan::Reader plan);

 private:
  DeepseekV3Model& model_;
  bool sample_here_;
  std::unordered_map<uint64_t, std::vector<int32_t>> history_;
  // Each sequence's block table as sent so far (plans carry only the entries that changed).
  std::unordered_map<uint64_t, std::vector<int32_t>> tables_;
  // Each sequence's sampling parameters, sent with its first step and kept until released.
  std::unordered_map<uint64_t, SequenceSampling> sampling_;
};

}  // namespace mlaserve
