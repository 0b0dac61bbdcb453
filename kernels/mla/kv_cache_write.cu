// Quantize-and-store of new latent + RoPE rows into the paged cache. Bytes equal those of the
// host KvCacheEncodeRow (kv_cache_format.cc); the GPU test compares them bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/mla/kv_cache_write.cuh"
#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {
namespace {

constexpr int kWriteWarps = 4;

template <KvCacheFormat kFormat>
__global__ void __launch_bounds__(kWriteWarps * 32)
    KvCacheWriteKernel(float fp8_scale, const uint16_t* __restrict__ latent, int64_t latent_stride,
                       const uint16_t* __restrict__ rope, int64_t rope_stride,
                       const int64_t* __restrict__ slots, int n, uint8_t* __restrict__ kv_pool) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kWriteWarps + (threadIdx.x >> 5);
  if (r >= n) return;
  const int64_t slot = slots[r];
  if (slot < 0) return;
  constexpr size_t kRowBytes = KvCacheBytesPerToken(kFormat);
  uint8_t* dst = kv_pool + static_cast<size_t>(slot) * kRowBytes;
  // Lane owns latent dims 16 * lane .. + 16 and rope dims 2 * lane, 2 * lane + 1.
  const uint4* src = reinterpret_cast<const uint4*>(latent + r * latent_stride) + 2 * lane;
  const uint4 raw0 = src[0], raw1 = src[1];
  const uint32_t rope2 = *reinterpret_cast<const uint32_t*>(rope + r * rope_stride + 2 * lane);
  StoreKvRow<kFormat>(lane, raw0, raw1, rope2, fp8_scale, dst);
}

}  // namespace

cudaError_t LaunchKvCacheWrite(KvCacheFormat format, float fp8_scale, const uint16_t* latent,
                               int64_t latent_stride, const uint16_t* rope, int64_t rope_stride,
                               const int64_t* slots, int n, uint8_t* kv_pool, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int grid = (n + kWriteWarps - 1) / kWriteWarps;
  switch (format) {
    case KvCacheFormat::kBf16:
      KvCacheWriteKernel<KvCacheFormat::kBf16><<<grid, kWriteWarps * 32, 0, stream>>>(
          fp8_scale, latent, latent_stride, rope, rope_stride, slots, n, kv_pool);
      break;
    case KvCacheFormat::kFp8:
      KvCacheWriteKernel<KvCacheFormat::kFp8><<<grid, kWriteWarps * 32, 0, stream>>>(
          fp8_scale, latent, latent_stride, rope, rope_stride, slots, n, kv_pool);
      break;
    case KvCacheFormat::kFp8Tiled:
      KvCacheWriteKernel<KvCacheFormat::kFp8Tiled><<<grid, kWriteWarps * 32, 0, stream>>>(
          fp8_scale, latent, latent_stride, rope, rope_stride, slots, n, kv_pool);
      break;
    case KvCacheFormat::kF32:  // the CPU reference's lossless format; not a GPU cache format
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace mlaserve::mla
