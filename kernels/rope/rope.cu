#include <cuda_bf16.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/rope/rope.h"

namespace mlaserve {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPairsPerLane = kRopeMaxDim / 2 / 32;

// One warp per rotary vector. Every lane loads its pairs into registers before any lane writes
// (the __syncwarp), because the interleaved layout writes element i from the pair (2i, 2i+1) that
// another lane read.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    RopeKernel(__nv_bfloat16* __restrict__ x, int64_t vectors, int64_t row_stride,
               int64_t first_col, int per_row, int64_t vec_stride, int dim,
               const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
               float scaling, bool interleaved) {
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (v >= vectors) return;  // whole warps exit together
  const int lane = threadIdx.x % 32;
  const int64_t row = v / per_row;
  const int j = static_cast<int>(v % per_row);
  __nv_bfloat16* vec = x + row * row_stride + first_col + j * vec_stride;
  const int half = dim / 2;
  const float pos = static_cast<float>(positions[row]);

  float x0[kMaxPairsPerLane], x1[kMaxPairsPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPairsPerLane; ++k) {
    const int i = lane + 32 * k;
    if (i < half) {
      x0[k] = __bfloat162float(vec[interleaved ? 2 * i : i]);
      x1[k] = __bfloat162float(vec[interleaved ? 2 * i + 1 : i + half]);
    }
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < kMaxPairsPerLane; ++k) {
    const int i = lane + 32 * k;
    if (i < half) {
      const float angle = __fmul_rn(inv_freq[i], pos);
      const float c = __fmul_rn(cosf(angle), scaling);
      const float s = __fmul_rn(sinf(angle), scaling);
      // Explicit roundings: the same operations as RopeRef, no FMA contraction.
      vec[i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(x0[k], c), __fmul_rn(x1[k], s)));
      vec[i + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(x1[k], c), __fmul_rn(x0[k], s)));
    }
  }
}

}  // namespace

absl::Status InvokeRope(const RopeParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.per_row <= 0 || p.dim <= 0 || p.dim % 2 != 0 || p.dim > kRopeMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeRope: need rows >= 0, per_row > 0 and an even dim in [2, ", kRopeMaxDim,
                     "], got rows ", p.rows, ", per_row ", p.per_row, ", dim ", p.dim));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr) {
    return absl::InvalidArgumentError("InvokeRope: x, positions and inv_freq must be non-null");
  }
  // Vectors of one row, and rows, must not overlap: each vector is rotated by one warp in place.
  const int64_t row_extent =
      p.first_col + static_cast<int64_t>(p.per_row - 1) * p.vec_stride + p.dim;
  if (p.first_col < 0 || (p.per_row > 1 && p.vec_stride < p.dim) ||
      (p.rows > 1 && p.row_stride < row_extent)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeRope: vectors overlap or lie outside their rows: first_col ", p.first_col,
        ", per_row ", p.per_row, ", vec_stride ", p.vec_stride, ", dim ", p.dim, ", row_stride ",
        p.row_stride, " (need first_col >= 0, vec_stride >= dim, row_stride >= ", row_extent, ")"));
  }
  const int64_t vectors = p.rows * p.per_row;
  const int64_t blocks = (vectors + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeRope: too many vectors (", vectors, ") for one launch"));
  }
  if (cudaError_t e = pdl::LaunchKernel(
          RopeKernel, dim3(static_cast<unsigned>(blocks)), dim3(kWarpsPerBlock * 32), 0, stream,
          p.programmatic, static_cast<__nv_bfloat16*>(p.x), vectors, p.row_stride, p.first_col,
          p.per_row, p.vec_stride, p.dim, p.positions, p.inv_freq, p.attention_scaling,
          p.interleaved);
      e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("InvokeRope: launch failed (rows ", p.rows,
                                            ", per_row ", p.per_row, ", dim ", p.dim,
                                            "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
