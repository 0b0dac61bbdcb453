// The merged projection's epilogue (split_columns.h): a thread moves V consecutive columns of one
// row, V = 4 where every segment's columns, strides and pointers allow 16-byte fp32 loads and
// aligned stores, else 1.
#include <cuda_bf16.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/linear/split_columns.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // gridDim.y limit; more rows loop

template <int V>
__global__ void __launch_bounds__(kThreads) SplitColumnsKernel(const SplitColumnsParams p) {
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  int s = 0;
  for (; s < p.num_segments && c >= p.seg[s].cols; ++s) c -= p.seg[s].cols;
  if (s == p.num_segments) return;
  int64_t src_col = c;
  for (int i = 0; i < s; ++i) src_col += p.seg[i].cols;
  const SplitColumnsParams::Segment& g = p.seg[s];
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const float* in = p.src + r * p.src_stride + src_col;
    float v[V];
    if constexpr (V == 4) {
      const float4 f = *reinterpret_cast<const float4*>(in);
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    } else {
      v[0] = *in;
    }
    if (g.dtype == DType::kF32) {
      float* out = static_cast<float*>(g.out) + r * g.out_stride + c;
      if constexpr (V == 4) {
        *reinterpret_cast<float4*>(out) =
            make_float4(g.alpha * v[0], g.alpha * v[1], g.alpha * v[2], g.alpha * v[3]);
      } else {
        *out = g.alpha * v[0];
      }
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(g.out) + r * g.out_stride + c;
      if constexpr (V == 4) {
        __nv_bfloat162 lo = __halves2bfloat162(__float2bfloat16_rn(g.alpha * v[0]),
                                               __float2bfloat16_rn(g.alpha * v[1]));
        __nv_bfloat162 hi = __halves2bfloat162(__float2bfloat16_rn(g.alpha * v[2]),
                                               __float2bfloat16_rn(g.alpha * v[3]));
        uint2 w;
        w.x = *reinterpret_cast<uint32_t*>(&lo);
        w.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(out) = w;
      } else {
        *out = __float2bfloat16_rn(g.alpha * v[0]);
      }
    }
  }
}

bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace

absl::Status InvokeSplitColumns(const SplitColumnsParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.num_segments < 1 || p.num_segments > kSplitColumnsMaxSegments ||
      p.src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeSplitColumns: need rows >= 0, 1..", kSplitColumnsMaxSegments,
        " segments and a source, got rows ", p.rows, ", ", p.num_segments, " segments"));
  }
  int64_t total = 0;
  bool vec = Aligned(p.src, 16) && p.src_stride % 4 == 0;
  for (int s = 0; s < p.num_segments; ++s) {
    const SplitColumnsParams::Segment& g = p.seg[s];
    if (g.cols < 1 || g.out == nullptr || g.out_stride < g.cols ||
        (g.dtype != DType::kBF16 && g.dtype != DType::kF32)) {
      return absl::InvalidArgumentError(
          absl::StrCat("InvokeSplitColumns: segment ", s,
                       " needs cols >= 1, an output, out_stride >= cols "
                       "and a bf16 or fp32 output; got cols ",
                       g.cols, ", out_stride ", g.out_stride));
    }
    const uintptr_t es = g.dtype == DType::kF32 ? 4 : 2;
    vec = vec && g.cols % 4 == 0 && g.out_stride % 4 == 0 && Aligned(g.out, 4 * es);
    total += g.cols;
  }
  if (p.src_stride < total) {
    return absl::InvalidArgumentError(absl::StrCat("InvokeSplitColumns: src_stride ", p.src_stride,
                                                   " < the segments' ", total, " columns"));
  }
  if (p.rows == 0) return absl::OkStatus();
  const int v = vec ? 4 : 1;
  const int64_t units = (total + v - 1) / v;
  const dim3 grid(static_cast<unsigned>((units + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.rows < kMaxRowBlocks ? p.rows : kMaxRowBlocks));
  const cudaError_t e = vec ? pdl::LaunchKernel(SplitColumnsKernel<4>, grid, dim3(kThreads), 0,
                                                stream, p.programmatic, p)
                            : pdl::LaunchKernel(SplitColumnsKernel<1>, grid, dim3(kThreads), 0,
                                                stream, p.programmatic, p);
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("InvokeSplitColumns: launch failed (rows ", p.rows,
                                            ", cols ", total, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
