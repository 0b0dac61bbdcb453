// The operations the DeepSeek-V3 model is written against (DESIGN.md "One model, two backends").
// The CPU backend implements them with the reference kernels of kernels/; the CUDA backend with
// the GPU kernels. Activations are fp32 [tokens, features] on the backend's device; weights are
// in their checkpoint formats (bf16, fp32, NVFP4).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/mla/kv_cache_format.h"
#include "worker/backend/tensor.h"

namespace mlaserve {

// y = x W^T. Dense: weight bf16/fp32 [out, in]. NVFP4 (ModelOpt): weight U8 [out, in/2] (two
// e2m1 codes per byte, low nibble first), block_scale F8_E4M3 [out, in/16], global_scale =
// weight_scale_2, input_scale kept for kernels that quantize activations.
struct LinearWeight {
  int out_features = 0;
  int in_features = 0;
  Tensor weight;
  Tensor block_scale;
  float global_scale = 1.0f;
  float input_scale = 0.0f;
  bool nvfp4() const { return !block_scale.empty(); }
};

struct ExpertWeights {
  LinearWeight gate;  // [intermediate, hidden]
  LinearWeight up;    // [intermediate, hidden]
  LinearWeight down;  // [hidden, intermediate]
};

// One layer's paged MLA cache: bytes [num_blocks, 64, KvCacheBytesPerToken(format)].
struct KvCacheLayer {
  Tensor pool;
  KvCacheFormat format = KvCacheFormat::kBf16;
  float fp8_scale = 1.0f;
};

// A sequence's part of a step: rows [token_begin, token_begin + num_tokens) of the step's
// activations are its new tokens, at positions context_len .. context_len + num_tokens - 1.
struct SequenceSlice {
  int token_begin = 0;
  int num_tokens = 0;
  int context_len = 0;  // tokens already in the cache before this step
  std::vector<int32_t> block_table;
};

struct MlaShape {
  int heads = 0;  // local heads
  int qk_nope = 0;
  int qk_rope = 0;  // 64
  int v_dim = 0;
  int kv_lora = 0;  // 512
  float softmax_scale = 1.0f;
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

class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;

  // Zero-filled fp32 activation.
  virtual Tensor Activation(std::vector<int64_t> shape) = 0;
  // A device copy of a host tensor (weights, tables); the CPU backend shares it.
  virtual Tensor Upload(const Tensor& host) = 0;
  virtual void CopyToHost(const Tensor& src, void* dst) = 0;

  // out[t] = table[ids[t] - vocab_begin] for ids inside this rank's rows of the table, else 0.
  virtual void Embed(const Tensor& table, int64_t vocab_begin, const std::vector<int32_t>& ids,
                     Tensor& out) = 0;
  // Rows of x: [rows, dim] with dim = weight.numel().
  virtual void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) = 0;
  virtual void Linear(const Tensor& x, const LinearWeight& w, Tensor& out) = 0;
  // out = silu(gate) * up, elementwise.
  virtual void SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // acc += x.
  virtual void Add(const Tensor& x, Tensor& acc) = 0;
  // out[:, :] = x[:, begin : begin + out.dim(1)].
  virtual void Columns(const Tensor& x, int64_t begin, Tensor& out) = 0;
  // Rotates `per_row` vectors of `dim` values in each row of x, the j-th starting at column
  // first_col + j * stride; row r is at positions[r] (transformers' convention, see rope_ref.h).
  virtual void Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
                    const std::vector<int32_t>& positions, const Tensor& inv_freq,
                    float attention_scaling, bool interleaved) = 0;

  // Stores the new tokens' rows (latent [T, 512], rotated k_rope [T, 64]) at cache slots.
  virtual void KvWrite(const Tensor& latent, const Tensor& k_rope,
                       const std::vector<int64_t>& slots, KvCacheLayer& cache) = 0;
  // Naive MLA (prefill of sequences with an empty cache): keys and values decompressed through
  // kv_b (local heads), causal softmax attention in fp32. q: [T, heads, nope + rope] (rope part
  // rotated), latent: [T, 512] (normalised), k_rope: [T, 64] (rotated); out: [T, heads, v].
  virtual void MlaNaive(const MlaShape& shape, const Tensor& q, const Tensor& latent,
                        const Tensor& k_rope, const LinearWeight& kv_b,
                        const std::vector<SequenceSlice>& seqs, Tensor& out) = 0;
  // Absorbed MLA over the paged cache (the new tokens must already be written): q_nope is
  // folded through kv_b's key half into the 512-dim latent space, attention runs against the
  // cached rows with causal masking inside the new tokens, and the output is expanded through
  // kv_b's value half. w_kb: [heads, nope, 512], w_vb: [heads, v, 512] fp32.
  virtual void MlaAbsorbed(const MlaShape& shape, const Tensor& q, const Tensor& w_kb,
                           const Tensor& w_vb, const KvCacheLayer& cache,
                           const std::vector<SequenceSlice>& seqs, Tensor& out) = 0;

  // Router: logits [T, E] fp32, bias [E] or empty -> ids [T, k] (I32), weights [T, k] (F32).
  virtual void MoeRoute(const MoeRouting& routing, const Tensor& logits, const Tensor& bias,
                        Tensor& ids, Tensor& weights) = 0;
  // out = sum over each token's chosen experts that are local ([first_expert, first_expert +
  // experts.size())) of weight * down(silu(gate x) * up x).
  virtual void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                          int first_expert, const std::vector<ExpertWeights>& experts,
                          Tensor& out) = 0;
};

}  // namespace mlaserve
