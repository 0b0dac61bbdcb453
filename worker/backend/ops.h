// The operations the DeepSeek-V3 model is written against (DESIGN.md "One model, two backends").
// The CPU backend implements them with the reference kernels of kernels/ (fp32 activations);
// the CUDA backend with the GPU kernels (bf16 activations, fp32 residual stream and router
// logits, fp32 accumulation inside every kernel). Ops take tensors on the backend's device only:
// the per-step metadata (token ids, positions, cache slots, block tables, sequence offsets) is
// uploaded once per step by BeginStep into a StepTensors that every layer's ops read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/mla/kv_cache_format.h"
#include "worker/backend/step_layout.h"
#include "worker/backend/tensor.h"
#include "worker/model/sampler.h"

namespace mlaserve {

// y = x W^T. Dense: weight bf16/fp32 [out, in]. NVFP4 (ModelOpt): weight U8 [out, in/2] (two
// e2m1 codes per byte, low nibble first), block_scale F8_E4M3 [out, in/16], global_scale =
// weight_scale_2, input_scale kept for kernels that quantize activations. A backend may hold an
// NVFP4 weight in another exact form (the CUDA backend: bf16 e2m1 * block_scale, and
// global_scale applied to the GEMM's output); `nvfp4()` then stays false and `alpha` carries
// the global scale.
// compressed-tensors INT4 (pack-quantized, kernels/linear/int4_group_ref.h), as the loader hands
// routed experts to UploadExperts: int4_packed I32 [out, ceil(int4_in / 8)] and int4_scale (BF16,
// F16 or F32, the checkpoint's dtype) [out, ceil(int4_in / int4_group)], whole rows of the
// checkpoint tensor (int4_in columns); the weight is its columns [int4_col0, int4_col0 + in).
// `weight` is then empty. The CPU backend dequantizes it (exact in fp32); the CUDA backend keeps it
// packed for its INT4 expert GEMM.
// DeepSeek FP8 block (kernels/linear/fp8_block_ref.h), likewise for routed experts: fp8_codes
// F8_E4M3 [out, in], the shard's window of the checkpoint tensor at (fp8_origin_row,
// fp8_origin_col), and fp8_scale_inv F32, the tensor's whole grid of weight_scale_inv (one per
// fp8_block_rows x fp8_block_cols block); `weight` empty. The CPU backend dequantizes it
// (fp32(e4m3 * s), exact as DequantizeFp8Block defines it); the CUDA backend keeps it in FP8 for
// its FP8 expert GEMM. The loader hands DeepSeek's other FP8 projections over the same way (but
// kv_b, which MLA reads as a dense weight): UploadLinear on the CUDA backend dequantizes them to a
// bf16 `weight` (measured faster than its FP8 kernels for projections: CudaOps::UploadLinear).
struct LinearWeight {
  int out_features = 0;
  int in_features = 0;
  Tensor weight;
  Tensor block_scale;
  float global_scale = 1.0f;
  float input_scale = 0.0f;
  float alpha = 1.0f;  // output multiplier of a dense weight (see above)
  Tensor int4_packed, int4_scale;
  int64_t int4_in = 0, int4_col0 = 0;
  int int4_group = 0;
  Tensor fp8_codes, fp8_scale_inv;
  int64_t fp8_origin_row = 0, fp8_origin_col = 0;
  int fp8_block_rows = 0, fp8_block_cols = 0;
  bool nvfp4() const { return !block_scale.empty(); }
  bool int4() const { return !int4_packed.empty(); }
  bool fp8() const { return !fp8_codes.empty(); }
};

struct ExpertWeights {
  LinearWeight gate;  // [intermediate, hidden]
  LinearWeight up;    // [intermediate, hidden]
  LinearWeight down;  // [hidden, intermediate]
};

// One layer's local routed experts as the backend holds them.
struct RoutedExperts {
  int first_expert = 0;
  int count = 0;
  int hidden = 0;
  int intermediate = 0;
  std::vector<ExpertWeights> weights;  // CPU backend: the weights, as LinearWeights
  std::shared_ptr<void> device;        // CUDA backend: its own layout
  size_t bytes = 0;                    // device bytes held
};

// One layer's paged MLA cache: bytes [num_blocks, 64, KvCacheBytesPerToken(format)].
struct KvCacheLayer {
  Tensor pool;
  KvCacheFormat format = KvCacheFormat::kBf16;
  float fp8_scale = 1.0f;
};

// The step's metadata on the backend's device. Shapes as in StepLayout (canonical order).
struct StepTensors {
  const StepLayout* layout = nullptr;  // the host copy
  Tensor tokens;                       // I32 [T]
  Tensor positions;                    // I32 [T]
  Tensor slots;                        // I64 [T]
  Tensor logits_rows;                  // I32 [R]
  Tensor block_tables;                 // I32 [S, max_blocks]
  Tensor seq_lens;                     // I32 [S]
  Tensor context_lens;                 // I32 [S]
  Tensor prefill_q_begin;              // I32 [P + 1]
  Tensor prefill_kv_begin;             // I32 [P + 1]
  Tensor attend_lens;                  // I32 [S] under DCP (StepLayout::attend_lens), else empty
};

struct MlaShape {
  int heads = 0;  // local heads
  int qk_nope = 0;
  int qk_rope = 0;  // 64
  int v_dim = 0;
  int kv_lora = 0;  // 512
  float softmax_scale = 1.0f;
};

// Decode context parallelism (ModelOptions::dcp): `ranks` ranks split the cache by blocks and
// the heads as ever; each attends with every head over its own rows. Heads travel between ranks
// in slots of heads_per_rank per rank (ceil(heads / ranks); a rank with fewer pads with zeros).
struct DcpShape {
  int ranks = 1;
  int rank = 0;
  int heads_per_rank = 0;
};

struct MoeRouting {
  int num_experts = 0;
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  bool softmax_scoring = false;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// The sampling of one step: one entry per logits row.
struct SamplingBatch {
  struct Row {
    const SequenceSampling* params = nullptr;
    const std::vector<int32_t>* history = nullptr;  // prompt then output tokens so far
    int prompt_len = 0;
    int generated = 0;  // output tokens so far (the step index of the random draw)
  };
  std::vector<Row> rows;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  // The dtype of activations between ops (F32 on the CPU, BF16 on the GPU).
  virtual DType activation_dtype() const = 0;

  // Starts a step: per-step scratch from earlier steps is released, and the layout's arrays
  // are uploaded (one copy) into `step`. Valid until the next BeginStep.
  virtual absl::Status BeginStep(const StepLayout& layout, StepTensors* step) = 0;
  // Step scratch (contents undefined on the GPU, zero on the CPU); freed at the next BeginStep.
  virtual Tensor Activation(std::vector<int64_t> shape, DType dtype) = 0;
  Tensor Activation(std::vector<int64_t> shape) {
    return Activation(std::move(shape), activation_dtype());
  }
  // Zero-filled memory held as long as the tensor (KV pools).
  virtual absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) = 0;
  // A device copy of a host tensor (weights, tables). The CPU backend widens BF16/F16 to F32
  // and shares everything else; the CUDA backend keeps the dtype.
  virtual absl::StatusOr<Tensor> Upload(const Tensor& host) = 0;
  // A linear weight from host tensors in the checkpoint's format.
  virtual absl::StatusOr<LinearWeight> UploadLinear(const LinearWeight& host) = 0;
  // One layer's local experts from host tensors in the checkpoint's format (first_expert is the
  // global id of experts[0]).
  virtual absl::StatusOr<RoutedExperts> UploadExperts(int first_expert, int num_routed_experts,
                                                      const std::vector<ExpertWeights>& host) = 0;
  // Waits for the step's work and copies src into host memory (src.nbytes() bytes).
  virtual absl::Status CopyToHost(const Tensor& src, void* dst) = 0;
  // Waits for the device's work; the first error of an asynchronous op surfaces here.
  virtual absl::Status Synchronize() = 0;

  // out[t] (fp32 residual [T, hidden]) = table[tokens[t] - vocab_begin] for ids inside this
  // rank's rows of the table, else 0.
  virtual void Embed(const Tensor& table, int64_t vocab_begin, const StepTensors& step,
                     Tensor& out) = 0;
  // out (activation dtype) = rmsnorm(x) * weight, rows of x: [rows, dim] with dim = weight.numel();
  // x is an activation or the fp32 residual.
  virtual void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) = 0;
  // residual (fp32) += delta; out = rmsnorm(residual) * weight.
  virtual void AddRmsNorm(const Tensor& delta, Tensor& residual, const Tensor& weight, float eps,
                          Tensor& out) = 0;
  // out = x W^T (out's dtype: activation or F32, e.g. router logits, lm_head).
  virtual void Linear(const Tensor& x, const LinearWeight& w, Tensor& out) = 0;
  // Several projections of one x (q_a and kv_a; a layer's gate, up and router): *outs[i] =
  // x W_i^T, as Linear on each (the default). The CUDA backend runs up to 4 of them as one kernel
  // at decode batches of up to 4 rows.
  struct LinearOut {
    const LinearWeight* w;
    Tensor* out;
  };
  virtual void Linears(const Tensor& x, std::initializer_list<LinearOut> outs) {
    for (const LinearOut& o : outs) Linear(x, *o.w, *o.out);
  }
  // Places dense weights that always project the same x in one Linears call, in this order (q_a
  // and kv_a; a layer's gate and up), side by side in the backend's memory, so that Linears may run
  // them as one product. Shapes, values and results stay as they were; a weight the backend cannot
  // place (another format, another input width) leaves all of them where they are. The default
  // does nothing.
  virtual absl::Status AdjoinLinears(std::initializer_list<LinearWeight*> weights) {
    (void)weights;
    return absl::OkStatus();
  }
  // out = silu(gate) * up, elementwise.
  virtual void SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // An op and the projection that reads its output, as one call (the defaults are the two ops;
  // the CUDA backend can run them as one kernel at decode batches of up to 4 rows,
  // CudaOps::SetFusedPrologues). x / gate may hold the normalized / activated rows afterwards,
  // or their inputs still: callers read only `out`.
  //   out = (RmsNorm(x) * norm_weight) W^T
  virtual void RmsNormLinear(Tensor& x, const Tensor& norm_weight, float eps,
                             const LinearWeight& w, Tensor& out) {
    RmsNorm(x, norm_weight, eps, x);
    Linear(x, w, out);
  }
  //   out = (silu(gate) * up) W^T
  virtual void SiluMulLinear(Tensor& gate, const Tensor& up, const LinearWeight& w, Tensor& out) {
    SiluMul(gate, up, gate);
    Linear(gate, w, out);
  }
  // out[:, :] = x[:, begin : begin + out.dim(1)].
  virtual void Columns(const Tensor& x, int64_t begin, Tensor& out) = 0;
  // dst[:, dst_col : dst_col + cols] = src[:, src_col : src_col + cols] (same row count).
  virtual void CopyColumns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                           int64_t cols) = 0;
  // out[i] = x[step.logits_rows[i]] (the rows whose logits are wanted).
  virtual void LogitsRows(const Tensor& x, const StepTensors& step, Tensor& out) = 0;
  // Rotates `per_row` vectors of `dim` values in each row of x, the j-th starting at column
  // first_col + j * stride; row r is at step.positions[r] (transformers' convention, rope_ref.h).
  virtual void Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
                    const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                    bool interleaved) = 0;

  // Stores the new tokens' rows (latent [T, 512], rotated k_rope [T, 64]) at step.slots.
  virtual void KvWrite(const Tensor& latent, const Tensor& k_rope, const StepTensors& step,
                       KvCacheLayer& cache) = 0;
  // MLA's input from kv_a's output kv [T, kv_lora + rope]: latent [T, kv_lora] =
  // RmsNorm(kv[:, :kv_lora]) * norm_weight, k_rope [T, rope] = kv[:, kv_lora:] rotated (one
  // vector a row), both stored to the cache (KvWrite). This default is those five ops; the CUDA
  // backend can run them as one kernel (CudaOps::SetFusedMlaInput).
  virtual void MlaKvPrep(const Tensor& kv, const Tensor& norm_weight, float eps,
                         const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                         bool interleaved, KvCacheLayer& cache, Tensor& latent, Tensor& k_rope) {
    const int64_t lora = latent.numel() / std::max<int64_t>(latent.dim(0), 1);
    const int rope = static_cast<int>(k_rope.numel() / std::max<int64_t>(k_rope.dim(0), 1));
    Columns(kv, 0, latent);
    RmsNorm(latent, norm_weight, eps, latent);
    Columns(kv, lora, k_rope);
    Rope(k_rope, 0, 1, rope, rope, step, inv_freq, attention_scaling, interleaved);
    KvWrite(latent, k_rope, step, cache);
  }
  // MlaKvPrep, then q's RoPE: Rope(q, q_first_col, q_heads, q_stride, rope, ...) with rope =
  // k_rope's width, the same positions, frequencies and scaling. One op so that the CUDA backend
  // can run both in one launch (CudaOps::SetMlaQFusion); this default is the two ops.
  // w_kb (MlaDecode's, or empty) lets a backend also absorb q for MlaDecode in the same launch
  // (CudaOps::SetMlaAbsorbFusion, decode steps of a few rows): it then sets q_abs to
  // [T, q_heads, 576] with dims 0..511 of each head = q_nope W_kb[h] (q_nope: the q_first_col
  // values before each head's RoPE dims), for MlaDecode's q_abs. Otherwise, as in this default,
  // q_abs is left empty and MlaDecode absorbs q itself.
  virtual void MlaInputPrep(const Tensor& kv, const Tensor& norm_weight, float eps,
                            const StepTensors& step, const Tensor& inv_freq,
                            float attention_scaling, bool interleaved, KvCacheLayer& cache,
                            Tensor& latent, Tensor& k_rope, Tensor& q, int64_t q_first_col,
                            int q_heads, int64_t q_stride, const Tensor& w_kb, Tensor& q_abs) {
    (void)w_kb;
    (void)q_abs;
    MlaKvPrep(kv, norm_weight, eps, step, inv_freq, attention_scaling, interleaved, cache, latent,
              k_rope);
    const int rope = static_cast<int>(k_rope.numel() / std::max<int64_t>(k_rope.dim(0), 1));
    Rope(q, q_first_col, q_heads, q_stride, rope, step, inv_freq, attention_scaling, interleaved);
  }
  // The prefill group's attention (step.layout->prefill), naive form: each sequence's keys and
  // values are its cached prefix (read back from `cache`) followed by its new tokens (latent,
  // k_rope rows of this step), decompressed through kv_b (local heads); causal softmax
  // attention. q: [T, heads, nope + rope] (rope part rotated), latent: [T, 512] (normalised),
  // k_rope: [T, 64] (rotated); writes the group's rows of out: [T, heads, v].
  virtual void MlaPrefill(const MlaShape& shape, const Tensor& q, const Tensor& latent,
                          const Tensor& k_rope, const LinearWeight& kv_b, const KvCacheLayer& cache,
                          const StepTensors& step, Tensor& out) = 0;
  // Decode group `group` of step.layout->decode, absorbed form over the paged cache (the new
  // tokens already written): q_nope folded through kv_b's key half into the 512-dim latent
  // space, attention against the cached rows (causal inside the new tokens), output expanded
  // through kv_b's value half. w_kb: [heads, nope, 512], w_vb: [heads, v, 512]. Writes the
  // group's rows of out. q_abs: empty, or MlaInputPrep's absorbed q for every row of the step
  // (dims 0..511 of each head; the RoPE dims are q's), which the backend may use instead of
  // absorbing q itself (the same values up to fp32 summation order).
  virtual void MlaDecode(const MlaShape& shape, const Tensor& q, const Tensor& w_kb,
                         const Tensor& w_vb, const KvCacheLayer& cache, const StepTensors& step,
                         int group, Tensor& out, const Tensor& q_abs) = 0;

  // The absorbed attention in three parts, for decode context parallelism (the model gathers
  // q_abs and exchanges the partial outputs between the parts; StepLayoutOptions::dcp_size).
  // q_abs [T, heads_per_rank, 576] = (q_nope W_kb[h] | q_rope) of the local heads (shape.heads),
  // the slots past them zero.
  virtual void MlaAbsorb(const MlaShape& shape, const DcpShape& dcp, const Tensor& q,
                         const Tensor& w_kb, Tensor& q_abs) = 0;
  // Decode group `group` (one-token sequences) against this rank's cache rows (step.attend_lens
  // keys each): q_all [ranks, T, heads_per_rank, 576] (every rank's q_abs) -> latent [ranks, T,
  // heads_per_rank, 512] in the activation dtype (fp32 on the CPU, bf16 on GPUs), normalised
  // over this rank's keys, and lse [ranks, T, heads_per_rank] fp32 (natural log; -inf and zeros
  // where this rank has no keys).
  virtual void MlaAttend(const MlaShape& shape, const DcpShape& dcp, const Tensor& q_all,
                         const KvCacheLayer& cache, const StepTensors& step, int group,
                         Tensor& latent, Tensor& lse) = 0;
  // The local heads' output out [T, heads, v] from every rank's partials for them (latent_all
  // [ranks, T, heads_per_rank, 512] in the activation dtype, lse_all [ranks, T, heads_per_rank]
  // fp32, by source rank: the all-to-all of MlaAttend's outputs): merged by log-sum-exp,
  // expanded through w_vb [heads, v, 512].
  virtual void MlaMergeExpand(const MlaShape& shape, const DcpShape& dcp, const Tensor& latent_all,
                              const Tensor& lse_all, const Tensor& w_vb, Tensor& out) = 0;

  // Router: logits [T, E] fp32, bias [E] or empty -> ids [T, k] (I32), weights [T, k] (F32).
  virtual void MoeRoute(const MoeRouting& routing, const Tensor& logits, const Tensor& bias,
                        Tensor& ids, Tensor& weights) = 0;
  // out = sum over each token's chosen experts that are local of weight * down(silu(gate x) *
  // up x), plus `shared` (the shared experts' output) when it is not empty.
  virtual void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                          const RoutedExperts& experts, const Tensor& shared, Tensor& out) = 0;
  // MoeRoute, the phase "moe.experts" (Phase below), then MoeExperts, as the model's MoE layer
  // calls them: a backend may fuse the router with the experts' dispatch (CudaOps::
  // SetMoeRouteDispatchFusion). ids and weights end as MoeRoute leaves them.
  virtual void MoeRouteExperts(const MoeRouting& routing, const Tensor& logits, const Tensor& bias,
                               const Tensor& x, const RoutedExperts& experts, const Tensor& shared,
                               Tensor& ids, Tensor& weights, Tensor& out) {
    MoeRoute(routing, logits, bias, ids, weights);
    Phase("moe.experts");
    MoeExperts(x, ids, weights, experts, shared, out);
  }

  // Samples one token per row of logits ([R, vocab] fp32); only ids and logprobs reach the host.
  virtual absl::Status Sample(const Tensor& logits, const SamplingBatch& batch,
                              std::vector<SampledOutput>* out) = 0;

  // Graphs (CUDA graphs on the GPU): the ops issued between BeginCapture and EndCapture are
  // recorded, not run; LaunchGraph replays them with whatever the step buffers then hold. A
  // graph bakes in the addresses of the step arena and the step buffers: memory_epoch() changes
  // whenever either moves, and graphs of an older epoch must be captured again. Backends without
  // graphs say so in SupportsGraphs and return Unimplemented.
  // Side branches: the ops issued between BeginSideBranch and EndSideBranch may run beside the
  // ops issued after EndSideBranch, until an op that reads the branch's results: MoeExperts
  // (whose `shared` input a branch may compute) waits for the branch before it reads it, and so
  // does every op that copies to the host, a step or a capture's end. A backend that says false
  // in SideBranches runs everything in order and the model issues the ops in its plain order.
  virtual bool SideBranches() const { return false; }
  virtual void BeginSideBranch() {}
  virtual void EndSideBranch() {}

  virtual bool SupportsGraphs() const { return false; }
  virtual absl::Status BeginCapture() {
    return absl::UnimplementedError("no graphs on this backend");
  }
  virtual absl::StatusOr<int> EndCapture() {
    return absl::UnimplementedError("no graphs on this backend");
  }
  virtual absl::Status LaunchGraph(int graph) {
    (void)graph;
    return absl::UnimplementedError("no graphs on this backend");
  }
  virtual uint64_t memory_epoch() const { return 0; }

  // Batch invariance (the deterministic mode, issue 23): when on, every op computes a row (a
  // token, a sequence's attention) with the same arithmetic in the same order whatever the
  // other rows of the step are and however many there are: no algorithm chosen by the row
  // count, no split sizes derived from the batch. The CPU backend always is (its loops are per
  // row); the GPU backend trades speed for it (bench/RESULTS.md measures the cost).
  // Profiling ranges: the ops issued from here to the next Phase call belong to phase `name` (a
  // string literal). Backends that can time their work (CudaOps::SetPhaseTiming) add it up per
  // phase; the others ignore it.
  virtual void Phase(const char* name) { (void)name; }

  // Scratch scopes: activations made after ScratchMark() are dead once ScratchRelease(mark) is
  // called, and their memory is reused by later ones (in stream order, so the reuse is safe
  // while earlier ops still run). The model releases each layer's scratch at the layer's end:
  // without it a step's scratch grows with the layer count (a 2048-token prefill of one
  // Kimi-K2.5 rank's 61 layers asked for 25.8 GB, mostly MoE outputs). Backends whose
  // activations own their memory ignore both.
  virtual uint64_t ScratchMark() { return 0; }
  virtual void ScratchRelease(uint64_t mark) { (void)mark; }

  // A batch-invariant GPU backend's per-token attention may hold this much scratch for split-KV
  // partials (the memory plan reserves it in the deterministic mode).
  static constexpr size_t kPerTokenAttentionWorkspaceBytes = size_t{256} << 20;
  virtual absl::Status SetBatchInvariant(bool on) {
    (void)on;
    return absl::OkStatus();
  }
  // Whether the fp8 caches' MLA decode may run on e4m3 tensor cores where the backend has such a
  // kernel (the FP8 tensor-core form MlaDecodeRef emulates; on by default). Off: the exact form.
  // The CPU backend's attention is always the exact form.
  virtual void SetMlaFp8TensorCores(bool on) { (void)on; }
};

}  // namespace mlaserve
