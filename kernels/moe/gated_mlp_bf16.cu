#include "kernels/moe/gated_mlp_bf16.h"

namespace mlaserve {
namespace {

__global__ void SiluMulKernel(const __nv_bfloat16* __restrict__ gate_up, int inter, int tokens,
                              __nv_bfloat16* __restrict__ act) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<size_t>(tokens) * inter) return;
  const size_t t = i / inter, f = i % inter;
  const float g = __bfloat162float(gate_up[t * 2 * inter + f]);
  const float u = __bfloat162float(gate_up[t * 2 * inter + inter + f]);
  act[i] = __float2bfloat16_rn(g / (1.0f + __expf(-g)) * u);
}

// Row-major C [m_rows, n_cols] = A [m_rows, k] @ B [n_cols, k]^T, as column-major
// C^T = B A^T.
cublasStatus_t GemmNT(cublasHandle_t h, int m_rows, int n_cols, int k, const __nv_bfloat16* a,
                      const __nv_bfloat16* b, __nv_bfloat16* c) {
  const float alpha = 1.0f, beta = 0.0f;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n_cols, m_rows, k, &alpha, b, CUDA_R_16BF, k, a,
                      CUDA_R_16BF, k, &beta, c, CUDA_R_16BF, n_cols, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

}  // namespace

cudaError_t InvokeBf16GatedMlp(const Bf16GatedMlpParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (cublasSetStream(p.cublas, stream) != CUBLAS_STATUS_SUCCESS) return cudaErrorUnknown;
  if (GemmNT(p.cublas, p.tokens, 2 * p.intermediate, p.hidden, p.x, p.gate_up_weight,
             p.gate_up_out) != CUBLAS_STATUS_SUCCESS) {
    return cudaErrorUnknown;
  }
  const size_t n = static_cast<size_t>(p.tokens) * p.intermediate;
  SiluMulKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      p.gate_up_out, p.intermediate, p.tokens, p.act);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (GemmNT(p.cublas, p.tokens, p.hidden, p.intermediate, p.act, p.down_weight, p.out) !=
      CUBLAS_STATUS_SUCCESS) {
    return cudaErrorUnknown;
  }
  return cudaSuccess;
}

}  // namespace mlaserve
