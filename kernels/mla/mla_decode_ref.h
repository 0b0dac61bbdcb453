// CPU reference of absorbed-MLA decode over a paged latent cache, and of the cache write.
//
// Exact and readable, not fast: fp32 inputs, fp64 softmax and accumulation. It is the oracle the
// GPU kernels (mla_decode.h) are tested against and the CPU backend's MLA decode.
#pragma once

#include <cstdint>

#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

// An FP8 tensor-core form of the attention math, emulated (issue 15: may the fp8 formats run q.k
// and P.V on Hopper's e4m3 MMAs, which halve the tensor work that bounds 64-128 heads?). For
// accuracy studies (tests/model/accuracy_test.cc); the CPU backend and the GPU kernels' oracle
// use kNone, the exact form. Only kFp8 and kFp8Tiled caches are affected. The form modelled:
// - q.k: q rounded to e4m3 with one scale a query row (the smallest power of two >= amax / 448,
//   so the scaling is exact: with amax / 448 itself, bf16 q values that land on e4m3 midpoints
//   round by how a division was done, a 2-3% score difference between two implementations; amax
//   over the row's latent dims, and for kFp8 its RoPE dims too, which that format also stores in
//   e4m3), multiplied by the cache's raw
//   e4m3 values; each 128-dim group (fp8_tiled: each scale tile) summed in the tensor core's
//   accumulator and promoted to fp32 after the group, times the group's scales. fp8_tiled's RoPE
//   dims stay bf16 (bf16 MMA, exact here).
// - P.V (kQkPv): per 64-token block, P = exp(s - running max) rounded to e4m3 after x256
// (fp8_tiled:
//   x the token's tile scale / the block's largest, so one P a 128-column group), times the raw
//   e4m3 values, summed in a fresh tensor-core accumulator a block and added to the fp32 O. The
//   row sums stay exact.
// - The tensor core's sums: each k32 step adds its 32 exact e4m3 products to the accumulator after
//   aligning all 33 terms to the largest one's exponent and truncating them to 13 fraction bits
//   (Hopper's FP8 MMA accumulates in ~22-bit floating point: SageAttention2, arXiv 2411.10958;
//   DeepSeek-V3 technical report, section 3.3.2, "around 14 bits"; deepseek-ai/DeepGEMM issue 37).
enum class MlaFp8MmaEmulation { kNone, kQk, kQkPv };

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
  MlaFp8MmaEmulation fp8_mma = MlaFp8MmaEmulation::kNone;
};

// Query i (0-based) of sequence b attends to cache positions 0 .. seq_lens[b] - s_q + i (causal
// inside the new tokens). V is the first 512 dims of the dequantized row. Uses a few threads.
void MlaDecodeRef(const MlaDecodeRefParams& p);

// Encodes n tokens into the pool: row r goes to global slot slots[r] (= block * 64 + offset).
// latent [n, 512], rope [n, 64] fp32; rounding and scales of KvCacheEncodeRow.
void KvCacheWriteRef(KvCacheFormat format, float fp8_scale, const float* latent, const float* rope,
                     const int64_t* slots, int n, uint8_t* kv_pool);

}  // namespace mlaserve
