// Kernel-side parameters and launchers of the MLA decode (internal to kernels/mla).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/mla/kv_cache_format.h"

namespace mlaserve::mla {

constexpr int kCostTokens = 16;        // Schedule granularity: work shares are multiples of 16
                                       // tokens (kernel tiles of 32 may straddle two shares).
constexpr int kSeqFixedCost = 3;       // Schedule cost of a sequence piece, in 16-token units
                                       // (q load, output write, pipeline fill).
constexpr int kMinTilesPerWorker = 4;  // Smallest share: below it partials cost more than KV.
// Short jobs (a batch's total cost below kShortJobWorkers * kMinTilesPerWorker units, e.g. one
// sequence of up to ~3.4k tokens) are cut into about kShortJobWorkers pieces instead: measured on
// the H200 (bench/RESULTS.md, session 13; mla_decode_bench --min-share), batch 1 x 1k went from 17
// workers of 4 units to 67 of 1 unit: 10.0 -> 7.8 us (bf16, 8 heads), 11.3 -> 9.2 us (fp8_tiled),
// while at 4k 259 one-unit workers lost to 65 of 4 units (11.4 -> 13.4 us): the combine's cost
// grows with the piece count, so the count, not the share, is what the rule holds near 72.
constexpr int kShortJobWorkers = 72;
// The balanced split's share (cost units a worker) for a batch of `total` cost units over
// `num_workers` workers; min_share > 0 overrides the smallest share (MlaDecodeParams::min_share),
// 0 takes the rule above.
constexpr int MlaBalancedShare(int total, int num_workers, int min_share) {
  const int even = (total + num_workers - 1) / num_workers;
  const int short_job = (total + kShortJobWorkers - 1) / kShortJobWorkers;
  const int smallest = min_share > 0 ? min_share
                       : short_job < 1 ? 1
                       : short_job > kMinTilesPerWorker ? kMinTilesPerWorker
                                                        : short_job;
  return even > smallest ? even : smallest;
}
// Schedule cost of one sequence (kCostTokens units plus the fixed cost).
constexpr int MlaSequenceCost(int len) {
  return (len + kCostTokens - 1) / kCostTokens + kSeqFixedCost;
}
// Batch-invariant schedules (MlaDecodeKernelParams::fixed_share > 0): a sequence's cost is
// rounded up to whole shares, so that no worker spans two sequences and a sequence's pieces are
// cut at offsets that depend on its own length alone. The share is kInvariantShareCost units:
// the first piece covers 512 - 48 tokens (the fixed cost), the others 512.
constexpr int kInvariantShareCost = 32;
constexpr int MlaScheduledCost(int len, int fixed_share) {
  const int c = MlaSequenceCost(len);
  return fixed_share > 0 ? (c + fixed_share - 1) / fixed_share * fixed_share : c;
}
// Batches up to this size have their schedule computed inside the sliced kernel (no separate
// schedule launch); the prefix lives in shared memory. A variant short of shared memory takes
// less (kSm120InlineScheduleMaxBatch: the SM120 two-blocks variant, mla_decode.cc).
constexpr int kInlineScheduleMaxBatch = 512;
constexpr int kSm120InlineScheduleMaxBatch = 256;
constexpr int kSeesawEarlyInlineScheduleMaxBatch = 64;  // seesaw::Layout<1>::kSchedMax

struct MlaDecodeKernelParams {
  const uint16_t* __restrict__ q;           // bf16 [batch, s_q, heads, 576]
  // RoPE dims of flat q row f at q_rope + f * q_rope_stride (q + 512 and 576 when they are q's).
  const uint16_t* __restrict__ q_rope;
  int64_t q_rope_stride;
  const uint8_t* __restrict__ kv_pool;      // [num_blocks, 64, row_bytes]
  const int32_t* __restrict__ block_table;  // [batch, max_blocks_per_seq]
  const int32_t* __restrict__ seq_lens;     // [batch]
  int max_blocks_per_seq;
  int batch, s_q, heads, rows;  // rows = s_q * heads
  int num_workers;
  int fixed_share;             // 0: shares balanced over num_workers; > 0: batch-invariant.
  int inline_schedule;         // 1: the (sliced) split kernel computes the schedule itself.
  int programmatic_combine;    // 1: the combine is launched programmatically (MlaDecodeParams).
  int min_share;               // MlaDecodeParams::min_share (0: MlaBalancedShare's rule)
  int combine_row_warps;       // 1: one warp a row (MlaDecodeParams::combine_row_warps, resolved)
  int kv_tma_l2;               // MlaDecodeParams::kv_tma_l2 (1: evict_first, 2: 128-B fills)
  float score_scale_log2;      // softmax_scale * log2(e) (* kv_scale for kFp8)
  float out_scale;             // kv_scale for kFp8, else 1
  uint16_t* __restrict__ out;  // bf16 [batch, s_q, heads, 512]
  float* __restrict__ lse;     // [batch, s_q, heads] or null
  // Workspace (device):
  int32_t* __restrict__ schedule;  // [batch + 2]: cost prefix P[0..batch], then tiles per worker
  float* __restrict__ o_part;      // [num_workers + batch, rows, 512]: normalized partial outputs
  float* __restrict__ lse_part;    // [num_workers + batch, rows]: their log2-sum-exp (log2 units)
  // Diagnostics (MlaDecodeParams::timeline): [2 * kMlaTimelineBlocks][kMlaTimelineEvents], or null.
  unsigned long long* __restrict__ timeline;
};

// The timeline's events (MlaDecodeParams::timeline; stamped by thread 0 of each block in builds
// with MLASERVE_KERNEL_TIMELINE, by the sliced split kernel and the combines only): split block i
// writes row i, combine block i row kMlaTimelineBlocks + i (blocks past kMlaTimelineBlocks
// write nothing). Where a block handles several sequence pieces, the piece events are its last
// piece's; an event a block never reaches stays as the caller left it (zeroed).
enum MlaTimelineEvent {
  kMlaEntry = 0,      // split kernel: first instruction
  kMlaScheduled,      // its share known (the schedule computed or read)
  kMlaQReady,         // the piece's ring filled and q loaded, before its first tile
  kMlaFirstTileDone,  // the piece's first tile computed (pieces of 2+ tiles)
  kMlaTilesDone,      // the piece's last tile computed
  kMlaSplitExit,      // partial outputs stored
  kMlaCombineEntry,   // combine block: after the wait for the split kernel
  kMlaCombineExit,    // its rows written (blocks with unsplit rows exit before)
  kMlaTimelineEvents
};
inline constexpr int kMlaTimelineBlocks = 8192;

// Resident blocks per SM of a split-decode kernel with `smem_bytes` of dynamic shared memory
// (after opting in to that much); 0 when the opt-in or the query fails.
inline int DecodeKernelBlocksPerSm(const void* kernel, int threads, int smem_bytes) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
      cudaSuccess) {
    return 0;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes) !=
      cudaSuccess) {
    return 0;
  }
  return n;
}

// Warp-sliced split decode kernel (mla_decode_sliced.cuh): 16 query rows per block, kTile KV
// tokens per stage, kStages-deep cp.async ring per warp, the schedule computed in the kernel for
// batches up to kSchedMax (p.inline_schedule must be 0 above it); kQkE4m3: q.k on e4m3 MMAs.
template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax, bool kQkE4m3>
cudaError_t LaunchMlaDecodeSliced(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream);
template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax, bool kQkE4m3>
int MlaDecodeSlicedBlocksPerSm();

// SM90a warpgroup-MMA split decode kernel (mla_decode_wgmma.cuh): 64 query rows per block,
// kTile KV tokens per tile, a kStages-deep ring; kAhead (fp8 formats only): the loop issues the
// next tile's q.k before this tile's softmax. BlocksPerSm is 0 off SM 9.0.
template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead = false>
cudaError_t LaunchMlaDecodeWgmma(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream);
template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead = false>
int MlaDecodeWgmmaBlocksPerSm();

// SM90a seesaw split decode kernel (mla_decode_seesaw.cuh): bf16 cache, 64 query rows per block,
// 64-token blocks, one a warpgroup; kTma: full blocks copied by TMA (the instantiated form);
// kOrder: the order of the warpgroups' work (0: session 28's; 1: FlashMLA's, which schedules
// batches up to kSeesawEarlyInlineScheduleMaxBatch in the kernel). BlocksPerSm is 0 off SM 9.0.
template <bool kTma, int kOrder>
cudaError_t LaunchMlaDecodeSeesaw(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream);
template <bool kTma, int kOrder>
int MlaDecodeSeesawBlocksPerSm();

// SM90a split decode kernel with q.k and P.V on e4m3 wgmma (mla_decode_fp8mma64.cuh): the fp8
// formats, 64 query rows per block, 64-token tiles (whole cache blocks) split by tokens between
// the warpgroups, a kStages-deep ring. The arithmetic is MlaDecodeRef's fp8_mma = kQkPv form, not
// the exact one. BlocksPerSm is 0 off SM 9.0.
template <KvCacheFormat kFormat, int kStages>
cudaError_t LaunchMlaDecodeFp8Mma64(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream);
template <KvCacheFormat kFormat, int kStages>
int MlaDecodeFp8Mma64BlocksPerSm();

// Cache write: one warp per token (kv_cache_write.cu).
cudaError_t LaunchKvCacheWrite(KvCacheFormat format, float fp8_scale, const uint16_t* latent,
                               int64_t latent_stride, const uint16_t* rope, int64_t rope_stride,
                               const int64_t* slots, int n, uint8_t* kv_pool, cudaStream_t stream);

cudaError_t LaunchMlaDecodeSchedule(const MlaDecodeKernelParams& p, cudaStream_t stream);
cudaError_t LaunchMlaDecodeCombine(const MlaDecodeKernelParams& p, cudaStream_t stream);

}  // namespace mlaserve::mla
