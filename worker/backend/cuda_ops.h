// The CUDA backend: every op of Ops on one GPU, through the kernels of kernels/ and cuBLAS(Lt).
//
// Numbers: activations bf16 between ops, the residual stream and router logits fp32, fp32
// accumulation inside every kernel (DESIGN.md "One model, two backends"). Weights: bf16 as the
// checkpoint stores them (fp32/fp16 checkpoints are rounded to bf16 once at load); NVFP4
// non-expert projections as bf16 e2m1 * block scale (exact) with weight_scale_2 applied to the
// GEMM output; NVFP4 routed experts in the grouped-GEMM layout (kernels/moe/moe_experts.h).
//
// Memory: weights and KV pools are allocated once; every op's scratch comes from a step arena
// (reset by BeginStep; it grows, then stays, at the size of the largest step seen, so after the
// first steps no step allocates), and the step's metadata is packed on the host and uploaded in
// one copy into a device buffer of fixed address (StepBuffers in GPU-BACKEND.md).
//
// Errors: ops are asynchronous and return nothing; the first failure (a launch error, a kernel
// fault, a missing kernel for a shape) is kept with the op's name and shapes, later ops are
// skipped, and the next Synchronize / CopyToHost / Sample returns it. The worker then exits with
// that message.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/linear/skinny_gemm.h"
#include "worker/backend/ops.h"

namespace mlaserve {

struct MoeRouteParams;

class CudaOps : public Ops {
 public:
  // Uses the current CUDA device; fails with the CUDA error when there is none.
  static absl::StatusOr<std::unique_ptr<CudaOps>> Create();
  ~CudaOps() override;

  Device device() const override { return Device::kCuda; }
  DType activation_dtype() const override { return DType::kBF16; }

  absl::Status BeginStep(const StepLayout& layout, StepTensors* step) override;
  Tensor Activation(std::vector<int64_t> shape, DType dtype) override;
  using Ops::Activation;
  absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) override;
  absl::StatusOr<Tensor> Upload(const Tensor& host) override;
  absl::StatusOr<LinearWeight> UploadLinear(const LinearWeight& host) override;
  absl::StatusOr<RoutedExperts> UploadExperts(int first_expert, int num_routed_experts,
                                              const std::vector<ExpertWeights>& host) override;
  absl::Status CopyToHost(const Tensor& src, void* dst) override;
  absl::Status Synchronize() override;

  void Embed(const Tensor& table, int64_t vocab_begin, const StepTensors& step,
             Tensor& out) override;
  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override;
  void AddRmsNorm(const Tensor& delta, Tensor& residual, const Tensor& weight, float eps,
                  Tensor& out) override;
  void Linear(const Tensor& x, const LinearWeight& w, Tensor& out) override;
  void Linears(const Tensor& x, std::initializer_list<LinearOut> outs) override;
  absl::Status AdjoinLinears(std::initializer_list<LinearWeight*> weights) override;
  void SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void RmsNormLinear(Tensor& x, const Tensor& norm_weight, float eps, const LinearWeight& w,
                     Tensor& out) override;
  void SiluMulLinear(Tensor& gate, const Tensor& up, const LinearWeight& w, Tensor& out) override;
  void Columns(const Tensor& x, int64_t begin, Tensor& out) override;
  void CopyColumns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                   int64_t cols) override;
  void LogitsRows(const Tensor& x, const StepTensors& step, Tensor& out) override;
  void Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
            const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
            bool interleaved) override;
  void KvWrite(const Tensor& latent, const Tensor& k_rope, const StepTensors& step,
               KvCacheLayer& cache) override;
  void MlaKvPrep(const Tensor& kv, const Tensor& norm_weight, float eps, const StepTensors& step,
                 const Tensor& inv_freq, float attention_scaling, bool interleaved,
                 KvCacheLayer& cache, Tensor& latent, Tensor& k_rope) override;
  void MlaInputPrep(const Tensor& kv, const Tensor& norm_weight, float eps, const StepTensors& step,
                    const Tensor& inv_freq, float attention_scaling, bool interleaved,
                    KvCacheLayer& cache, Tensor& latent, Tensor& k_rope, Tensor& q,
                    int64_t q_first_col, int q_heads, int64_t q_stride,
                    const Tensor& w_kb, Tensor& q_abs) override;
  void MlaPrefill(const MlaShape& shape, const Tensor& q, const Tensor& latent,
                  const Tensor& k_rope, const LinearWeight& kv_b, const KvCacheLayer& cache,
                  const StepTensors& step, Tensor& out) override;
  // Decode context parallelism: q absorbed into head slots; the MLA decode kernel over this
  // rank's cache rows with every rank's heads (q and the partials moved between the by-rank and
  // by-token layouts, kernels/mla/mla_dcp.h), partials in bf16 with fp32 lse; the log-sum-exp
  // merge of this rank's heads, then the W_vb expansion.
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
  // With SetMoeRouteDispatchFusion on (and phases not timed): the router's launch folded into
  // the experts' call, fused with their dispatch at decode sizes (InvokeMoeRouteDispatch).
  void MoeRouteExperts(const MoeRouting& routing, const Tensor& logits, const Tensor& bias,
                       const Tensor& x, const RoutedExperts& experts, const Tensor& shared,
                       Tensor& ids, Tensor& weights, Tensor& out) override;
  absl::Status Sample(const Tensor& logits, const SamplingBatch& batch,
                      std::vector<SampledOutput>* out) override;

  // Side branches (Ops::SideBranches) run on a second stream, forked from and joined into the
  // main one by events (graph branches when captured). Off while phase timing is on.
  bool SideBranches() const override;
  void BeginSideBranch() override;
  void EndSideBranch() override;
  bool SupportsGraphs() const override { return true; }
  absl::Status SetBatchInvariant(bool on) override;
  uint64_t ScratchMark() override;
  // Phase timing (eager steps only: graphs are not split into phases): with it on, every Phase
  // call records a CUDA event, and PhaseTimes() returns the device time between consecutive
  // events summed per phase name (ms, synchronising first), then starts a new account. The
  // events add ~2 us of launch work per phase to the host side.
  void SetPhaseTiming(bool on);
  // Decode-step optimisations with switches for A/B runs (mlaserve-model-bench --programmatic /
  // --fused-mla-input / --moe-few-expert / --fused-prologues / --programmatic-small;
  // bench/RESULTS.md, "Decode at batch 1-8", "The 61-layer shard after the decode-step work" and
  // "The few-expert kernel"): the first three on by default. Set them before the first step:
  // captured graphs keep what they were captured with.
  // The skinny projections of decode steps launched programmatically dependent on the previous
  // kernel (LinearGemm::SetProgrammaticLaunch).
  void SetProgrammaticLaunch(bool on);
  // Projections of 5..rows activation rows (rows <= 16) on the skinny kernels' tensor-core
  // variant instead of cuBLASLt (LinearGemm::SetSkinnyTensorCoreRows); 0, the default, is off
  // (measured no faster than cuBLASLt on the H200, session 11).
  void SetSkinnyTensorCoreRows(int rows);
  // cuBLASLt's algorithm choice for the projections it runs (LinearGemm::SetHeuristicChoice): the
  // heuristic's rank-th algorithm, and none with split-K from no_split_rows rows up (0: never).
  // (0, 0), the default, is the heuristic's first.
  void SetGemmHeuristicChoice(int rank, int no_split_rows);
  // Projections of 5..rows activation rows (rows <= 64) on the split-K tensor-core kernel
  // (LinearGemm::SetDecodeGemmRows, kernels/linear/decode_gemm.h); 0 leaves them on cuBLASLt.
  // kDefaultDecodeGemmRows by default: on the H100's 16-layer Kimi cut (bench/RESULTS.md, session
  // 26) it made batch 8 1.04x faster (its launches are programmatic, cuBLASLt's are not), batch 16
  // even, batches 32 and 64 0.99x (each projection alone is slower than cuBLASLt's from 16 rows).
  static constexpr int kDefaultDecodeGemmRows = 8;
  void SetDecodeGemmRows(int rows);
  // Linears over adjoined weights (AdjoinLinears: q_a and kv_a, a layer's gate and up) at 5..rows
  // activation rows as one product into fp32 scratch, whose columns a second kernel hands to each
  // weight's output with its alpha (kernels/linear/split_columns.h): one GEMM (and one split-K
  // reduction) where there were two, for an extra small launch. Up to 4 rows the skinny kernels
  // already run them as one launch; the batch-invariant mode never merges (the bits would depend
  // on the batch size). 0 is off. 64 by default: on the H100's 16-layer Kimi cut (bench/RESULTS.md,
  // session 27; two rounds each way in one process) batch 8 2.88 / 2.96 ms against 2.91 / 3.06,
  // batch 16 3.79 / 3.78 against 3.93 / 3.98, batch 32 5.43 / 5.44 against 5.48 / 5.50, batch 64
  // 7.19 / 7.25 against 7.26 / 7.39 (1.01-1.05x).
  static constexpr int kDefaultMergedProjectionRows = 64;
  void SetMergedProjectionRows(int rows);
  // Merged products enqueued so far (for tests and benchmarks).
  uint64_t merged_projections() const;
  // MlaKvPrep as one kernel (kernels/mla/mla_kv_prep.h) instead of the five ops.
  void SetFusedMlaInput(bool on);
  // q's RoPE inside the fused MLA input kernel (MlaInputPrep: one launch where there were the
  // fused input and RopeKernel), and the MLA decode reading q's rotated RoPE dims where they are
  // (MlaDecodeParams::q_rope) instead of a 2-D copy into the absorbed q (a memcpy node in the
  // step's graph that also ended the programmatic chain). On by default.
  void SetMlaQFusion(bool on);
  // q's absorption (q_nope W_kb[h], the MLA decode's first product) inside the fused MLA input
  // kernel at decode steps of at most 4 rows (Ops::MlaInputPrep's q_abs) instead of a cuBLASLt
  // launch in MlaDecode; needs SetMlaQFusion, off in the batch-invariant mode. On by default
  // since session 19: the 16-layer Kimi shard's batch-1 step 1.27 -> 1.22 ms, batch 2 1.51 ->
  // 1.47, batch 4 unchanged (H200, off / on alternated twice; bench/RESULTS.md). Its first two
  // forms were slower than cuBLASLt's absorption (session 13).
  void SetMlaAbsorbFusion(bool on);
  // The router's decode-size path (MoeRouteParams::split): a block of 4 warps a token instead
  // of one warp, for sigmoid routers with one expert group (Kimi-K2). Same ids and weights. On
  // by default (16-layer Kimi shard on the H200: batch 1 1.28 -> 1.27 ms, batches 8 and 64
  // unchanged).
  void SetMoeRouteSplit(bool on);
  // MoeRouteExperts with the router and the routed experts' dispatch as one kernel where the
  // split router serves the batch (SetMoeRouteSplit) and the step has one token: one launch a
  // MoE layer fewer. Same ids, weights and dispatch rows. On by default (batch 1 1.28 -> 1.26
  // ms on the 16-layer shard; at 8 tokens it lost, 2.9 -> 3.1 ms, so larger steps keep the two
  // launches).
  void SetMoeRouteDispatchFusion(bool on);
  // The routed experts' dispatch in decode batches launched programmatically dependent on the
  // router (MoeExpertsRunParams::programmatic_dispatch), as the GEMMs after it are. On by default.
  void SetProgrammaticDispatch(bool on);
  // The shared expert of MoE layers on a side branch beside the router, the dispatch and the
  // routed experts (SideBranches true; the router then its own launch). On by default.
  void SetSharedExpertOverlap(bool on);
  // The MLA decode's combine launched programmatically dependent on its split kernel
  // (MlaDecodeParams::programmatic_combine). On by default.
  void SetProgrammaticMlaCombine(bool on);
  // The MLA decode split's smallest share in 16-token units (MlaDecodeParams::min_share; 0, the
  // default, keeps the kernels' rule, 4 the rule before it cut short jobs finer); for
  // measurements.
  void SetMlaMinShare(int units);
  // The MLA decode of the fp8 cache formats on e4m3 tensor cores where the plan has such a kernel
  // (from 64 query rows on SM90: PlanMlaDecode's fp8_tensor_cores, the FP8 tensor-core form that
  // MlaDecodeRef emulates, within issue 18's accuracy bounds). On by default; off: the exact form.
  void SetMlaFp8TensorCores(bool on) override;
  // RmsNormLinear and SiluMulLinear as one skinny kernel each at 1-4 rows
  // (LinearGemm::RunWithPrologue): the q_a norm with q_b, the shared expert's SiLU with its down
  // projection. Off by default: slower at batches 2-4 on the H200 (sessions 7 and 11).
  void SetFusedPrologues(bool on);
  // The RMSNorms, RoPE, the fused MLA input, SiLU and the route kernel launched
  // programmatically dependent on the previous kernel (each waits for it first thing), so that
  // their launch overlaps the previous kernel's tail. On by default since session 11 (H200, 61-layer
  // Kimi-K2.5 shard: batch 1 5.37 -> 4.99 ms; bench/RESULTS.md); session 7 had measured it only
  // together with the fused prologues, whose loss hid its gain.
  void SetProgrammaticSmallKernels(bool on);
  // The routed experts' decode GEMMs on the few-expert kernel where few experts are active
  // (kernels/moe/moe_few_expert.h, MoeDecodeKernel::kAuto); off: always the tile kernel (as the
  // batch-invariant mode runs). On by default.
  void SetMoeFewExpert(bool on);
  // Where the few-expert kernel runs a 1-4 token step's NVFP4 / INT4 / FP8 routed experts: the
  // whole layer as one fused launch (kernels/moe/moe_few_expert_layer.h: no dispatch, gate_up and
  // down in one persistent kernel, the combine inside; the same bits). Off by default: written in
  // session 17 without a GPU, not yet measured.
  void SetMoeFewExpertLayer(bool on);
  // Where a decode step's routed experts stay on the tile kernel: the tiles of its last wave, when
  // that wave would be less than half full, on the few-expert kernel (MoeExpertsRunParams::
  // wave_tail). On by default (session 25); never in the batch-invariant mode.
  void SetMoeWaveTail(bool on);
  // The NVFP4 / INT4 routed experts' prefill tiles on the SM90 warpgroup-MMA kernel where the
  // device has it (kernels/moe/moe_weight_only_wgmma.cuh); off: the mma.sync kernel (as the
  // batch-invariant mode runs). On by default.
  void SetMoePrefillWgmma(bool on);
  void Phase(const char* name) override;
  std::vector<std::pair<std::string, double>> PhaseTimes();
  void ScratchRelease(uint64_t mark) override;
  absl::Status BeginCapture() override;
  absl::StatusOr<int> EndCapture() override;
  absl::Status LaunchGraph(int graph) override;
  uint64_t memory_epoch() const override;

  cudaStream_t stream() const;
  // Bytes of device memory this backend holds: persistent (weights, pools) and the arena.
  size_t persistent_bytes() const;
  size_t arena_bytes() const;

 private:
  // MoeExperts' body; route: MoeExpertsRunParams::route (the router runs in the call) or nullptr.
  void RunMoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                     const RoutedExperts& experts, const Tensor& shared, Tensor& out,
                     const MoeRouteParams* route);
  // Linears over adjoined weights as one product and a split (SetMergedProjectionRows) where the
  // step's rows and the weights allow; false, with nothing enqueued, where they do not.
  bool MergedLinears(const Tensor& x, std::initializer_list<LinearOut> outs);
  // The fused MLA input kernel (with q's RoPE when q is set, and q's absorption into q_abs
  // when w_kb is set as well) where it takes these tensors; false, with nothing enqueued, where
  // it does not.
  bool FusedMlaInput(const Tensor& kv, const Tensor& norm_weight, float eps,
                     const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                     bool interleaved, KvCacheLayer& cache, Tensor& latent, Tensor& k_rope,
                     Tensor* q, int64_t q_first_col, int q_heads, int64_t q_stride,
                     const Tensor* w_kb = nullptr, Tensor* q_abs = nullptr);
  struct Impl;
  explicit CudaOps(std::unique_ptr<Impl> impl);
  // out = T(x) W^T as one skinny kernel (LinearGemm::RunWithPrologue); false where that does
  // not apply (nothing enqueued: the caller runs the two ops). `what` names the op in errors.
  bool LinearWithPrologue(const Tensor& x, const LinearWeight& w, Tensor& out,
                          const SkinnyPrologueArgs& prologue, const char* what);
  std::unique_ptr<Impl> impl_;
};

// Free and total bytes of the current device (cudaMemGetInfo).
absl::Status CudaMemoryInfo(size_t* free_bytes, size_t* total_bytes);

}  // namespace mlaserve
