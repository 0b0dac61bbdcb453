// RMSNorm on the GPU, the arithmetic of RmsNormRef (kernels/norm/rms_norm_ref.h): per row,
// inv = 1 / sqrt(mean(x^2) + eps) in fp32, out = weight * (x * inv), rounded once to bf16. The
// sum of squares is an fp32 tree (the reference sums in double), so results differ from the
// reference by fp32 rounding before the final bf16 rounding.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace mlaserve {

struct RmsNormParams {
  int64_t rows = 0;
  int dim = 0;
  float eps = 1e-6f;
  const void* x = nullptr;        // [rows, dim] of x_dtype, row stride x_stride elements
  DType x_dtype = DType::kF32;    // kBF16 or kF32
  int64_t x_stride = 0;           // elements, >= dim
  const float* weight = nullptr;  // [dim]
  void* out = nullptr;            // bf16 [rows, dim], row stride out_stride elements
  int64_t out_stride = 0;         // elements, >= dim
  // Launch programmatically dependent on the stream's previous kernel
  // (kernels/programmatic_launch.cuh): the kernel waits for it before reading anything.
  bool programmatic = false;
};

// rows = 0 is a no-op. Asynchronous on `stream`; no host sync, no allocation (graph-capturable).
absl::Status InvokeRmsNorm(const RmsNormParams& p, cudaStream_t stream);

// The pre-norm residual update of a decoder layer, fused:
//   residual (fp32 [rows, dim], contiguous) += delta (bf16 [rows, dim], contiguous)
//   out (bf16 [rows, dim], contiguous) = RmsNorm(residual) * weight  (as InvokeRmsNorm)
// The add is one fp32 addition per element, as CpuOps::Add followed by CpuOps::RmsNorm.
struct AddRmsNormParams {
  int64_t rows = 0;
  int dim = 0;
  float eps = 1e-6f;
  float* residual = nullptr;      // fp32 [rows, dim], updated in place
  const void* delta = nullptr;    // bf16 [rows, dim]
  const float* weight = nullptr;  // [dim]
  void* out = nullptr;            // bf16 [rows, dim]
  bool programmatic = false;      // as RmsNormParams::programmatic
};

absl::Status InvokeAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream);

}  // namespace mlaserve
