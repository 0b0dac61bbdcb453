#include <cuda_bf16.h>

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// Sum over the block, returned to every thread. kThreads is a multiple of 32.
template <int kThreads>
__device__ __forceinline__ float BlockSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if constexpr (kThreads == 32) {
    return v;
  } else {
    constexpr int kWarps = kThreads / 32;
    __shared__ float partial[kWarps];
    __shared__ float total;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
      float s = lane < kWarps ? partial[lane] : 0.0f;
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
  }
}

// One block per row. Pass 1 sums x^2 (for kAdd: x = residual + delta, written back to the
// residual); pass 2 rereads x (from L1/L2: a row is at most a few tens of KiB) and writes
// weight * (x * inv). In pass 2 every thread reads only the elements it wrote in pass 1, so the
// residual update needs no barrier.
template <int kThreads, typename T, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const T* __restrict__ x, int64_t x_stride,
                  const __nv_bfloat16* __restrict__ delta, float* __restrict__ residual,
                  const float* __restrict__ weight, int dim, float eps,
                  __nv_bfloat16* __restrict__ out, int64_t out_stride) {
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();     // a programmatic successor (a projection) may set up
  const int64_t row = blockIdx.x;
  float sum = 0.0f;
  if constexpr (kAdd) {
    float* r = residual + row * dim;
    const __nv_bfloat16* d = delta + row * dim;
    for (int i = threadIdx.x; i < dim; i += kThreads) {
      const float v = r[i] + __bfloat162float(d[i]);
      r[i] = v;
      sum += v * v;
    }
  } else {
    const T* xr = x + row * x_stride;
    for (int i = threadIdx.x; i < dim; i += kThreads) {
      const float v = ToFloat(xr[i]);
      sum += v * v;
    }
  }
  sum = BlockSum<kThreads>(sum);
  // IEEE division and square root (no fast math), as RmsNormRef's 1.0f / std::sqrt(...).
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
  __nv_bfloat16* o = out + row * out_stride;
  for (int i = threadIdx.x; i < dim; i += kThreads) {
    float v;
    if constexpr (kAdd) {
      v = residual[row * dim + i];
    } else {
      v = ToFloat(x[row * x_stride + i]);
    }
    o[i] = __float2bfloat16_rn(weight[i] * (v * inv));
  }
}

// The same arithmetic with the row held in registers: kIters vectors of 4 elements a thread
// (dims up to kThreads * 4 * kIters, a multiple of 4, rows 16-byte aligned for fp32 and 8-byte
// for bf16), every load issued before the first add. The loop kernel above serializes a
// DRAM round trip per element a thread at one row (decode): 15.6 us for the 7168-wide AddRmsNorm
// on the H200 (ncu, batch 1), where one round trip is under 1 us. Each thread sums its elements
// in order and the block by BlockSum, so a row's result depends only on dim, never on the rows
// beside it. In place (out == x) is safe: every load completes before the barrier in BlockSum and
// each thread writes only the elements it read.
struct Bf16x4 {
  __nv_bfloat162 a, b;
};
__device__ __forceinline__ float4 Load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void Store4(__nv_bfloat16* p, float4 v) {
  Bf16x4 o;
  o.a = __floats2bfloat162_rn(v.x, v.y);
  o.b = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<Bf16x4*>(p) = o;
}

template <int kThreads, int kIters, typename T, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    RmsNormRegKernel(const T* x, int64_t x_stride, const __nv_bfloat16* __restrict__ delta,
                     float* residual, const float* __restrict__ weight, int dim, float eps,
                  __nv_bfloat16* out, int64_t out_stride) {
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();     // a programmatic successor (a projection) may set up
  const int64_t row = blockIdx.x;
  float4 v[kIters];
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int i = (threadIdx.x + j * kThreads) * 4;
    if (i < dim) {
      if constexpr (kAdd) {
        const float4 r = Load4(residual + row * dim + i);
        const float4 d = Load4(delta + row * dim + i);
        v[j] = make_float4(r.x + d.x, r.y + d.y, r.z + d.z, r.w + d.w);
      } else {
        v[j] = Load4(x + row * x_stride + i);
      }
    } else {
      v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    sum += v[j].x * v[j].x;
    sum += v[j].y * v[j].y;
    sum += v[j].z * v[j].z;
    sum += v[j].w * v[j].w;
  }
  if constexpr (kAdd) {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = (threadIdx.x + j * kThreads) * 4;
      if (i < dim) *reinterpret_cast<float4*>(residual + row * dim + i) = v[j];
    }
  }
  sum = BlockSum<kThreads>(sum);
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int i = (threadIdx.x + j * kThreads) * 4;
    if (i < dim) {
      const float4 w = *reinterpret_cast<const float4*>(weight + i);
      Store4(out + row * out_stride + i,
             make_float4(w.x * (v[j].x * inv), w.y * (v[j].y * inv), w.z * (v[j].z * inv),
                         w.w * (v[j].w * inv)));
    }
  }
}

bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <typename T, bool kAdd>
cudaError_t Launch(int64_t rows, int dim, float eps, const T* x, int64_t x_stride,
                   const void* delta, float* residual, const float* weight, void* out,
                   int64_t out_stride, bool programmatic, cudaStream_t stream) {
  const auto* d = static_cast<const __nv_bfloat16*>(delta);
  auto* o = static_cast<__nv_bfloat16*>(out);
  const unsigned grid = static_cast<unsigned>(rows);
  auto go = [&](auto kernel, int threads) {
    return pdl::LaunchKernel(kernel, dim3(grid), dim3(threads), 0, stream, programmatic, x,
                             x_stride, d, residual, weight, dim, eps, o, out_stride);
  };
  // Register-held rows where the vectors line up (every model width: multiples of 4).
  const bool vec = dim % 4 == 0 && dim <= 8192 && Aligned(weight, 16) && Aligned(o, 8) &&
                   out_stride % 4 == 0 &&
                   (kAdd ? Aligned(residual, 16) && Aligned(d, 8)
                         : Aligned(x, sizeof(T) * 4) && x_stride % 4 == 0);
  if (vec) {
    if (dim <= 512) return go(RmsNormRegKernel<128, 1, T, kAdd>, 128);
    if (dim <= 1024) return go(RmsNormRegKernel<256, 1, T, kAdd>, 256);
    if (dim <= 2048) return go(RmsNormRegKernel<256, 2, T, kAdd>, 256);
    return go(RmsNormRegKernel<256, 8, T, kAdd>, 256);
  }
  // Threads per row by width: a warp for the small norms (q/kv latents of tiny test models,
  // 16..256), 128 up to 1024 (kv_a latent 512, q_a 1536 lands in 256), 256 for the hidden size
  // (7168: 28 elements a thread).
  if (dim <= 256) return go(RmsNormKernel<32, T, kAdd>, 32);
  if (dim <= 1024) return go(RmsNormKernel<128, T, kAdd>, 128);
  return go(RmsNormKernel<256, T, kAdd>, 256);
}

absl::Status CheckShape(const char* who, int64_t rows, int dim, float eps) {
  if (rows < 0 || rows > std::numeric_limits<int32_t>::max() || dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": need 0 <= rows <= 2^31-1 and dim > 0, got rows ", rows, ", dim ", dim));
  }
  if (!(eps >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": eps must be >= 0, got ", eps));
  }
  return absl::OkStatus();
}

absl::Status LaunchStatus(const char* who, cudaError_t e, int64_t rows, int dim) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(who, ": launch failed (rows ", rows, ", dim ", dim,
                                          "): ", cudaGetErrorString(e)));
}

}  // namespace

absl::Status InvokeRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckShape("InvokeRmsNorm", p.rows, p.dim, p.eps); !s.ok()) return s;
  if (p.rows == 0) return absl::OkStatus();
  if (p.x_dtype != DType::kBF16 && p.x_dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeRmsNorm: x_dtype must be BF16 or F32, got ", std::string(DTypeName(p.x_dtype))));
  }
  if (p.x_stride < p.dim || p.out_stride < p.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeRmsNorm: strides must be >= dim = ", p.dim, ", got x_stride ",
                     p.x_stride, ", out_stride ", p.out_stride));
  }
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("InvokeRmsNorm: x, weight and out must be non-null");
  }
  const cudaError_t e =
      p.x_dtype == DType::kBF16
          ? Launch<__nv_bfloat16, false>(p.rows, p.dim, p.eps,
                                         static_cast<const __nv_bfloat16*>(p.x), p.x_stride,
                                         nullptr, nullptr, p.weight, p.out, p.out_stride,
                                         p.programmatic, stream)
          : Launch<float, false>(p.rows, p.dim, p.eps, static_cast<const float*>(p.x), p.x_stride,
                                 nullptr, nullptr, p.weight, p.out, p.out_stride, p.programmatic,
                                 stream);
  return LaunchStatus("InvokeRmsNorm", e, p.rows, p.dim);
}

absl::Status InvokeAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckShape("InvokeAddRmsNorm", p.rows, p.dim, p.eps); !s.ok()) return s;
  if (p.rows == 0) return absl::OkStatus();
  if (p.residual == nullptr || p.delta == nullptr || p.weight == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError(
        "InvokeAddRmsNorm: residual, delta, weight and out must be non-null");
  }
  const cudaError_t e = Launch<float, true>(p.rows, p.dim, p.eps, nullptr, 0, p.delta, p.residual,
                                            p.weight, p.out, p.dim, p.programmatic, stream);
  return LaunchStatus("InvokeAddRmsNorm", e, p.rows, p.dim);
}

}  // namespace mlaserve
