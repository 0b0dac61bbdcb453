// The active routed experts' weights into the L2 cache before the decode GEMMs read them
// (kernels/prefetch/l2_prefetch.h says why; the few-expert decode streams one or two experts at
// 25-50% of copy bandwidth, bench/RESULTS.md, issue 16). The experts are found on the device
// from the router's top-k ids, so the call needs no host sync and can be captured in a graph.
//
// This header is included by C++20 host code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace mlaserve {

struct MoeExpertPrefetchParams {
  static constexpr int kMaxArrays = 4;
  // Decode batches only: the assignments are scanned by one warp.
  static constexpr int kMaxAssignments = 64;
  const int32_t* topk_ids = nullptr;  // [assignments] global expert ids (device)
  int assignments = 0;                // tokens x top_k, <= kMaxAssignments
  int first_expert = 0, num_local_experts = 0;
  // The first max_experts distinct local experts in slot order (token-major) are prefetched.
  int max_experts = 1;
  // Local expert e's bytes of array a: [base[a] + e * expert_bytes[a], + expert_bytes[a]).
  const void* base[kMaxArrays] = {};
  size_t expert_bytes[kMaxArrays] = {};
  int arrays = 0;
  int mode = 0;                // L2PrefetchRanges::mode
  int blocks_per_expert = 0;   // <= 0: the SMs / max_experts (at least 1)
  // Optional (tests): [max_experts] the local experts prefetched in order, -1 past the last.
  int32_t* selected = nullptr;
  bool programmatic = true;    // waits for the router before reading the ids either way
};

cudaError_t InvokeMoeExpertPrefetch(const MoeExpertPrefetchParams& p, cudaStream_t stream);

}  // namespace mlaserve
