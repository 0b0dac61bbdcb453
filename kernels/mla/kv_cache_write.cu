// Quantize-and-store of new latent + RoPE rows into the paged cache. Bytes equal those of the
// host KvCacheEncodeRow (kv_cache_format.cc); the GPU test compares them bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {
namespace {

constexpr int kWriteWarps = 4;

// IEEE division (as the host's x / s), whatever fast-math flags the build sets.
__device__ __forceinline__ uint16_t QuantE4m3x2(float a, float b, float scale) {
  const float2 v = make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale));
  return __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);  // RNE, saturate at 448.
}

// Fp8TiledTileScale on the device: smallest power of two >= max(amax / 448, 1e-4).
__device__ __forceinline__ float TileScale(float amax) {
  const float v = fmaxf(__fdiv_rn(amax, 448.0f), kFp8TiledMinScaleInv);  // Normal, positive.
  const uint32_t bits = __float_as_uint(v);
  const uint32_t exp_field = (bits >> 23) & 0xff;
  if (exp_field == 0xff) return __uint_as_float(0x7fc00000u);  // inf/NaN -> NaN as ue8m0 255.
  const uint32_t up = (bits & 0x7fffffu) != 0 ? 1u : 0u;
  return __uint_as_float((exp_field + up) << 23);
}

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
  if constexpr (kFormat == KvCacheFormat::kBf16) {
    reinterpret_cast<uint4*>(dst)[2 * lane] = raw0;
    reinterpret_cast<uint4*>(dst)[2 * lane + 1] = raw1;
    reinterpret_cast<uint32_t*>(dst + 2 * kMlaLatentDim)[lane] = rope2;
    return;
  }
  float x[16];
  const uint32_t words[8] = {raw0.x, raw0.y, raw0.z, raw0.w, raw1.x, raw1.y, raw1.z, raw1.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = __uint_as_float(words[i] << 16);
    x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
  float scale = fp8_scale;
  if constexpr (kFormat == KvCacheFormat::kFp8Tiled) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    // A 128-value tile is 8 lanes.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    scale = TileScale(amax);
  }
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[i] = static_cast<uint32_t>(QuantE4m3x2(x[4 * i], x[4 * i + 1], scale)) |
           (static_cast<uint32_t>(QuantE4m3x2(x[4 * i + 2], x[4 * i + 3], scale)) << 16);
  }
  reinterpret_cast<uint4*>(dst)[lane] = make_uint4(q[0], q[1], q[2], q[3]);
  if constexpr (kFormat == KvCacheFormat::kFp8) {
    const float r0 = __uint_as_float(rope2 << 16), r1 = __uint_as_float(rope2 & 0xffff0000u);
    reinterpret_cast<uint16_t*>(dst + kMlaLatentDim)[lane] = QuantE4m3x2(r0, r1, scale);
  } else {
    if ((lane & 7) == 0) {
      reinterpret_cast<float*>(dst + kFp8TiledScaleOffset)[lane / 8] = scale;
    }
    reinterpret_cast<uint32_t*>(dst + kFp8TiledRopeOffset)[lane] = rope2;
  }
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
