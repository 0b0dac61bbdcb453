// Token sampling for a step, in the worker: penalties, min_tokens masking, then the reference
// sampler (kernels/sampling/sampling_ref.h), whose random numbers depend only on the request's
// seed, its step index and the token ids, so batching never changes a seeded request's tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/sampling/sampling_ref.h"

namespace mlaserve {

struct SequenceSampling {
  SamplingRefParams base;
  float repetition_penalty = 1.0f;  // HF/vLLM: logit / p if > 0 else logit * p, on prompt + output
  float presence_penalty = 0.0f;    // OpenAI: - p if the token occurred in the output
  float frequency_penalty = 0.0f;   // OpenAI: - p * count in the output
  int min_tokens = 0;
  std::vector<int32_t> eos_ids;   // masked while fewer than min_tokens were generated
  std::vector<int32_t> stop_ids;  // likewise
  int top_logprobs = 0;
  bool want_logprobs = false;
};

struct SampledOutput {
  int32_t token = 0;
  float logprob = 0.0f;  // log softmax of the model's logits (temperature 1, no penalties)
  std::vector<std::pair<int32_t, float>> top;  // top_logprobs alternatives, best first
};

// logits: [vocab] of one sequence; history: its prompt then its output tokens so far;
// prompt_len: how many of them are prompt; generated: output tokens so far (the step index).
// Returns the [vocab] logits SampleRef decides on: the penalties applied, eos and stop ids at
// -inf while fewer than min_tokens were generated.
std::vector<float> PenalizedLogits(const float* logits, int vocab, const SequenceSampling& s,
                                   const std::vector<int32_t>& history, int prompt_len,
                                   int generated);

// The step's token (SampleRef of PenalizedLogits), its logprob and the top alternatives.
SampledOutput SampleToken(const float* logits, int vocab, const SequenceSampling& s,
                          const std::vector<int32_t>& history, int prompt_len, int generated);

}  // namespace mlaserve
