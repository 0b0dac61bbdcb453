#include <cuda_bf16.h>

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/embedding/embedding.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename Src, typename Dst>
__device__ __forceinline__ Dst Convert(Src v) {
  if constexpr (std::is_same_v<Src, Dst>) {
    return v;  // bit copy (keeps NaN payloads)
  } else {
    return FromFloat<Dst>(ToFloat(v));
  }
}

// One block per output row (blockIdx.x over count), threads over columns. The rows are
// independent, so blockIdx.y splits a wide row (cols up to the hidden size, 7168) further when
// count is small.
template <typename Src, typename Dst>
__global__ void GatherRowsKernel(const Src* __restrict__ src, int64_t src_rows, int64_t src_stride,
                                 int cols, const int32_t* __restrict__ ids, int64_t id_offset,
                                 Dst* __restrict__ out, int64_t out_stride) {
  pdl::AllowDependentLaunch();  // a programmatic successor (lm_head) may set up
  const int64_t i = blockIdx.x;
  const int64_t row = static_cast<int64_t>(ids[i]) - id_offset;
  const bool valid = row >= 0 && row < src_rows;
  const Src* s = src + (valid ? row : 0) * src_stride;
  Dst* o = out + i * out_stride;
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
    o[c] = valid ? Convert<Src, Dst>(s[c]) : FromFloat<Dst>(0.0f);
  }
}

template <typename Src, typename Dst>
cudaError_t Launch(const GatherRowsParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int col_blocks = (p.cols + kThreads - 1) / kThreads;
  // Enough blocks in y to fill the GPU when few rows are gathered (e.g. decode: count = batch).
  const int split = p.count >= 256 ? 1 : (col_blocks < 8 ? col_blocks : 8);
  const dim3 grid(static_cast<unsigned>(p.count), static_cast<unsigned>(split));
  GatherRowsKernel<Src, Dst><<<grid, kThreads, 0, stream>>>(
      static_cast<const Src*>(p.src), p.src_rows, p.src_stride, p.cols, p.ids, p.id_offset,
      static_cast<Dst*>(p.out), p.out_stride);
  return cudaGetLastError();
}

bool IsSupported(DType d) { return d == DType::kBF16 || d == DType::kF32; }

}  // namespace

absl::Status InvokeGatherRows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.count < 0 || p.cols <= 0 || p.src_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("InvokeGatherRows: need count >= 0 (got ",
                                                   p.count, "), cols > 0 (got ", p.cols,
                                                   "), src_rows >= 0 (got ", p.src_rows, ")"));
  }
  if (p.count == 0) return absl::OkStatus();
  if (!IsSupported(p.src_dtype) || !IsSupported(p.out_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeGatherRows: src_dtype and out_dtype must be BF16 or F32, got ",
        std::string(DTypeName(p.src_dtype)), " -> ", std::string(DTypeName(p.out_dtype))));
  }
  if (p.src_stride < p.cols || p.out_stride < p.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeGatherRows: strides must be >= cols = ", p.cols, ", got src_stride ",
                     p.src_stride, ", out_stride ", p.out_stride));
  }
  if ((p.src == nullptr && p.src_rows > 0) || p.ids == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("InvokeGatherRows: src, ids and out must be non-null");
  }
  cudaError_t e;
  const bool src_bf16 = p.src_dtype == DType::kBF16, out_bf16 = p.out_dtype == DType::kBF16;
  if (src_bf16 && out_bf16) {
    e = Launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
  } else if (src_bf16) {
    e = Launch<__nv_bfloat16, float>(p, stream);
  } else if (out_bf16) {
    e = Launch<float, __nv_bfloat16>(p, stream);
  } else {
    e = Launch<float, float>(p, stream);
  }
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("InvokeGatherRows: launch failed (count ", p.count,
                                            ", cols ", p.cols, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
