// Gather of rows by id, with a dtype conversion: the token embedding (bf16 table -> fp32
// residual stream, vocab-parallel: each rank holds rows [id_offset, id_offset + src_rows) of the
// vocabulary and gives zeros for the others, which the all-reduce fills in) and the selection of
// the hidden-state rows whose logits are wanted (bf16 -> bf16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace mlaserve {

struct GatherRowsParams {
  const void* src = nullptr;       // [src_rows, cols] of src_dtype, row stride src_stride elements
  DType src_dtype = DType::kBF16;  // kBF16 or kF32
  int64_t src_rows = 0;
  int64_t src_stride = 0;  // elements, >= cols
  int cols = 0;
  const int32_t* ids = nullptr;  // device [count]
  int count = 0;
  int64_t id_offset = 0;          // row = ids[i] - id_offset; rows outside [0, src_rows) give 0
  void* out = nullptr;            // [count, cols] of out_dtype, row stride out_stride elements
  DType out_dtype = DType::kF32;  // kBF16 or kF32
  int64_t out_stride = 0;         // elements, >= cols
};

// out[i, :] = convert(src[ids[i] - id_offset, :]) or zeros. fp32 -> bf16 rounds to nearest even;
// the other conversions are exact. count = 0 is a no-op. Asynchronous on `stream`; no host sync,
// no allocation (graph-capturable).
absl::Status InvokeGatherRows(const GatherRowsParams& p, cudaStream_t stream);

}  // namespace mlaserve
