// Decode context parallelism's layout copy and log-sum-exp merge (mla_dcp.h).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_dcp.h"

namespace mlaserve {
namespace {

constexpr int kCopyThreads = 256;

// One thread a Unit of a block; blocks (i, j) flattened, units fastest.
template <class Unit>
__global__ void __launch_bounds__(kCopyThreads)
    StridedBlockCopyKernel(const StridedBlockCopy c, int64_t units_per_block, int64_t total) {
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x; u < total;
       u += static_cast<int64_t>(gridDim.x) * kCopyThreads) {
    const int64_t k = u % units_per_block, blk = u / units_per_block;
    const int64_t j = blk % c.inner, i = blk / c.inner;
    const Unit* s = reinterpret_cast<const Unit*>(static_cast<const char*>(c.src) +
                                                  i * c.src_outer + j * c.src_inner);
    Unit* d =
        reinterpret_cast<Unit*>(static_cast<char*>(c.dst) + i * c.dst_outer + j * c.dst_inner);
    d[k] = s[k];
  }
}

constexpr int kMergeWarps = 4;
// Columns a lane: 512 / 32, as two runs of 8 bf16 (16 bytes) at lane * 8 and 256 + lane * 8.
constexpr int kMergeRun = 8;

__device__ __forceinline__ void AddRun(float* acc, const uint4& v, float w) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += w * __uint_as_float(words[i] << 16);
    acc[2 * i + 1] += w * __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 PackRun(const float* acc, float inv) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    words[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// One warp a merged row (token t, head h). The sources' lse are read once a lane (sources <=
// 64: two a lane at most), their maximum and weights taken by the warp; then every lane adds its
// 16 columns of each source with a nonzero weight, in source order.
__global__ void __launch_bounds__(kMergeWarps * 32) MlaDcpMergeKernel(const MlaDcpMergeParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  if (row >= static_cast<int64_t>(p.tokens) * p.heads) return;  // whole warps
  const int64_t t = row / p.heads;
  const int h = static_cast<int>(row % p.heads);
  const int64_t in_row = t * p.slots + h;  // the partials' row of source 0
  float l0 = -INFINITY, l1 = -INFINITY;
  if (lane < p.sources) l0 = p.lse[lane * p.src_stride + in_row];
  if (lane + 32 < p.sources) l1 = p.lse[(lane + 32) * p.src_stride + in_row];
  float m = fmaxf(l0, l1);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  // exp of lse - m: a source without keys (lse -inf) weighs 0, and so does every source of a
  // row no rank has keys for (m = -inf).
  const float w0 = m == -INFINITY ? 0.0f : __expf(l0 - m);
  const float w1 = m == -INFINITY ? 0.0f : __expf(l1 - m);
  float acc[2][kMergeRun] = {};
  float wsum = 0.0f;
  const __nv_bfloat16* lat = static_cast<const __nv_bfloat16*>(p.latent);
  for (int s = 0; s < p.sources; ++s) {
    const float w = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31);
    if (w == 0.0f) continue;  // also never reads a keyless source's rows
    wsum += w;
    const __nv_bfloat16* src = lat + (s * p.src_stride + in_row) * kMlaLatentDim;
    AddRun(acc[0], *reinterpret_cast<const uint4*>(src + lane * kMergeRun), w);
    AddRun(acc[1], *reinterpret_cast<const uint4*>(src + 256 + lane * kMergeRun), w);
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + row * kMlaLatentDim;
  *reinterpret_cast<uint4*>(out + lane * kMergeRun) = PackRun(acc[0], inv);
  *reinterpret_cast<uint4*>(out + 256 + lane * kMergeRun) = PackRun(acc[1], inv);
}

bool Multiple(int64_t v, int64_t of) { return v % of == 0; }
bool Aligned(const void* p, uintptr_t of) { return reinterpret_cast<uintptr_t>(p) % of == 0; }

unsigned GridFor(int64_t threads_needed, int64_t per_block) {
  // A grid-stride loop: enough blocks to fill any GPU, never more than needed.
  return static_cast<unsigned>(
      std::clamp<int64_t>((threads_needed + per_block - 1) / per_block, 1, 65535));
}

}  // namespace

absl::Status InvokeStridedBlockCopy(const StridedBlockCopy& c, cudaStream_t stream) {
  if (c.outer < 0 || c.inner < 0 || c.block_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("StridedBlockCopy: negative extent (", c.outer,
                                                   " x ", c.inner, " blocks of ", c.block_bytes,
                                                   " bytes)"));
  }
  if (c.outer == 0 || c.inner == 0 || c.block_bytes == 0) return absl::OkStatus();
  if (c.src == nullptr || c.dst == nullptr) {
    return absl::InvalidArgumentError("StridedBlockCopy: src and dst must be set");
  }
  const auto all = [&](int64_t of) {
    return Multiple(c.block_bytes, of) && Multiple(c.src_outer, of) && Multiple(c.src_inner, of) &&
           Multiple(c.dst_outer, of) && Multiple(c.dst_inner, of) && Aligned(c.src, of) &&
           Aligned(c.dst, of);
  };
  const int64_t blocks = c.outer * c.inner;
  if (all(16)) {
    const int64_t units = c.block_bytes / 16, total = blocks * units;
    StridedBlockCopyKernel<uint4>
        <<<GridFor(total, kCopyThreads), kCopyThreads, 0, stream>>>(c, units, total);
  } else if (all(4)) {
    const int64_t units = c.block_bytes / 4, total = blocks * units;
    StridedBlockCopyKernel<uint32_t>
        <<<GridFor(total, kCopyThreads), kCopyThreads, 0, stream>>>(c, units, total);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "StridedBlockCopy: block size, strides and pointers must be multiples of 4 bytes (block ",
        c.block_bytes, ", strides ", c.src_outer, "/", c.src_inner, " -> ", c.dst_outer, "/",
        c.dst_inner, ")"));
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("StridedBlockCopy launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::Status InvokeMlaDcpMerge(const MlaDcpMergeParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.heads < 0 || p.sources < 1 || p.sources > kMlaDcpMaxSources ||
      p.heads > p.slots || p.src_stride < static_cast<int64_t>(p.tokens) * p.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("MlaDcpMerge: ", p.sources, " sources (1..", kMlaDcpMaxSources, "), ",
                     p.tokens, " tokens, ", p.heads, " heads of ", p.slots,
                     " slots, source stride ", p.src_stride, " rows (at least tokens x slots)"));
  }
  if (p.tokens == 0 || p.heads == 0) return absl::OkStatus();
  if (p.latent == nullptr || p.lse == nullptr || p.out == nullptr || !Aligned(p.latent, 16) ||
      !Aligned(p.out, 16)) {
    return absl::InvalidArgumentError(
        "MlaDcpMerge: latent, lse and out must be set, latent and out 16-byte aligned");
  }
  const int64_t rows = static_cast<int64_t>(p.tokens) * p.heads;
  const int64_t grid = (rows + kMergeWarps - 1) / kMergeWarps;
  if (grid > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("MlaDcpMerge: ", rows, " rows are too many"));
  }
  MlaDcpMergeKernel<<<static_cast<unsigned>(grid), kMergeWarps * 32, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("MlaDcpMerge launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
