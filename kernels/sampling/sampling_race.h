// The random draw of a sampled step, shared by the CPU reference (sampling_ref.cc) and the CUDA
// sampler (sampling.cu) so that both compute the same bits: an exponential race (Gumbel-max)
// over the kept candidates, with one counter-based uniform per (seed, step, token id).
//
// Why a race: candidate i wins if its score s_i = l_i / T - log(E_i) is the largest, with
// E_i = -log(u_i) ~ Exp(1) independent per token. Then E_i / exp(l_i / T) ~ Exp(rate
// w_i = exp(l_i / T)), and the smallest of independent exponentials is the i-th with probability
// w_i / sum_j w_j: exactly softmax(l / T) restricted to the candidates (-log(E_i) is a standard
// Gumbel variable; this is the Gumbel-max trick). Unlike inverse-CDF sampling over a sorted
// list, the pick does not depend on the candidates' order: a perturbation of the logits changes
// it only when it changes which perturbed score is the largest (for a perturbation of size d,
// with probability about d times the density of the gap between the two largest scores, which
// is O(1) per unit of logit / T).
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MLASERVE_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define MLASERVE_SAMPLING_HD inline
#endif

namespace mlaserve {

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection of 64-bit words with full
// avalanche, so consecutive counters give independent-looking outputs.
MLASERVE_SAMPLING_HD uint64_t SamplingSplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The key of one request's step: mixes (seed, step). Counter-based: nothing is carried between
// steps, so a token depends on the seed and the step index alone, not on the batch.
MLASERVE_SAMPLING_HD uint64_t SamplingStepKey(uint64_t seed, uint64_t step) {
  return SamplingSplitMix64(SamplingSplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull));
}

// The uniform of token `token` at the step with key `step_key`: u = (2k + 1) * 2^-53 with k the
// top 52 bits of SplitMix64(step_key ^ token * odd constant). Exact in double and strictly inside
// (0, 1), in [2^-53, 1 - 2^-53], so -log(u) is in [1.1e-16, 36.8] and log(-log(u)) is finite.
// For a fixed step key, distinct tokens hash distinct 64-bit words (each stage is a bijection).
MLASERVE_SAMPLING_HD double SamplingUniformOf(uint64_t step_key, int32_t token) {
  const uint64_t bits = SamplingSplitMix64(
      step_key ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) * 0x8cb92ba72f3d8dd7ull));
  return static_cast<double>(((bits >> 12) << 1) | 1) * (1.0 / 9007199254740992.0);
}

// The race score of a candidate: scaled_logit (= logit / T, divided in fp32 as the softmax of
// the filters does) minus log(E), E = -log(u), in double. The device's double log() is within
// 1 ulp of glibc's but not always identical, so the CPU's and the GPU's scores of one candidate
// may differ by a few ulps of log(E) and of the score (~1e-14 absolute for scores below ~100):
// that changes the pick only where the two largest scores of a row are that close, which for
// continuous scores has probability ~1e-14 per draw. Exact score ties, where the id decides,
// need equal logits and equal 52-bit uniforms (~vocab^2 * 2^-53 per row for the uniforms alone),
// so the tie rule matters for determinism, not for the distribution.
MLASERVE_SAMPLING_HD double SamplingRaceScore(float scaled_logit, uint64_t step_key,
                                              int32_t token) {
  const double e = -log(SamplingUniformOf(step_key, token));
  return static_cast<double>(scaled_logit) - log(e);
}

// The order of the race: a larger score wins, equal scores go to the lower id. A total order on
// non-NaN scores, so any reduction tree (the GPU's) finds the CPU's winner. A NaN score (a NaN
// logit) never wins; start from {-inf, INT32_MAX} and -inf scores (masked tokens) still win
// over nothing, the lowest id first.
MLASERVE_SAMPLING_HD bool SamplingRaceBeats(double score, int32_t id, double best_score,
                                            int32_t best_id) {
  return score > best_score || (score == best_score && id < best_id);
}

// Whether a sampled row has a filter that needs the candidates sorted (top-k below the vocab,
// top-p below 1, min-p above 0). Without one the race runs over the whole vocabulary, unsorted.
MLASERVE_SAMPLING_HD bool SamplingRowFiltered(int32_t top_k, float top_p, float min_p, int vocab) {
  return (top_k > 0 && top_k < vocab) || top_p < 1.0f || min_p > 0.0f;
}

}  // namespace mlaserve
