// The one definition of the MLA latent KV cache formats: byte layout of one token's row, and the
// exact host encode/decode every other piece (CPU model, GPU write kernel, tests) agrees with.
//
// A cache row holds one token of one layer: the 512-dim compressed latent (kv_lora_rank, also
// the value vector of absorbed MLA) followed by the 64-dim decoupled RoPE key.
//
//   bf16       1152 B: 576 bf16 (latent then rope).
//   fp8         576 B: 576 e4m3, each x / fp8_scale (one scale per layer; dequant = e4m3 * scale).
//   fp8_tiled   656 B: 512 e4m3 latent in 4 tiles of 128 values, each tile x / s_t;
//                      then 4 fp32 s_t (powers of two);
//                      then 64 bf16 rope values (not quantized).
//                      This is FlashMLA's FP8 cache layout ("V32_FP8Sparse").
//
// fp8_tiled tile scale, as FlashMLA computes it (deepseek-ai/FlashMLA tests/quant.py,
// quantize_k_cache and _cast_scale_inv_to_ue8m0):
//   s_t = 2^ceil(log2(max(amax_t / 448, 1e-4)))
// i.e. the smallest power of two >= amax/448, with amax/448 clamped below at 1e-4 (FlashMLA's
// comment: "align with HFAI FP8's FP8_AMAX_MARGIN"). Because s_t >= amax/448 no value saturates,
// and because s_t is a power of two x / s_t is exact before the e4m3 rounding.
//
// A paged pool is bytes [num_blocks, kKvBlockTokens, KvCacheBytesPerToken(fmt)]; token t of a
// sequence lives in block block_table[t / 64] at slot t % 64 (global slot = block * 64 + slot).
#pragma once

#include "common/kv_block.h"
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace mlaserve {

// kF32 (2304 B/token, 576 fp32) is lossless: the CPU reference model's golden tests use it to
// check the absorbed, paged decode path against transformers exactly (random tiny MoE models
// amplify bf16 rounding chaotically). It is not a serving format: GPU kernels reject it.
enum class KvCacheFormat { kBf16, kFp8, kFp8Tiled, kF32 };

constexpr int kMlaLatentDim = 512;  // kv_lora_rank; also the value dimension.
constexpr int kMlaRopeDim = 64;     // qk_rope_head_dim.
constexpr int kMlaQkDim = 576;      // Absorbed query/key dimension.

// fp8_tiled constants (see the layout above).
constexpr int kFp8TileDim = 128;                              // Latent values per scale.
constexpr int kFp8TilesPerRow = kMlaLatentDim / kFp8TileDim;  // 4.
constexpr int kFp8TiledScaleOffset = kMlaLatentDim;           // Byte offset of the 4 fp32 scales.
constexpr int kFp8TiledRopeOffset = kMlaLatentDim + 4 * kFp8TilesPerRow;  // 528: bf16 rope.
constexpr float kFp8TiledMinScaleInv = 1e-4f;  // Clamp of amax / 448 (FlashMLA tests/quant.py).

// "bf16" | "fp8" | "fp8_tiled".
absl::StatusOr<KvCacheFormat> ParseKvCacheFormat(std::string_view name);
std::string_view KvCacheFormatName(KvCacheFormat format);

// 1152, 576 or 656.
constexpr size_t KvCacheBytesPerToken(KvCacheFormat format) {
  switch (format) {
    case KvCacheFormat::kBf16:
      return 2 * kMlaQkDim;
    case KvCacheFormat::kFp8:
      return kMlaQkDim;
    case KvCacheFormat::kFp8Tiled:
      return kMlaLatentDim + 4 * kFp8TilesPerRow + 2 * kMlaRopeDim;
    case KvCacheFormat::kF32:
      return 4 * kMlaQkDim;
  }
  return 0;
}

// The power-of-two scale of one fp8_tiled tile whose largest magnitude is `amax`.
float Fp8TiledTileScale(float amax);

// Encodes one token: latent[512] and rope[64] in fp32 -> KvCacheBytesPerToken(format) bytes at
// dst. fp8_scale is used by kFp8 only (must be > 0). Rounding: RNE; e4m3 saturates at +-448.
void KvCacheEncodeRow(KvCacheFormat format, const float* latent, const float* rope, float fp8_scale,
                      uint8_t* dst);

// Decodes one row back into 576 floats (latent then rope), exactly the values the GPU kernels
// compute with: bf16 -> fp32, e4m3 * fp8_scale, e4m3 * tile scale.
void KvCacheDecodeRow(KvCacheFormat format, const uint8_t* src, float fp8_scale, float* out576);

}  // namespace mlaserve
