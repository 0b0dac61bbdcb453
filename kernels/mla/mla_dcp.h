// Decode context parallelism's device pieces (Ops::MlaAttend and Ops::MlaMergeExpand on the GPU,
// worker/backend/cuda_ops.cc). Under DCP every rank of a group attends with every head of the
// group over its own cache rows, so the tensors that travel between ranks are laid out by rank
// ([ranks, tokens, heads_per_rank, ...], what an all-gather produces), while the decode kernel
// wants each token's heads together ([tokens, ranks * heads_per_rank, ...]). Two kernels:
//
//  - a strided block copy, which moves those layouts into each other (q before the decode kernel,
//    the partial latents and their log-sum-exp after it) without a host loop of copies;
//  - the log-sum-exp merge of one rank's heads from every rank's partials (the CPU reference is
//    CpuOps::MlaMergeExpand, worker/backend/cpu_ops.cc): for partial outputs o_s normalised over
//    rank s's keys with natural-log lse_s,
//        out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m),   m = max_s lse_s,
//    the softmax over the union of the ranks' keys (ranks without keys have lse -inf and weigh
//    0; a row no rank has keys for is zeros). As FlashMLA's and vLLM's split-KV combines, and
//    vLLM's DCP (cp_lse_ag_out_rs: all-gather of outputs and lse, then the same merge).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

// dst block (i, j) = src block (i, j) for i < outer, j < inner: block_bytes bytes each, block
// (i, j) at src + i * src_outer + j * src_inner (bytes) and at dst + i * dst_outer + j *
// dst_inner. Blocks must not overlap between src and dst. Moves 16 bytes a thread where every
// size, stride and pointer is a multiple of 16, else 4 (then each must be a multiple of 4).
struct StridedBlockCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t outer = 0, inner = 0;
  int64_t block_bytes = 0;
  int64_t src_outer = 0, src_inner = 0;
  int64_t dst_outer = 0, dst_inner = 0;
};
// Nothing to copy is a no-op. Asynchronous; no allocation (graph-capturable).
absl::Status InvokeStridedBlockCopy(const StridedBlockCopy& c, cudaStream_t stream);

// The merge of one rank's heads: partial (source s, token t, head h) at row
// s * src_stride + t * slots + h of `latent` (bf16 rows of 512) and of `lse` (fp32, natural log);
// merged bf16 rows out[(t * heads + h) * 512 ...], fp32 arithmetic, one rounding.
struct MlaDcpMergeParams {
  const void* latent = nullptr;
  const float* lse = nullptr;
  int64_t src_stride = 0;  // rows between sources
  int sources = 0;         // 1..kMlaDcpMaxSources
  int tokens = 0;
  int heads = 0;  // merged heads a token (<= slots)
  int slots = 0;  // head slots a token in the partials
  void* out = nullptr;
};
constexpr int kMlaDcpMaxSources = 64;
absl::Status InvokeMlaDcpMerge(const MlaDcpMergeParams& p, cudaStream_t stream);

}  // namespace mlaserve
