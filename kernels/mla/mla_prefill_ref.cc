#include "kernels/mla/mla_prefill_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace mlaserve {
namespace {

// One (sequence, head): every query row of it. Statement for statement CpuOps::MlaNaive's loop
// body with the key index offset by the sequence's cached prefix.
void PrefillOneHead(int heads, int qk_nope, int qk_rope, int v_dim, const float* q, const float* kv,
                    const float* k_rope, int64_t q0, int n, int64_t kv0, int ctx, int h,
                    float softmax_scale, float* out, std::vector<float>& scores) {
  const int qk = qk_nope + qk_rope;
  const int kv_cols = qk_nope + v_dim;
  for (int i = 0; i < n; ++i) {
    const int64_t ti = q0 + i;
    const float* qi = q + (ti * heads + h) * qk;
    const int keys = ctx + i + 1;
    scores.assign(keys, 0.0f);
    float mx = -INFINITY;
    for (int j = 0; j < keys; ++j) {
      const int64_t tj = kv0 + j;
      const float* kj = kv + (tj * heads + h) * kv_cols;
      float dot = 0.0f;
      for (int d = 0; d < qk_nope; ++d) dot += qi[d] * kj[d];
      for (int d = 0; d < qk_rope; ++d) dot += qi[qk_nope + d] * k_rope[tj * qk_rope + d];
      scores[j] = dot * softmax_scale;
      mx = std::max(mx, scores[j]);
    }
    float sum = 0.0f;
    for (float& v : scores) sum += (v = std::exp(v - mx));
    float* oi = out + (ti * heads + h) * v_dim;
    std::fill(oi, oi + v_dim, 0.0f);
    for (int j = 0; j < keys; ++j) {
      const float p = scores[j] / sum;
      const float* vj = kv + ((kv0 + j) * heads + h) * kv_cols + qk_nope;
      for (int d = 0; d < v_dim; ++d) oi[d] += p * vj[d];
    }
  }
}

}  // namespace

void MlaPrefillRef(int num_seqs, int heads, int qk_nope, int qk_rope, int v_dim, const float* q,
                   const float* kv, const float* k_rope, const int32_t* q_begin,
                   const int32_t* kv_begin, const int32_t* context_lens, float softmax_scale,
                   float* out) {
  const int jobs = num_seqs * heads;
  if (jobs <= 0) return;
  const int threads =
      std::max(1, std::min<int>({jobs, static_cast<int>(std::thread::hardware_concurrency()), 16}));
  auto work = [&](int w) {
    std::vector<float> scores;
    for (int job = w; job < jobs; job += threads) {
      const int s = job / heads, h = job % heads;
      PrefillOneHead(heads, qk_nope, qk_rope, v_dim, q, kv, k_rope, q_begin[s],
                     q_begin[s + 1] - q_begin[s], kv_begin[s], context_lens[s], h, softmax_scale,
                     out, scores);
    }
  };
  if (threads == 1) {
    work(0);
    return;
  }
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) pool.emplace_back(work, w);
  for (std::thread& t : pool) t.join();
}

}  // namespace mlaserve
