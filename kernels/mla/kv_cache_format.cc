#include "kernels/mla/kv_cache_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace mlaserve {

absl::StatusOr<KvCacheFormat> ParseKvCacheFormat(std::string_view name) {
  if (name == "bf16") return KvCacheFormat::kBf16;
  if (name == "fp8") return KvCacheFormat::kFp8;
  if (name == "fp8_tiled") return KvCacheFormat::kFp8Tiled;
  if (name == "f32") return KvCacheFormat::kF32;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache format \"", std::string(name),
                   "\": expected bf16, fp8, fp8_tiled (or f32, the lossless reference format)"));
}

std::string_view KvCacheFormatName(KvCacheFormat format) {
  switch (format) {
    case KvCacheFormat::kBf16:
      return "bf16";
    case KvCacheFormat::kFp8:
      return "fp8";
    case KvCacheFormat::kFp8Tiled:
      return "fp8_tiled";
    case KvCacheFormat::kF32:
      return "f32";
  }
  return "?";
}

float Fp8TiledTileScale(float amax) {
  const float scale_inv = std::max(amax / 448.0f, kFp8TiledMinScaleInv);
  return Ue8m0ToFloat(FloatToUe8m0RoundUp(scale_inv));
}

void KvCacheEncodeRow(KvCacheFormat format, const float* latent, const float* rope, float fp8_scale,
                      uint8_t* dst) {
  switch (format) {
    case KvCacheFormat::kBf16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(dst);
      for (int i = 0; i < kMlaLatentDim; ++i) out[i] = FloatToBf16(latent[i]);
      for (int i = 0; i < kMlaRopeDim; ++i) out[kMlaLatentDim + i] = FloatToBf16(rope[i]);
      return;
    }
    case KvCacheFormat::kFp8: {
      for (int i = 0; i < kMlaLatentDim; ++i) dst[i] = FloatToE4m3(latent[i] / fp8_scale);
      for (int i = 0; i < kMlaRopeDim; ++i)
        dst[kMlaLatentDim + i] = FloatToE4m3(rope[i] / fp8_scale);
      return;
    }
    case KvCacheFormat::kFp8Tiled: {
      float scales[kFp8TilesPerRow];
      for (int t = 0; t < kFp8TilesPerRow; ++t) {
        float amax = 0.0f;
        for (int i = 0; i < kFp8TileDim; ++i) {
          amax = std::max(amax, std::fabs(latent[t * kFp8TileDim + i]));
        }
        scales[t] = Fp8TiledTileScale(amax);
        for (int i = 0; i < kFp8TileDim; ++i) {
          const int d = t * kFp8TileDim + i;
          dst[d] = FloatToE4m3(latent[d] / scales[t]);
        }
      }
      std::memcpy(dst + kFp8TiledScaleOffset, scales, sizeof(scales));
      for (int i = 0; i < kMlaRopeDim; ++i) {
        const uint16_t bits = FloatToBf16(rope[i]);
        std::memcpy(dst + kFp8TiledRopeOffset + 2 * i, &bits, 2);
      }
      return;
    }
    case KvCacheFormat::kF32: {
      std::memcpy(dst, latent, kMlaLatentDim * sizeof(float));
      std::memcpy(dst + kMlaLatentDim * sizeof(float), rope, kMlaRopeDim * sizeof(float));
      return;
    }
  }
}

void KvCacheDecodeRow(KvCacheFormat format, const uint8_t* src, float fp8_scale, float* out576) {
  switch (format) {
    case KvCacheFormat::kBf16: {
      for (int i = 0; i < kMlaQkDim; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        out576[i] = Bf16ToFloat(bits);
      }
      return;
    }
    case KvCacheFormat::kFp8: {
      for (int i = 0; i < kMlaQkDim; ++i) out576[i] = E4m3ToFloat(src[i]) * fp8_scale;
      return;
    }
    case KvCacheFormat::kFp8Tiled: {
      float scales[kFp8TilesPerRow];
      std::memcpy(scales, src + kFp8TiledScaleOffset, sizeof(scales));
      for (int i = 0; i < kMlaLatentDim; ++i) {
        out576[i] = E4m3ToFloat(src[i]) * scales[i / kFp8TileDim];
      }
      for (int i = 0; i < kMlaRopeDim; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + kFp8TiledRopeOffset + 2 * i, 2);
        out576[kMlaLatentDim + i] = Bf16ToFloat(bits);
      }
      return;
    }
    case KvCacheFormat::kF32: {
      std::memcpy(out576, src, kMlaQkDim * sizeof(float));
      return;
    }
  }
}

}  // namespace mlaserve
