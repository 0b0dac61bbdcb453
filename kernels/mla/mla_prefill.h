// MLA chunked prefill on the GPU, in the non-absorbed form (per head: q = [q_nope | q_rope],
// k = [k_nope (from kv_b) | k_rope (shared by all heads)], v from kv_b).
//
// A prefill sequence s has context_lens[s] tokens already in the paged cache (its prefix) and
// n_s = q_begin[s+1] - q_begin[s] new tokens. Query i of s sits at absolute position
// context_lens[s] + i and attends causally to keys 0 .. context_lens[s] + i of its sequence.
//
// A step runs: InvokeMlaPrefillGather (prefix rows decoded from the cache + new rows, one
// contiguous [total_kv, 512 | 64] bf16 block per step), the model's cuBLAS kv = latent @ kv_b^T,
// then InvokeMlaPrefill. CPU reference: mla_prefill_ref.h.
//
// bf16 tensors are `const void*` / `void*` (bf16 bits) so that C++20 code includes this header
// without cuda_bf16.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

// Step 1: each prefill sequence's keys, contiguous: its cached prefix rows decoded from the
// paged cache (exactly KvCacheDecodeRow's values, rounded to bf16 — exact for kBf16; fp8 values
// e4m3*scale are rounded to bf16 by RNE), then its new tokens' rows copied from the step's
// activations. Sequence s's keys are rows kv_begin[s] .. kv_begin[s+1] of the outputs; row
// kv_begin[s] + t is cache position t (t < context_lens[s]) or new token q_begin[s] + t -
// context_lens[s]. Rows whose metadata is inconsistent (kv length != context + new, a negative
// block id) are written as NaN rather than read out of bounds.
struct MlaPrefillGatherParams {
  KvCacheFormat format = KvCacheFormat::kBf16;  // kBf16, kFp8, kFp8Tiled (kF32 rejected)
  float fp8_scale = 1.0f;                       // kFp8 only
  const void* kv_pool = nullptr;  // [num_blocks, 64, KvCacheBytesPerToken(format)], 16-B aligned
  const int32_t* block_table = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs] cached tokens before this step
  const int32_t* q_begin = nullptr;       // [num_seqs + 1] cumulative new tokens (rows of new_*)
  const int32_t* kv_begin = nullptr;      // [num_seqs + 1] cumulative keys (context + new)
  // bf16 rows, row r at new_latent + r * latent_stride (elements), 512 values; 16-B aligned rows.
  const void* new_latent = nullptr;
  int64_t latent_stride = 512;
  const void* new_rope = nullptr;  // bf16 rows (rotated k_rope), 64 values, stride rope_stride
  int64_t rope_stride = 64;        // (4-B aligned rows)
  int num_seqs = 0;
  int total_kv = 0;            // kv_begin[num_seqs] (host knows it; sizes the grid)
  void* out_latent = nullptr;  // bf16 [total_kv, 512]
  void* out_rope = nullptr;    // bf16 [total_kv, 64]
};
absl::Status InvokeMlaPrefillGather(const MlaPrefillGatherParams& p, cudaStream_t stream);

// (Between the two steps the model computes kv = out_latent @ kv_b^T with cuBLAS:
//  kv: bf16 [total_kv, heads, qk_nope + v_dim], per head k_nope then v.)

// Step 2: causal flash attention (online softmax, no [T, T] matrix in memory), bf16 tensor
// cores (mma.sync m16n8k16, fp32 accumulation), any head count 1..128.
struct MlaPrefillParams {
  int num_seqs = 0, heads = 0, qk_nope = 0, qk_rope = 64, v_dim = 0;
  const void* q = nullptr;       // bf16 [total_q, heads, qk_nope + qk_rope], row-major contiguous
  const void* kv = nullptr;      // bf16 [total_kv, heads, qk_nope + v_dim]
  const void* k_rope = nullptr;  // bf16 [total_kv, 64]
  const int32_t* q_begin = nullptr;   // [num_seqs + 1] (device)
  const int32_t* kv_begin = nullptr;  // [num_seqs + 1] (device)
  // [num_seqs] (device); kv_begin[s+1]-kv_begin[s] == context_lens[s] + q_begin[s+1]-q_begin[s]
  const int32_t* context_lens = nullptr;
  int total_q = 0, max_q_len = 0;  // host-known; size the grid
  float softmax_scale = 0.0f;      // multiplies q.k
  void* out = nullptr;             // bf16 [total_q, heads, v_dim]
};
// Supported (qk_nope, v_dim): (16,16), (32,32), (64,64), (128,128), (128,64); anything else is
// an InvalidArgument error naming the dims. qk_rope must be 64. q, kv and k_rope must be 16-B
// aligned. A sequence whose kv length disagrees with context + new tokens gets NaN outputs.
absl::Status InvokeMlaPrefill(const MlaPrefillParams& p, cudaStream_t stream);

}  // namespace mlaserve
