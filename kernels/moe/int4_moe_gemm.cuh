// The INT4 format of the weight-only grouped GEMM (moe_weight_only_gemm.cuh; declared in
// int4_moe_gemm.h).
//
// Dequantization (layout: int4_moe_layout.h): per 16x16 A fragment a lane reads one 32-bit code
// word; register r is ((word >> 4r) & 0x000f000f) | 0x43004300, the bf16 pair (128 + u0, 128 + u1)
// (one shift and one LOP3; no shift for r = 0), then a bf16x2 subtraction of 136 gives the pair
// (q0, q1) exactly and a bf16x2 multiply by the broadcast scale pair gives bf16(q * s), one
// rounding to nearest even (PTX bf16 arithmetic keeps subnormals). 15 integer / bf16 ops per 8
// weights, as NVFP4's. The epilogue has no global scale to apply. Registers (ptxas, sm_90a,
// 2026-12-01): 104 / 102 (gate_up / down, 16-row tiles), 115 (64), 128 with a 4-byte spill in the
// 128-row gate_up (NVFP4: none).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/int4_moe_gemm.h"
#include "kernels/moe/int4_moe_layout.h"
#include "kernels/moe/moe_weight_only_gemm.cuh"
#include "kernels/moe/moe_weight_only_wgmma.cuh"

namespace mlaserve::moe_gemm {

// The biased pair (128 + u0, 128 + u1) minus (136, 136): (q0, q1), exact. sub.bf16x2 (sm_90+)
// needs one constant register where the sm_80 form (fma with 1.0) needs two (measured: 104
// against 110 registers in the 16-row decode tile, 2026-12-01).
__device__ __forceinline__ uint32_t Int4Unbias(uint32_t biased) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
      : "=r"(d)
      : "r"(biased), "r"(kInt4Bf16x2One), "r"(kInt4Bf16x2MinusBias));
#else
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(biased), "r"(kInt4Bf16x2Bias));
#endif
  return d;
}

struct Int4Format : FourBitLanes {
  using Params = Int4MoeGemmParams;
  // Registers a0..a3 of 16-column block j (0..3) of a 64-column chunk: cw = the lane's code
  // vector, sw = its scale vector: sw.x = (s(g), s(g + 8)) of columns 0..31, sw.y of 32..63.
  static __device__ __forceinline__ void Fragment(const uint4& cw, const uint2& sw, int j,
                                                  uint32_t (&a)[4]) {
    const uint32_t word = j < 2 ? sw.x : sw.y;
    // (s(g), s(g)) for registers a0, a2 and (s(g + 8), s(g + 8)) for a1, a3: word's halves,
    // taken by the multiplies' operand swizzle (no instruction of their own; session 21).
    const uint32_t sg = Int4ScalePair(word, false);
    const uint32_t sg8 = Int4ScalePair(word, true);
    const uint32_t q = j == 0 ? cw.x : j == 1 ? cw.y : j == 2 ? cw.z : cw.w;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      a[r] = Int4Unbias(Int4BiasedPair(q, r));
    }
    a[0] = MulBf16x2(a[0], sg);
    a[1] = MulBf16x2(a[1], sg8);
    a[2] = MulBf16x2(a[2], sg);
    a[3] = MulBf16x2(a[3], sg8);
  }
  static __device__ __forceinline__ float GateAlpha(const Params&, int) { return 1.0f; }
  static __device__ __forceinline__ float UpAlpha(const Params&, int) { return 1.0f; }
  static __device__ __forceinline__ float DownAlpha(const Params&, int) { return 1.0f; }
};

// Prefill tiles on SM90: the wgmma kernel (moe_weight_only_wgmma.cuh) where it applies, as
// NVFP4; the mma.sync tile kernel otherwise.
template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Int4MoeGemmParams& p, cudaStream_t stream) {
  if constexpr (kTileTokens == kMoeTileTokensLarge) {
    cudaError_t err = cudaSuccess;
    if (p.prefill_wgmma &&
        LaunchWeightOnlyMoeGemmWgmma<Int4Format, kGateUp, kWgmmaPrefillMBlocks>(p, stream, &err)) {
      return err;
    }
  }
  return LaunchWeightOnlyMoeGemm<Int4Format, kGateUp, kTileTokens>(p, stream);
}

}  // namespace mlaserve::moe_gemm
