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

template <int kPer>
__global__ void __launch_bounds__(32 * kSplitWarps) MoeRouteSplitKernel(const MoeRouteParams p) {
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
  if (warp != 0) return;
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

cudaError_t InvokeMoeRoute(const MoeRouteParams& p, cudaStream_t stream) {
  if (!ValidateMoeRouterConfig(p.config).ok()) return cudaErrorInvalidValue;
  if (p.tokens <= 0) return cudaSuccess;
  const MoeRouterConfig& c = p.config;
  if (p.split && !c.softmax_scoring && c.n_group == 1 && p.tokens <= kSplitMaxTokens &&
      c.num_experts <= kSplitWarps * 32 * 8) {
    auto split = [&](auto kernel) {
      return pdl::LaunchKernel(kernel, dim3(p.tokens), dim3(32 * kSplitWarps), 0, stream,
                               p.programmatic, p);
    };
    const int per = (c.num_experts + kSplitWarps * 32 - 1) / (kSplitWarps * 32);
    if (per <= 2) return split(MoeRouteSplitKernel<2>);
    if (per <= 3) return split(MoeRouteSplitKernel<3>);
    if (per <= 4) return split(MoeRouteSplitKernel<4>);
    return split(MoeRouteSplitKernel<8>);
  }
  const int blocks = (p.tokens + kRouterWarps - 1) / kRouterWarps;
  auto go = [&](auto kernel) {
    return pdl::LaunchKernel(kernel, dim3(blocks), dim3(32 * kRouterWarps), 0, stream,
                             p.programmatic, p);
  };
  if (p.config.num_experts <= 8 * 32) return go(MoeRouteKernel<8>);
  if (p.config.num_experts <= 16 * 32) return go(MoeRouteKernel<16>);
  return go(MoeRouteKernel<32>);
}

}  // namespace mlaserve
