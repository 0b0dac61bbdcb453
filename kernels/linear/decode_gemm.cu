// Decode-step projections on tensor cores with a K split (decode_gemm.h says why and how).
//
// Fragment layouts: PTX ISA, "Matrix fragments for mma.m16n8k16" (.bf16): lane (g, t) = (lane / 4,
// lane % 4) holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9], a3 =
// A[g+8][2t+8..2t+9]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d0, d1 = D[g][2t, 2t+1], d2,
// d3 = D[g+8][2t, 2t+1]. ldmatrix.x4 gives matrix j (addresses from lanes 8j..8j+7) to register
// j, lane (g, t) holding its row g, elements 2t..2t+1. A = W rows (16 a warp) x 16 columns: lanes
// 0-15 address rows 0-15 at columns 0-7, lanes 16-31 rows 0-15 at columns 8-15, so registers 0-3
// are a0-a3. B = x^T: x's token rows stored as shared-memory rows, so a matrix of 8 tokens x 8
// columns gives lane (g, t) token g, columns 2t..2t+1 = b0 (or b1 for columns 8-15); lanes 0-7 /
// 8-15 / 16-23 / 24-31 address tokens 0-7 / 0-7 / 8-15 / 8-15 at columns 0-7 / 8-15 / 0-7 / 8-15,
// which is (b0, b1) of n-tile 2p and (b0, b1) of n-tile 2p + 1.
#include <cuda_bf16.h>

#include <algorithm>
#include <limits>

#include "kernels/linear/decode_gemm.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockRows = 16 * kWarps;  // weight rows a block
constexpr int kStages = 4;               // 64-column stages in the cp.async ring
constexpr int kMinChunksPerSlice = 4;    // a K slice keeps at least 256 columns

// Shared memory of one stage: the block's 64 weight rows x 64 columns, then the tokens' rows x 64
// columns (at least 16 rows: one ldmatrix x4 covers two n-tiles); 128-byte rows whose 16-byte
// units are XOR-swizzled by (row & 7), so that the 8 rows of an ldmatrix matrix and the 8 units a
// row's copies write fall on different banks.
template <int NT>
struct Stage {
  static constexpr int kXRows = NT < 2 ? 16 : 8 * NT;
  static constexpr int kWBytes = kBlockRows * 128;
  static constexpr int kXBytes = kXRows * 128;
  static constexpr int kBytes = kWBytes + kXBytes;
  static constexpr int kRingBytes = kStages * kBytes;
};

__device__ __forceinline__ int Swizzled(int row, int unit) {
  return row * 128 + ((unit ^ (row & 7)) << 4);
}

template <int NT>
__global__ void __launch_bounds__(kThreads)
    DecodeGemmKernel(const DecodeGemmArgs a, const int splits) {
  using St = Stage<NT>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = blockIdx.x * kBlockRows;
  const int slice = blockIdx.y;
  const int chunks = static_cast<int>(a.k / 64);
  const int c0 = static_cast<int>(static_cast<int64_t>(chunks) * slice / splits);
  const int nc = static_cast<int>(static_cast<int64_t>(chunks) * (slice + 1) / splits) - c0;
  const int n = static_cast<int>(a.n);
  const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(a.w);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);

  // Weight rows past n read row n - 1 and tokens past m read token m - 1: their products land in
  // output rows and columns that are never stored.
  auto load_w = [&](int stage, int c) {
    uint8_t* s = smem + stage * St::kBytes;
#pragma unroll
    for (int j = 0; j < kBlockRows * 8 / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i >> 3, u = i & 7;
      const __nv_bfloat16* src =
          w + static_cast<int64_t>(min(row0 + r, n - 1)) * a.k + c * 64 + u * 8;
      ptx::CpAsync16(s + Swizzled(r, u), src, true);
    }
  };
  auto load_x = [&](int stage, int c) {
    uint8_t* s = smem + stage * St::kBytes + St::kWBytes;
#pragma unroll
    for (int j = 0; j < St::kXRows * 8 / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i >> 3, u = i & 7;
      const __nv_bfloat16* src =
          x + static_cast<int64_t>(min(r, a.m - 1)) * a.x_stride + c * 64 + u * 8;
      ptx::CpAsync16(s + Swizzled(r, u), src, true);
    }
  };

  // The first stages' weights go out before the wait for the previous kernel (weights are
  // constant); x is read only after it. They join the first commit group, so stage s is complete
  // once group s is.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nc) load_w(s, c0 + s);
  }
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nc) load_x(s, c0 + s);
    ptx::CpAsyncCommit();
  }

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = 0.0f;

  const int a_row = warp * 16 + (lane & 15), a_unit_hi = lane >> 4;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_unit_hi = (lane >> 3) & 1;
  for (int it = 0; it < nc; ++it) {
    ptx::CpAsyncWait<kStages - 2>();
    __syncthreads();
    {
      const int next = it + kStages - 1;
      if (next < nc) {
        load_w(next % kStages, c0 + next);
        load_x(next % kStages, c0 + next);
      }
      ptx::CpAsyncCommit();
    }
    const uint32_t s_w = ptx::SmemAddr(smem + (it % kStages) * St::kBytes);
    const uint32_t s_x = s_w + St::kWBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t af[4];
      ptx::LdMatrixX4(af, s_w + Swizzled(a_row, 2 * kk + a_unit_hi));
#pragma unroll
      for (int p = 0; p < (NT + 1) / 2; ++p) {
        uint32_t b[4];
        ptx::LdMatrixX4(b, s_x + Swizzled(16 * p + b_row, 2 * kk + b_unit_hi));
        ptx::MmaBf16(acc[2 * p], af, b[0], b[1]);
        if (2 * p + 1 < NT) ptx::MmaBf16(acc[2 * p + 1], af, b[2], b[3]);
      }
    }
  }
  ptx::CpAsyncWait<0>();

  const int g = lane >> 2, t = lane & 3;
  const int r_lo = row0 + warp * 16 + g;
  if (splits == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = r_lo + (q >= 2 ? 8 : 0), token = nt * 8 + 2 * t + (q & 1);
        if (row < n && token < a.m) {
          const int64_t o = static_cast<int64_t>(token) * a.out_stride + row;
          const float v = a.alpha * acc[nt][q];
          if (a.out_dtype == DType::kF32) {
            static_cast<float*>(a.out)[o] = v;
          } else {
            static_cast<__nv_bfloat16*>(a.out)[o] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  } else {
    // fp32 partials [slice][token][row], rows padded to the grid's (every row written).
    const int rows_pad = gridDim.x * kBlockRows;
    float* part = static_cast<float*>(a.workspace) + static_cast<int64_t>(slice) * a.m * rows_pad;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = r_lo + (q >= 2 ? 8 : 0), token = nt * 8 + 2 * t + (q & 1);
        if (token < a.m) part[static_cast<int64_t>(token) * rows_pad + row] = acc[nt][q];
      }
    }
  }
}

// out = alpha * (partial[0] + partial[1] + ... + partial[splits - 1]), in that order; 4 elements
// a thread (rows_pad is a multiple of 64).
__global__ void __launch_bounds__(256)
    DecodeGemmReduceKernel(const DecodeGemmArgs a, const int splits, const int rows_pad) {
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  const int64_t total = static_cast<int64_t>(a.m) * rows_pad;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (e >= total) return;
  const float* part = static_cast<const float*>(a.workspace);
  float4 s = *reinterpret_cast<const float4*>(part + e);
  for (int i = 1; i < splits; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(part + i * total + e);
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
  const int token = static_cast<int>(e / rows_pad), row = static_cast<int>(e % rows_pad);
  const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (row + q < a.n) {
      const int64_t o = static_cast<int64_t>(token) * a.out_stride + row + q;
      if (a.out_dtype == DType::kF32) {
        static_cast<float*>(a.out)[o] = a.alpha * v[q];
      } else {
        static_cast<__nv_bfloat16*>(a.out)[o] = __float2bfloat16_rn(a.alpha * v[q]);
      }
    }
  }
}

// Resident blocks of DecodeGemmKernel<NT> an SM, asked once (with its shared memory opted in).
template <int NT>
int ResidentBlocks() {
  static const int blocks = [] {
    auto* kernel = DecodeGemmKernel<NT>;
    int b = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Stage<NT>::kRingBytes) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads,
                                                      Stage<NT>::kRingBytes) != cudaSuccess) {
      return 0;
    }
    return b;
  }();
  return blocks;
}

template <int NT>
cudaError_t Launch(const DecodeGemmArgs& a, cudaStream_t stream) {
  const int per_sm = ResidentBlocks<NT>();
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const int row_blocks = static_cast<int>((a.n + kBlockRows - 1) / kBlockRows);
  const int chunks = static_cast<int>(a.k / 64);
  // One wave of the device's resident blocks, each slice at least kMinChunksPerSlice stages.
  const int resident = std::max(1, a.sm_count) * per_sm;
  int splits = std::clamp(resident / row_blocks, 1, std::max(1, chunks / kMinChunksPerSlice));
  const int rows_pad = row_blocks * kBlockRows;
  const size_t split_bytes = static_cast<size_t>(a.m) * rows_pad * sizeof(float);
  if (splits > 1) {
    const size_t fit = a.workspace == nullptr ? 0 : a.workspace_bytes / split_bytes;
    splits = static_cast<int>(std::min<size_t>(splits, fit));
    if (splits < 2) splits = 1;
  }
  cudaError_t err =
      pdl::LaunchKernel(DecodeGemmKernel<NT>, dim3(row_blocks, splits), dim3(kThreads),
                        Stage<NT>::kRingBytes, stream, a.programmatic, a, splits);
  if (err != cudaSuccess || splits == 1) return err;
  const int64_t quads = static_cast<int64_t>(a.m) * rows_pad / 4;
  return pdl::LaunchKernel(DecodeGemmReduceKernel, dim3(static_cast<unsigned>((quads + 255) / 256)),
                           dim3(256), 0, stream, /*programmatic=*/true, a, splits, rows_pad);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool DecodeGemmSupports(const DecodeGemmArgs& a) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max() / 2;
  return a.m >= 1 && a.m <= kDecodeGemmMaxRows && a.n >= 1 && a.n <= kMax && a.k >= 64 &&
         a.k <= kMax && a.k % 64 == 0 && a.x_stride >= a.k && a.x_stride <= kMax &&
         a.x_stride % 8 == 0 && a.out_stride >= a.n && a.out_stride <= kMax &&
         (a.out_dtype == DType::kBF16 || a.out_dtype == DType::kF32) && a.x != nullptr &&
         a.w != nullptr && a.out != nullptr && Aligned16(a.x) && Aligned16(a.w) &&
         (a.workspace == nullptr || Aligned16(a.workspace));
}

cudaError_t InvokeDecodeGemm(const DecodeGemmArgs& a, cudaStream_t stream) {
  if (!DecodeGemmSupports(a)) return cudaErrorInvalidValue;
  if (a.m <= 8) return Launch<1>(a, stream);
  if (a.m <= 16) return Launch<2>(a, stream);
  if (a.m <= 32) return Launch<4>(a, stream);
  return Launch<8>(a, stream);
}

}  // namespace mlaserve
