// Token sampling on the GPU for one step: the same function as the worker's CPU sampler
// (worker/model/sampler.h SampleToken: penalties, min_tokens masking, then SampleRef of
// kernels/sampling/sampling_ref.h: the top-k / min-p / top-p kept set, then the exponential race
// of sampling_race.h), computed with the same fp32/double operations, so that a row's token,
// logprob and top-n alternatives match the CPU's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

inline constexpr int kMaxTopLogprobs = 20;

// Vocabularies up to 2^kSamplingMaxVocabLog2 ids: the sort key packs the id into the low bits.
inline constexpr int kSamplingMaxVocabLog2 = 24;

// One row of a step's sampling (one sequence), host-built, uploaded once per step.
struct SamplingRow {
  float temperature = 0.0f;  // <= 0: greedy (first maximum)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // >= 1: off
  float min_p = 0.0f;        // <= 0: off
  uint64_t seed = 0;
  uint64_t step = 0;  // the request's generation step (tokens generated so far)
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  // Entries [penalty_begin, penalty_begin + penalty_count) of SamplingParams::penalties.
  int32_t penalty_begin = 0, penalty_count = 0;
  // Entries [mask_begin, mask_begin + mask_count) of SamplingParams::masks: token ids set to
  // -inf (min_tokens not reached: eos + stop ids). Duplicates are harmless.
  int32_t mask_begin = 0, mask_count = 0;
  int32_t top_logprobs = 0;  // 0..kMaxTopLogprobs (larger values are clamped)
  // Non-zero: logprobs[row] gets the token's log-probability; zero: 0 (the normaliser over the
  // vocabulary is computed only for rows with want_logprob or top_logprobs).
  int32_t want_logprob = 0;
};

// A token in a row's history: the DISTINCT tokens of prompt + output (all get the repetition
// penalty) with output_count = occurrences in the output part (presence / frequency penalties;
// 0 for prompt-only tokens). Built on the host from the request's history. A token listed twice
// in one row would be penalised twice (and race): the host must deduplicate. Ids outside
// [0, vocab) are ignored, as the CPU sampler ignores them.
struct SamplingPenaltyEntry {
  int32_t token;
  int32_t output_count;
};

struct SamplingParams {
  int rows = 0, vocab = 0;
  const float* logits = nullptr;  // [rows, vocab] fp32, row stride logits_stride (elements)
  int64_t logits_stride = 0;
  const SamplingRow* row_params = nullptr;          // [rows] device
  const SamplingPenaltyEntry* penalties = nullptr;  // [total] device
  const int32_t* masks = nullptr;                   // [total] device
  // Whether any row has temperature > 0 (the host knows): false skips the sort and the draw.
  // Must be true when any row samples, else rows with a filter get no token. (Sampled rows
  // without a filter are decided before the sort; their segments are empty.)
  bool any_sampled = true;
  int32_t* tokens = nullptr;      // [rows] out
  float* logprobs = nullptr;      // [rows] out (nullable): log softmax(original logits)[token]
                                  // for rows with want_logprob, else 0
  int32_t* top_ids = nullptr;     // [rows, kMaxTopLogprobs] out (nullable; first top_logprobs
                                  // valid, the rest -1)
  float* top_logprobs = nullptr;  // [rows, kMaxTopLogprobs] out (nullable; the rest 0)
  void* workspace = nullptr;      // SamplingWorkspaceBytes(rows, vocab) bytes, 256-B aligned
  size_t workspace_bytes = 0;
};

// Device workspace InvokeSampling needs: 16 bytes per logit (two 64-bit sort-key buffers) plus
// the sort's temporary storage and a few per-row values. For rows = 256, vocab = 163840: ~640 MiB.
size_t SamplingWorkspaceBytes(int rows, int vocab);

// Graph-capturable: launches only (no host synchronisation, no allocation).
absl::Status InvokeSampling(const SamplingParams& p, cudaStream_t stream);

}  // namespace mlaserve
