// The CPU backend: the reference kernels of kernels/, fp32 throughout. Exact and readable,
// not fast; CI runs it, and it is the oracle for the CUDA backend.
#pragma once

#include "worker/backend/ops.h"

namespace mlaserve {

class CpuOps : public Ops {
 public:
  explicit CpuOps(int threads = 1) : threads_(threads) {}
  Device device() const override { return Device::kCpu; }

  Tensor Activation(std::vector<int64_t> shape) override;
  // BF16 and F16 tensors become F32 (every CPU kernel reads fp32); others are shared as is.
  Tensor Upload(const Tensor& host) override;
  void CopyToHost(const Tensor& src, void* dst) override;

  void Embed(const Tensor& table, int64_t vocab_begin, const std::vector<int32_t>& ids,
             Tensor& out) override;
  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override;
  void Linear(const Tensor& x, const LinearWeight& w, Tensor& out) override;
  void SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void Add(const Tensor& x, Tensor& acc) override;
  void Columns(const Tensor& x, int64_t begin, Tensor& out) override;
  void Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
            const std::vector<int32_t>& positions, const Tensor& inv_freq,
            float attention_scaling, bool interleaved) override;
  void KvWrite(const Tensor& latent, const Tensor& k_rope, const std::vector<int64_t>& slots,
               KvCacheLayer& cache) override;
  void MlaNaive(const MlaShape& shape, const Tensor& q, const Tensor& latent, const Tensor& k_rope,
                const LinearWeight& kv_b, const std::vector<SequenceSlice>& seqs,
                Tensor& out) override;
  void MlaAbsorbed(const MlaShape& shape, const Tensor& q, const Tensor& w_kb, const Tensor& w_vb,
                   const KvCacheLayer& cache, const std::vector<SequenceSlice>& seqs,
                   Tensor& out) override;
  void MoeRoute(const MoeRouting& routing, const Tensor& logits, const Tensor& bias, Tensor& ids,
                Tensor& weights) override;
  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights, int first_expert,
                  const std::vector<ExpertWeights>& experts, Tensor& out) override;

 private:
  int threads_;
};

}  // namespace mlaserve
