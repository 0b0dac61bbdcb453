#include "kernels/mla/mla_decode_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace mlaserve {
namespace {

// One (b, i) pair: decodes the visible rows once and runs every head over them.
void DecodeOneQueryPosition(const MlaDecodeRefParams& p, int b, int i) {
  const size_t row_bytes = KvCacheBytesPerToken(p.format);
  const int visible = p.seq_lens[b] - p.s_q + i + 1;  // Positions 0 .. visible - 1.
  std::vector<float> kv(static_cast<size_t>(std::max(visible, 0)) * kMlaQkDim);
  for (int t = 0; t < visible; ++t) {
    const int32_t block =
        p.block_table[static_cast<size_t>(b) * p.max_blocks_per_seq + t / kKvBlockTokens];
    const uint8_t* row =
        p.kv_pool + (static_cast<size_t>(block) * kKvBlockTokens + t % kKvBlockTokens) * row_bytes;
    KvCacheDecodeRow(p.format, row, p.kv_scale, &kv[static_cast<size_t>(t) * kMlaQkDim]);
  }
  std::vector<double> scores(std::max(visible, 0));
  for (int h = 0; h < p.heads; ++h) {
    const size_t qrow = (static_cast<size_t>(b) * p.s_q + i) * p.heads + h;
    const float* q = p.q + qrow * kMlaQkDim;
    double max_score = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < visible; ++t) {
      const float* k = &kv[static_cast<size_t>(t) * kMlaQkDim];
      double dot = 0.0;
      for (int d = 0; d < kMlaQkDim; ++d) dot += static_cast<double>(q[d]) * k[d];
      scores[t] = dot * p.softmax_scale;
      max_score = std::max(max_score, scores[t]);
    }
    double sum = 0.0;
    std::vector<double> acc(kMlaLatentDim, 0.0);
    for (int t = 0; t < visible; ++t) {
      const double w = std::exp(scores[t] - max_score);
      sum += w;
      const float* v = &kv[static_cast<size_t>(t) * kMlaQkDim];
      for (int d = 0; d < kMlaLatentDim; ++d) acc[d] += w * v[d];
    }
    float* out = p.out + qrow * kMlaLatentDim;
    for (int d = 0; d < kMlaLatentDim; ++d) {
      out[d] = visible > 0 ? static_cast<float>(acc[d] / sum) : 0.0f;
    }
    if (p.lse != nullptr) {
      p.lse[qrow] = visible > 0 ? static_cast<float>(max_score + std::log(sum))
                                : -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace

void MlaDecodeRef(const MlaDecodeRefParams& p) {
  const int jobs = p.batch * p.s_q;
  const int threads =
      std::max(1, std::min<int>({jobs, static_cast<int>(std::thread::hardware_concurrency()), 16}));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&p, w, threads, jobs] {
      for (int j = w; j < jobs; j += threads) DecodeOneQueryPosition(p, j / p.s_q, j % p.s_q);
    });
  }
  for (std::thread& t : pool) t.join();
}

void KvCacheWriteRef(KvCacheFormat format, float fp8_scale, const float* latent, const float* rope,
                     const int64_t* slots, int n, uint8_t* kv_pool) {
  const size_t row_bytes = KvCacheBytesPerToken(format);
  for (int r = 0; r < n; ++r) {
    if (slots[r] < 0) continue;  // not this rank's row (padding, or another rank's under DCP)
    KvCacheEncodeRow(format, latent + static_cast<size_t>(r) * kMlaLatentDim,
                     rope + static_cast<size_t>(r) * kMlaRopeDim, fp8_scale,
                     kv_pool + static_cast<size_t>(slots[r]) * row_bytes);
  }
}

}  // namespace mlaserve
