// The epilogue of a merged projection: one GEMM over weights placed side by side in memory
// (CudaOps::AdjoinLinears: q_a and kv_a, the shared expert's gate and up) writes fp32 [rows, N]
// with alpha 1, and this kernel hands each weight's columns to that weight's own output,
// multiplied by its alpha and rounded once to the output's dtype: the same rounding point as a
// product run alone (round(alpha * fp32 sum)), so merging changes only the fp32 summation order
// that the GEMM's algorithm chooses.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace mlaserve {

inline constexpr int kSplitColumnsMaxSegments = 4;

struct SplitColumnsParams {
  int64_t rows = 0;
  const float* src = nullptr;  // fp32 [rows, sum of the segments' cols], row stride src_stride
  int64_t src_stride = 0;      // elements, >= the sum of the segments' cols
  int num_segments = 0;        // 1..kSplitColumnsMaxSegments, in column order
  struct Segment {
    int64_t cols = 0;            // >= 1
    void* out = nullptr;         // dtype [rows, cols], row stride out_stride elements
    DType dtype = DType::kBF16;  // kBF16 or kF32
    int64_t out_stride = 0;      // elements, >= cols
    float alpha = 1.0f;
  } seg[kSplitColumnsMaxSegments];
  // Launch programmatically dependent on the stream's previous kernel (the GEMM): nothing is read
  // before it has finished (kernels/programmatic_launch.cuh).
  bool programmatic = false;
};

// rows = 0 is a no-op. Asynchronous on `stream`; no allocation (graph-capturable).
absl::Status InvokeSplitColumns(const SplitColumnsParams& p, cudaStream_t stream);

}  // namespace mlaserve
