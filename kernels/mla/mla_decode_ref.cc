#include "kernels/mla/mla_decode_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "common/dtype.h"

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

// --- The FP8 tensor-core form (MlaFp8MmaEmulation; the model is described in the header). ---

constexpr int kFp22FractionBits = 13;
constexpr int kMmaK = 32;           // e4m3 values a k-step
constexpr int kGroupDims = 128;     // q.k dims summed in the accumulator before fp32 promotion
constexpr int kPvBlockTokens = 64;  // tokens a P.V block (one cache block)
constexpr double kPScale = 256.0;   // P in (0, 1] times this before the e4m3 rounding

// One k-step into an accumulator register: the 32 exact products and the accumulator aligned to
// the largest term's exponent and truncated to kFp22FractionBits, summed, stored as fp32. Exact in
// float and int: products of two e4m3 values have <= 8 significant bits, each truncated term is a
// multiple of the quantum below 2^14 of them, and 33 such terms sum below 2^20 quanta.
float TensorCoreStep(float acc, const float* products, int n) {
  float top = std::fabs(acc);
  for (int i = 0; i < n; ++i) top = std::max(top, std::fabs(products[i]));
  if (top == 0.0f) return 0.0f;
  const int e = std::ilogb(top);  // top in [2^e, 2^(e+1))
  const float quantum = std::ldexp(1.0f, e - kFp22FractionBits);
  const float inv = std::ldexp(1.0f, kFp22FractionBits - e);  // powers of two: exact scalings
  int32_t sum = static_cast<int32_t>(acc * inv);              // truncates toward zero
  for (int i = 0; i < n; ++i) sum += static_cast<int32_t>(products[i] * inv);
  return static_cast<float>(sum) * quantum;
}

float RoundE4m3(double x) { return E4m3ToFloat(FloatToE4m3(static_cast<float>(x))); }

// A cache row as the FP8 MMAs see it: raw e4m3 values (fp8_tiled's RoPE dims: bf16 values) and
// the scale of each dim.
void RawRow(const MlaDecodeRefParams& p, const uint8_t* row, float* raw, float* scale) {
  if (p.format == KvCacheFormat::kFp8) {
    for (int d = 0; d < kMlaQkDim; ++d) {
      raw[d] = E4m3ToFloat(row[d]);
      scale[d] = p.kv_scale;
    }
    return;
  }
  float tiles[kFp8TilesPerRow];
  std::memcpy(tiles, row + kFp8TiledScaleOffset, sizeof(tiles));
  for (int d = 0; d < kMlaLatentDim; ++d) {
    raw[d] = E4m3ToFloat(row[d]);
    scale[d] = tiles[d / kFp8TileDim];
  }
  for (int d = 0; d < kMlaRopeDim; ++d) {
    uint16_t bits;
    std::memcpy(&bits, row + kFp8TiledRopeOffset + 2 * d, 2);
    raw[kMlaLatentDim + d] = Bf16ToFloat(bits);
    scale[kMlaLatentDim + d] = 1.0f;
  }
}

// Heads [h_begin, h_end) of one (b, i) pair.
void DecodeOneQueryPositionFp8Mma(const MlaDecodeRefParams& p, int b, int i, int h_begin,
                                  int h_end) {
  const size_t row_bytes = KvCacheBytesPerToken(p.format);
  const int visible = std::max(p.seq_lens[b] - p.s_q + i + 1, 0);
  const bool tiled = p.format == KvCacheFormat::kFp8Tiled;
  // Dims on the e4m3 MMAs: all 576 in kFp8, the 512 latent ones in kFp8Tiled (RoPE in bf16).
  const int fp8_dims = tiled ? kMlaLatentDim : kMlaQkDim;
  std::vector<float> raw(static_cast<size_t>(visible) * kMlaQkDim),
      scale(static_cast<size_t>(visible) * kMlaQkDim);
  for (int t = 0; t < visible; ++t) {
    const int32_t block =
        p.block_table[static_cast<size_t>(b) * p.max_blocks_per_seq + t / kKvBlockTokens];
    const uint8_t* row =
        p.kv_pool + (static_cast<size_t>(block) * kKvBlockTokens + t % kKvBlockTokens) * row_bytes;
    RawRow(p, row, &raw[static_cast<size_t>(t) * kMlaQkDim],
           &scale[static_cast<size_t>(t) * kMlaQkDim]);
  }
  std::vector<double> scores(visible);
  float products[kMmaK];
  for (int h = h_begin; h < h_end; ++h) {
    const size_t qrow = (static_cast<size_t>(b) * p.s_q + i) * p.heads + h;
    const float* q = p.q + qrow * kMlaQkDim;
    double amax = 0.0;
    for (int d = 0; d < fp8_dims; ++d) amax = std::max(amax, std::fabs(static_cast<double>(q[d])));
    // The smallest power of two >= amax / 448 (amax = f 2^e, f in [0.5, 1): 2^(e - 9) when
    // f <= 448 / 512, else 2^(e - 8)), so that q / q_scale is exact and its e4m3 rounding (ties
    // included: bf16 inputs land on e4m3 midpoints often) is the same in every implementation.
    int e = 0;
    const double f = amax > 0.0 ? std::frexp(amax, &e) : 0.0;
    const double q_scale = amax > 0.0 ? std::ldexp(1.0, f <= 448.0 / 512.0 ? e - 9 : e - 8) : 1.0;
    float q8[kMlaQkDim];
    for (int d = 0; d < fp8_dims; ++d) q8[d] = RoundE4m3(q[d] / q_scale);
    double max_score = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < visible; ++t) {
      const float* k = &raw[static_cast<size_t>(t) * kMlaQkDim];
      const float* ks = &scale[static_cast<size_t>(t) * kMlaQkDim];
      double dot = 0.0;
      for (int g = 0; g < fp8_dims; g += kGroupDims) {
        const int end = std::min(g + kGroupDims, fp8_dims);
        float acc = 0.0f;
        for (int k0 = g; k0 < end; k0 += kMmaK) {
          const int n = std::min(kMmaK, end - k0);
          for (int j = 0; j < n; ++j) products[j] = q8[k0 + j] * k[k0 + j];
          acc = TensorCoreStep(acc, products, n);
        }
        dot += static_cast<double>(acc) * ks[g];  // one scale a group
      }
      dot *= q_scale;
      for (int d = fp8_dims; d < kMlaQkDim; ++d) {  // fp8_tiled's RoPE dims: bf16 q, bf16 k
        dot += static_cast<double>(Bf16ToFloat(FloatToBf16(q[d]))) * k[d];
      }
      scores[t] = dot * p.softmax_scale;
      max_score = std::max(max_score, scores[t]);
    }
    float* out = p.out + qrow * kMlaLatentDim;
    if (visible == 0) {
      std::fill(out, out + kMlaLatentDim, 0.0f);
      if (p.lse != nullptr) p.lse[qrow] = -std::numeric_limits<float>::infinity();
      continue;
    }
    std::vector<double> acc(kMlaLatentDim, 0.0);
    double sum = 0.0;
    if (p.fp8_mma == MlaFp8MmaEmulation::kQk) {
      for (int t = 0; t < visible; ++t) {
        const double w = std::exp(scores[t] - max_score);
        sum += w;
        const float* v = &raw[static_cast<size_t>(t) * kMlaQkDim];
        const float* vs = &scale[static_cast<size_t>(t) * kMlaQkDim];
        for (int d = 0; d < kMlaLatentDim; ++d) acc[d] += w * (static_cast<double>(v[d]) * vs[d]);
      }
    } else {
      // Blocks in order with a running max, as a split kernel's piece walks them.
      double m = -std::numeric_limits<double>::infinity();
      std::vector<double> pw(kPvBlockTokens);
      std::vector<float> p8(kPvBlockTokens);
      for (int t0 = 0; t0 < visible; t0 += kPvBlockTokens) {
        const int n = std::min(kPvBlockTokens, visible - t0);
        double m_new = m;
        for (int j = 0; j < n; ++j) m_new = std::max(m_new, scores[t0 + j]);
        const double rescale =
            m == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(m - m_new);
        sum *= rescale;
        for (double& a : acc) a *= rescale;
        m = m_new;
        for (int j = 0; j < n; ++j) {
          pw[j] = std::exp(scores[t0 + j] - m);
          sum += pw[j];
        }
        for (int g = 0; g < kMlaLatentDim; g += kGroupDims) {
          // The block's largest scale of this column group (kFp8: the layer's scale).
          double top = 0.0;
          for (int j = 0; j < n; ++j) {
            top = std::max(top,
                           static_cast<double>(scale[static_cast<size_t>(t0 + j) * kMlaQkDim + g]));
          }
          for (int j = 0; j < n; ++j) {
            const double s_t = scale[static_cast<size_t>(t0 + j) * kMlaQkDim + g];
            p8[j] = RoundE4m3(kPScale * pw[j] * (s_t / top));
          }
          for (int d = g; d < g + kGroupDims; ++d) {
            float a = 0.0f;  // a fresh accumulator a block
            for (int j0 = 0; j0 < n; j0 += kMmaK) {
              const int k = std::min(kMmaK, n - j0);
              for (int j = 0; j < k; ++j) {
                products[j] = p8[j0 + j] * raw[static_cast<size_t>(t0 + j0 + j) * kMlaQkDim + d];
              }
              a = TensorCoreStep(a, products, k);
            }
            acc[d] += static_cast<double>(a) * (top / kPScale);
          }
        }
      }
      // The scores were shifted by the final running max, which is max_score.
    }
    for (int d = 0; d < kMlaLatentDim; ++d) out[d] = static_cast<float>(acc[d] / sum);
    if (p.lse != nullptr) p.lse[qrow] = static_cast<float>(max_score + std::log(sum));
  }
}

}  // namespace

void MlaDecodeRef(const MlaDecodeRefParams& p) {
  const bool fp8_mma = p.fp8_mma != MlaFp8MmaEmulation::kNone &&
                       (p.format == KvCacheFormat::kFp8 || p.format == KvCacheFormat::kFp8Tiled);
  // The emulated form is ~4x the exact one's work: its jobs are (b, i, head) so that one decode
  // step's heads spread over the threads too.
  const int per_pair = fp8_mma ? p.heads : 1;
  const int jobs = p.batch * p.s_q * per_pair;
  const int threads =
      std::max(1, std::min<int>({jobs, static_cast<int>(std::thread::hardware_concurrency()), 16}));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&p, w, threads, jobs, per_pair, fp8_mma] {
      for (int j = w; j < jobs; j += threads) {
        const int pair = j / per_pair, b = pair / p.s_q, i = pair % p.s_q;
        if (fp8_mma) {
          const int h = j % per_pair;
          DecodeOneQueryPositionFp8Mma(p, b, i, h, h + 1);
        } else {
          DecodeOneQueryPosition(p, b, i);
        }
      }
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
