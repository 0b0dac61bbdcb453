// Dense projections held in the FP8 layout of the expert GEMMs (fp8_moe_layout.h: DeepSeek's
// e4m3 codes with an fp32 scale per 8 x 64 weights, padded to multiples of 128): the weight-only
// kernel's dense mode (fp8_moe_gemm.h InvokeFp8DenseGemm: reads 1 byte a weight), and a
// dequantized bf16 copy of such a weight (the same bf16(fp32(e4m3 * s)) values).
//
// Not used by the model: measured on the H200 (fp8_block_bench, bench/RESULTS.md "FP8
// projections") the dense mode is 0.13-1.01x the bf16 GEMM's speed at 1-512 rows on DeepSeek-R1's
// projections but kv_b's 1-8 rows (1.19-1.25x) (one weight gives the grid ceil(n / BN) x row
// tiles blocks and no split-K, so a [576, 7168] projection leaves most of 132 SMs idle), so the
// CUDA backend holds FP8 projections
// in bf16 (CudaOps::UploadLinear). Kept, with its test and that bench, as the measured
// alternative: a split-K variant reading 1 byte a weight is what could beat bf16 at decode.
//
// This header is included by C++20 host code: no cuda_bf16.h, bf16 tensors are void pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mlaserve {

struct Fp8DenseLinearParams {
  int m = 0;                        // rows of x
  int n = 0;                        // out_features (<= n_p)
  int n_p = 0, k_p = 0;             // the layout's padded [n_p, k_p] (multiples of 128)
  const void* x = nullptr;          // bf16 [m, k_p], columns past in_features zero
  const uint8_t* codes = nullptr;   // Fp8TiledCodeBytes(n_p, k_p)
  const uint8_t* scales = nullptr;  // Fp8TiledScaleBytes(n_p, k_p)
  float alpha = 1.0f;
  void* out = nullptr;  // bf16 [m, n]
};

// out = alpha * x W^T, one kernel; a row's bits do not depend on m (no split-K, fixed K order).
cudaError_t InvokeFp8DenseLinear(const Fp8DenseLinearParams& p, cudaStream_t stream);

// W as row-major bf16 [n, k] (out's row stride k) from the layout [n_p, k_p].
cudaError_t InvokeFp8DenseToBf16(const uint8_t* codes, const uint8_t* scales, int n_p, int k_p,
                                 int n, int k, void* out, cudaStream_t stream);

}  // namespace mlaserve
