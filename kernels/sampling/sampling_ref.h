// Token sampling, CPU reference: greedy, or temperature with top-k, top-p and min-p filters and
// an exponential race (Gumbel-max, sampling_race.h) over the kept candidates, whose random
// numbers depend on (seed, step, token id) alone: a request's tokens do not depend on which other
// requests share its batch, nor on the order in which near-equal candidates sort.
#pragma once

#include <cstdint>
#include <vector>

namespace mlaserve {

struct SamplingRefParams {
  float temperature = 0.0f;  // <= 0: greedy (first maximum wins on ties, as torch.argmax)
  int top_k = 0;             // <= 0: off
  float top_p = 1.0f;        // >= 1: off
  float min_p = 0.0f;        // <= 0: off; keeps p >= min_p * p_max
  uint64_t seed = 0;
};

// The uniform in (0, 1) of token `token` at generation step `step` of a request with `seed`
// (sampling_race.h: SplitMix64 of the triple; counter-based, no state between steps).
double SamplingUniform(uint64_t seed, uint64_t step, int32_t token);

// The candidates a sampled step (temperature > 0) draws from. Without a filter
// (SamplingRowFiltered false): every id, in id order. Otherwise the ids sorted by logit
// descending (ties: lower id first), cut to top_k, then, on the softmax at `temperature` of
// those (double, accumulated in that order), to the prefix with p >= min_p * p_max, then to the
// shortest prefix whose cumulative p reaches top_p; never fewer than one.
std::vector<int32_t> SamplingKeptIds(const float* logits, int vocab, const SamplingRefParams& p);

// Returns the chosen token: greedy, or the winner of the race among SamplingKeptIds (largest
// SamplingRaceScore, ties to the lower id; only NaN logits leave no winner, and then the first
// kept id is returned). `logprob` (nullable) gets log softmax(logits)[token] at temperature 1
// (what clients asking for logprobs expect).
int32_t SampleRef(const float* logits, int vocab, const SamplingRefParams& params, uint64_t step,
                  float* logprob);

}  // namespace mlaserve
