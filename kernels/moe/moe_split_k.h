// Split-K for the routed experts' decode GEMMs when few experts are active: with one to a few
// active local experts a decode step has a few dozen 128-row weight tiles (Kimi-K2.5 EP8 at
// batch 1: one expert, 32 gate_up and 56 down) for 132 SMs. A split GEMM runs
// FewExpertMoeGemmKernel (moe_few_expert_gemm.cuh): every tile gets `splits` blocks of 8 warps
// over disjoint K ranges; each writes its fp32 sums to `partial` and the last block of a tile to
// arrive (a counter per tile) adds the partials in split order and runs the usual epilogue. The
// sum order is fixed, so results are deterministic, but they differ from the unsplit K loop by
// fp32 rounding: the batch-invariant mode does not split.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlaserve {

struct MoeSplitK {
  int splits = 1;              // K ranges per tile (1: no split)
  float* partial = nullptr;    // [n / 128 x max_tiles][splits][block's accumulators] fp32
  int* counters = nullptr;     // [n / 128 x max_tiles], zero; the last block resets its own
};

// A block's partial slot: 128 weight rows x the 16 rows of a decode tile (only the tile's rows are
// written).
inline constexpr size_t kMoeSplitKPartialFloatsPerBlock = 128 * 16;
// At most this many splits, and at least ceil((k / 64) / kMoeSplitKMaxChunksPerSplit) where a GEMM
// splits: a block holds its K range of 16 activation rows in shared memory (16 x 32 x 128 B = 64
// KB at most, so three blocks fit an H200 SM and one an SM120 SM).
inline constexpr int kMoeSplitKMaxSplits = 32;
inline constexpr int kMoeSplitKMaxChunksPerSplit = 32;

// Partial buffer bytes for a GEMM of n weight rows (multiple of 128) over max_tiles row tiles.
inline size_t MoeSplitKPartialBytes(int n, int max_tiles, int splits) {
  return splits <= 1 ? 0
                     : static_cast<size_t>(n / 128) * max_tiles * splits *
                           kMoeSplitKPartialFloatsPerBlock * sizeof(float);
}

// K splits of one decode GEMM of n weight rows (a multiple of 128) over k: enough blocks of 8
// warps for about three per SM over the expected number of active local experts (tokens routed
// uniformly over routed_experts), at most kMoeSplitKMaxSplits and one per 256 of k; 1 (no split)
// past 64 assignments or where the tile is not the 16-token decode tile. Defined in
// moe_experts.cu.
int MoeSplitKFor(int sm_count, int local_experts, int routed_experts, int tokens, int top_k, int n,
                 int k);

}  // namespace mlaserve
