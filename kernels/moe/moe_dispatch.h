// Groups the (token, slot) assignments of a batch by local expert for the grouped GEMMs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mlaserve {

struct MoeDispatchParams {
  int tokens;
  int top_k;
  int first_expert;         // local experts: [first_expert, first_expert + num_local_experts)
  int num_local_experts;    // <= 1024; all experts: first_expert 0, num_local_experts E
  int tile_tokens;          // rows per GEMM tile (kMoeTileTokens*)
  const int32_t* topk_ids;  // [tokens, top_k] global expert ids
  // Outputs. Rows are the local assignments grouped by expert, ascending assignment index
  // a = t * top_k + j within an expert (a stable order: the same for any batch order of equal
  // tokens up to the renumbering).
  int32_t* expert_counts;      // [num_local_experts]
  int32_t* expert_offsets;     // [num_local_experts + 1], exclusive prefix sums of the counts
  int32_t* tile_offsets;       // [num_local_experts + 1], prefix sums of ceil(count / tile_tokens)
  int32_t* sorted_assignment;  // [tokens * top_k]: row -> a (the first expert_offsets[E] used)
  int32_t* assignment_row;     // [tokens * top_k]: a -> row, -1 for experts of other ranks
  // Launch programmatically dependent on the stream's previous kernel (the router): the kernel
  // waits for it before reading or writing anything, so the launch overlaps its tail.
  bool programmatic = false;
};

// One thread block: histogram, scans, then a stable placement over shared-memory chunks of the
// ids: by one warp up to 2048 assignments (decode), past that by all 32 warps, each a slice of
// the chunk from bases a per-warp count and a scan give (prefill; the one-warp walk measured
// 1.25 ms of an 11.4 ms layer at 262,144 assignments, issue 16). The same rows either way.
cudaError_t InvokeMoeDispatch(const MoeDispatchParams& params, cudaStream_t stream);

}  // namespace mlaserve
