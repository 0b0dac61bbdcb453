#include "kernels/sampling/sampling_ref.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/sampling/sampling_uniform.h"

namespace mlaserve {
namespace {

float LogSoftmaxAt(const float* logits, int vocab, int token) {
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  return static_cast<float>(logits[token] - mx - std::log(sum));
}

}  // namespace

double SamplingUniform(uint64_t seed, uint64_t step) { return SamplingUniformOf(seed, step); }

int32_t SampleRef(const float* logits, int vocab, const SamplingRefParams& p, uint64_t step,
                  float* logprob) {
  int32_t chosen = 0;
  if (p.temperature <= 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  } else {
    // Candidates sorted by logit, descending; ties by lower id (a total order: reproducible).
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    int keep = vocab;
    if (p.top_k > 0) keep = std::min(keep, p.top_k);
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
    double total = 0.0;
    for (int i = 0; i < keep; ++i) total += probs[i];
    const double u = SamplingUniform(p.seed, step) * total;
    double cum = 0.0;
    chosen = ids[keep - 1];
    for (int i = 0; i < keep; ++i) {
      cum += probs[i];
      if (u < cum) {
        chosen = ids[i];
        break;
      }
    }
  }
  if (logprob != nullptr) *logprob = LogSoftmaxAt(logits, vocab, chosen);
  return chosen;
}

}  // namespace mlaserve
