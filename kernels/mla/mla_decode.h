// Absorbed-MLA decode on the GPU over a paged latent KV cache in any KvCacheFormat.
//
// Two kernels behind one plan:
// * the portable warp-sliced kernel (mla_decode_sliced.cuh) for SM90, SM100 and SM120: 16 query
//   rows per block, warp-level mma.sync (fp32 accumulate), cp.async loads, < 99 KB of shared
//   memory per block. Each of a block's 4 warps owns a 128-dim slice of every cache row. FP8 bytes
//   are converted in registers straight into f16 mma fragments (exact: e4m3 fits f16; fp8's
//   per-layer scale is applied to the fp32 scores and outputs, fp8_tiled's tile scales to each
//   token's partial score and P entry);
// * on SM 9.0 from 64 query rows (heads x s_q), the warpgroup-MMA kernel (mla_decode_wgmma.cuh):
//   64 rows per block, so each KV tile is read and converted once for up to 64 heads (fp8
//   converted exactly to f16 operand tiles in shared memory, fp8_tiled's power-of-two tile scales
//   multiplied in).
// The only rounding beyond the CPU reference (mla_decode_ref.h) is P = softmax weights in bf16
// (bf16 cache) or f16 (fp8 caches) for the P.V product (and, in the wgmma kernel, fp8_tiled's
// bf16 RoPE values below 2^-14 in f16).
//
// Work split: the KV tokens of the whole batch are cut into equal shares, one per persistent
// worker (a worker = one block per 16 or 64 query rows), so a single 128k sequence among short
// ones, or batch 1, still fills every SM. A sequence that spans several workers gets one partial
// result per worker (fp32, normalized, with its log-sum-exp), merged by a combine kernel. The
// per-call schedule is computed on the device from seq_lens (inside the split kernel for batch <=
// 512, else by a schedule kernel), so the kernels of a call can be captured in a CUDA graph once
// and replayed with new lengths.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

struct MlaDecodeParams {
  const void* q;               // bf16 [batch, s_q, heads, 576], contiguous.
  // Where each q row's RoPE dims (512..575) come from when not from q itself: row f (the flat
  // index (b * s_q + s) * heads + h) reads 64 bf16 at q_rope + f * q_rope_stride (16-B aligned,
  // the stride a multiple of 8 elements). The model's rotated q rows ([T, heads, 192]: nope 128,
  // rope 64) feed the kernel this way with no copy into q's columns 512..575. Null: from q.
  const void* q_rope = nullptr;
  int64_t q_rope_stride = 0;
  const void* kv_pool;         // [num_blocks, 64, KvCacheBytesPerToken(format)], 16-B aligned.
  const int32_t* block_table;  // [batch, max_blocks_per_seq] (device).
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [batch] (device): cached tokens INCLUDING the s_q new ones.
  int batch = 0, s_q = 1, heads = 0;  // s_q 1..4, heads 1..128.
  KvCacheFormat format = KvCacheFormat::kBf16;
  float kv_scale = 1.0f;       // kFp8 per-layer scale (dequant = e4m3 * kv_scale); else ignored.
  float softmax_scale = 0.0f;  // Multiplies q.k.
  void* out = nullptr;         // bf16 [batch, s_q, heads, 512].
  float* lse = nullptr;        // [batch, s_q, heads], natural log (nullable).
  void* workspace = nullptr;   // MlaDecodePlan::workspace_bytes, 256-B aligned (cudaMalloc).
  size_t workspace_bytes = 0;
  int variant = -1;  // Kernel variant; -1 chooses from the batch size (tests, benchmarks).
  // Cap on the persistent workers per row tile (0: every resident block slot of the GPU).
  // A lower cap leaves SMs to kernels running beside the decode (communication overlap) and
  // means fewer partial outputs; PlanMlaDecode must be given the same value.
  int max_workers = 0;
  // > 0: the batch-invariant schedule (issue 23's deterministic mode) for sequences of at most
  // this many tokens: every sequence is cut into pieces of fixed token counts (512, the first
  // 464) that depend on its length alone, one worker per piece, and partials are merged in piece
  // order, so a sequence's output bits do not depend on the other sequences of the call nor on
  // their number. The grid then covers batch x pieces(max_seq_len) workers (most exit at once
  // for short sequences); PlanMlaDecode must be given the same value. 0: the balanced split.
  int invariant_max_seq_len = 0;
  // Launch the combine (where sequences are split) programmatically dependent on the split kernel,
  // which lets it start as soon as its blocks are resident (kernels/programmatic_launch.cuh): the
  // combine's launch overlaps the split kernel's tail. Needs a stream other than nullptr.
  bool programmatic_combine = false;
  // The smallest share of the balanced split, in 16-token cost units (a sequence piece also
  // costs 3 units of fixed work): 0 takes the default rule (mla_decode_params.h's
  // MlaBalancedShare: 4 units, kMinTilesPerWorker, except for short jobs, which are cut into
  // about 72 pieces of 1-3 units); 1..1024 force that smallest share. A tuning knob for
  // benchmarks (mla_decode_bench --min-share); no effect on the batch-invariant schedule.
  int min_share = 0;
  // The combine's form. 0: one block per (sequence, row, 128 columns), its warps striding over
  // the row's partials; 1: one warp per (sequence, row), 8 a block, where the call has more than
  // 16 rows; -1 (default): 1 where the call has >= 1,024 rows (batch x s_q x heads) and at most
  // 16 workers a sequence (so ~17 partials a row or fewer), else 0. Measured (H100, session 32,
  // bench/RESULTS.md): the warp form 1.10-1.39x at batch 16-128 with 64-128 heads x 4k, 1.00-1.05x
  // at 32k, 0.57-0.94x at batch 1-4 (hundreds of partials a row, too few warps). The
  // batch-invariant schedule always takes form 0 (its combine order must not depend on the batch).
  int combine_row_warps = -1;
  // L2 hints of the TMA cache copies (the seesaw variants; others ignore it), bit flags: 1: the
  // copies carry an L2::evict_first cache policy on calls of up to ~320k cached tokens
  // (seesaw::kEvictFirstMaxCost); 2: the pool's tensor map promotes L2 fills to 128 B instead of
  // 256 B. FlashMLA's dense decode uses both on every call (deepseek-ai/FlashMLA 9241ae3,
  // csrc/sm90/decode/dense/splitkv_mla.cuh: CacheHintSm90::EVICT_FIRST; CUTLASS 147f567
  // cute/atom/copy_traits_sm90_tma.hpp: L2_PROMOTION_L2_128B by default). Measured (H100, session
  // 32, 128 heads bf16, up to four runs a shape): evict_first 1.10-1.13x at batch 1 x 32k and batch
  // 16-64 x 4k, 0.95-1.00x from 524k tokens (hence the bound); the 128-B fills add nothing.
  // Default 1; 0-3 for benchmarks.
  int kv_tma_l2 = 1;
  // Diagnostics (mla_decode_bench --timeline): a device buffer of 2 * mla::kMlaTimelineBlocks *
  // mla::kMlaTimelineEvents uint64 (mla_decode_params.h) where the sliced split kernel and the
  // combine stamp their blocks' phases in builds with MLASERVE_KERNEL_TIMELINE; null: none.
  unsigned long long* timeline = nullptr;
};

// Query i of sequence b attends to positions 0 .. seq_lens[b] - s_q + i, as MlaDecodeRef.

struct MlaDecodePlan {
  int variant;             // Index of the kernel variant (MlaDecodeVariantName).
  int rows_per_cta;        // 16 (sliced) or 64 (wgmma) query rows (of heads * s_q) per block.
  int num_workers;         // Persistent workers; the grid is num_workers * row tiles blocks.
  size_t workspace_bytes;  // Schedule + partial outputs: ~ (num_workers + batch) * rows * 2 KiB.
};

// The launch shape for the current device; depends on shapes, not on sequence lengths.
// fp8_tensor_cores: with variant -1, the fp8 formats may take a kernel on e4m3 tensor cores
// (MlaDecodeVariantFp8Mma: MlaDecodeRef's emulated FP8 form, within issue 18's accuracy bounds);
// false keeps the exact form.
absl::StatusOr<MlaDecodePlan> PlanMlaDecode(int batch, int s_q, int heads, KvCacheFormat format,
                                            int variant = -1, int max_workers = 0,
                                            int invariant_max_seq_len = 0,
                                            bool fp8_tensor_cores = true);

// Kernel variants (sliced with two cp.async ring depths, wgmma), for tests and benchmarks that
// cover each one.
int MlaDecodeVariantCount();
std::string MlaDecodeVariantName(int variant);
// Whether the variant can run on the current device (the wgmma variant needs SM 9.0).
bool MlaDecodeVariantAvailable(int variant, KvCacheFormat format);
// Whether the variant computes q.k and P.V on e4m3 tensor cores: the arithmetic MlaDecodeRef
// emulates with fp8_mma = MlaFp8MmaEmulation::kQkPv (mla_decode_ref.h) rather than the exact one.
bool MlaDecodeVariantFp8Mma(int variant);

// Runs [schedule,] split decode and combine on `stream` (2-3 kernels, graph-capturable).
absl::Status InvokeMlaDecode(const MlaDecodeParams& params, cudaStream_t stream);

// Quantizes and stores new cache rows with exactly KvCacheEncodeRow's rounding and scales.
struct KvCacheWriteParams {
  KvCacheFormat format = KvCacheFormat::kBf16;
  float fp8_scale = 1.0f;  // kFp8 only.
  const void* latent;      // bf16 [n, 512], row stride latent_stride elements (16-B aligned).
  const void* rope;        // bf16 [n, 64], row stride rope_stride elements (4-B aligned).
  int64_t latent_stride = 512, rope_stride = 64;
  const int64_t* slots;  // [n] (device): global slot block * 64 + offset; < 0 skips the row.
  int n = 0;
  void* kv_pool;  // [num_blocks, 64, KvCacheBytesPerToken(format)].
};

absl::Status InvokeKvCacheWrite(const KvCacheWriteParams& params, cudaStream_t stream);

}  // namespace mlaserve
