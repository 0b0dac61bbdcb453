// Token sampling, CPU reference: greedy, or temperature with top-k, top-p and min-p filters,
// drawing its uniform number from (seed, step) alone so that a request's tokens do not depend
// on which other requests share its batch.
#pragma once

#include <cstdint>

namespace mlaserve {

struct SamplingRefParams {
  float temperature = 0.0f;  // 0: greedy (first maximum wins on ties, as torch.argmax)
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off; keeps p >= min_p * p_max
  uint64_t seed = 0;
};

// The uniform number in [0, 1) used at generation step `step` of a request with `seed`
// (SplitMix64 of the pair: counter-based, no state carried between steps).
double SamplingUniform(uint64_t seed, uint64_t step);

// Returns the chosen token; `logprob` (nullable) gets log softmax(logits)[token] at
// temperature 1 (what clients asking for logprobs expect).
int32_t SampleRef(const float* logits, int vocab, const SamplingRefParams& params, uint64_t step,
                  float* logprob);

}  // namespace mlaserve
