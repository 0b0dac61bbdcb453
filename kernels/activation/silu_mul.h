// SiLU(gate) * up on the GPU for bf16 activations, the math of SiluMulRef
// (kernels/activation/silu_mul_ref.h): g / (1 + exp(-g)) * u in fp32 with the accurate expf and
// IEEE division, rounded once to bf16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

struct SiluMulParams {
  int64_t rows = 0;
  int cols = 0;
  const void* gate = nullptr;  // bf16 [rows, cols], row stride in_stride elements
  const void* up = nullptr;    // bf16 [rows, cols], row stride in_stride elements (e.g. gate + cols
                               // when gate and up are the halves of one [rows, 2 * cols] GEMM out)
  int64_t in_stride = 0;       // elements, >= cols
  void* out = nullptr;         // bf16 [rows, cols], row stride out_stride elements; may alias gate
                               // or up when it has the same stride
  int64_t out_stride = 0;      // elements, >= cols
  // Launch programmatically dependent on the stream's previous kernel
  // (kernels/programmatic_launch.cuh): the kernel waits for it before reading anything.
  bool programmatic = false;
};

// rows = 0 is a no-op. Asynchronous on `stream`; no host sync, no allocation (graph-capturable).
absl::Status InvokeSiluMul(const SiluMulParams& p, cudaStream_t stream);

}  // namespace mlaserve
