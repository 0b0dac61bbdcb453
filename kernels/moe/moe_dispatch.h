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
};

// One thread block: histogram, scans, then a stable placement by one warp over shared-memory
// chunks of the ids. Cost grows with tokens * top_k (about 0.2 ms at 262144 assignments).
cudaError_t InvokeMoeDispatch(const MoeDispatchParams& params, cudaStream_t stream);

}  // namespace mlaserve
