#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

namespace mlaserve {

std::vector<float> PenalizedLogits(const float* logits, int vocab, const SequenceSampling& s,
                                   const std::vector<int32_t>& history, int prompt_len,
                                   int generated) {
  std::vector<float> work(logits, logits + vocab);
  if (s.repetition_penalty != 1.0f) {
    std::vector<bool> seen(vocab, false);
    for (int32_t t : history) {
      if (t >= 0 && t < vocab) seen[t] = true;
    }
    for (int i = 0; i < vocab; ++i) {
      if (seen[i])
        work[i] = work[i] > 0 ? work[i] / s.repetition_penalty : work[i] * s.repetition_penalty;
    }
  }
  if (s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (size_t i = std::min<size_t>(prompt_len, history.size()); i < history.size(); ++i)
      ++counts[history[i]];
    for (const auto& [t, n] : counts) {
      if (t >= 0 && t < vocab) work[t] -= s.presence_penalty + s.frequency_penalty * n;
    }
  }
  if (generated < s.min_tokens) {
    for (int32_t t : s.eos_ids) {
      if (t >= 0 && t < vocab) work[t] = -std::numeric_limits<float>::infinity();
    }
    for (int32_t t : s.stop_ids) {
      if (t >= 0 && t < vocab) work[t] = -std::numeric_limits<float>::infinity();
    }
  }
  return work;
}

SampledOutput SampleToken(const float* logits, int vocab, const SequenceSampling& s,
                          const std::vector<int32_t>& history, int prompt_len, int generated) {
  const std::vector<float> work = PenalizedLogits(logits, vocab, s, history, prompt_len, generated);
  SampledOutput out;
  out.token = SampleRef(work.data(), vocab, s.base, static_cast<uint64_t>(generated), nullptr);
  // Log-probabilities of the model's own distribution.
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  const float log_z = mx + static_cast<float>(std::log(sum));
  out.logprob = logits[out.token] - log_z;
  if (s.top_logprobs > 0) {
    const int k = std::min(s.top_logprobs, vocab);
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
    for (int i = 0; i < k; ++i) out.top.emplace_back(ids[i], logits[ids[i]] - log_z);
  }
  return out;
}

}  // namespace mlaserve
