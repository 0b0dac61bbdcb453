#include <cfloat>

#include "kernels/moe/moe_router.h"
#include "kernels/moe/moe_router_math.h"

namespace mlaserve {
namespace {

namespace rm = router_math;

constexpr int kRouterWarps = 4;
constexpr int kMaxExperts = 1024;
constexpr int kPerLane = kMaxExperts / 32;

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

__global__ void __launch_bounds__(32 * kRouterWarps) MoeRouteKernel(const MoeRouteParams p) {
  __shared__ float s_score[kRouterWarps][kMaxExperts];
  __shared__ float s_choice[kRouterWarps][kMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kRouterWarps + warp;
  if (t >= p.tokens) return;
  const MoeRouterConfig& c = p.config;
  const int E = c.num_experts;
  const float* l = p.logits + static_cast<size_t>(t) * E;
  float* score = s_score[warp];
  float* choice = s_choice[warp];

  if (c.softmax_scoring) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float partial = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float ex = rm::Exp(rm::Add(l[e], -m));
      score[e] = ex;
      partial = rm::Add(partial, ex);
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
      partial = rm::Add(partial, __shfl_xor_sync(0xffffffffu, partial, o));
    }
    for (int e = lane; e < E; e += 32) score[e] = rm::Div(score[e], partial);
  } else {
    for (int e = lane; e < E; e += 32) score[e] = rm::Sigmoid(l[e]);
  }
  for (int e = lane; e < E; e += 32) {
    const float v = p.bias ? rm::Add(score[e], p.bias[e]) : score[e];
    choice[e] = isnan(v) ? -INFINITY : v;
  }
  __syncwarp();

  if (c.n_group > 1) {
    const int group_size = E / c.n_group;
    float gscore = -INFINITY;
    if (lane < c.n_group) {
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        const float v = choice[e];
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
    for (int e = lane; e < E; e += 32) {
      if (!((kept_mask >> (e / group_size)) & 1u)) choice[e] = -INFINITY;
    }
    __syncwarp();
  }

  // top_k rounds of warp argmax; lane owns experts lane + 32 i, bit i of `taken`.
  unsigned taken = 0;
  int32_t* ids = p.topk_ids + static_cast<size_t>(t) * c.top_k;
  float* w = p.topk_weights + static_cast<size_t>(t) * c.top_k;
  float sum = 0.0f;
  for (int r = 0; r < c.top_k; ++r) {
    float s = -INFINITY;
    int idx = INT_MAX;
#pragma unroll 4
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= E) break;
      if ((taken >> i) & 1u) continue;
      if (rm::Better(choice[e], e, s, idx)) {
        s = choice[e];
        idx = e;
      }
    }
    WarpBest(s, idx);
    if ((idx & 31) == lane) taken |= 1u << (idx >> 5);
    if (lane == 0) {
      ids[r] = idx;
      w[r] = score[idx];
    }
    sum = rm::Add(sum, score[idx]);  // rank order, identical in every lane
  }
  __syncwarp();
  if (lane == 0) {
    const float denom = rm::Add(sum, 1e-20f);
    for (int r = 0; r < c.top_k; ++r) {
      float v = w[r];
      if (c.norm_topk_prob) v = rm::Div(v, denom);
      w[r] = rm::Mul(v, c.routed_scaling_factor);
    }
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
  const int blocks = (p.tokens + kRouterWarps - 1) / kRouterWarps;
  MoeRouteKernel<<<blocks, 32 * kRouterWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve
