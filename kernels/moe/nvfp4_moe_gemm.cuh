// The NVFP4 format of the weight-only grouped GEMM (moe_weight_only_gemm.cuh; declared in
// nvfp4_moe_gemm.h).
//
// Dequantization (layout and exactness: nvfp4_moe_layout.h): per 16x16 A fragment a lane reads
// one 32-bit code word; 11 shifts and masks give a0..a3 as bf16 pairs equal to e2m1 * 2^-126,
// then one bf16x2 multiply by the broadcast scale pair (scale * 2^119 in bf16) each: exactly
// e2m1 * scale * 2^-7. The fp32 accumulators are multiplied by weight_scale_2 * 2^7 in the
// epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/moe_weight_only_gemm.cuh"
#include "kernels/moe/moe_weight_only_wgmma.cuh"
#include "kernels/moe/nvfp4_moe_gemm.h"

namespace mlaserve::moe_gemm {

// a * b + c as one PTX multiply-add. ptxas issues it as IMAD (FMA pipe) or LEA (integer pipe),
// its own balance: in the measured build, 7 of the 16 a 16 x 64 chunk became LEA.
__device__ __forceinline__ uint32_t MulAddU32(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("mad.lo.u32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The e2m1 codes of fragment registers a0..a3 as bf16 pairs times 2^-126 (bit positions:
// nvfp4_moe_layout.h).
__device__ __forceinline__ void CodesToBf16Tiny(uint32_t q, uint32_t (&a)[4]) {
  a[0] = (q << 6) & 0x81c081c0u;
  a[1] = (q << 3) & 0x81c081c0u;
  a[2] = (q & 0x01c001c0u) | ((q << 4) & 0x80008000u);
  a[3] = ((q >> 7) & 0x01c001c0u) | ((q << 5) & 0x80008000u);
}

struct Nvfp4Format : FourBitLanes {
  using Params = Nvfp4MoeGemmParams;
  // Registers a0..a3 of 16-column block j (0..3) of a 64-column chunk: cw = the lane's code
  // vector, sw = its scale-code vector (row g's and row g + 8's codes of the 4 blocks).
  static __device__ __forceinline__ void Fragment(const uint4& cw, const uint2& sw, int j,
                                                  uint32_t (&a)[4]) {
    const uint32_t word = j < 2 ? sw.x : sw.y;
    // word's bytes: row g's scale code of block 2i (i = j / 2), row g + 8's of 2i, row g's of
    // 2i + 1, row g + 8's of 2i + 1. bf16 bits (code << 4) + (232 << 7) = scale * 2^119: one
    // byte permute puts row g's two codes (or row g + 8's) in bytes 0 and 2, one multiply-add
    // shifts them and adds the exponent bias, and each multiply below takes the half of its
    // block j through the operand swizzle (.H0_H0 / .H1_H1), so a pair of blocks shares the two
    // scale registers: 4 integer operations per 2 fragments where a broadcast pair per fragment
    // took 8 (session 21; the same bf16 operands, so the same bits). Session 10 had brought a
    // warp's integer-pipe operations per 16 x 64 chunk from ~53 to ~44 with the code placement
    // of nvfp4_moe_layout.h (bench/RESULTS.md).
    const uint32_t s_g = MulAddU32(__byte_perm(word, 0, 0x4240u), 16u, 0x74007400u);
    const uint32_t s_g8 = MulAddU32(__byte_perm(word, 0, 0x4341u), 16u, 0x74007400u);
    const bool odd = (j & 1) != 0;
    const uint32_t sg = Bf16x2Broadcast(s_g, odd), sg8 = Bf16x2Broadcast(s_g8, odd);
    const uint32_t q = j == 0 ? cw.x : j == 1 ? cw.y : j == 2 ? cw.z : cw.w;
#ifdef MLASERVE_MOE_DIAG_NO_DEQUANT
    // Diagnostic builds only (bench/moe/build_variants.sh RAW): the codes and scales go to the
    // MMA undecoded, so the kernels read the same bytes with no dequantization work. Wrong
    // results; it times the kernels' memory structure alone.
    a[0] = q;
    a[1] = q ^ sg;
    a[2] = q ^ sg8;
    a[3] = q;
    return;
#endif
    CodesToBf16Tiny(q, a);
    a[0] = MulBf16x2(a[0], sg);
    a[1] = MulBf16x2(a[1], sg8);
    a[2] = MulBf16x2(a[2], sg);
    a[3] = MulBf16x2(a[3], sg8);
  }
  // weight_scale_2 of the expert's gate, up, down, times the 2^7 the fragments leave out.
  static __device__ __forceinline__ float GateAlpha(const Params& p, int e) {
    return __ldg(p.w_global_scale + 2 * e) * 128.0f;
  }
  static __device__ __forceinline__ float UpAlpha(const Params& p, int e) {
    return __ldg(p.w_global_scale + 2 * e + 1) * 128.0f;
  }
  static __device__ __forceinline__ float DownAlpha(const Params& p, int e) {
    return __ldg(p.w_global_scale + e) * 128.0f;
  }
};

// Prefill tiles on SM90: the wgmma kernel (moe_weight_only_wgmma.cuh) where it applies; the
// mma.sync tile kernel otherwise.

template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Nvfp4MoeGemmParams& p, cudaStream_t stream) {
  if constexpr (kTileTokens == kMoeTileTokensLarge) {
    cudaError_t err = cudaSuccess;
    if (p.prefill_wgmma &&
        LaunchWeightOnlyMoeGemmWgmma<Nvfp4Format, kGateUp, kWgmmaPrefillMBlocks>(p, stream, &err)) {
      return err;
    }
  }
  return LaunchWeightOnlyMoeGemm<Nvfp4Format, kGateUp, kTileTokens>(p, stream);
}

}  // namespace mlaserve::moe_gemm
