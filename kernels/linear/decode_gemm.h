// Projections of a decode step's 5..kDecodeGemmMaxRows activation rows on tensor cores:
// out = alpha * x W^T (W [n, k] row-major bf16, x bf16, out bf16 or fp32), for the shapes where
// cuBLASLt streams a large-K, small-N weight at 25-50% of copy bandwidth (Kimi-K2.5's q_a [1536,
// 7168], kv_a [576, 7168], o_proj [7168, 1024] at 8-256 rows: bench/linear/linear_bench, H100,
// bench/RESULTS.md session 26), so that batches of 5-64 decode rows read their projections near
// the bandwidth the skinny kernels reach at 1-4 rows.
//
// Layout of the work (decode_gemm.cu): a block of 4 warps owns 64 weight rows (one 16-row m-tile
// a warp: mma.sync.m16n8k16 with the weight as the A operand, the tokens as B in n-tiles of 8), a
// K slice of the whole K split S ways so that the grid fills the device's resident blocks, and
// streams it in 64-column stages through a cp.async ring (the weight tile and the tokens' columns
// of each stage together; ldmatrix from XOR-swizzled rows). S = 1 stores the product; S > 1 stores
// fp32 partials [S][m][rows] into the caller's workspace and a second kernel adds the S partials
// in slice order (fixed, so the result is the same on every run and in every graph replay) and
// stores alpha * sum. Both kernels launch programmatically where asked: the product's blocks issue
// their first weight stages before waiting for the previous kernel; the reduction waits for the
// product.
//
// Numerics: bf16 products exact in fp32, fp32 accumulation in the MMA's order within a 16-column
// step, steps in column order within a slice, slices in slice order. Independent of the other
// rows of x (each token is its own B column), so a row's result does not depend on m, but it
// differs from cuBLASLt's and the skinny kernels' by fp32 summation order (the batch-invariant
// mode does not use it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace mlaserve {

inline constexpr int kDecodeGemmMaxRows = 64;

struct DecodeGemmArgs {
  int m = 0;                // 1..kDecodeGemmMaxRows
  int64_t n = 0;            // weight rows (out features), >= 1
  int64_t k = 0;            // a multiple of 64
  const void* x = nullptr;  // bf16 [m, k], row stride x_stride elements (16-byte aligned rows)
  int64_t x_stride = 0;     // >= k, a multiple of 8
  const void* w = nullptr;  // bf16 [n, k] row-major, 16-byte aligned
  float alpha = 1.0f;
  void* out = nullptr;             // out_dtype [m, n], row stride out_stride elements
  DType out_dtype = DType::kBF16;  // kBF16 or kF32
  int64_t out_stride = 0;          // >= n
  // The K split's fp32 partials (device memory, 16-byte aligned): S x m x (n rounded up to 64) x
  // 4 bytes for a split of S; with fewer bytes the split is reduced to what fits (S = 1 needs
  // none).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int sm_count = 132;         // the device's multiprocessors: sizes the K split
  bool programmatic = false;  // kernels/programmatic_launch.cuh
};

// Whether the kernels take these arguments (sizes within int32, alignments above).
bool DecodeGemmSupports(const DecodeGemmArgs& a);

// Enqueues the product (and the reduction where K is split); cudaErrorInvalidValue where
// DecodeGemmSupports is false.
cudaError_t InvokeDecodeGemm(const DecodeGemmArgs& a, cudaStream_t stream);

}  // namespace mlaserve
