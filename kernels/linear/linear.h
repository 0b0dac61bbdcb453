// Dense projections y = alpha * x W^T on the GPU: bf16 x and W, fp32 accumulation
// (CUBLAS_COMPUTE_32F), bf16 or fp32 output, through cuBLASLt. Covers the model's bf16
// projections, and its non-expert NVFP4 ones run as bf16 GEMMs on weights expanded by
// DequantizeNvfp4ToBf16Unscaled (kernels/linear/linear_ref.h) with alpha = weight_scale_2; and,
// batched over heads with strides, MLA's absorbed q (x W_kb[h], W stored [k, n]) and output
// (x W_vb[h]^T) products.
//
// Batch invariance (SetBatchInvariant, the deterministic mode of issue 23): cuBLASLt's heuristic
// picks tile shapes and split-K by the row count, so a row's bits change with the batch it is
// in. Invariant plans take one algorithm per (n, k, strides, dtype, alignment), chosen once for
// kInvariantPlanRows rows with split-K and its reduction schemes excluded, and use it for every
// m: every output element is then one fixed kernel's K loop in one order, whatever the other
// rows are (the GPU test checks every row's bits across m and row positions). A shape for which
// that algorithm is not usable at some m fails with an error rather than computing differently.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/linear/skinny_gemm.h"

namespace mlaserve {

// One per device and stream user: it owns a cuBLASLt handle, a device workspace and a cache of
// algorithm choices by shape, none of them thread-safe. Create on the device it will run on.
class LinearGemm {
 public:
  // workspace_bytes: device scratch for split-k and the like (allocated here, once).
  static absl::StatusOr<std::unique_ptr<LinearGemm>> Create(size_t workspace_bytes = 32 << 20);
  ~LinearGemm();
  LinearGemm(const LinearGemm&) = delete;
  LinearGemm& operator=(const LinearGemm&) = delete;

  struct Args {
    int64_t m = 0;                   // rows of x (tokens)
    int64_t n = 0;                   // out_features
    int64_t k = 0;                   // in_features
    const void* x = nullptr;         // bf16 [m, k], row stride x_stride elements
    int64_t x_stride = 0;            // >= k
    const void* w = nullptr;         // bf16 [n, k] row-major (PyTorch Linear layout), or [k, n]
    bool w_kn = false;               // true: w is [k, n] row-major (out = x W)
    float alpha = 1.0f;              // e.g. NVFP4 weight_scale_2 when w holds e2m1 * block_scale
    void* out = nullptr;             // out_dtype [m, n], row stride out_stride elements
    DType out_dtype = DType::kBF16;  // kBF16 or kF32
    int64_t out_stride = 0;          // >= n
    // Strided batch: `batch` independent products, the i-th at x + i * x_batch_stride,
    // w + i * w_batch_stride, out + i * out_batch_stride (elements).
    int batch = 1;
    int64_t x_batch_stride = 0, w_batch_stride = 0, out_batch_stride = 0;
  };

  // out = alpha * x W^T (out's columns n..out_stride are not touched). m = 0 is a no-op. The
  // first call with a new (shape, strides, dtype, pointer alignments) asks cuBLASLt's heuristic
  // for an algorithm and caches it, later ones only enqueue: no host sync, no allocation
  // (graph-capturable, once each shape has been seen or also during capture, since the
  // heuristic query does not touch the stream).
  absl::Status Run(const Args& a, cudaStream_t stream);

  // Several products of the same x (the same x, x_stride, m and k; batch 1): one skinny launch
  // where they qualify (m <= kSkinnyMaxRows, at most kSkinnyMaxSegments of them, outside the
  // invariant mode), else one Run each. The shared launch splits K by the weights' combined
  // rows, so its bits can differ from Run's of one weight alone by fp32 summation order.
  absl::Status RunShared(const Args* list, int count, cudaStream_t stream);

  // out = alpha * T(x) W^T with T a transform of x applied as the skinny kernel reads it
  // (skinny_gemm.h's SkinnyPrologue: RMSNorm of x's rows, or SiLU(x) * up), one launch for the
  // op and the product. Only where the skinny kernels run it (m <= kSkinnyMaxRows, W [n, k],
  // batch 1, outside the invariant mode): returns false without enqueuing anything otherwise,
  // and the caller runs the two ops.
  absl::StatusOr<bool> RunWithPrologue(const Args& a, const SkinnyPrologueArgs& prologue,
                                       cudaStream_t stream);

  // Skinny launches (m <= kSkinnyMaxRows) programmatically dependent on the stream's previous
  // kernel from now on (SkinnyGemmArgs::programmatic); off by default (CudaOps turns it on).
  void SetProgrammaticLaunch(bool on);

  // Products of kSkinnyMaxRows < m <= rows (at most kSkinnyMmaMaxRows) on the skinny kernels'
  // tensor-core variant (SkinnyGemmArgs::mma) from now on, where it takes them (k % 32 == 0),
  // in Run and RunShared; 0 (the default) leaves them on cuBLASLt. Outside the invariant mode.
  // Written in session 10 for batches 5-16 (the CUDA-core skinny kernels measured slower than
  // cuBLASLt there); correct on the H200 but no faster than cuBLASLt at 5-16 rows (session 11,
  // bench/RESULTS.md), so off.
  void SetSkinnyTensorCoreRows(int rows);

  // Products of kSkinnyMaxRows < m <= rows (at most kDecodeGemmMaxRows) on the split-K
  // tensor-core kernel (kernels/linear/decode_gemm.h) from now on, where it takes them (W [n, k],
  // batch 1, k a multiple of 64, 16-byte aligned x and W rows), in Run and RunShared; 0 leaves
  // them on cuBLASLt. Outside the invariant mode. Its K split's partials use this object's
  // workspace, as cuBLASLt's split-K does (so the same one-stream-at-a-time rule holds).
  void SetDecodeGemmRows(int rows);

  // Outside the invariant mode, plans from now on take the heuristic's rank-th usable algorithm
  // instead of its first (fewer usable: the last), and from no_split_rows rows up (0: never) only
  // algorithms without split-K where the heuristic offers any. For tuning runs
  // (bench/linear/linear_bench, mlaserve-model-bench --gemm-*); the defaults are (0, 0). Plans made
  // before are dropped.
  void SetHeuristicChoice(int rank, int no_split_rows);
  // The algorithm Run would use for `a` past the skinny kernels (planned now if it is new), in
  // words: cuBLASLt's algorithm, tile and stages ids, split-K factor and reduction scheme.
  absl::StatusOr<std::string> PlanSummary(const Args& a);

  // Batch-invariant plans from now on (see the file comment); off by default.
  void SetBatchInvariant(bool on);
  bool batch_invariant() const;
  // The row count invariant plans choose their algorithm for: a decode-sized batch, so that the
  // steps the deterministic mode spends most of its time in get a kernel sized for them.
  static constexpr int64_t kInvariantPlanRows = 64;

  // Number of distinct shapes planned so far (for tests: repeated shapes must not add plans).
  size_t CachedPlans() const;

 private:
  struct Impl;
  explicit LinearGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlaserve
