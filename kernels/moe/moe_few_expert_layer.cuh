// The fused few-expert layer (moe_few_expert_layer.h): FewExpertMoeGemmKernel's gate_up and down
// (moe_few_expert_gemm.cuh) and MoeCombine's slot-order sum in one persistent kernel, for 1-4
// decode tokens.
//
// A block of 8 warps. First, warp 0 lays out the <= 32 assignments from topk_ids as the dispatch
// does (rows grouped by local expert, ascending assignment index within one; experts of other
// ranks dropped), into shared memory; every block does this itself. Work items, taken in turn by
// the persistent grid (item w by block w % grid):
// - gate_up items w < G = active experts x gate_up m-blocks: one m-block (16 * kMT weight rows)
//   of one expert over the whole hidden, FewExpertMoeGemmKernel's warp split and register ring,
//   its rows' h written to the workspace; then one count on counters[0];
// - down items w >= G: one m-block of the output's hidden rows for every active expert in turn
//   (the ring runs on from one expert's chunks to the next's); each expert's weighted outputs go
//   to shared memory, and after the last the item sums them per token in slot order, adds
//   shared_out and writes out / out_bf16 as MoeCombine does.
// A down item's first weight loads are issued before its block waits for counters[0] to reach G
// (every block's gate_up items precede its down items, so the wait cannot deadlock: the items it
// waits for never wait), so down's weight stream overlaps gate_up's tail. The last block out
// resets the counters.
//
// Bits: the same K slices, ring order, MMA sequence, slice sums and epilogue arithmetic as
// FewExpertMoeGemmKernel, and MoeCombine's order for the experts and shared_out: the output
// equals the four-launch few-expert sequence's bit for bit (moe_experts_gpu_test checks it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/moe/moe_few_expert_gemm.cuh"
#include "kernels/moe/moe_few_expert_layer.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/resident_blocks.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::moe_gemm {

static_assert(kFewExpertLayerMaxTokens == kFewExpertPassRows,
              "an active expert's rows (at most the tokens) are one pass of activation rows");
static_assert(kFewExpertLayerMaxRows <= 32, "one warp lays out the assignments");

// Shared memory (byte offsets), computed on the host and passed in: region A holds the tokens' x
// rows over the whole hidden during gate_up items and two buffers of an expert's h rows during
// down items; then the K slices' sums [8 warps][32 lanes][4], the down item's weighted expert
// outputs [assignment][16 * kMT], and the assignment layout (ints).
struct FewExpertLayerSmem {
  int x_stride = 0, h_stride = 0;
  int sum_off = 0, y_off = 0, ints_off = 0, total = 0;
};
inline constexpr int kFewExpertLayerInts = 3 * kFewExpertLayerMaxRows + 3;

inline FewExpertLayerSmem FewExpertLayerSmemLayout(int hidden, int intermediate) {
  FewExpertLayerSmem s;
  s.x_stride = hidden / 64 * kFewExpertChunkXBytes + kFewExpertRowPad;
  s.h_stride = intermediate / 64 * kFewExpertChunkXBytes + kFewExpertRowPad;
  const int x_bytes = kFewExpertLayerMaxTokens * s.x_stride;
  const int h_bytes = 2 * kFewExpertPassRows * s.h_stride;
  s.sum_off = (std::max(x_bytes, h_bytes) + 127) / 128 * 128;
  s.y_off = s.sum_off + kFewExpertWarps * 32 * 16;
  s.ints_off = s.y_off + kFewExpertLayerMaxRows * 16 * 4 * 4;  // 16 rows x kMT <= 4, fp32
  s.total = s.ints_off + kFewExpertLayerInts * 4;
  return s;
}

template <class Format>
struct FewExpertLayerParams {
  typename Format::Params gate_up, down;
  FewExpertLayerArgs args;
  FewExpertLayerSmem smem;
  int mt_gate_up, mt_down;  // m-tiles a block: FewExpertTilesPerBlock(k) of each GEMM
};

__device__ __forceinline__ int LoadAcquireGpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <class Format>
__global__ void __launch_bounds__(kFewExpertThreads, kFewExpertMinBlocks<Format>)
    FewExpertLayerKernel(const FewExpertLayerParams<Format> P) {
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;
  constexpr int kDepth = kFewExpertDepth;
  const FewExpertLayerArgs& A = P.args;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  float* s_sum = reinterpret_cast<float*>(smem + P.smem.sum_off);
  float* s_y = reinterpret_cast<float*>(smem + P.smem.y_off);
  int* s_assign = reinterpret_cast<int*>(smem + P.smem.ints_off);  // sorted row -> assignment
  int* s_act_e = s_assign + kFewExpertLayerMaxRows;                // active expert -> local expert
  int* s_act_begin = s_act_e + kFewExpertLayerMaxRows;     // [n_active + 1] sorted-row offsets
  int* s_misc = s_act_begin + kFewExpertLayerMaxRows + 1;  // n_active, valid-assignment mask

  // Diagnostics (FewExpertLayerArgs::timeline): thread 0's %globaltimer at each event, in builds
  // with MLASERVE_KERNEL_TIMELINE only (cmake -DMLASERVE_KERNEL_TIMELINE=ON): at 80 registers (3
  // blocks an SM) even these few stores moved ptxas's allocation to 4-12 bytes of spills, so the
  // default build has none.
  auto stamp = [&](int event) {
#ifdef MLASERVE_KERNEL_TIMELINE
    if (A.timeline != nullptr && tid == 0) {
      A.timeline[blockIdx.x * kFewExpertLayerTimelineEvents + event] = ptx::GlobalTimerNs();
    }
#else
    (void)event;
#endif
  };
  stamp(kLayerEntry);

  // topk_ids, topk_weights and x come from predecessors.
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  stamp(kLayerPrerequisite);

  // The dispatch's layout, in every block: lane i holds assignment i's local expert (-1: another
  // rank's); its sorted row counts the valid assignments before it in (expert, index) order.
  const int rows = A.tokens * A.top_k;
  if (warp == 0) {
    int le = -1;
    if (lane < rows) {
      le = __ldcg(A.topk_ids + lane) - A.first_expert;
      if (le < 0 || le >= A.num_local_experts) le = -1;
    }
    int rank = 0;
    bool first = le >= 0;  // the first assignment of its expert
    for (int j = 0; j < rows; ++j) {
      const int lj = __shfl_sync(0xffffffffu, le, j);
      if (lj >= 0 && (lj < le || (lj == le && j < lane))) ++rank;
      if (lj == le && j < lane) first = false;
    }
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    const unsigned valid = __ballot_sync(0xffffffffu, le >= 0);
    int act = 0;  // active experts below this one
    for (int j = 0; j < rows; ++j) {
      const int lj = __shfl_sync(0xffffffffu, le, j);
      if (((firsts >> j) & 1u) && lj < le) ++act;
    }
    if (le >= 0) s_assign[rank] = lane;
    if (first) {
      s_act_e[act] = le;
      s_act_begin[act] = rank;
    }
    if (lane == 0) {
      const int n = __popc(firsts);
      s_act_begin[n] = __popc(valid);
      s_misc[0] = n;
      s_misc[1] = static_cast<int>(valid);
    }
  }
  __syncthreads();
  const int n_active = s_misc[0];
  const unsigned valid_mask = static_cast<unsigned>(s_misc[1]);

  // Items and each warp's share of one (FewExpertMoeGemmKernel's split, per GEMM).
  const int H = A.hidden, I = A.intermediate;
  const int mt_gu = P.mt_gate_up, mt_dn = P.mt_down;
  const int gu_chunks = H / 64, dn_chunks = I / 64;
  const int gu_mblocks = 2 * I / (16 * mt_gu), dn_mblocks = H / (16 * mt_dn);
  const int G = n_active * gu_mblocks;
  const int T = G + dn_mblocks;
  const int gu_slices = kFewExpertWarps / mt_gu, dn_slices = kFewExpertWarps / mt_dn;
  const int gu_mt = warp % mt_gu, gu_slice = warp / mt_gu;
  const int dn_mt = warp % mt_dn, dn_slice = warp / mt_dn;
  const int gu_c0 = gu_chunks * gu_slice / gu_slices;
  const int gu_nc = gu_chunks * (gu_slice + 1) / gu_slices - gu_c0;
  const int dn_c0 = dn_chunks * dn_slice / dn_slices;
  const int dn_nc = dn_chunks * (dn_slice + 1) / dn_slices - dn_c0;
  const size_t gu_expert_code = static_cast<size_t>(2 * I) * H / (1024 / kChunkCode);
  const size_t dn_expert_code = static_cast<size_t>(H) * I / (1024 / kChunkCode);
  constexpr int kScaleDiv = kChunkCode / kChunkScale;

  // A unit: a gate_up item, or one active expert of a down item.
  struct Unit {
    int w, a;  // item; active expert (down)
    int le, row_begin, nrows, nc;
    const uint8_t* codes;
    const uint8_t* scales;
  };
  auto unit_at = [&](int w, int a) {
    Unit u{w, a, -1, 0, 0, 0, nullptr, nullptr};
    if (w >= T) return u;
    const bool gate_up = w < G;
    if (!gate_up && n_active == 0) return u;  // a down item with nothing routed here
    const int act = gate_up ? w / gu_mblocks : a;
    const int mb = gate_up ? w % gu_mblocks : w - G;
    u.a = act;
    u.le = s_act_e[act];
    u.row_begin = s_act_begin[act];
    u.nrows = s_act_begin[act + 1] - u.row_begin;
    if (gate_up) {
      u.nc = gu_nc;
      const size_t chunk0 = static_cast<size_t>(mb * mt_gu + gu_mt) * gu_chunks + gu_c0;
      u.codes = P.gate_up.w_codes + u.le * gu_expert_code + chunk0 * kChunkCode;
      u.scales = P.gate_up.w_scales + u.le * (gu_expert_code / kScaleDiv) + chunk0 * kChunkScale;
    } else {
      u.nc = dn_nc;
      const size_t chunk0 = static_cast<size_t>(mb * mt_dn + dn_mt) * dn_chunks + dn_c0;
      u.codes = P.down.w_codes + u.le * dn_expert_code + chunk0 * kChunkCode;
      u.scales = P.down.w_scales + u.le * (dn_expert_code / kScaleDiv) + chunk0 * kChunkScale;
    }
    return u;
  };
  auto next_of = [&](const Unit& u) {
    if (u.w < G || u.a + 1 >= n_active) return unit_at(u.w + gridDim.x, 0);
    return unit_at(u.w, u.a + 1);
  };

  // The ring: chunk c of the unit's K slice lives in slot c % kDepth until computed.
  typename Format::Codes cw[kDepth];
  typename Format::Scales sw[kDepth];
  auto prefetch = [&](const Unit& u) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (d < u.nc) {
        cw[d] = Format::LoadCodes(u.codes + d * kChunkCode, lane);
        sw[d] = Format::LoadScales(u.scales + d * kChunkScale, g);
      }
    }
  };
  // A down unit's h rows (the expert's sorted rows, gate_up's output) into buffer `buf`.
  auto load_h = [&](const Unit& u, int buf) {
    const int vecs = I / 8;
    uint8_t* dst = smem + buf * kFewExpertPassRows * P.smem.h_stride;
    for (int v = tid; v < u.nrows * vecs; v += kFewExpertThreads) {
      const int r = v / vecs, cv = v % vecs;
      ptx::CpAsync16(dst + r * P.smem.h_stride + cv * 16,
                     A.h + static_cast<size_t>(u.row_begin + r) * I + cv * 8, true);
    }
    ptx::CpAsyncCommit();
  };

  Unit u = unit_at(blockIdx.x, 0);
  if (u.w < T) prefetch(u);
  if (static_cast<int>(blockIdx.x) < G) {  // every token's x row over the whole hidden
    const int vecs = H / 8;
    for (int v = tid; v < A.tokens * vecs; v += kFewExpertThreads) {
      const int t = v / vecs, cv = v % vecs;
      ptx::CpAsync16(smem + t * P.smem.x_stride + cv * 16,
                     A.x + static_cast<size_t>(t) * H + cv * 8, true);
    }
    ptx::CpAsyncCommit();
  }
  ptx::CpAsyncWait<0>();
  __syncthreads();
  stamp(kLayerStaged);

  bool down_started = false;
  int hbuf = 0;
  while (u.w < T) {
    const bool gate_up = u.w < G;
    if (!gate_up && !down_started) {
      // h is complete once every gate_up item has counted itself (this block's own included).
      // Gate_up items never wait, so this ends; should a fault break that, the kernel traps after
      // 20 s and the launch fails with an error instead of hanging the stream.
      stamp(kLayerDownWaitBegin);
      if (tid == 0) {
        const uint64_t t0 = ptx::GlobalTimerNs();
        while (LoadAcquireGpu(A.counters) < G) {
          if (ptx::GlobalTimerNs() - t0 > 20'000'000'000ull) __trap();
          __nanosleep(64);
        }
      }
      __syncthreads();
      if (u.nrows > 0) load_h(u, 0);
      ptx::CpAsyncWait<0>();
      __syncthreads();
      down_started = true;
      stamp(kLayerDownWaitEnd);
    }
    // B fragments by ldmatrix x4 as in FewExpertMoeGemmKernel; gate_up's rows are the tokens of
    // the expert's assignments, down's the rows of its h buffer. Rows past the unit's read its
    // last row (their columns are not stored).
    uint32_t ld_addr;
    if (gate_up) {
      const int r = min(lane & 7, u.nrows - 1);
      const int tok = s_assign[u.row_begin + r] / A.top_k;
      ld_addr = ptx::SmemAddr(smem + tok * P.smem.x_stride + gu_c0 * kFewExpertChunkXBytes +
                              (lane >> 3) * 16);
    } else {
      const int r = min(lane & 7, max(u.nrows - 1, 0));
      ld_addr = ptx::SmemAddr(smem + (hbuf * kFewExpertPassRows + r) * P.smem.h_stride +
                              dn_c0 * kFewExpertChunkXBytes + (lane >> 3) * 16);
    }
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    FewExpertSliceMma<Format, kDepth>(acc, cw, sw, ld_addr, u.nc, u.codes, u.scales, lane, g);
    // The next unit's first weight loads (and, down after down, its h rows into the other
    // buffer) go out before this unit's epilogue.
    const Unit nu = next_of(u);
    const bool item_ends = nu.w != u.w;
    if (nu.w < T) {
      prefetch(nu);
      if (!gate_up && nu.nrows > 0) load_h(nu, hbuf ^ 1);
    }

    // The slices' sums in slice order: acc = (row g, column 2t4), (g, 2t4 + 1), (g + 8, 2t4),
    // (g + 8, 2t4 + 1); columns are the unit's rows.
    const int mt_here = gate_up ? mt_gu : mt_dn;
    const int slices = gate_up ? gu_slices : dn_slices;
    *reinterpret_cast<float4*>(s_sum + (warp * 32 + lane) * 4) =
        make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (warp < mt_here && u.nrows > 0) {
      float sum[4] = {acc[0], acc[1], acc[2], acc[3]};
      for (int s = 1; s < slices; ++s) {
        const float4 v =
            *reinterpret_cast<const float4*>(s_sum + ((s * mt_here + warp) * 32 + lane) * 4);
        sum[0] += v.x;
        sum[1] += v.y;
        sum[2] += v.z;
        sum[3] += v.w;
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * t4 + half;
        if (r >= u.nrows) continue;
        if (gate_up) {
          // m-tile mt holds gate rows of features 8mt..8mt+7 (rows g) and their up rows (g + 8).
          const int mt = (u.w % gu_mblocks) * mt_gu + warp;
          const float gate = sum[half] * Format::GateAlpha(P.gate_up, u.le);
          const float up = sum[2 + half] * Format::UpAlpha(P.gate_up, u.le);
          const float hval = gate / (1.0f + __expf(-gate)) * up;
          A.h[static_cast<size_t>(u.row_begin + r) * I + mt * 8 + g] = __float2bfloat16_rn(hval);
        } else {
          const int asg = s_assign[u.row_begin + r];
          const float wt = __ldcg(A.topk_weights + asg) * Format::DownAlpha(P.down, u.le);
          float* y = s_y + asg * (16 * mt_dn) + warp * 16;
          y[g] = sum[half] * wt;
          y[g + 8] = sum[2 + half] * wt;
        }
      }
    }
    if (gate_up) __threadfence();  // this block's h rows visible device-wide before the count
    ptx::CpAsyncWait<0>();
    __syncthreads();
    if (gate_up && tid == 0) {
      __threadfence();
      atomicAdd(A.counters, 1);
      stamp(kLayerGateUpDone);
    }
    if (!gate_up && item_ends) {
      // The item's outputs: each token's experts in slot order, then shared_out (MoeCombine's).
      const int rows_here = 16 * mt_dn;
      const int o0 = (u.w - G) * rows_here;
      for (int i = tid; i < A.tokens * rows_here; i += kFewExpertThreads) {
        const int t = i / rows_here, rr = i % rows_here;
        float sum = 0.0f;
        for (int j = 0; j < A.top_k; ++j) {
          const int asg = t * A.top_k + j;
          if ((valid_mask >> asg) & 1u) sum += s_y[asg * rows_here + rr];
        }
        const size_t o = static_cast<size_t>(t) * H + o0 + rr;
        if (A.shared_out != nullptr) sum += __bfloat162float(A.shared_out[o]);
        if (A.out != nullptr) A.out[o] = sum;
        if (A.out_bf16 != nullptr) A.out_bf16[o] = __float2bfloat16_rn(sum);
      }
    }
    if (!gate_up) hbuf ^= 1;
    u = nu;
  }
  stamp(kLayerLastItemDone);

  // The last block out sets the counters back to 0 for the next launch (every other block has
  // finished waiting by then).
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(A.counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(A.counters, 0);
      atomicExch(A.counters + 1, 0);
      __threadfence();
    }
  }
  stamp(kLayerExit);
}

// Persistent grid: as many blocks as the device holds at once, at most one an item (items bounded
// by the active experts possible: min(local experts, assignments)).
template <class Format>
cudaError_t LaunchFewExpertLayer(const typename Format::Params& gate_up,
                                 const typename Format::Params& down, const FewExpertLayerArgs& a,
                                 cudaStream_t stream) {
  if (!FewExpertLayerApplies(a.tokens, a.top_k, a.hidden, a.intermediate) ||
      a.num_local_experts <= 0 || a.counters == nullptr || a.x == nullptr ||
      a.topk_ids == nullptr || a.topk_weights == nullptr || a.h == nullptr ||
      (a.out == nullptr && a.out_bf16 == nullptr) || gate_up.n != 2 * a.intermediate ||
      gate_up.k != a.hidden || down.n != a.hidden || down.k != a.intermediate) {
    return cudaErrorInvalidValue;
  }
  FewExpertLayerParams<Format> P{};
  P.gate_up = gate_up;
  P.down = down;
  P.args = a;
  P.smem = FewExpertLayerSmemLayout(a.hidden, a.intermediate);
  P.mt_gate_up = FewExpertTilesPerBlock(a.hidden);
  P.mt_down = FewExpertTilesPerBlock(a.intermediate);
  auto* kernel = FewExpertLayerKernel<Format>;
  const int smem = P.smem.total;
  ResidentBlocks rb;
  if (cudaError_t err = QueryResidentBlocks(kernel, kFewExpertThreads, smem, &rb);
      err != cudaSuccess) {
    return err;
  }
  if (rb.per_sm < 1) return cudaErrorInvalidConfiguration;
  const long long max_active = std::min(a.num_local_experts, a.tokens * a.top_k);
  const long long items =
      max_active * (2 * a.intermediate / (16 * P.mt_gate_up)) + a.hidden / (16 * P.mt_down);
  const int grid =
      static_cast<int>(std::min<long long>(items, static_cast<long long>(rb.sms) * rb.per_sm));
  return pdl::LaunchKernel(kernel, dim3(grid), dim3(kFewExpertThreads), smem, stream,
                           a.programmatic, P);
}

}  // namespace mlaserve::moe_gemm
