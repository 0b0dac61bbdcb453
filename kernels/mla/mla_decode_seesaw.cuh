// SM90a split-KV MLA decode, bf16 cache, 64 query rows a block: the "seesaw" schedule (variant
// wgmma_rows64_seesaw_tma, the plan's choice for bf16 above 64 rows on SM 9.0). Same schedule,
// sequence pieces, partial outputs and combine as the other kernels (mla_decode_sliced.cuh,
// mla_decode_wgmma.cuh); only the per-block work differs.
//
// Why (kernels/mla/NOTES.md, session 28): the 64-row kernel of mla_decode_wgmma.cuh splits a
// 32-token tile's 36 q.k k-steps between its two warpgroups (m64n32), so Q (73.7 KB) is read from
// shared memory once per 32 tokens and the two fp32 partial scores are exchanged through shared
// memory before the softmax; at 128 heads it reads 0.49-0.50 of copy bandwidth where FlashMLA's
// dense decode reads 0.81-0.83 on the same H100 (bench/RESULTS.md, session 28). This kernel takes
// the schedule FlashMLA's authors describe (deepseek-ai/FlashMLA docs/20250422-new-kernel-deep-
// dive.md; the design is taken from that text, no code from the repository):
//
// * KV in 64-token blocks (one cache page each), two at a time in two operand buffers, laid out
//   as mla_decode_wgmma.cuh's tiles: [9 blocks of 64 dims][64 tokens][128 B], 128-byte swizzle.
//   Warpgroup g owns buffer g: it computes the whole q.k of that buffer's block (36 k-steps of
//   m64n64k16, Q and K from shared memory), so Q is read once per 64 tokens a warpgroup and no
//   partial scores are exchanged.
// * O (64 x 512 fp32) is split by columns: warpgroup g holds dims [256g, 256g + 256) of every
//   row, 128 registers a thread. Its P.V takes its own P from registers (RS) and the other
//   warpgroup's P from shared memory (SS), written into the RoPE dims (64-dim block 8) of the
//   other buffer, which P.V does not read: 64 rows x 64 tokens of bf16 is exactly that block.
// * The seesaw order for blocks (0, 1) in buffers (0, 1) with m the running max:
//     W0: S0 = q K0^T; m0 = max(m, rowmax S0) (lazy, as the other kernels: P <= 2^8);
//         scale0 = 2^(m - m0); P0 = 2^(S0 - m0); publish m0, scale0;
//         O_L = O_L scale0 + P0 V0_L;
//     W1: S1 = q K1^T (beside W0's); after m0: m1 = max(m0, rowmax S1); scale1 = 2^(m0 - m1);
//         P1 = 2^(S1 - m1); O_R = O_R scale0 scale1 + P1 V1_R; publish m1, scale1, P1;
//     W0: P0 *= scale1; publish P0; O_L = O_L scale1 + P1 V1_L;
//     W1: O_R += P0 V0_R.
//   Each warpgroup's softmax runs beside the other's tensor work. The row sums: W0 keeps
//   l0 = (l0 scale0 + rowsum P0) scale1, W1 l1 = l1 scale0 scale1 + rowsum P1, both at the
//   current max; l = l0 + l1 at the end of a piece.
// * Loads: cp.async by one warpgroup (buffer 0 by W1 after its last read of it, buffer 1 by W0
//   after both warpgroups' last reads), completion tracked by one mbarrier per 64-dim block
//   (cp.async.mbarrier.arrive), so a q.k starts on the first 8 KB of its block and the next
//   block of a buffer is in flight while the other buffer is computed. Rows past a sequence's
//   end are zero-filled; a piece with an odd block count gets a zero-filled, fully masked last
//   block.
// * Hand-offs between the warpgroups by named barriers (bar.arrive by the producer, bar.sync by
//   the consumer, 256 threads each).
// bf16 only (the fp8 formats' converted operand blocks do not fit beside Q and two buffers:
// kernels/mla/NOTES.md, session 28).
#pragma once

#include <cuda.h>          // CUtensorMap (a type only: no driver library is linked)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_schedule.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace mlaserve::mla {

namespace seesaw {

constexpr int kRows = 64;
constexpr int kThreads = 256;                        // Two warpgroups.
constexpr int kBlockTokens = kKvBlockTokens;         // 64: one cache page a buffer
constexpr int kDimBlocks = kMlaQkDim / 64;           // 9 blocks of 64 dims (8 latent, 1 RoPE).
constexpr int kChunkBytes = kBlockTokens * 128;      // one 64-dim block of a buffer: 8,192
constexpr int kBufBytes = kDimBlocks * kChunkBytes;  // 73,728
constexpr int kQBytes = kDimBlocks * kRows * 128;    // 73,728
constexpr int kRowBytes = kMlaQkDim * 2;             // bf16 cache row: 1,152
constexpr int kQOff = 0;
constexpr int kBufOff = kQOff + kQBytes;
// The rest of the layout depends on the kernel's order (kOrder, below): order 1 keeps W1's P in
// a buffer of its own (8 KB) and so schedules at most 64 sequences in the kernel (larger batches
// take the separate schedule launch, as every variant does above its own bound).
template <int kOrder>
struct Layout {
  static constexpr int kP1Off = kBufOff + 2 * kBufBytes;  // order 1: P1 (64 rows x 64 tokens)
  // Row statistics handed between the warpgroups, each written by one warpgroup only: m0,
  // scale0 (W0), m1, scale1 (W1), l0, l1 (64 floats each).
  static constexpr int kStatOff = kP1Off + (kOrder == 1 ? kChunkBytes : 0);
  static constexpr int kBarOff = kStatOff + 6 * kRows * 4;
  static constexpr int kSchedOff = kBarOff + 2 * kDimBlocks * 8;  // mbarriers: [buffer][dim blk]
  static constexpr int kSchedMax =
      kOrder == 1 ? kSeesawEarlyInlineScheduleMaxBatch : kInlineScheduleMaxBatch;
  static constexpr int kSchedBytes = 4 * (kSchedMax + 2);
  static constexpr int kSmemBytes = kSchedOff + kSchedBytes + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "H100 / H200: 227 KB per block");
};
static_assert(kBlockTokens == 64, "a buffer is one 64-token cache page");

// Named barriers (0 is __syncthreads').
constexpr int kBarScale0 = 1;   // W0 published m0, scale0
constexpr int kBarP1 = 2;       // W1 published m1, scale1 (order 0: and P1)
constexpr int kBarP0 = 3;       // W0 published P0 (times scale1)
constexpr int kBarIssued = 4;   // order 1: W1 stored P1 and issued P0 V0_R
constexpr int kBarLoaders = 5;  // + warpgroup: its 128 threads' cp.async tracked (kTma only)

__device__ __forceinline__ void MbarInit(uint32_t addr, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
// Arrives on the mbarrier once every cp.async this thread issued before has landed; the barrier's
// expected count is not raised (noinc): it was set to the number of arriving threads at init.
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
// Waits until the mbarrier phase of the given parity has completed.
// kTma's forms: the copies of a cp.async-filled block tracked without raising the expected
// count (one plain arrive by the warpgroup's first thread completes the phase once they land),
// and a TMA tile copy completing on the mbarrier by its byte count.
__device__ __forceinline__ void CpAsyncMbarArriveTracked(uint32_t addr) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t addr, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes)
               : "memory");
}
// The box {64 dims, 64 tokens} at (x = first dim, y = first token) of the pool's tensor map into
// shared memory at dst (128-byte swizzled, as the map says), completing on mbarrier bar.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, int x, int y,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// The same copy with an L2 cache policy (createpolicy's 64-bit operand) on the reads.
__device__ __forceinline__ void TmaLoad2dHint(uint32_t dst, const CUtensorMap* map, int x, int y,
                                              uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "l"(policy)
      : "memory");
}
// MlaDecodeParams::kv_tma_l2 bit 1 applies to calls of at most this schedule cost (16-token units
// plus 3 a sequence: ~320k cached tokens). Session 32 (H100, 128 heads bf16): evict_first
// 0.99-1.13x (mean 1.06) on the seven shapes of up to 262k tokens measured, 0.95-1.00x (mean 0.97)
// on the six of 524k and more.
constexpr int kEvictFirstMaxCost = 20000;
// An L2 policy that marks every line it touches evict_first (PTX ISA, createpolicy).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void BarSyncCount(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t addr, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (done == 0);
}
// The producers' side of a hand-off. A racecheck build may make it a full rendezvous
// (-DMLASERVE_SEESAW_SYNC_HANDOFFS=1: bar.sync on both sides, slower, the same order of accesses)
// to tell the tool's reports on the statistics apart from real races (session 28: racecheck flags
// accesses ordered only by bar.arrive -> bar.sync; session 29: 0 hazards on the rendezvous build,
// so those reports are the tool's model of bar.arrive, which PTX orders like bar.sync).
__device__ __forceinline__ void BarArrive(int id) {
#if defined(MLASERVE_SEESAW_SYNC_HANDOFFS) && MLASERVE_SEESAW_SYNC_HANDOFFS
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
#else
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
#endif
}
__device__ __forceinline__ void BarSync(int id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

}  // namespace seesaw

// kTma: a cache block whose 64 tokens are all inside the sequence is copied by TMA (one thread,
// 9 tiles of 64 x 64 from the pool's tensor map `map`, async-proxy writes: no proxy fence before
// the wgmma reads them); a sequence's last, partly filled block and the zero block keep cp.async
// (rows past the end must be zeros: TMA would copy whatever the page holds there, and 0 x NaN in
// P.V is NaN). Without kTma every block is copied by cp.async and `map` is unused. (Session 28's
// third variant, W1's q.k issued after W0's, lost 8-10% and was removed.)
//
// kOrder 0 (variant wgmma_rows64_seesaw_tma): the order above; P1 lies in buffer 1's block 8, so
// W1 may refill buffer 1 only after W0's P1 V1_L. kOrder 1 (wgmma_rows64_seesaw_tma_early): the
// order FlashMLA's sm90 dense decode uses (its source was read for the order of operations only,
// nothing copied; deepseek-ai/FlashMLA 9241ae3, csrc/sm90/decode/dense/splitkv_mla.cuh):
// * P1 in a buffer of its own, so W1 refills buffer 1's dims 256-575 right after its own P.V
//   (mid-pair) and its next q.k starts on those five blocks;
// * W1 publishes m1 and scale1 before storing P1; W0 waits for "W1 issued P0 V0_R" (kBarIssued,
//   which also covers P1) before its P1 V1_L, so the tensor cores free buffer 0's right half
//   first;
// * W0 issues its next q.k on the four blocks it refilled mid-pair right behind P1 V1_L, without
//   waiting for it, refills buffer 1's left half as soon as the P.V retires, then issues the other
//   five blocks; W1 issues its next q.k once both its P.V have retired and it has refilled;
// * each warpgroup ends the pair waiting for its q.k, inside its own branch and outside the
//   "more pairs" one (a wgmma in flight across the loop's back edge, or a wait after the two
//   branches merge, makes ptxas serialize every wgmma: C7520 / C7515);
// * the cache pages of the next pair are read at the top of the pair, so no refill waits on a
//   block-table load.
template <bool kTma, int kOrder>
__global__ void __launch_bounds__(seesaw::kThreads, 1)
    MlaDecodeSeesawKernel(const MlaDecodeKernelParams p, const __grid_constant__ CUtensorMap map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Launched plainly: a programmatically launched combine may become resident now and wait for
  // this grid.
  pdl::AllowDependentLaunch();
  using namespace seesaw;
  using L = Layout<kOrder>;
  extern __shared__ uint8_t smem_raw[];
  // 1024-B aligned base: the swizzle atoms of the wgmma operands must be.
  const uint32_t smem_raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (smem_raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - smem_raw_addr);
  const uint32_t q_smem = base + kQOff;
  float* s_m0 = reinterpret_cast<float*>(smem + L::kStatOff);
  float* s_scale0 = s_m0 + kRows;
  float* s_m1 = s_scale0 + kRows;
  float* s_scale1 = s_m1 + kRows;
  float* s_l = s_scale1 + kRows;  // [2][64]
  const uint32_t bar_base = base + L::kBarOff;
  auto full_bar = [&](int buf, int kb) { return bar_base + 8 * (buf * kDimBlocks + kb); };

  const int tid = threadIdx.x, lane = tid & 31;
  // Warpgroup index, broadcast from lane 0 so the compiler knows it is warp-uniform.
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int tw = tid & 127;               // thread in warpgroup
  const int wq = tw >> 5;                 // warp in warpgroup: rows 16wq .. 16wq + 15
  const int g = lane >> 2, c = lane & 3;  // accumulator row / column group
  const int row_tiles = (p.rows + kRows - 1) / kRows;
  const int worker = blockIdx.x / row_tiles, mt = blockIdx.x % row_tiles;

  if (tid < 2 * kDimBlocks) MbarInit(bar_base + 8 * tid, kTma ? 1 : 128);
  __syncthreads();
  const int32_t* prefix = p.schedule;
  if (p.inline_schedule) {
    prefix = InlineSchedule<kThreads>(p, reinterpret_cast<int32_t*>(smem + L::kSchedOff));
  }
  const int total = prefix[p.batch], share = prefix[p.batch + 1];
  const int cost_begin = worker * share;
  const int cost_end = min(cost_begin + share, total);
  if (cost_begin >= cost_end) return;
  const int first_seq = FirstSequence(prefix, p.batch, cost_begin);

  // This thread's two rows (of the block's 64) and their indices in the sequence's rows.
  const int lrow_lo = 16 * wq + g, lrow_hi = lrow_lo + 8;
  const int row_lo = mt * kRows + lrow_lo, row_hi = mt * kRows + lrow_hi;

  // This warpgroup's buffer (its q.k, its P.V with its own P) and the other one (P.V with the
  // other warpgroup's P, which lies in the other buffer's 64-dim block 8).
  const uint32_t own_buf = base + kBufOff + wgi * kBufBytes;
  const uint32_t other_buf = base + kBufOff + (1 - wgi) * kBufBytes;
  const wgmma::Desc dq = wgmma::Desc128B(q_smem, 16, 1024);
  const wgmma::Desc dk = wgmma::Desc128B(own_buf, 16, 1024);
  const wgmma::Desc dv_own = wgmma::Desc128B(own_buf + 4 * wgi * kChunkBytes, kChunkBytes, 1024);
  const wgmma::Desc dv_other =
      wgmma::Desc128B(other_buf + 4 * wgi * kChunkBytes, kChunkBytes, 1024);
  // P of the other warpgroup: W1's P0 in buffer 0's block 8; W0's P1 in buffer 1's block 8
  // (order 0) or in its own buffer (order 1).
  const uint32_t p1_smem =
      kOrder == 1 ? base + L::kP1Off : base + kBufOff + kBufBytes + 8 * kChunkBytes;
  const uint32_t own_p = wgi == 0 ? own_buf + 8 * kChunkBytes : p1_smem;
  const wgmma::Desc dp_other =
      wgmma::Desc128B(wgi == 0 ? p1_smem : other_buf + 8 * kChunkBytes, 16, 1024);
  // Fills of this warpgroup's buffer so far (the parity of the mbarrier phase to wait for).
  uint32_t fills = 0;

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const bool whole = piece.whole;
    const int blk_begin = tok_begin / kBlockTokens;
    const int n_blk =
        tok_end > tok_begin ? (tok_end + kBlockTokens - 1) / kBlockTokens - blk_begin : 0;
    const int n_pairs = (n_blk + 1) / 2;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;

    // The 64-dim blocks in `mask` of block j of the piece (j < n_blk; else zeros) into buffer
    // buf by this warpgroup's 128 threads: thread (token ct, half) copies 4 of the 8 16-B chunks
    // of the token's 128-B row of each dim block, then arrives on that dim block's mbarrier. A
    // buffer's dim blocks are refilled by whichever warpgroup reads them last, as soon as it has:
    // buffer 0's dims 0-255 (V0_L) by W0 after its own P.V, dims 256-511 and the P0 block by W1
    // after its P0 V0_R; buffer 1's dims 256-511 (V1_R) by W1 after its own P.V, dims 0-255 and
    // the P1 block by W0 after its P1 V1_L. Each q.k takes the early half first.
    // `page`: the block's cache page (page_of(j), read ahead by order 1).
    auto page_of = [&](int j) { return j < n_blk ? blocks[blk_begin + j] : 0; };
    auto load_block = [&](int j, int page, int buf, uint32_t mask) {
      const int ct = tw >> 1, half = tw & 1;
      const bool real = j < n_blk;
      const int t = blk_begin + j;
      const uint8_t* row =
          real ? p.kv_pool + (static_cast<size_t>(page) * kBlockTokens + ct) * kRowBytes
               : p.kv_pool;
      const bool valid = real && t * kBlockTokens + ct < len;
      if (kTma && real && t * kBlockTokens + kBlockTokens <= len) {
        if (tw == 0) {
          const int y = page * kBlockTokens;
          const bool hint = (p.kv_tma_l2 & 1) != 0 && total <= kEvictFirstMaxCost;
          const uint64_t policy = hint ? EvictFirstPolicy() : 0;
#pragma unroll
          for (int kb = 0; kb < kDimBlocks; ++kb) {
            if (((mask >> kb) & 1u) == 0) continue;
            MbarArriveExpectTx(full_bar(buf, kb), kChunkBytes);
            const uint32_t dst = base + kBufOff + buf * kBufBytes + kb * kChunkBytes;
            if (hint) {
              TmaLoad2dHint(dst, &map, 64 * kb, y, full_bar(buf, kb), policy);
            } else {
              TmaLoad2d(dst, &map, 64 * kb, y, full_bar(buf, kb));
            }
          }
        }
        return;
      }
      const uint32_t dst = base + kBufOff + buf * kBufBytes + ct * 128;
#pragma unroll
      for (int kb = 0; kb < kDimBlocks; ++kb) {
        if (((mask >> kb) & 1u) == 0) continue;
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          const int cch = 4 * half + q4;
          ptx::CpAsync16(dst + kb * kChunkBytes + ((cch ^ (ct & 7)) << 4),
                         row + (valid ? kb * 128 + cch * 16 : 0), valid);
        }
        if constexpr (kTma) {
          CpAsyncMbarArriveTracked(full_bar(buf, kb));
        } else {
          CpAsyncMbarArrive(full_bar(buf, kb));
        }
      }
      if constexpr (kTma) {
        BarSyncCount(kBarLoaders + wgi, 128);  // every thread's copies are tracked
        if (tw == 0) {
#pragma unroll
          for (int kb = 0; kb < kDimBlocks; ++kb) {
            if (((mask >> kb) & 1u) != 0) MbarArrive(full_bar(buf, kb));
          }
        }
      }
    };
    // Prologue: each warpgroup its dim blocks of both buffers, as in the loop. Order 1: buffer
    // 1's block 8 (no P there) goes with its right half.
    constexpr uint32_t kMaskB0W0 = 0x00Fu, kMaskB0W1 = 0x1F0u;  // buffer 0: W0, W1's dim blocks
    constexpr uint32_t kMaskB1W1 = kOrder == 1 ? 0x1F0u : 0x0F0u;  // buffer 1: W1, W0's
    constexpr uint32_t kMaskB1W0 = kOrder == 1 ? 0x00Fu : 0x10Fu;
    if (n_pairs > 0) {
      load_block(0, page_of(0), 0, wgi == 0 ? kMaskB0W0 : kMaskB0W1);
      load_block(1, page_of(1), 1, wgi == 0 ? kMaskB1W0 : kMaskB1W1);
    }

    // Q rows of this block into shared memory (swizzled, K-major), as mla_decode_wgmma.cuh.
    {
      const uint16_t* qb = p.q + static_cast<size_t>(b) * p.rows * kMlaQkDim;
      const int lr = tid >> 2, part = tid & 3;  // 4 threads per row, 18 chunks each
      const int row = mt * kRows + lr;
      const bool ok = row < p.rows;
      const uint4* src = reinterpret_cast<const uint4*>(qb + static_cast<size_t>(row) * kMlaQkDim);
      const uint4* rsrc = reinterpret_cast<const uint4*>(
          p.q_rope + (static_cast<int64_t>(b) * p.rows + row) * p.q_rope_stride);
#pragma unroll 6
      for (int k = 0; k < 18; ++k) {
        const int cc = part + 4 * k, kb = cc >> 3, ch = cc & 7;
        const uint4 v = !ok                      ? make_uint4(0, 0, 0, 0)
                        : cc < kMlaLatentDim / 8 ? src[cc]
                                                 : rsrc[cc - kMlaLatentDim / 8];
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         q_smem + kb * (kRows * 128) + lr * 128 + ((ch ^ (lr & 7)) << 4)),
                     "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
      }
    }
    wgmma::FenceProxyAsyncShared();
    __syncthreads();  // Q complete

    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);
    const int lim_min = min(lim_lo, lim_hi);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    float m_lo = -INFINITY,
          m_hi = -INFINITY;          // running max (log2 domain), as both warpgroups see it
    float l_lo = 0.0f, l_hi = 0.0f;  // this warpgroup's part of the row sums

    // S = q K^T over this warpgroup's buffer, each 64-dim block as soon as it has landed; scaled
    // to the log2 domain and masked; returns the rows' maxima.
    // The dim blocks in the order they are refilled (W0: 0..8; W1: 4..8, then 0..3), the order
    // a compile-time constant (kW) so that the descriptors' offsets are too; the blocks [kFrom,
    // kTo) of that order (the first with the accumulator's scale 0).
    auto qk_issue = [&](float(&s)[32], auto kW, auto kFrom, auto kTo, bool proxy_fence) {
#pragma unroll
      for (int i = decltype(kFrom)::value; i < decltype(kTo)::value; ++i) {
        const int kb = decltype(kW)::value == 0 ? i : (i + 4) % kDimBlocks;
        MbarWait(full_bar(decltype(kW)::value, kb), fills & 1);
        // Order 1 may issue with a P.V in flight: the fence after the wait loop keeps ptxas from
        // placing its own warpgroup.arrive inside the loop and serializing every wgmma (C7520).
        if constexpr (kOrder == 1) wgmma::Fence();
        // The consumer's proxy fence after each dim block's mbarrier: MEMBAR.ALL.CTA +
        // FENCE.VIEW.ASYNC.S in the SASS, nine a q.k. Tuning builds may drop it
        // (-DMLASERVE_SEESAW_CHUNK_FENCE=0) to time what it costs; TMA copies (async proxy writes)
        // would need none.
#if !defined(MLASERVE_SEESAW_CHUNK_FENCE) || MLASERVE_SEESAW_CHUNK_FENCE
        if (proxy_fence) wgmma::FenceProxyAsyncShared();
#endif
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          const uint32_t off = (kb * kChunkBytes + q4 * 32) >> 4;  // Q and K: the same layout
          wgmma::WgmmaM64N64K16SS<false>(s, dq.lo + off, dq.hi, dk.lo + off, dk.hi,
                                         i + q4 > 0 ? 1 : 0);
        }
      }
    };
    using I0 = std::integral_constant<int, 0>;
    using I1 = std::integral_constant<int, 1>;
    using I4 = std::integral_constant<int, 4>;
    using I9 = std::integral_constant<int, kDimBlocks>;
    // cp.async-filled blocks (every block without kTma) need the proxy fence.
    auto needs_proxy_fence = [&](int t) {
      return !kTma || !(t < blk_begin + n_blk && t * kBlockTokens + kBlockTokens <= len);
    };
    // Zeroes the accumulator before a q.k. Not while another wgmma of this warpgroup is in flight:
    // ptxas then serializes every wgmma of the kernel (C7515, "non wgmma instructions defining
    // accumulator registers of a wgmma between start and end of the pipeline stage").
    auto qk_zero = [&](float(&s)[32]) {
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.0f;
      wgmma::FenceRegs(s);
    };
    auto qk_start = [&](float(&s)[32]) {
      qk_zero(s);
      wgmma::Fence();
    };
    // The whole q.k of this warpgroup's block t, committed as one group (not waited for).
    auto qk_issue_all = [&](float(&s)[32], int t) {
      qk_start(s);
      const bool fence = needs_proxy_fence(t);
      if (wgi == 0) {
        qk_issue(s, I0{}, I0{}, I9{}, fence);
      } else {
        qk_issue(s, I1{}, I0{}, I9{}, fence);
      }
      wgmma::Commit();
      ++fills;
    };
    // The scores of block t once its q.k has retired: scaled to the log2 domain, masked, and the
    // rows' maxima.
    auto qk_scores = [&](float(&s)[32], int t, float& mx_lo, float& mx_hi) {
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] *= p.score_scale_log2;
      if (!(t * kBlockTokens >= tok_begin && t * kBlockTokens + kBlockTokens - 1 <= lim_min)) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int pos = t * kBlockTokens + 8 * j + 2 * c + (e & 1);
            if (pos < tok_begin || pos > (e >= 2 ? lim_hi : lim_lo)) s[4 * j + e] = -INFINITY;
          }
        }
      }
      mx_lo = -INFINITY;
      mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    };
    auto qk = [&](float(&s)[32], int t, float& mx_lo, float& mx_hi) {
      qk_issue_all(s, t);
      wgmma::Wait<0>();
      wgmma::FenceRegs(s);
      qk_scores(s, t, mx_lo, mx_hi);
    };
    // Lazy max (see mla_decode_sliced.cuh: the max moves only by more than 2^8, so P <= 2^8 and
    // O is rescaled rarely): the new max, the exponent base and the old-to-new scale.
    auto new_max = [](float m, float mx, float& base_out, float& scale_out) {
      constexpr float kLazyLog2 = 8.0f;
      const float nm = mx > m + kLazyLog2 ? mx : m;
      base_out = nm == -INFINITY ? 0.0f : nm;
      scale_out = exp2f(m - base_out);
      return nm;
    };
    // P = 2^(S - base) in place; returns the rows' sums (of this block).
    auto exponentiate = [&](float(&s)[32], float base_lo, float base_hi, float& sum_lo,
                            float& sum_hi) {
      sum_lo = 0.0f;
      sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[4 * j + 0] = exp2f(s[4 * j + 0] - base_lo);
        s[4 * j + 1] = exp2f(s[4 * j + 1] - base_lo);
        s[4 * j + 2] = exp2f(s[4 * j + 2] - base_hi);
        s[4 * j + 3] = exp2f(s[4 * j + 3] - base_hi);
        sum_lo += s[4 * j + 0] + s[4 * j + 1];
        sum_hi += s[4 * j + 2] + s[4 * j + 3];
      }
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
    };
    auto rescale_o = [&](float a_lo, float a_hi) {
      if (__any_sync(0xffffffffu, a_lo != 1.0f || a_hi != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[4 * n + 0] *= a_lo;
          o[4 * n + 1] *= a_lo;
          o[4 * n + 2] *= a_hi;
          o[4 * n + 3] *= a_hi;
        }
      }
    };
    // P (bf16) as the A operand of this warpgroup's own P.V (the accumulator layout repacks into
    // the register A fragment of each 16-token k-step).
    auto pack = [&](const float(&s)[32], uint32_t(&pa)[4][4]) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = PackBf16(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = PackBf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = PackBf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = PackBf16(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    // P (bf16) into this warpgroup's buffer's 64-dim block 8 (the RoPE dims, done with after the
    // q.k; P.V reads dims 0..511 only), or order 1's P1 buffer, as a K-major [64 rows][64 tokens] A
    // operand, 128-byte swizzled: element (row, token) at row * 128 + ((token / 8) ^ (row % 8)) *
    // 16 + token % 8 * 2.
    auto store_p = [&](const float(&s)[32]) {
      const uint32_t pb = own_p;
#ifdef MLASERVE_SEESAW_STMATRIX_P
      // Experiment (session 37, not yet run; kernels/mla/NOTES.md session 30's idea, FlashMLA's
      // form): 4 stmatrix .x4 a thread instead of 16 32-bit stores. Matrices of one instruction:
      // (rows 16wq..+7, 16-B chunk j), (rows +8..+15, j), (rows 16wq..+7, j + 1), (+8..+15, j + 1);
      // lane t gives the address of row t % 8 of matrix t / 8, and each register is the lane's
      // m8n8 fragment (row g, columns 2c, 2c + 1), which is how the accumulator pairs lie.
      const int srow = 16 * wq + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const uint32_t addr = pb + srow * 128 + (((j + (lane >> 4)) ^ (lane & 7)) << 4);
        asm volatile(
            "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
            "r"(PackBf16(s[4 * j], s[4 * j + 1])), "r"(PackBf16(s[4 * j + 2], s[4 * j + 3])),
            "r"(PackBf16(s[4 * j + 4], s[4 * j + 5])), "r"(PackBf16(s[4 * j + 6], s[4 * j + 7]))
            : "memory");
      }
#else
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t lo = pb + lrow_lo * 128 + ((j ^ (lrow_lo & 7)) << 4) + 4 * c;
        const uint32_t hi = pb + lrow_hi * 128 + ((j ^ (lrow_hi & 7)) << 4) + 4 * c;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(lo), "r"(PackBf16(s[4 * j], s[4 * j + 1]))
                     : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(hi),
                     "r"(PackBf16(s[4 * j + 2], s[4 * j + 3]))
                     : "memory");
      }
#endif
      wgmma::FenceProxyAsyncShared();
    };
    // O += P V over this warpgroup's 256 dims: own P from registers, V from its own buffer.
    auto pv_own = [&](uint32_t(&pa)[4][4]) {
      wgmma::FenceRegs(o);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma::WgmmaM64N256K16RSTransB<false>(o, pa[kk], dv_own.lo + ((kk * 16 * 128) >> 4),
                                              dv_own.hi, 1);
      }
      wgmma::Commit();
    };
    // O += P V with the other warpgroup's P and V, both from the other buffer.
    // Issued and committed only (order 1); `chained`: behind this warpgroup's own P.V still in
    // flight on the same accumulator (no register fence between them).
    auto pv_other_issue = [&](bool chained) {
      if (!chained) wgmma::FenceRegs(o);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma::WgmmaM64N256K16SSTransB<false>(o, dp_other.lo + ((kk * 32) >> 4), dp_other.hi,
                                              dv_other.lo + ((kk * 16 * 128) >> 4), dv_other.hi, 1);
      }
      wgmma::Commit();
    };
    auto pv_other = [&]() {
      pv_other_issue(false);
      wgmma::Wait<0>();
      wgmma::FenceRegs(o);
    };

    float s[32];  // this warpgroup's scores, then P

    // The softmax steps of the seesaw, shared by both orders (s: this warpgroup's scores, then P).
    // W0: m0 = max(m, rowmax S0) and scale0 published (kBarScale0); P0 = 2^(S0 - m0) in s and,
    // as bf16, in pa; O and l0 rescaled by scale0.
    auto w0_softmax = [&](float mx_lo, float mx_hi, uint32_t(&pa)[4][4]) {
      float base_lo, base_hi, sc0_lo, sc0_hi;
      const float m0_lo = new_max(m_lo, mx_lo, base_lo, sc0_lo);
      const float m0_hi = new_max(m_hi, mx_hi, base_hi, sc0_hi);
      if (c == 0) {
        s_m0[lrow_lo] = m0_lo;
        s_m0[lrow_hi] = m0_hi;
        s_scale0[lrow_lo] = sc0_lo;
        s_scale0[lrow_hi] = sc0_hi;
      }
      BarArrive(kBarScale0);
      float sum_lo, sum_hi;
      exponentiate(s, base_lo, base_hi, sum_lo, sum_hi);
      rescale_o(sc0_lo, sc0_hi);
      l_lo = l_lo * sc0_lo + sum_lo;
      l_hi = l_hi * sc0_hi + sum_hi;
      pack(s, pa);
    };
    // W0 once m1 and scale1 are published: the running max becomes m1; scale1 returned.
    auto w0_take_scale1 = [&](float& sc1_lo, float& sc1_hi) {
      sc1_lo = s_scale1[lrow_lo];
      sc1_hi = s_scale1[lrow_hi];
      m_lo = s_m1[lrow_lo];
      m_hi = s_m1[lrow_hi];
    };
    // W0: P0 *= scale1, stored for W1's P0 V0_R (published by the caller's kBarP0).
    auto w0_store_p = [&](float sc1_lo, float sc1_hi) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[4 * j + 0] *= sc1_lo;
        s[4 * j + 1] *= sc1_lo;
        s[4 * j + 2] *= sc1_hi;
        s[4 * j + 3] *= sc1_hi;
      }
      store_p(s);
    };
    auto w0_rescale = [&](float sc1_lo, float sc1_hi) {
      l_lo *= sc1_lo;
      l_hi *= sc1_hi;
      rescale_o(sc1_lo, sc1_hi);
    };
    // W1 once m0 and scale0 are published: m1 = max(m0, rowmax S1) (the running max from now),
    // P1 = 2^(S1 - m1) in s; returns scale1, scale0 x scale1 and P1's row sums.
    auto w1_softmax = [&](float mx_lo, float mx_hi, float(&sc1)[2], float(&sc01)[2],
                          float(&sum)[2]) {
      BarSync(kBarScale0);
      const float m0_lo = s_m0[lrow_lo], m0_hi = s_m0[lrow_hi];
      const float sc0_lo = s_scale0[lrow_lo], sc0_hi = s_scale0[lrow_hi];
      float base_lo, base_hi;
      m_lo = new_max(m0_lo, mx_lo, base_lo, sc1[0]);
      m_hi = new_max(m0_hi, mx_hi, base_hi, sc1[1]);
      exponentiate(s, base_lo, base_hi, sum[0], sum[1]);
      sc01[0] = sc0_lo * sc1[0];
      sc01[1] = sc0_hi * sc1[1];
    };
    auto w1_publish = [&](const float(&sc1)[2]) {
      if (c == 0) {
        s_m1[lrow_lo] = m_lo;
        s_m1[lrow_hi] = m_hi;
        s_scale1[lrow_lo] = sc1[0];
        s_scale1[lrow_hi] = sc1[1];
      }
      BarArrive(kBarP1);
    };
    // W1: O and l1 rescaled by scale0 x scale1, P1's sums added; P1 as bf16 in pa.
    auto w1_rescale = [&](const float(&sc01)[2], const float(&sum)[2], uint32_t(&pa)[4][4]) {
      rescale_o(sc01[0], sc01[1]);
      l_lo = l_lo * sc01[0] + sum[0];
      l_hi = l_hi * sc01[1] + sum[1];
      pack(s, pa);
    };
    for (int pair = 0; kOrder == 0 && pair < n_pairs; ++pair) {
      const bool more = pair + 1 < n_pairs;
      const int t = blk_begin + 2 * pair + wgi;  // this warpgroup's block
      float mx_lo, mx_hi;
      qk(s, t, mx_lo, mx_hi);
      uint32_t pa[4][4];
      if (wgi == 0) {
        w0_softmax(mx_lo, mx_hi, pa);
        pv_own(pa);
        BarSync(kBarP1);  // m1, scale1 and P1 published
        float sc1_lo, sc1_hi;
        w0_take_scale1(sc1_lo, sc1_hi);
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
        if (more)
          load_block(2 * pair + 2, page_of(2 * pair + 2), 0,
                     kMaskB0W0);  // V0_L read: its dims go first
        w0_store_p(sc1_lo, sc1_hi);
        BarArrive(kBarP0);
        w0_rescale(sc1_lo, sc1_hi);
        pv_other();  // P1 V1 (left half)
        if (more) load_block(2 * pair + 3, page_of(2 * pair + 3), 1, kMaskB1W0);
      } else {
        float sc1[2], sc01[2], sum[2];
        w1_softmax(mx_lo, mx_hi, sc1, sc01, sum);  // after m0, scale0 are published
        store_p(s);
        w1_publish(sc1);
        w1_rescale(sc01, sum, pa);
        pv_own(pa);
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
        if (more)
          load_block(2 * pair + 3, page_of(2 * pair + 3), 1,
                     kMaskB1W1);                           // V1_R read: its dims go first
        BarSync(kBarP0);                                   // P0 (times scale1) published
        pv_other();                                        // P0 V0 (right half)
        if (more) load_block(2 * pair + 2, page_of(2 * pair + 2), 0, kMaskB0W1);
      }
    }

    // Order 1 (see the kernel's comment). s holds this warpgroup's scores of the pair's block,
    // issued in the prologue or at the end of the previous pair and retired there.
    if constexpr (kOrder == 1) {
      if (n_pairs > 0) {
        qk_issue_all(s, blk_begin + wgi);
        wgmma::Wait<0>();
        wgmma::FenceRegs(s);
      }
    }
    for (int pair = 0; kOrder == 1 && pair < n_pairs; ++pair) {
      const bool more = pair + 1 < n_pairs;
      const int t = blk_begin + 2 * pair + wgi;  // this warpgroup's block
      // The next pair's pages, read now (the loads retire behind this pair's work).
      const int page_a = more ? page_of(2 * pair + 2) : 0;
      const int page_b = more ? page_of(2 * pair + 3) : 0;
      const bool fence_next = needs_proxy_fence(t + 2);
      float mx_lo, mx_hi;
      qk_scores(s, t, mx_lo, mx_hi);
      uint32_t pa[4][4];
      if (wgi == 0) {
        w0_softmax(mx_lo, mx_hi, pa);
        pv_own(pa);  // P0 V0_L
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
        BarSync(kBarP1);  // m1, scale1 published
        float sc1_lo, sc1_hi;
        w0_take_scale1(sc1_lo, sc1_hi);
        if (more) load_block(2 * pair + 2, page_a, 0, kMaskB0W0);  // V0_L read
        w0_store_p(sc1_lo, sc1_hi);
        BarArrive(kBarP0);
        w0_rescale(sc1_lo, sc1_hi);
        qk_zero(s);             // P0 is stored: s is free for the next q.k
        BarSync(kBarIssued);    // P1 stored, P0 V0_R issued
        pv_other_issue(false);  // P1 V1_L
        if (more) {
          qk_issue(s, I0{}, I0{}, I4{}, fence_next);  // the blocks refilled mid-pair
          wgmma::Commit();
          wgmma::Wait<1>();  // P1 V1_L retired: buffer 1's left half is free
          load_block(2 * pair + 3, page_b, 1, kMaskB1W0);
          qk_issue(s, I0{}, I4{}, I9{}, fence_next);
          wgmma::Commit();
          ++fills;
        }
        // Each warpgroup retires its q.k in its own branch (outside `more`'s): a wait after the
        // branches merge lets the compiler's register copies at the merge touch the accumulators
        // of wgmmas in flight, and ptxas then serializes every wgmma (C7515).
        wgmma::Wait<0>();
        wgmma::FenceRegs(s);
        wgmma::FenceRegs(o);
      } else {
        float sc1[2], sc01[2], sum[2];
        w1_softmax(mx_lo, mx_hi, sc1, sc01, sum);  // after m0, scale0 are published
        w1_publish(sc1);
        store_p(s);  // P1, published by kBarIssued
        w1_rescale(sc01, sum, pa);
        pv_own(pa);            // P1 V1_R
        BarSync(kBarP0);       // P0 (times scale1) published
        pv_other_issue(true);  // P0 V0_R
        BarArrive(kBarIssued);
        wgmma::Wait<1>();  // P1 V1_R retired: buffer 1's right half and block 8 are free
        if (more) load_block(2 * pair + 3, page_b, 1, kMaskB1W1);
        wgmma::Wait<0>();  // P0 V0_R retired: buffer 0's right half and block 8 are free
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
        if (more) {
          load_block(2 * pair + 2, page_a, 0, kMaskB0W1);
          qk_start(s);
          qk_issue(s, I1{}, I0{}, I9{}, fence_next);
          wgmma::Commit();
          ++fills;
        }
        wgmma::Wait<0>();
        wgmma::FenceRegs(s);
      }
    }

    // l = l0 + l1 (the same order in both warpgroups); the max is the same in both.
    if (c == 0) {
      s_l[wgi * kRows + lrow_lo] = l_lo;
      s_l[wgi * kRows + lrow_hi] = l_hi;
    }
    __syncthreads();
    const float lt_lo = s_l[lrow_lo] + s_l[kRows + lrow_lo];
    const float lt_hi = s_l[lrow_hi] + s_l[kRows + lrow_hi];
    const float inv_lo = lt_lo > 0.0f ? p.out_scale / lt_lo : 0.0f;
    const float inv_hi = lt_hi > 0.0f ? p.out_scale / lt_hi : 0.0f;
    const float lse2_lo = lt_lo > 0.0f ? m_lo + log2f(lt_lo) : -INFINITY;  // log2 units
    const float lse2_hi = lt_hi > 0.0f ? m_hi + log2f(lt_hi) : -INFINITY;
    constexpr float kLn2 = 0.693147180559945309f;
    const size_t slot = static_cast<size_t>(worker) + b;  // Unique per (sequence, worker).
    auto store_row = [&](int row, int half, float inv, float lse2) {
      const int col0 = 256 * wgi + 2 * c;
      if (whole) {
        uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<uint32_t*>(out + col0 + 8 * n) =
              PackBf16(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
        }
        if (wgi == 0 && c == 0 && p.lse != nullptr) {
          p.lse[static_cast<size_t>(b) * p.rows + row] = lse2 * kLn2;
        }
      } else {
        float* part = p.o_part + (slot * p.rows + row) * kMlaLatentDim;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<float2*>(part + col0 + 8 * n) =
              make_float2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
        }
        if (wgi == 0 && c == 0) p.lse_part[slot * p.rows + row] = lse2;
      }
    };
    if (row_lo < p.rows) store_row(row_lo, 0, inv_lo, lse2_lo);
    if (row_hi < p.rows) store_row(row_hi, 1, inv_hi, lse2_hi);
    __syncthreads();  // The next piece's prologue reuses Q, the buffers and the statistics.
  }
#endif
}

// 1 on an SM90 device (the kernel fits one block per SM), 0 elsewhere: the plan then refuses
// this variant (MlaDecodeVariantAvailable).
template <bool kTma, int kOrder>
int MlaDecodeSeesawBlocksPerSm() {
  static const int blocks = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return 0;
    return DecodeKernelBlocksPerSm(
        reinterpret_cast<const void*>(&MlaDecodeSeesawKernel<kTma, kOrder>), seesaw::kThreads,
        seesaw::Layout<kOrder>::kSmemBytes);
  }();
  return blocks;
}

// The pool as a 2-D tensor for TMA: [tokens][576] bf16, rows 1,152 B apart, 64 x 64 boxes,
// 128-byte swizzle (the operand layout of the kernel's buffers). The pool's size is not known
// here; the map's token extent (2^28) only bounds the coordinates, and the kernel reads only the
// sequences' own pages. cuTensorMapEncodeTiled comes from the driver through the runtime's entry
// point query, so nothing links the driver library.
// promote_128: L2 fills of 128 B instead of 256 B (MlaDecodeParams::kv_tma_l2 bit 2).
inline cudaError_t SeesawPoolTensorMap(const void* pool, CUtensorMap* map, bool promote_128) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kMlaQkDim), cuuint64_t{1} << 28};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(seesaw::kRowBytes)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(seesaw::kBlockTokens)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(pool), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             promote_128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <bool kTma, int kOrder>
cudaError_t LaunchMlaDecodeSeesaw(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  using L = seesaw::Layout<kOrder>;
  if (MlaDecodeSeesawBlocksPerSm<kTma, kOrder>() == 0) return cudaErrorInvalidConfiguration;
  if (p.inline_schedule && p.batch > L::kSchedMax) return cudaErrorInvalidValue;
  CUtensorMap map{};
  if constexpr (kTma) {
    if (cudaError_t e = SeesawPoolTensorMap(p.kv_pool, &map, (p.kv_tma_l2 & 2) != 0);
        e != cudaSuccess)
      return e;
  }
  MlaDecodeSeesawKernel<kTma, kOrder><<<grid, seesaw::kThreads, L::kSmemBytes, stream>>>(p, map);
  return cudaGetLastError();
}

}  // namespace mlaserve::mla
