#include <cfloat>

#include "kernels/moe/moe_router.h"
#include "kernels/moe/moe_router_math.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

namespace rm = router_math;

constexpr int kRouterWarps = 4;

// Warp argmax under rm::Better; every lane ends with the winner.
__device__ __forceinline__ void WarpBest(float& score, int& index) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    const float s = __shfl_xor_sync(0xffffffffu, score, o);
    const int i = __shfl_xor_sync(0xffffffffu, index, o);
    if (rm::Better(s, i, score, index)) {
      score = s;
      index = i;
    }
  }
}

// One warp per token. Lane l holds experts l + 32 i (i < kPer) in registers: every logit and
// bias is loaded before the first use (a loop that stored each score to shared memory before
// loading the next logit serialized one global round trip per expert: 14 us a token for Kimi's
// 384 experts on the H200, ncu). Shared memory holds the biased scores only for the group stage.
template <int kPer>
__global__ void __launch_bounds__(32 * kRouterWarps) MoeRouteKernel(const MoeRouteParams p) {
  __shared__ float s_choice[kRouterWarps][32 * kPer];
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();     // the dispatch may become resident (it is launched plainly)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kRouterWarps + warp;
  if (t >= p.tokens) return;
  const MoeRouterConfig& c = p.config;
  const int E = c.num_experts;
  const float* l = p.logits + static_cast<size_t>(t) * E;
  float score[kPer], choice[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    score[i] = e < E ? l[e] : 0.0f;
    choice[i] = e < E && p.bias ? p.bias[e] : 0.0f;
  }
  if (c.softmax_scoring) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (lane + 32 * i < E) m = fmaxf(m, score[i]);
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (lane + 32 * i < E) {
        score[i] = rm::Exp(rm::Add(score[i], -m));
        partial = rm::Add(partial, score[i]);
      }
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
      partial = rm::Add(partial, __shfl_xor_sync(0xffffffffu, partial, o));
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) score[i] = rm::Div(score[i], partial);
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) score[i] = rm::Sigmoid(score[i]);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const float v = p.bias ? rm::Add(score[i], choice[i]) : score[i];
    choice[i] = lane + 32 * i < E && !isnan(v) ? v : -INFINITY;
  }
  if (c.n_group > 1) {
    float* sc = s_choice[warp];
#pragma unroll
    for (int i = 0; i < kPer; ++i) sc[lane + 32 * i] = choice[i];
    __syncwarp();
    const int group_size = E / c.n_group;
    float gscore = -INFINITY;
    if (lane < c.n_group) {
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        const float v = sc[e];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      const float gs = (c.softmax_scoring || group_size == 1) ? m1 : rm::Add(m1, m2);
      gscore = isnan(gs) ? -INFINITY : gs;
    }
    bool kept = false;
    for (int r = 0; r < c.topk_group; ++r) {
      float s = (lane < c.n_group && !kept) ? gscore : -INFINITY;
      int i = (lane < c.n_group && !kept) ? lane : INT_MAX;
      WarpBest(s, i);
      if (lane == i) kept = true;
    }
    const unsigned kept_mask = __ballot_sync(0xffffffffu, kept);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((kept_mask >> (e / group_size)) & 1u)) choice[i] = -INFINITY;
    }
  }
  // top_k rounds of warp argmax; bit i of `taken` marks the lane's expert lane + 32 i. The
  // winner's unbiased score comes from its owner lane; lane r keeps round r's (top_k <= 32).
  unsigned taken = 0;
  int32_t* ids = p.topk_ids + static_cast<size_t>(t) * c.top_k;
  float* w = p.topk_weights + static_cast<size_t>(t) * c.top_k;
  float sum = 0.0f, mine = 0.0f;
  for (int r = 0; r < c.top_k; ++r) {
    float s = -INFINITY, raw = 0.0f;
    int idx = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((taken >> i) & 1u) && rm::Better(choice[i], e, s, idx)) {
        s = choice[i];
        idx = e;
        raw = score[i];
      }
    }
    WarpBest(s, idx);
    const int owner = idx & 31;
    raw = __shfl_sync(0xffffffffu, raw, owner);
    if (owner == lane) taken |= 1u << (idx >> 5);
    if (lane == 0) ids[r] = idx;
    if (lane == r) mine = raw;
    sum = rm::Add(sum, raw);  // rank order, identical in every lane
  }
  if (lane < c.top_k) {
    const float denom = rm::Add(sum, 1e-20f);
    float v = mine;
    if (c.norm_topk_prob) v = rm::Div(v, denom);
    w[lane] = rm::Mul(v, c.routed_scaling_factor);
  }
}

// The decode-size path (MoeRouteParams::split): one block of kSplitWarps warps per token, for
// sigmoid scoring with one expert group (Kimi-K2: 384 experts, top 8). The one-warp kernel above
// is latency-bound at small batches: a lone warp runs ~2,000 dependent instructions for Kimi (16
// experts a lane through 8 argmax rounds; 6.3 us a layer at batch 1 on the H200, ncu, bench/
// RESULTS.md session 11). Here warp w ranks only experts [w E', (w + 1) E') (E' = 32 kPer, kPer
// = 3 for Kimi), keeps its top_k in rank order in shared memory, and warp 0 merges the
// kSplitWarps * top_k candidates with the same argmax rounds. Better is a total order, so the
// merge picks the same experts in the same order as one pass over all of them; the sigmoid is per
// expert and the weights' sum runs in rank order as above, so ids and weight bits are identical to
// MoeRouteRef's. (Softmax scoring sums over all experts in the one-warp kernel's order, and the
// group stage needs every expert of a group in one warp: both stay on the one-warp kernel.)
constexpr int kSplitWarps = 4;
constexpr int kSplitMaxTokens = 512;  // above: the one-warp kernel (prefill; the work dominates)

// The fused dispatch's limits: MoeDispatchKernel's one-warp placement range, and its expert count.
constexpr int kFusedDispatchMaxAssignments = 256;
constexpr int kFusedDispatchMaxExperts = 1024;

// The tail of MoeRouteSplitKernel<kPer, true>, all kSplitWarps warps.
__device__ __forceinline__ void FusedDispatch(const MoeRouteParams& p, const MoeDispatchParams& d,
                                              int* counter) {
  __shared__ int s_count[kFusedDispatchMaxExperts], s_cursor[kFusedDispatchMaxExperts];
  __shared__ int s_local[kFusedDispatchMaxAssignments];
  __shared__ int s_warp_sum[kSplitWarps][2];
  __shared__ int s_last;
  constexpr int kThreads = 32 * kSplitWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Warp 0's ids reach the device before the block counts itself done (the classic last-block
  // pattern: release by the fence, the atomic orders the blocks, the last one fences again before
  // it reads the others' ids through L2). One token: its block is the last, no counter.
  if (p.tokens > 1) {
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counter, 1) == p.tokens - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
  } else {
    __syncthreads();
  }
  const int E = d.num_local_experts, A = d.tokens * d.top_k;
  for (int e = tid; e < E; e += kThreads) s_count[e] = 0;
  for (int a = tid; a < A; a += kThreads) {
    const int local = __ldcg(d.topk_ids + a) - d.first_expert;
    s_local[a] = local >= 0 && local < E ? local : -1;
  }
  __syncthreads();
  for (int a = tid; a < A; a += kThreads) {
    if (s_local[a] >= 0) atomicAdd(&s_count[s_local[a]], 1);
  }
  __syncthreads();
  // Exclusive sums of the counts and of their tiles: thread i owns experts [i per, (i + 1) per).
  const int per = (E + kThreads - 1) / kThreads;
  const int lo = min(E, tid * per), hi = min(E, lo + per);
  int rows = 0, tiles = 0;
  for (int e = lo; e < hi; ++e) {
    rows += s_count[e];
    tiles += (s_count[e] + d.tile_tokens - 1) / d.tile_tokens;
  }
  int rows_incl = rows, tiles_incl = tiles;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows_incl, o);
    const int t = __shfl_up_sync(0xffffffffu, tiles_incl, o);
    if (lane >= o) {
      rows_incl += r;
      tiles_incl += t;
    }
  }
  if (lane == 31) {
    s_warp_sum[warp][0] = rows_incl;
    s_warp_sum[warp][1] = tiles_incl;
  }
  __syncthreads();
  int row = rows_incl - rows, tile = tiles_incl - tiles, total_rows = 0, total_tiles = 0;
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) {
    if (w < warp) {
      row += s_warp_sum[w][0];
      tile += s_warp_sum[w][1];
    }
    total_rows += s_warp_sum[w][0];
    total_tiles += s_warp_sum[w][1];
  }
  for (int e = lo; e < hi; ++e) {
    const int c = s_count[e];
    d.expert_counts[e] = c;
    d.expert_offsets[e] = row;
    d.tile_offsets[e] = tile;
    s_cursor[e] = row;
    row += c;
    tile += (c + d.tile_tokens - 1) / d.tile_tokens;
  }
  if (tid == 0) {
    d.expert_offsets[E] = total_rows;
    d.tile_offsets[E] = total_tiles;
  }
  __syncthreads();
  // Stable placement by warp 0, 32 assignments a step (MoeDispatchKernel<false>'s walk).
  if (warp == 0) {
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int i0 = 0; i0 < A; i0 += 32) {
      const int i = i0 + lane;
      const int local = i < A ? s_local[i] : -2;
      const unsigned peers = __match_any_sync(0xffffffffu, local);
      const int rank = __popc(peers & lanes_below);
      if (local >= 0) {
        const int r = s_cursor[local] + rank;
        d.sorted_assignment[r] = i;
        d.assignment_row[i] = r;
      } else if (local == -1) {
        d.assignment_row[i] = -1;
      }
      __syncwarp();
      if (local >= 0 && rank == 0) s_cursor[local] += __popc(peers);
      __syncwarp();
    }
    if (lane == 0 && p.tokens > 1) *counter = 0;  // for the next call
  }
}

// Warp 0 of MoeRouteSplitKernel: the merge of the warps' picks, and the outputs.
__device__ __forceinline__ void MergeSplitPicks(const MoeRouteParams& p, int t, int lane,
                                                const float* s_score, const int* s_index,
                                                const float* s_raw) {
  const MoeRouterConfig& c = p.config;
  const int K = c.top_k;
  // The merge: lane l holds candidates l + 32 j (j < kSplitWarps), warp j's rank-l pick.
  float cs[kSplitWarps], craw[kSplitWarps];
  int ci[kSplitWarps];
#pragma unroll
  for (int j = 0; j < kSplitWarps; ++j) {
    cs[j] = s_score[j * 32 + lane];
    ci[j] = s_index[j * 32 + lane];
    craw[j] = s_raw[j * 32 + lane];
  }
  int32_t* ids = p.topk_ids + static_cast<size_t>(t) * K;
  float* w = p.topk_weights + static_cast<size_t>(t) * K;
  float sum = 0.0f, mine = 0.0f;
  for (int r = 0; r < K; ++r) {
    float s = -INFINITY, raw = 0.0f;
    int idx = INT_MAX, from = 0;
#pragma unroll
    for (int j = 0; j < kSplitWarps; ++j) {
      if (ci[j] != INT_MAX && rm::Better(cs[j], ci[j], s, idx)) {
        s = cs[j];
        idx = ci[j];
        raw = craw[j];
        from = j;
      }
    }
    const int mine_idx = idx;
    WarpBest(s, idx);
    // The winner's owner lane: the one whose best was it (indices are distinct).
    const unsigned won = __ballot_sync(0xffffffffu, mine_idx == idx);
    const int owner = __ffs(won) - 1;
    raw = __shfl_sync(0xffffffffu, raw, owner);
    if (owner == lane) {
#pragma unroll
      for (int j = 0; j < kSplitWarps; ++j) {
        if (j == from) ci[j] = INT_MAX;
      }
    }
    if (lane == 0) ids[r] = idx;
    if (lane == r) mine = raw;
    sum = rm::Add(sum, raw);  // rank order, identical in every lane
  }
  if (lane < K) {
    const float denom = rm::Add(sum, 1e-20f);
    float v = mine;
    if (c.norm_topk_prob) v = rm::Div(v, denom);
    w[lane] = rm::Mul(v, c.routed_scaling_factor);
  }
}

// kDispatch: the experts' dispatch follows in the same kernel (InvokeMoeRouteDispatch): each
// block counts itself done on `counter` once its token's ids are out, and the last one places
// every assignment as MoeDispatchKernel does (same rows), then sets the counter back to 0.
template <int kPer, bool kDispatch>
__global__ void __launch_bounds__(32 * kSplitWarps)
    MoeRouteSplitKernel(const MoeRouteParams p, const MoeDispatchParams d, int* counter) {
  __shared__ float s_score[kSplitWarps * 32], s_raw[kSplitWarps * 32];
  __shared__ int s_index[kSplitWarps * 32];
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x;
  const MoeRouterConfig& c = p.config;
  const int E = c.num_experts, K = c.top_k;
  const float* l = p.logits + static_cast<size_t>(t) * E;
  const int base = warp * 32 * kPer;
  float score[kPer], choice[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = base + lane + 32 * i;
    score[i] = e < E ? l[e] : 0.0f;
    choice[i] = e < E && p.bias ? p.bias[e] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    score[i] = rm::Sigmoid(score[i]);
    const float v = p.bias ? rm::Add(score[i], choice[i]) : score[i];
    choice[i] = !isnan(v) ? v : -INFINITY;
  }
  // This warp's top K (fewer where it holds fewer experts): lane r keeps round r's candidate.
  unsigned taken = 0;
  float my_s = -INFINITY, my_raw = 0.0f;
  int my_i = INT_MAX;
  for (int r = 0; r < K; ++r) {
    float s = -INFINITY, raw = 0.0f;
    int idx = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = base + lane + 32 * i;
      if (e < E && !((taken >> i) & 1u) && rm::Better(choice[i], e, s, idx)) {
        s = choice[i];
        idx = e;
        raw = score[i];
      }
    }
    WarpBest(s, idx);
    if (idx == INT_MAX) break;  // this warp's experts are all taken (uniform across the warp)
    const int owner = (idx - base) & 31;
    raw = __shfl_sync(0xffffffffu, raw, owner);
    if (owner == lane) taken |= 1u << ((idx - base) >> 5);
    if (lane == r) {
      my_s = s;
      my_i = idx;
      my_raw = raw;
    }
  }
  s_score[warp * 32 + lane] = my_s;
  s_index[warp * 32 + lane] = my_i;
  s_raw[warp * 32 + lane] = my_raw;
  __syncthreads();
  if (warp == 0) MergeSplitPicks(p, t, lane, s_score, s_index, s_raw);
  if constexpr (kDispatch) FusedDispatch(p, d, counter);
}

}  // namespace

cublasStatus_t InvokeMoeRouterLogits(const MoeRouterLogitsParams& p, cudaStream_t stream) {
  cublasStatus_t st = cublasSetStream(p.cublas, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: logits^T [E, T] = gate [E, H] (row-major = col-major [H, E], transposed)
  // times hidden^T [H, T].
  return cublasGemmEx(p.cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.num_experts, p.tokens, p.hidden, &alpha,
                      p.gate_weight, CUDA_R_16BF, p.hidden, p.hidden_states, CUDA_R_16BF, p.hidden,
                      &beta, p.logits, CUDA_R_32F, p.num_experts, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

namespace {

// Where MoeRouteSplitKernel serves the call (MoeRouteParams::split).
bool SplitApplies(const MoeRouteParams& p) {
  const MoeRouterConfig& c = p.config;
  return p.split && !c.softmax_scoring && c.n_group == 1 && p.tokens <= kSplitMaxTokens &&
         c.num_experts <= kSplitWarps * 32 * 8;
}

template <bool kDispatch>
cudaError_t LaunchSplit(const MoeRouteParams& p, const MoeDispatchParams& d, int* counter,
                        cudaStream_t stream) {
  auto split = [&](auto kernel) {
    return pdl::LaunchKernel(kernel, dim3(p.tokens), dim3(32 * kSplitWarps), 0, stream,
                             p.programmatic, p, d, counter);
  };
  const int per = (p.config.num_experts + kSplitWarps * 32 - 1) / (kSplitWarps * 32);
  if (per <= 2) return split(MoeRouteSplitKernel<2, kDispatch>);
  if (per <= 3) return split(MoeRouteSplitKernel<3, kDispatch>);
  if (per <= 4) return split(MoeRouteSplitKernel<4, kDispatch>);
  return split(MoeRouteSplitKernel<8, kDispatch>);
}

}  // namespace

cudaError_t InvokeMoeRoute(const MoeRouteParams& p, cudaStream_t stream) {
  if (!ValidateMoeRouterConfig(p.config).ok()) return cudaErrorInvalidValue;
  if (p.tokens <= 0) return cudaSuccess;
  if (SplitApplies(p)) return LaunchSplit<false>(p, MoeDispatchParams{}, nullptr, stream);
  const int blocks = (p.tokens + kRouterWarps - 1) / kRouterWarps;
  auto go = [&](auto kernel) {
    return pdl::LaunchKernel(kernel, dim3(blocks), dim3(32 * kRouterWarps), 0, stream,
                             p.programmatic, p);
  };
  if (p.config.num_experts <= 8 * 32) return go(MoeRouteKernel<8>);
  if (p.config.num_experts <= 16 * 32) return go(MoeRouteKernel<16>);
  return go(MoeRouteKernel<32>);
}

cudaError_t InvokeMoeRouteDispatch(const MoeRouteParams& route, const MoeDispatchParams& dispatch,
                                   int* counter, cudaStream_t stream) {
  if (!ValidateMoeRouterConfig(route.config).ok() || route.topk_ids != dispatch.topk_ids ||
      route.tokens != dispatch.tokens || route.config.top_k != dispatch.top_k ||
      dispatch.num_local_experts < 1 || dispatch.num_local_experts > kFusedDispatchMaxExperts ||
      dispatch.tile_tokens < 1) {
    return cudaErrorInvalidValue;
  }
  if (route.tokens <= 0) return cudaSuccess;
  if (counter != nullptr && SplitApplies(route) &&
      route.tokens * route.config.top_k <= kFusedDispatchMaxAssignments) {
    return LaunchSplit<true>(route, dispatch, counter, stream);
  }
  if (cudaError_t e = InvokeMoeRoute(route, stream); e != cudaSuccess) return e;
  return InvokeMoeDispatch(dispatch, stream);
}

}  // namespace mlaserve
