// CPU reference of absorbed-MLA decode over a paged latent cache, and of the cache write.
//
// Exact and readable, not fast: fp32 inputs, fp64 softmax and accumulation. It is the oracle the
// GPU kernels (mla_decode.h) are tested against and the CPU backend's MLA decode.
#pragma once

#include <cstdint>

#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

struct MlaDecodeRefParams {
  const float* q;              // [batch, s_q, heads, 576]: absorbed query (latent then rope).
  const uint8_t* kv_pool;      // [num_blocks, 64, KvCacheBytesPerToken(format)]
  const int32_t* block_table;  // [batch, max_blocks_per_seq]
  int max_blocks_per_seq;
  const int32_t* seq_lens;  // [batch]: tokens in the cache for each sequence INCLUDING its s_q new
                            // ones (so seq_lens[b] >= s_q).
  int batch, s_q, heads;
  KvCacheFormat format;
  float kv_scale;       // Per-layer scale of kFp8; ignored by the other formats.
  float softmax_scale;  // Multiplies q.k before the softmax.
  float* out;           // [batch, s_q, heads, 512]
  float* lse;           // [batch, s_q, heads]: ln(sum_j exp(softmax_scale * q.k_j)); nullable.
};

// Query i (0-based) of sequence b attends to cache positions 0 .. seq_lens[b] - s_q + i (causal
// inside the new tokens). V is the first 512 dims of the dequantized row. Uses a few threads.
void MlaDecodeRef(const MlaDecodeRefParams& p);

// Encodes n tokens into the pool: row r goes to global slot slots[r] (= block * 64 + offset).
// latent [n, 512], rope [n, 64] fp32; rounding and scales of KvCacheEncodeRow.
void KvCacheWriteRef(KvCacheFormat format, float fp8_scale, const float* latent, const float* rope,
                     const int64_t* slots, int n, uint8_t* kv_pool);

}  // namespace mlaserve
