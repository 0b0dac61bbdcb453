// Projections of 1..kSkinnyMaxRows activation rows: out = alpha * x W^T (W [n, k] row-major),
// bf16 x and W, fp32 accumulation, bf16 or fp32 out -- the decode steps of small
// batches, where every weight byte is read for a handful of rows and the step is a chain of
// weight streams. cuBLASLt's kernels for these shapes reached 0.65-1.9 TB/s on the H200 (ncu,
// Kimi-K2.5 rank-0 shard at batch 1, bench/RESULTS.md) and most came with a split-K reduction
// kernel; these read each weight row once with 16-byte loads, several in flight per lane, and
// reduce inside the block: one kernel per call, no workspace.
//
// Up to kSkinnyMaxSegments weights that share x run as one launch (q_a and kv_a; the shared
// expert's gate and up and the router), each with its own n, alpha and output.
//
// W [k, n] (MLA's q absorb) stays on cuBLASLt: a kernel of this kind for it (16 row slots x 128
// columns a block) measured 5.3 us against cuBLASLt's 3.7 us at Kimi-K2.5's 8 heads x [128, 512]
// (ncu, H200, 2026-12-01) and was dropped.
//
// Summation order: lane l of a warp sums its 8-element chunks c = l, l + 32, ... of the warp's K
// slice in order (one fp32 fma per product), the warp adds its lanes by a butterfly, and the
// block adds its K slices in slice order. The order depends on (n, k, batch, segments) and
// never on m or on a row's position, so results are batch-invariant among m <= kSkinnyMaxRows
// (they differ from cuBLASLt's: LinearGemm does not use this path in its invariant mode).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace mlaserve {

inline constexpr int kSkinnyMaxRows = 4;
// The tensor-core variant (SkinnyGemmArgs::mma) takes up to this many rows.
inline constexpr int kSkinnyMmaMaxRows = 16;
inline constexpr int kSkinnyMaxSegments = 4;

// A transform of x applied as the kernel reads it, so that the op producing the product's
// input and the product are one launch (one weight, batch 1). The transformed rows are never
// stored.
//   kRmsNorm: the product reads bf16(norm_weight[j] * (x[j] * inv)), inv = 1 / sqrt(mean(x^2) +
//     eps) over x's row: RmsNorm's arithmetic (kernels/norm/rms_norm.h), computed once a block
//     before the weights stream, the sum of squares in this kernel's order (warp w of 4 sums
//     the w-th quarter of the row's 8-element chunks, lane l the chunks l, l + 32, ... in
//     element order, then a butterfly; the 4 in warp order), so inv can differ from
//     InvokeRmsNorm's by fp32 rounding.
//   kSiluMul: the product reads bf16(silu(x[j]) * up[j]): SiluMul's arithmetic
//     (kernels/activation/silu_mul.cu), bit for bit.
enum class SkinnyPrologue { kNone, kRmsNorm, kSiluMul };

struct SkinnyPrologueArgs {
  SkinnyPrologue kind = SkinnyPrologue::kNone;
  const float* norm_weight = nullptr;  // kRmsNorm: fp32 [k], 16-byte aligned
  float eps = 0.0f;                    // kRmsNorm
  const void* up = nullptr;            // kSiluMul: bf16 [m, k], row stride up_stride elements
  int64_t up_stride = 0;
};

struct SkinnyGemmSegment {
  const void* w = nullptr;  // bf16 [n, k]
  int64_t n = 0;
  float alpha = 1.0f;
  void* out = nullptr;  // out_dtype [m, n], row stride out_stride elements
  DType out_dtype = DType::kBF16;
  int64_t out_stride = 0;
};

struct SkinnyGemmArgs {
  int m = 0;  // 1..kSkinnyMaxRows (1..kSkinnyMmaMaxRows with mma)
  // The tensor-core variant (skinny_gemm.cu): the products on mma.sync, 16 weight rows a warp;
  // needs k % 32 == 0 and no prologue. Its summation order differs from the CUDA-core kernel's
  // (both independent of the other rows). LinearGemm::SetSkinnyTensorCoreRows chooses it.
  bool mma = false;
  int64_t k = 0;
  const void* x = nullptr;  // bf16 [m, k], row stride x_stride elements
  int64_t x_stride = 0;
  bool w_kn = false;  // W [k, n]: not supported (SkinnyGemmSupports is false)
  int num_segments = 1;
  SkinnyGemmSegment seg[kSkinnyMaxSegments];
  // Strided batch (one segment only): `batch` products, the i-th at x + i * x_batch_stride,
  // w + i * w_batch_stride, out + i * out_batch_stride (elements).
  int batch = 1;
  int64_t x_batch_stride = 0, w_batch_stride = 0, out_batch_stride = 0;
  int sm_count = 132;  // the device's multiprocessors: sizes the K split
  // Launch programmatically dependent on the stream's previous kernel (kernels/
  // programmatic_launch.cuh): the blocks issue their first weight loads, then wait for it before
  // reading x. LinearGemm::SetProgrammaticLaunch; off by default.
  bool programmatic = false;
  SkinnyPrologueArgs prologue;  // kind != kNone: one segment, batch 1
};

// Whether the kernels take these arguments: W [n, k], m in [1, kSkinnyMaxRows] (with mma: in
// [1, kSkinnyMmaMaxRows], k a multiple of 32, no prologue), 16-byte aligned
// x and W rows (pointers, strides and batch strides), k a multiple of 8, sizes within int32,
// out_dtype bf16 or fp32; a prologue only with one segment and batch 1, its norm weight or up
// rows 16-byte aligned (up_stride >= k, a multiple of 8). Outputs need no alignment.
bool SkinnyGemmSupports(const SkinnyGemmArgs& a);

// Enqueues the product; cudaErrorInvalidValue where SkinnyGemmSupports is false.
cudaError_t InvokeSkinnyGemm(const SkinnyGemmArgs& a, cudaStream_t stream);

}  // namespace mlaserve
