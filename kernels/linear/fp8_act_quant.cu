// Activation quantization for the FP8 block-128 GEMM (kernels/linear/fp8_block_gemm.h).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/linear/fp8_block_gemm.h"

namespace mlaserve {
namespace {

constexpr int kGroup = 128;
constexpr int kWarpsPerBlock = 4;

// One warp per (row, 128-column group): 4 values a lane, amax by shuffles, s = amax / 448.
__global__ void QuantizeFp8BlockKernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                                       int64_t m, int64_t groups, uint8_t* __restrict__ xq,
                                       float* __restrict__ x_scale, int64_t scale_stride) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= m * groups) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = task / groups, g = task % groups;
  const __nv_bfloat16* src = x + row * x_stride + g * kGroup + lane * 4;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = __bfloat162float(src[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = __nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3);
    packed |= q << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(xq + row * groups * kGroup + g * kGroup + lane * 4) = packed;
  if (lane == 0) x_scale[g * scale_stride + row] = s;
}

}  // namespace

cudaError_t QuantizeActivationsFp8Block(const void* x, int64_t x_stride, int64_t m, int64_t k,
                                        uint8_t* xq, float* x_scale, int64_t scale_stride,
                                        cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  if (k % kGroup != 0 || x_stride < k || scale_stride < m) return cudaErrorInvalidValue;
  const int64_t groups = k / kGroup;
  const int64_t tasks = m * groups;
  const int64_t blocks = (tasks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  QuantizeFp8BlockKernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), x_stride, m, groups, xq, x_scale, scale_stride);
  return cudaGetLastError();
}

}  // namespace mlaserve
