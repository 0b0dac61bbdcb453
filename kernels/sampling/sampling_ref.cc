#include "kernels/sampling/sampling_ref.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/sampling/sampling_race.h"

namespace mlaserve {
namespace {

float LogSoftmaxAt(const float* logits, int vocab, int token) {
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  return static_cast<float>(logits[token] - mx - std::log(sum));
}

}  // namespace

double SamplingUniform(uint64_t seed, uint64_t step, int32_t token) {
  return SamplingUniformOf(SamplingStepKey(seed, step), token);
}

std::vector<int32_t> SamplingKeptIds(const float* logits, int vocab, const SamplingRefParams& p) {
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  if (!SamplingRowFiltered(p.top_k, p.top_p, p.min_p, vocab)) return ids;
  // Sorted by logit, descending; ties by lower id (a total order: reproducible). Only the first
  // top_k places matter when top_k is set. The GPU sorts the same (logit, id) keys.
  int keep = vocab;
  if (p.top_k > 0) keep = std::min(keep, p.top_k);
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  if (p.min_p > 0.0f || p.top_p < 1.0f) {
    // The softmax at temperature over the top_k candidates: logit / T in fp32, then double.
    std::vector<double> probs(keep);
    const double mx = logits[ids[0]] / p.temperature;
    double sum = 0.0;
    for (int i = 0; i < keep; ++i) {
      probs[i] = std::exp(logits[ids[i]] / p.temperature - mx);
      sum += probs[i];
    }
    for (double& q : probs) q /= sum;
    if (p.min_p > 0.0f) {
      int k = 0;
      while (k < keep && probs[k] >= p.min_p * probs[0]) ++k;
      keep = std::max(1, k);
    }
    if (p.top_p < 1.0f) {
      double cum = 0.0;
      int k = 0;
      while (k < keep) {
        cum += probs[k++];
        if (cum >= p.top_p) break;
      }
      keep = std::max(1, k);
    }
  }
  ids.resize(keep);
  return ids;
}

int32_t SampleRef(const float* logits, int vocab, const SamplingRefParams& p, uint64_t step,
                  float* logprob) {
  int32_t chosen = 0;
  if (p.temperature <= 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  } else {
    const std::vector<int32_t> kept = SamplingKeptIds(logits, vocab, p);
    const uint64_t key = SamplingStepKey(p.seed, step);
    double best = -INFINITY;
    int32_t best_id = INT32_MAX;
    for (const int32_t id : kept) {
      const double s = SamplingRaceScore(logits[id] / p.temperature, key, id);
      if (SamplingRaceBeats(s, id, best, best_id)) {
        best = s;
        best_id = id;
      }
    }
    chosen = best_id != INT32_MAX ? best_id : kept[0];
  }
  if (logprob != nullptr) *logprob = LogSoftmaxAt(logits, vocab, chosen);
  return chosen;
}

}  // namespace mlaserve
