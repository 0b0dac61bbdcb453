// One token's cache row from a warp's registers, in every format (kv_cache_format.h): shared by
// the cache write (kv_cache_write.cu) and the fused MLA input kernel (mla_kv_prep.cu). Bytes
// equal those of the host KvCacheEncodeRow; the arithmetic is explicitly rounded (IEEE
// division), so fast-math flags of the including file change nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {

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

// Lane `lane` of a warp holds latent dims 16 * lane .. + 16 (bf16 words raw0, raw1) and rope
// dims 2 * lane, 2 * lane + 1 (rope2, low half first); all 32 lanes call this for the row at dst.
template <KvCacheFormat kFormat>
__device__ __forceinline__ void StoreKvRow(int lane, const uint4& raw0, const uint4& raw1,
                                           uint32_t rope2, float fp8_scale, uint8_t* dst) {
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

}  // namespace mlaserve::mla
