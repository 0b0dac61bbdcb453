// Rotary position embedding on the GPU, in place on bf16, the math of RopeRef
// (kernels/rope/rope_ref.h): angle_i = float(position) * inv_freq[i] in fp32, cos and sin with
// the accurate cosf/sinf (not the __cosf intrinsics: positions reach 160k rad), products and
// sums in fp32 without FMA contraction, the result rounded to bf16 once. Interleaved input pairs
// (x[2i], x[2i+1]) are written de-interleaved (out[i], out[i + dim/2]) as RopeRef documents.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

inline constexpr int kRopeMaxDim = 512;  // values per rotary vector the kernel supports

struct RopeParams {
  void* x = nullptr;  // bf16, `rows` rows of row_stride elements
  int64_t rows = 0;
  int64_t row_stride = 0;  // elements; rows must not overlap
  // Each row holds per_row vectors of `dim` values, vector j at first_col + j * vec_stride
  // (e.g. the 64 rope values of each of the heads of q: first_col 128, vec_stride 192).
  int64_t first_col = 0;
  int per_row = 1;
  int64_t vec_stride = 0;              // elements, >= dim when per_row > 1
  int dim = 0;                         // even, <= kRopeMaxDim
  const int32_t* positions = nullptr;  // device [rows], >= 0
  const float* inv_freq = nullptr;     // device [dim / 2]
  float attention_scaling = 1.0f;      // multiplies cos and sin (YaRN's mscale)
  bool interleaved = false;
  // Launch programmatically dependent on the stream's previous kernel
  // (kernels/programmatic_launch.cuh): the kernel waits for it before reading anything.
  bool programmatic = false;
};

// rows = 0 is a no-op. Asynchronous on `stream`; no host sync, no allocation (graph-capturable).
absl::Status InvokeRope(const RopeParams& p, cudaStream_t stream);

}  // namespace mlaserve
