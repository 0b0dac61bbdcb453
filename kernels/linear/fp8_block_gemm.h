// DeepSeek-V3/R1 FP8 block-128 projections on the GPU without widening the weights (issue 21):
//
//   y = dequant(xq) dequant(W)^T, bf16 out, fp32 accumulation, where
//   W  = the checkpoint's e4m3 [n, k] with weight_scale_inv fp32 [ceil(n/128), ceil(k/128)]
//        (kernels/linear/fp8_block_ref.h: w = e4m3 * scale_inv of its 128x128 block), as stored;
//   xq = the bf16 activations quantized here per token and per 128 columns ("1x128"), as
//        DeepSeek's inference/kernel.py act_quant does: s = amax / 448 over the group, x / s
//        rounded to e4m3 (saturating), s kept in fp32. An all-zero group gets s = 1 (act_quant
//        would divide by 0).
//
// The product is cuBLASLt's block-scaled FP8 GEMM (cuBLAS 12.9+: A scale mode BLK128x128_32F
// for W, B scale mode VEC128_32F for x, fast accumulation off as those modes require). Layouts,
// from the checks PyTorch's _scaled_mm makes before it calls the same cuBLASLt modes
// (pytorch/pytorch aten/src/ATen/native/cuda/ScaledBlas.cpp, is_blockwise_1x128_scaling /
// is_blockwise_128x128_scaling; read 2026-12-01, no code copied):
//   - the 128x128 scales of a row-major [n, k] operand are row-major [ceil(n/128), ceil(k/128)]
//     with a 16-byte aligned row pitch: the checkpoint's weight_scale_inv as it is (k a multiple
//     of 512 keeps the pitch aligned: DeepSeek's 512, 1536, 2048, 7168, 16384, 18432 are);
//   - the 1x128 scales of a row-major [m, k] operand are "outer-dim-major": [ceil(k/128), m]
//     with m contiguous (x_scale[g * m + row]).
// cuBLAS documents these modes for compute capability 9.0 (Hopper) only; Blackwell's FP8 block
// scaling is the MX kind (32-element e8m0 scales), so Supported() is false there and the model
// keeps the dequantized bf16 weights. k must be a multiple of 512 (128-column blocks whose rows
// of scales start 16-byte aligned); a projection with other k (DeepSeek-R1's dense down_proj at
// 8-way TP, k 2304) keeps the bf16 path.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlaserve {

// Quantizes bf16 x [m, k] (row stride x_stride elements) to e4m3 xq [m, k] (dense) and fp32
// scales [k / 128, scale_stride >= m] as described above. k % 128 == 0. One warp per 128-column
// group.
cudaError_t QuantizeActivationsFp8Block(const void* x, int64_t x_stride, int64_t m, int64_t k,
                                        uint8_t* xq, float* x_scale, int64_t scale_stride,
                                        cudaStream_t stream);

class Fp8BlockGemm {
 public:
  // Whether `device` can run it (compute capability 9.x and a cuBLASLt with the block modes).
  static bool Supported(int device);
  static absl::StatusOr<std::unique_ptr<Fp8BlockGemm>> Create(size_t workspace_bytes = 32 << 20);
  ~Fp8BlockGemm();
  Fp8BlockGemm(const Fp8BlockGemm&) = delete;
  Fp8BlockGemm& operator=(const Fp8BlockGemm&) = delete;

  struct Args {
    int64_t m = 0, n = 0, k = 0;
    const void* x = nullptr;        // bf16 [m, k], row stride x_stride
    int64_t x_stride = 0;
    const uint8_t* w = nullptr;     // e4m3 [n, k] row-major
    const float* w_scale = nullptr; // fp32 [ceil(n/128), k/128] row-major
    void* out = nullptr;            // bf16 [m, n], row stride out_stride
    int64_t out_stride = 0;
    void* scratch = nullptr;        // ScratchBytes(m, n, k) bytes of device memory
  };
  // cuBLASLt's block modes take only row counts that are multiples of kRowMultiple (measured on
  // the H200: 8, 64, 256 run, 1, 3, 17, 33, 129 are NOT_SUPPORTED); other m are padded with zero
  // rows in the scratch and the product goes through a scratch output.
  static constexpr int64_t kRowMultiple = 8;
  // Scratch: padded xq, its scales, and (for m not a multiple of kRowMultiple) the padded output.
  static size_t ScratchBytes(int64_t m, int64_t n, int64_t k);

  // Quantizes x into the scratch, then one cuBLASLt call. No host sync, no allocation after a
  // shape's first call (graph-capturable once planned).
  absl::Status Run(const Args& a, cudaStream_t stream);

 private:
  struct Impl;
  explicit Fp8BlockGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlaserve
