// The FP8 block-128 format of the weight-only grouped GEMM (moe_weight_only_gemm.cuh; declared in
// fp8_moe_gemm.h).
//
// Dequantization (layout and rounding: fp8_moe_layout.h): per 16x16 A fragment a lane holds 8
// e4m3 codes (two 32-bit words of its code vectors), register r the pair at bytes 2r, 2r + 1;
// Fp8PairToBf16 makes each pair bf16(fp32(e4m3 * s)) with s the fp32 scale of the register's rows
// (a0 / a2: rows g, the tile's first 8 rows; a1 / a3: rows g + 8). 24 instructions per 8 weights
// (cvt e4m3x2 -> f16x2, two cvt f16 -> f32, two fp32 multiplies, one cvt to bf16x2 per pair):
// 3 a code byte, where the 4-bit formats spend 15 per 4 code bytes, and half their mma.sync per
// byte. The epilogue has no global scale to apply.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/fp8_moe_gemm.h"
#include "kernels/moe/fp8_moe_layout.h"
#include "kernels/moe/moe_weight_only_gemm.cuh"

namespace mlaserve::moe_gemm {

// FP8 tiles: the 4-bit formats' shapes (moe_weight_only_gemm.cuh, TileFor). The 16-token decode
// tile halves their K step (128 -> 64), so a stage carries their 8 KB of codes (128 weight rows x
// 64 columns); the 64- and 128-token tiles keep their K step of 64, twice their code bytes a stage.
// Shared memory 40 KB (16 tokens), 66 KB (64) and 98.5 KB (128, under sm_120's 99 KB). ptxas
// (sm_90a, 2026-12-02): 96 registers (16-token tiles), 121 (64), 128 (128), no spills. Measured
// on the H200 2026-12-01 (moe_bench --fp8: 55-95% of copy bandwidth in decode); not tuned.
#ifndef MLASERVE_FP8_MOE_DECODE_BK
#define MLASERVE_FP8_MOE_DECODE_BK 64
#endif
#ifndef MLASERVE_FP8_MOE_DECODE_STAGES
#define MLASERVE_FP8_MOE_DECODE_STAGES 4
#endif
#ifndef MLASERVE_FP8_MOE_DECODE_MIN_BLOCKS
#define MLASERVE_FP8_MOE_DECODE_MIN_BLOCKS 4
#endif
#ifndef MLASERVE_FP8_MOE_PREFILL_STAGES
#define MLASERVE_FP8_MOE_PREFILL_STAGES 4
#endif
template <int kTileTokens>
struct Fp8TileFor;
template <>
struct Fp8TileFor<16> {
  using Cfg =
      TileConfig<128, 16, MLASERVE_FP8_MOE_DECODE_BK, 4, 1, MLASERVE_FP8_MOE_DECODE_STAGES,
                 MLASERVE_FP8_MOE_DECODE_MIN_BLOCKS, kFp8ChunkCodeBytes, kFp8ChunkScaleBytes>;
};
template <>
struct Fp8TileFor<64> {
  using Cfg = TileConfig<128, 64, 64, 4, 2, 4, 2, kFp8ChunkCodeBytes, kFp8ChunkScaleBytes>;
};
template <>
struct Fp8TileFor<128> {
  using Cfg = TileConfig<128, 128, 64, 8, 1, MLASERVE_FP8_MOE_PREFILL_STAGES, 2, kFp8ChunkCodeBytes,
                         kFp8ChunkScaleBytes>;
};

struct Fp8Format {
  using Params = Fp8MoeGemmParams;
  static constexpr int kChunkCodeBytes = kFp8ChunkCodeBytes;
  static constexpr int kChunkScaleBytes = kFp8ChunkScaleBytes;
  struct Codes {
    uint4 lo, hi;  // blocks j = 0, 1 and j = 2, 3 of the chunk
  };
  using Scales = float2;  // (s of the tile's rows 0..7, s of its rows 8..15)
  static __device__ __forceinline__ Codes LoadCodes(const uint8_t* chunk, int lane) {
    return {*reinterpret_cast<const uint4*>(chunk + lane * 16),
            *reinterpret_cast<const uint4*>(chunk + 512 + lane * 16)};
  }
  static __device__ __forceinline__ float2 LoadScales(const uint8_t* chunk, int) {
    return *reinterpret_cast<const float2*>(chunk);  // the same 8 bytes for every lane
  }
  // Registers a0..a3 of 16-column block j (0..3) of a 64-column chunk.
  static __device__ __forceinline__ void Fragment(const Codes& cw, const float2& sw, int j,
                                                  uint32_t (&a)[4]) {
    const uint4& v = j < 2 ? cw.lo : cw.hi;
    const uint32_t w01 = (j & 1) ? v.z : v.x;  // a0 (bytes 0, 1), a1 (bytes 2, 3)
    const uint32_t w23 = (j & 1) ? v.w : v.y;  // a2, a3
    a[0] = Fp8PairToBf16(w01 & 0xffffu, sw.x);
    a[1] = Fp8PairToBf16(w01 >> 16, sw.y);
    a[2] = Fp8PairToBf16(w23 & 0xffffu, sw.x);
    a[3] = Fp8PairToBf16(w23 >> 16, sw.y);
  }
  static __device__ __forceinline__ float GateAlpha(const Params&, int) { return 1.0f; }
  static __device__ __forceinline__ float UpAlpha(const Params&, int) { return 1.0f; }
  static __device__ __forceinline__ float DownAlpha(const Params&, int) { return 1.0f; }
  template <int kTileTokens>
  using Tile = Fp8TileFor<kTileTokens>;
};

template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  return LaunchWeightOnlyMoeGemm<Fp8Format, kGateUp, kTileTokens>(p, stream);
}

template <int kTileTokens>
cudaError_t LaunchDense(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  return LaunchWeightOnlyMoeGemm<Fp8Format, false, kTileTokens, true>(p, stream);
}

}  // namespace mlaserve::moe_gemm
