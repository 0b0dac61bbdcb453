// Dense gated MLP in BF16 through cuBLAS: shared experts and the first dense layers, which the
// NVFP4 checkpoints keep in BF16. out = down(silu(gate x) * up x).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace mlaserve {

struct Bf16GatedMlpParams {
  int tokens;
  int hidden;
  int intermediate;                     // even
  const __nv_bfloat16* x;               // [tokens, hidden]
  const __nv_bfloat16* gate_up_weight;  // [2 * intermediate, hidden]: gate rows, then up rows
  const __nv_bfloat16* down_weight;     // [hidden, intermediate]
  __nv_bfloat16* gate_up_out;           // scratch [tokens, 2 * intermediate]
  __nv_bfloat16* act;                   // scratch [tokens, intermediate]
  __nv_bfloat16* out;                   // [tokens, hidden]
  cublasHandle_t cublas;                // set to `stream` by the launcher
};

// Two cuBLAS GEMMs (bf16 in and out, fp32 accumulation) around a SiLU(gate) * up kernel; the
// intermediate values are rounded to bf16 as a BF16 PyTorch model rounds them.
cudaError_t InvokeBf16GatedMlp(const Bf16GatedMlpParams& params, cudaStream_t stream);

}  // namespace mlaserve
