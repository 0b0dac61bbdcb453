// Kernel-side arguments and launcher of the MLA prefill attention (internal to kernels/mla);
// the kernel is mla_prefill_attention.cuh, one instantiation per (qk_nope, v_dim) in
// prefill_instantiations/, the dispatch in mla_prefill_attention.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mlaserve::mla {

constexpr int kPrefillBlockRows = 64;  // Query rows per block (4 warps x 16).
constexpr int kPrefillThreads = 128;

struct MlaPrefillKernelArgs {
  const uint16_t* __restrict__ q;            // bf16 [total_q, heads, nope + 64]
  const uint16_t* __restrict__ kv;           // bf16 [total_kv, heads, nope + v]
  const uint16_t* __restrict__ k_rope;       // bf16 [total_kv, 64]
  const int32_t* __restrict__ q_begin;       // [num_seqs + 1]
  const int32_t* __restrict__ kv_begin;      // [num_seqs + 1]
  const int32_t* __restrict__ context_lens;  // [num_seqs]
  int heads;
  float scale_log2;            // softmax_scale * log2(e)
  uint16_t* __restrict__ out;  // bf16 [total_q, heads, v]
};

// grid = (ceil(max_q_len / 64), heads, num_seqs), block = 128 threads.
template <int kNope, int kV>
cudaError_t LaunchMlaPrefill(const MlaPrefillKernelArgs& args, dim3 grid, cudaStream_t stream);

}  // namespace mlaserve::mla
