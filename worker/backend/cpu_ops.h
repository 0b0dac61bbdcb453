// The CPU backend: the reference kernels of kernels/, fp32 throughout. Exact and readable,
// not fast; CI runs it, and it is the oracle for the CUDA backend.
#pragma once

#include "kernels/mla/mla_decode_ref.h"
#include "worker/backend/ops.h"

namespace mlaserve {

class CpuOps : public Ops {
 public:
  explicit CpuOps(int threads = 1) : threads_(threads) {}
  // Accuracy studies only (tests/model/accuracy_test.cc): attention over fp8 caches in the emulated
  // FP8 tensor-core form (MlaFp8MmaEmulation) instead of the exact one.
  void set_mla_fp8_mma_emulation(MlaFp8MmaEmulation e) { mla_fp8_mma_ = e; }
  Device device() const override { return Device::kCpu; }
  DType activation_dtype() const override { return DType::kF32; }

  absl::Status BeginStep(const StepLayout& layout, StepTensors* step) override;
  Tensor Activation(std::vector<int64_t> shape, DType dtype) override;
  using Ops::Activation;
  absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) override;
  // BF16 and F16 tensors become F32 (every CPU kernel reads fp32); others are shared as is.
  absl::StatusOr<Tensor> Upload(const Tensor& host) override;
  absl::StatusOr<LinearWeight> UploadLinear(const LinearWeight& host) override;
  absl::StatusOr<RoutedExperts> UploadExperts(int first_expert, int num_routed_experts,
                                              const std::vector<ExpertWeights>& host) override;
  absl::Status CopyToHost(const Tensor& src, void* dst) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

  void Embed(const Tensor& table, int64_t vocab_begin, const StepTensors& step,
             Tensor& out) override;
  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override;
  void AddRmsNorm(const Tensor& delta, Tensor& residual, const Tensor& weight, float eps,
                  Tensor& out) override;
  void Linear(const Tensor& x, const LinearWeight& w, Tensor& out) override;
  void SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void Columns(const Tensor& x, int64_t begin, Tensor& out) override;
  void CopyColumns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                   int64_t cols) override;
  void LogitsRows(const Tensor& x, const StepTensors& step, Tensor& out) override;
  void Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
            const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
            bool interleaved) override;
  void KvWrite(const Tensor& latent, const Tensor& k_rope, const StepTensors& step,
               KvCacheLayer& cache) override;
  void MlaPrefill(const MlaShape& shape, const Tensor& q, const Tensor& latent,
                  const Tensor& k_rope, const LinearWeight& kv_b, const KvCacheLayer& cache,
                  const StepTensors& step, Tensor& out) override;
  void MlaAbsorb(const MlaShape& shape, const DcpShape& dcp, const Tensor& q, const Tensor& w_kb,
                 Tensor& q_abs) override;
  void MlaAttend(const MlaShape& shape, const DcpShape& dcp, const Tensor& q_all,
                 const KvCacheLayer& cache, const StepTensors& step, int group, Tensor& latent,
                 Tensor& lse) override;
  void MlaMergeExpand(const MlaShape& shape, const DcpShape& dcp, const Tensor& latent_all,
                      const Tensor& lse_all, const Tensor& w_vb, Tensor& out) override;
  void MlaDecode(const MlaShape& shape, const Tensor& q, const Tensor& w_kb, const Tensor& w_vb,
                 const KvCacheLayer& cache, const StepTensors& step, int group, Tensor& out,
                 const Tensor& q_abs) override;
  void MoeRoute(const MoeRouting& routing, const Tensor& logits, const Tensor& bias, Tensor& ids,
                Tensor& weights) override;
  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                  const RoutedExperts& experts, const Tensor& shared, Tensor& out) override;
  absl::Status Sample(const Tensor& logits, const SamplingBatch& batch,
                      std::vector<SampledOutput>* out) override;

 private:
  int threads_;
  MlaFp8MmaEmulation mla_fp8_mma_ = MlaFp8MmaEmulation::kNone;
};

}  // namespace mlaserve
