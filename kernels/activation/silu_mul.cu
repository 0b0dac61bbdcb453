#include <cuda_bf16.h>

#include "absl/strings/str_cat.h"
#include "kernels/activation/silu_mul.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // gridDim.y limit; more rows loop

// Not __restrict__: out may alias gate or up (each element is read before it is written, by the
// same thread).
__global__ void __launch_bounds__(kThreads)
    SiluMulKernel(int64_t rows, int cols, const __nv_bfloat16* gate, const __nv_bfloat16* up,
                  int64_t in_stride, __nv_bfloat16* out, int64_t out_stride) {
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();     // a programmatic successor (the down projection) may set up
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float g = __bfloat162float(gate[r * in_stride + c]);
    const float u = __bfloat162float(up[r * in_stride + c]);
    out[r * out_stride + c] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), u));
  }
}

}  // namespace

absl::Status InvokeSiluMul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeSiluMul: need rows >= 0 and cols > 0, got rows ", p.rows, ", cols ", p.cols));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.in_stride < p.cols || p.out_stride < p.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeSiluMul: strides must be >= cols = ", p.cols, ", got in_stride ",
                     p.in_stride, ", out_stride ", p.out_stride));
  }
  if (p.gate == nullptr || p.up == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("InvokeSiluMul: gate, up and out must be non-null");
  }
  const dim3 grid(static_cast<unsigned>((p.cols + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.rows < kMaxRowBlocks ? p.rows : kMaxRowBlocks));
  if (cudaError_t e = pdl::LaunchKernel(SiluMulKernel, grid, dim3(kThreads), 0, stream,
                                        p.programmatic, p.rows, p.cols,
                                        static_cast<const __nv_bfloat16*>(p.gate),
                                        static_cast<const __nv_bfloat16*>(p.up), p.in_stride,
                                        static_cast<__nv_bfloat16*>(p.out), p.out_stride);
      e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("InvokeSiluMul: launch failed (rows ", p.rows,
                                            ", cols ", p.cols, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
