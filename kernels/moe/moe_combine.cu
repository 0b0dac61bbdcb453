#include "kernels/moe/moe_combine.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) MoeCombineKernel(const MoeCombineParams p) {
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  const int t = blockIdx.y;
  const int h = (blockIdx.x * kThreads + threadIdx.x) * 4;
  if (h >= p.hidden) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < p.top_k; ++j) {
    const int row = p.assignment_row != nullptr
                        ? __ldg(p.assignment_row + static_cast<size_t>(t) * p.top_k + j)
                        : t * p.top_k + j;
    if (row < 0) continue;
    const float4 v =
        __ldg(reinterpret_cast<const float4*>(p.y + static_cast<size_t>(row) * p.hidden + h));
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const size_t o = static_cast<size_t>(t) * p.hidden + h;
  if (p.shared_out != nullptr) {
    const __nv_bfloat162 s01 = *reinterpret_cast<const __nv_bfloat162*>(p.shared_out + o);
    const __nv_bfloat162 s23 = *reinterpret_cast<const __nv_bfloat162*>(p.shared_out + o + 2);
    acc.x += __low2float(s01);
    acc.y += __high2float(s01);
    acc.z += __low2float(s23);
    acc.w += __high2float(s23);
  }
  if (p.out != nullptr) *reinterpret_cast<float4*>(p.out + o) = acc;
  if (p.out_bf16 != nullptr) {
    *reinterpret_cast<__nv_bfloat162*>(p.out_bf16 + o) = __floats2bfloat162_rn(acc.x, acc.y);
    *reinterpret_cast<__nv_bfloat162*>(p.out_bf16 + o + 2) = __floats2bfloat162_rn(acc.z, acc.w);
  }
}

}  // namespace

cudaError_t InvokeMoeCombine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.hidden % 4 != 0 || p.tokens > 65535) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const dim3 grid((p.hidden / 4 + kThreads - 1) / kThreads, p.tokens);
  return pdl::LaunchKernel(MoeCombineKernel, grid, dim3(kThreads), 0, stream,
                                     p.programmatic, p);
}

}  // namespace mlaserve
