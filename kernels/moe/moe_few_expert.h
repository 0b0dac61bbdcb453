// Which kernel runs the routed experts' decode GEMMs of 16-token tiles: the tile kernel
// (moe_weight_only_gemm.cuh: 128 weight rows x the whole K a block of 4 warps) or the few-expert
// kernel (moe_few_expert_gemm.cuh: 8 warps a block splitting the K of 16-32 rows, a persistent
// grid). The tile kernel streams 70-75% of copy bandwidth once dozens of experts are active but
// gives one block an SM to one or two (0.6-1.0 TB/s); the few-expert kernel starts the weight
// streams of one or two experts on every SM but tops out near 50% (measured on the H200,
// bench/RESULTS.md, "The few-expert kernel").
#pragma once

namespace mlaserve {

enum class MoeDecodeKernel {
  kAuto,       // ChooseMoeFewExpert decides
  kTile,       // always the tile kernel (its K order is the same for every batch: the
               // batch-invariant mode needs it)
  kFewExpert,  // the few-expert kernel for every 16-token tile (where its shared memory, 4
               // activation rows over the whole K, fits: K up to ~23,000)
};

// Whether the few-expert kernel is the faster at `tokens` tokens of top_k picks over
// routed_experts, local_experts of them on this rank (uniform routing expected): at most 64
// assignments, 16-token tiles, and at most kMoeFewExpertMaxActive local experts expected active.
// Defined in moe_experts.cu.
bool ChooseMoeFewExpert(int local_experts, int routed_experts, int tokens, int top_k);
// Measured crossover (moe_bench --decode, H200): Kimi-K2.5 EP8 at 4 tokens (5 active) 76 against
// 80 us, at 8 tokens (10 active) 126 against 127 us; DeepSeek all-256 at 1 token (8 active) 109
// against 83 us.
inline constexpr double kMoeFewExpertMaxActive = 6.0;

// The 16-token tiles a decode step of `tokens` tokens is expected to give this rank (uniform
// routing): its expected active local experts while they mostly hold one tile each (tokens * top_k
// <= 4 * routed_experts), else 0 (unknown). Sizes the tile kernel's wave tail
// (Nvfp4MoeGemmParams::expected_tiles). Defined in moe_experts.cu.
int MoeExpectedDecodeTiles(int local_experts, int routed_experts, int tokens, int top_k);

}  // namespace mlaserve
