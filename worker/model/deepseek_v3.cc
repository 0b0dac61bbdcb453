#include "worker/model/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/moe/nvfp4_ref.h"

namespace mlaserve {

ShardRange ShardRange::Of(int total, int rank, int world) {
  const int base = total / world, rem = total % world;
  return {rank * base + std::min(rank, rem), base + (rank < rem ? 1 : 0)};
}

struct DeepseekV3Model::Layer {
  Tensor input_norm, post_norm;
  // Attention (local heads).
  LinearWeight q_a, q_b, q_proj, kv_a, kv_b, o_proj;
  Tensor q_a_norm, kv_a_norm;
  Tensor w_kb, w_vb;  // [heads, nope, 512], [heads, v, 512] fp32, from kv_b
  // MLP: dense MLP or shared experts (local slice of the intermediate dimension).
  bool moe = false;
  bool has_mlp = false;  // a dense MLP, or shared experts present
  LinearWeight gate, up, down;
  LinearWeight router;
  Tensor router_bias;
  int first_expert = 0;
  std::vector<ExpertWeights> experts;
  KvCacheLayer kv;
};

DeepseekV3Model::DeepseekV3Model(Ops& ops, Communicator& comm) : ops_(ops), comm_(comm) {}
DeepseekV3Model::~DeepseekV3Model() = default;

namespace {

std::string Shape(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

bool IsDenseFloat(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

// Reads rows [r0, r0 + nr) and columns [c0, c0 + nc) of a 2-D dense tensor into host memory in
// its own dtype: a rank touches only the pages of its shard.
Tensor ReadSlice(const TensorRef& ref, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const size_t esize = DTypeBits(ref.info->dtype) / 8;
  const int64_t cols = ref.info->shape.size() == 2 ? ref.info->shape[1] : 1;
  Tensor out = Tensor::Host(ref.info->dtype, ref.info->shape.size() == 2
                                                 ? std::vector<int64_t>{nr, nc}
                                                 : std::vector<int64_t>{nr});
  for (int64_t r = 0; r < nr; ++r) {
    std::memcpy(out.data<uint8_t>() + r * nc * esize,
                ref.bytes.data() + ((r0 + r) * cols + c0) * esize, nc * esize);
  }
  return out;
}

Tensor ToF32(const Tensor& host) {
  if (host.dtype() == DType::kF32) return host;
  Tensor out = Tensor::Host(DType::kF32, host.shape());
  DecodeFloats(host.dtype(), host.data<void>(), static_cast<size_t>(host.numel()), out.data<float>());
  return out;
}

float ScalarF32(const TensorRef& ref) {
  float v;
  std::memcpy(&v, ref.bytes.data(), 4);
  return v;
}

class WeightReader {
 public:
  WeightReader(const Checkpoint& ckpt, std::string prefix, Ops& ops, size_t& bytes,
               const QuantConfig* quant)
      : ckpt_(ckpt), prefix_(std::move(prefix)), ops_(ops), bytes_(bytes), quant_(quant) {}

  std::string Name(const std::string& n) const { return prefix_ + n; }
  bool Has(const std::string& n) const { return ckpt_.Has(Name(n)); }

  absl::StatusOr<TensorRef> Dense(const std::string& n, std::vector<int64_t> shape) const {
    auto ref = ckpt_.Get(Name(n));
    if (!ref.ok()) return ref.status();
    if (!IsDenseFloat(ref->info->dtype) || ref->info->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", Name(n), ": expected BF16, F16 or F32 ",
                                                     Shape(shape), ", found ", ref->info->Describe()));
    }
    return ref;
  }

  // 1-D vector as fp32 (norm weights, router bias).
  absl::StatusOr<Tensor> Vector(const std::string& n, int64_t dim) {
    auto ref = Dense(n, {dim});
    if (!ref.ok()) return ref.status();
    Tensor t = ops_.Upload(ToF32(ReadSlice(*ref, 0, dim, 0, 1)));
    bytes_ += t.nbytes();
    return t;
  }

  // Rows [rows.begin, +count) and columns [cols.begin, +count) of module.weight: dense, or NVFP4
  // when the checkpoint has module.weight_scale (ModelOpt layout).
  absl::StatusOr<LinearWeight> Linear(const std::string& module, int64_t out, int64_t in,
                                      ShardRange rows, ShardRange cols) {
    LinearWeight w;
    w.out_features = rows.count;
    w.in_features = cols.count;
    const std::string wn = module + ".weight";
    if (Has(module + ".weight_scale")) {
      if (quant_ != nullptr && quant_->IsExcluded(module)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", Name(module + ".weight_scale"), ": module ", module,
            " is NVFP4 in the checkpoint but excluded from quantization by its quantization config"));
      }
      if (in % 16 != 0 || cols.begin % 16 != 0 || cols.count % 16 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", Name(wn), ": NVFP4 columns ", cols.begin, "+", cols.count,
            " do not fall on 16-value scale blocks; choose a rank count that splits ", in,
            " into multiples of 16"));
      }
      auto packed = ckpt_.Get(Name(wn), DType::kU8, {out, in / 2});
      if (!packed.ok()) return packed.status();
      auto scale = ckpt_.Get(Name(module + ".weight_scale"), DType::kF8E4M3, {out, in / 16});
      if (!scale.ok()) return scale.status();
      auto scale2 = ckpt_.Get(Name(module + ".weight_scale_2"));
      if (!scale2.ok()) return scale2.status();
      if (scale2->info->dtype != DType::kF32 || scale2->info->NumElements() != 1) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", Name(module + ".weight_scale_2"),
                                                       ": expected F32 scalar, found ", scale2->info->Describe()));
      }
      w.global_scale = ScalarF32(*scale2);
      if (Has(module + ".input_scale")) {
        auto in_scale = ckpt_.Get(Name(module + ".input_scale"));
        if (!in_scale.ok()) return in_scale.status();
        if (in_scale->info->dtype != DType::kF32 || in_scale->info->NumElements() != 1) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", Name(module + ".input_scale"),
                                                         ": expected F32 scalar, found ", in_scale->info->Describe()));
        }
        w.input_scale = ScalarF32(*in_scale);
      }
      w.weight = ops_.Upload(ReadSlice(*packed, rows.begin, rows.count, cols.begin / 2, cols.count / 2));
      w.block_scale = ops_.Upload(ReadSlice(*scale, rows.begin, rows.count, cols.begin / 16, cols.count / 16));
      bytes_ += w.weight.nbytes() + w.block_scale.nbytes();
      return w;
    }
    auto ref = Dense(wn, {out, in});
    if (!ref.ok()) return ref.status();
    w.weight = ops_.Upload(ReadSlice(*ref, rows.begin, rows.count, cols.begin, cols.count));
    bytes_ += w.weight.nbytes();
    return w;
  }

  // kv_b rows of the local heads as fp32 on the host: [heads, nope + v, 512].
  absl::StatusOr<Tensor> KvBHost(const std::string& module, int64_t all_heads, ShardRange heads,
                                 int nope, int v, int kv_lora) {
    const int64_t per = nope + v;
    if (Has(module + ".weight_scale")) {
      auto lw = Linear(module, all_heads * per, kv_lora, {heads.begin * static_cast<int>(per), heads.count * static_cast<int>(per)},
                       {0, kv_lora});
      if (!lw.ok()) return lw.status();
      // Linear() may have uploaded to a device: read the packed bytes again from the file.
      auto packed = ckpt_.Get(Name(module + ".weight"));
      auto scale = ckpt_.Get(Name(module + ".weight_scale"));
      Tensor out = Tensor::Host(DType::kF32, {heads.count, per, kv_lora});
      DequantizeNvfp4(packed->bytes.data() + heads.begin * per * (kv_lora / 2),
                      scale->bytes.data() + heads.begin * per * (kv_lora / 16), lw->global_scale,
                      static_cast<int>(heads.count * per), kv_lora, out.data<float>());
      return out;
    }
    auto ref = Dense(module + ".weight", {all_heads * per, kv_lora});
    if (!ref.ok()) return ref.status();
    Tensor t = ToF32(ReadSlice(*ref, heads.begin * per, heads.count * per, 0, kv_lora));
    return t.Reshaped({heads.count, per, kv_lora});
  }

  Ops& ops() { return ops_; }
  size_t& bytes() { return bytes_; }

 private:
  const Checkpoint& ckpt_;
  std::string prefix_;
  Ops& ops_;
  size_t& bytes_;
  const QuantConfig* quant_;  // exclude lists to honour; null for unquantized checkpoints
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeepseekV3Model>> DeepseekV3Model::Load(const std::string& folder,
                                                                       const ModelOptions& options,
                                                                       Ops& ops, Communicator& comm) {
  auto config = LoadModelConfig(folder);
  if (!config.ok()) return config.status();
  if (config->quant.method == QuantConfig::Method::kFp8Block) {
    return absl::UnimplementedError(absl::StrCat(
        folder, ": DeepSeek's FP8 block-quantized weights are not served; use the BF16 or NVFP4 "
                "(ModelOpt) checkpoint, or quantize a BF16 one with mlaserve-quantize"));
  }
  if (config->kv_lora_rank != kMlaLatentDim || config->qk_rope_head_dim != kMlaRopeDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        folder, ": kv_lora_rank ", config->kv_lora_rank, " and qk_rope_head_dim ",
        config->qk_rope_head_dim, " are not the 512 and 64 of DeepSeek-V2/V3 and Kimi models, "
        "which the MLA cache formats are built for"));
  }
  auto ckpt = Checkpoint::Open(folder);
  if (!ckpt.ok()) return ckpt.status();
  std::unique_ptr<DeepseekV3Model> m(new DeepseekV3Model(ops, comm));
  m->config_ = *std::move(config);
  m->options_ = options;
  if (auto s = m->LoadWeights(*ckpt); !s.ok()) return s;
  return m;
}

absl::Status DeepseekV3Model::LoadWeights(const Checkpoint& ckpt) {
  const ModelConfig& c = config_;
  const int rank = comm_.rank(), world = comm_.size();
  if (c.num_attention_heads < world) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split ", c.num_attention_heads,
                                                   " attention heads over ", world, " ranks"));
  }
  heads_ = ShardRange::Of(c.num_attention_heads, rank, world);
  vocab_ = ShardRange::Of(c.vocab_size, rank, world);
  dense_inter_ = ShardRange::Of(c.intermediate_size, rank, world);
  shared_inter_ = ShardRange::Of(c.moe_intermediate_size * c.n_shared_experts, rank, world);
  if (options_.moe == MoeParallelism::kExpert) {
    experts_ = ShardRange::Of(c.n_routed_experts, rank, world);
    expert_inter_ = {0, c.moe_intermediate_size};
  } else {
    experts_ = {0, c.n_routed_experts};
    expert_inter_ = ShardRange::Of(c.moe_intermediate_size, rank, world);
  }
  mla_ = {heads_.count, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank,
          static_cast<float>(c.SoftmaxScale())};
  routing_ = {c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
              c.softmax_scoring, c.norm_topk_prob, c.routed_scaling_factor};
  {
    std::vector<float> inv = c.RopeInvFreq();
    Tensor t = Tensor::Host(DType::kF32, {static_cast<int64_t>(inv.size())});
    std::copy(inv.begin(), inv.end(), t.data<float>());
    inv_freq_ = ops_.Upload(t);
    rope_scaling_ = static_cast<float>(c.RopeAttentionScaling());
  }

  WeightReader r(ckpt, c.tensor_prefix, ops_, weight_bytes_,
                 c.quant.method == QuantConfig::Method::kNvfp4 ? &c.quant : nullptr);
  const int64_t H = c.hidden_size;
  {
    auto emb = r.Dense("model.embed_tokens.weight", {c.vocab_size, H});
    if (!emb.ok()) return emb.status();
    embed_ = ops_.Upload(ReadSlice(*emb, vocab_.begin, vocab_.count, 0, H));
    weight_bytes_ += embed_.nbytes();
  }
  auto norm = r.Vector("model.norm.weight", H);
  if (!norm.ok()) return norm.status();
  final_norm_ = *norm;
  {
    const std::string head = c.tie_word_embeddings && !r.Has("lm_head.weight")
                                 ? "model.embed_tokens" : "lm_head";
    auto lm = r.Linear(head, c.vocab_size, H, vocab_, {0, static_cast<int>(H)});
    if (!lm.ok()) return lm.status();
    lm_head_ = *lm;
  }

  const int qk = c.qk_head_dim();
  const ShardRange all_h{0, static_cast<int>(H)};
  const ShardRange q_rows{heads_.begin * qk, heads_.count * qk};
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    auto layer = std::make_unique<Layer>();
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::string a = p + "self_attn.";
    auto set_vec = [&](Tensor& dst, const std::string& n, int64_t dim) -> absl::Status {
      auto v = r.Vector(n, dim);
      if (!v.ok()) return v.status();
      dst = *v;
      return absl::OkStatus();
    };
    auto set_lin = [&](LinearWeight& dst, const std::string& n, int64_t out, int64_t in,
                       ShardRange rows, ShardRange cols) -> absl::Status {
      auto w = r.Linear(n, out, in, rows, cols);
      if (!w.ok()) return w.status();
      dst = *w;
      return absl::OkStatus();
    };
#define MLASERVE_TRY(expr)            \
  if (auto _s = (expr); !_s.ok()) { \
    return _s;                        \
  }
    MLASERVE_TRY(set_vec(layer->input_norm, p + "input_layernorm.weight", H));
    MLASERVE_TRY(set_vec(layer->post_norm, p + "post_attention_layernorm.weight", H));
    if (c.q_lora_rank > 0) {
      MLASERVE_TRY(set_lin(layer->q_a, a + "q_a_proj", c.q_lora_rank, H, {0, c.q_lora_rank}, all_h));
      MLASERVE_TRY(set_vec(layer->q_a_norm, a + "q_a_layernorm.weight", c.q_lora_rank));
      MLASERVE_TRY(set_lin(layer->q_b, a + "q_b_proj", int64_t{c.num_attention_heads} * qk,
                           c.q_lora_rank, q_rows, {0, c.q_lora_rank}));
    } else {
      MLASERVE_TRY(set_lin(layer->q_proj, a + "q_proj", int64_t{c.num_attention_heads} * qk, H,
                           q_rows, all_h));
    }
    const int kv_a_rows = c.kv_lora_rank + c.qk_rope_head_dim;
    MLASERVE_TRY(set_lin(layer->kv_a, a + "kv_a_proj_with_mqa", kv_a_rows, H, {0, kv_a_rows}, all_h));
    MLASERVE_TRY(set_vec(layer->kv_a_norm, a + "kv_a_layernorm.weight", c.kv_lora_rank));
    const int per = c.qk_nope_head_dim + c.v_head_dim;
    MLASERVE_TRY(set_lin(layer->kv_b, a + "kv_b_proj", int64_t{c.num_attention_heads} * per,
                         c.kv_lora_rank, {heads_.begin * per, heads_.count * per},
                         {0, c.kv_lora_rank}));
    {
      auto kvb = r.KvBHost(a + "kv_b_proj", c.num_attention_heads, heads_, c.qk_nope_head_dim,
                           c.v_head_dim, c.kv_lora_rank);
      if (!kvb.ok()) return kvb.status();
      Tensor kb = Tensor::Host(DType::kF32, {heads_.count, c.qk_nope_head_dim, c.kv_lora_rank});
      Tensor vb = Tensor::Host(DType::kF32, {heads_.count, c.v_head_dim, c.kv_lora_rank});
      for (int h = 0; h < heads_.count; ++h) {
        const float* src = kvb->data<float>() + static_cast<int64_t>(h) * per * c.kv_lora_rank;
        std::copy(src, src + c.qk_nope_head_dim * c.kv_lora_rank,
                  kb.data<float>() + static_cast<int64_t>(h) * c.qk_nope_head_dim * c.kv_lora_rank);
        std::copy(src + c.qk_nope_head_dim * c.kv_lora_rank, src + per * c.kv_lora_rank,
                  vb.data<float>() + static_cast<int64_t>(h) * c.v_head_dim * c.kv_lora_rank);
      }
      layer->w_kb = ops_.Upload(kb);
      layer->w_vb = ops_.Upload(vb);
      weight_bytes_ += kb.nbytes() + vb.nbytes();
    }
    MLASERVE_TRY(set_lin(layer->o_proj, a + "o_proj", H, int64_t{c.num_attention_heads} * c.v_head_dim,
                         all_h, {heads_.begin * c.v_head_dim, heads_.count * c.v_head_dim}));

    layer->moe = c.IsMoeLayer(i);
    const std::string mlp = p + "mlp.";
    if (!layer->moe) {
      layer->has_mlp = true;
      const ShardRange in_rows = dense_inter_;
      MLASERVE_TRY(set_lin(layer->gate, mlp + "gate_proj", c.intermediate_size, H, in_rows, all_h));
      MLASERVE_TRY(set_lin(layer->up, mlp + "up_proj", c.intermediate_size, H, in_rows, all_h));
      MLASERVE_TRY(set_lin(layer->down, mlp + "down_proj", H, c.intermediate_size, all_h, in_rows));
    } else {
      if (c.n_shared_experts > 0 && shared_inter_.count > 0) {
        layer->has_mlp = true;
        const int si = c.moe_intermediate_size * c.n_shared_experts;
        const std::string se = mlp + "shared_experts.";
        MLASERVE_TRY(set_lin(layer->gate, se + "gate_proj", si, H, shared_inter_, all_h));
        MLASERVE_TRY(set_lin(layer->up, se + "up_proj", si, H, shared_inter_, all_h));
        MLASERVE_TRY(set_lin(layer->down, se + "down_proj", H, si, all_h, shared_inter_));
      }
      MLASERVE_TRY(set_lin(layer->router, mlp + "gate", c.n_routed_experts, H,
                           {0, c.n_routed_experts}, all_h));
      if (c.has_score_correction_bias) {
        MLASERVE_TRY(set_vec(layer->router_bias, mlp + "gate.e_score_correction_bias", c.n_routed_experts));
      }
      layer->first_expert = experts_.begin;
      const int I = c.moe_intermediate_size;
      for (int e = experts_.begin; e < experts_.begin + experts_.count; ++e) {
        const std::string ex = absl::StrCat(mlp, "experts.", e, ".");
        ExpertWeights w;
        MLASERVE_TRY(set_lin(w.gate, ex + "gate_proj", I, H, expert_inter_, all_h));
        MLASERVE_TRY(set_lin(w.up, ex + "up_proj", I, H, expert_inter_, all_h));
        MLASERVE_TRY(set_lin(w.down, ex + "down_proj", H, I, all_h, expert_inter_));
        layer->experts.push_back(std::move(w));
      }
    }
#undef MLASERVE_TRY
    // The paged latent cache of this layer (held whole on every rank).
    layer->kv.format = options_.kv_format;
    layer->kv.fp8_scale = 1.0f;
    // The per-layer FP8 scale (dequantized value = e4m3 * scale), where the checkpoint exports
    // one: ModelOpt and llm-compressor name it k_scale (MLA caches keys and values as one
    // latent), under the attention module or its fused kv_a projection.
    if (options_.kv_format == KvCacheFormat::kFp8) {
      for (const char* n : {"k_scale", "kv_scale", "kv_a_proj_with_mqa.k_scale"}) {
        if (!r.Has(a + n)) continue;
        auto ref = ckpt.Get(c.tensor_prefix + a + n);
        if (!ref.ok() || ref->info->dtype != DType::kF32 || ref->info->NumElements() != 1) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", c.tensor_prefix, a, n,
                                                         ": expected an F32 scalar KV scale"));
        }
        layer->kv.fp8_scale = ScalarF32(*ref);
        if (!(layer->kv.fp8_scale > 0.0f) || !std::isfinite(layer->kv.fp8_scale)) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", c.tensor_prefix, a, n,
                                                         ": KV scale must be positive and finite"));
        }
        break;
      }
    }
    Tensor pool = Tensor::Host(DType::kU8, {options_.num_kv_blocks, kKvBlockTokens,
                                            static_cast<int64_t>(KvCacheBytesPerToken(options_.kv_format))});
    layer->kv.pool = ops_.Upload(pool);
    layers_.push_back(std::move(layer));
  }
  return absl::OkStatus();
}

float DeepseekV3Model::kv_fp8_scale(int layer) const { return layers_[layer]->kv.fp8_scale; }

size_t DeepseekV3Model::kv_cache_bytes() const {
  size_t total = 0;
  for (const auto& l : layers_) total += l->kv.pool.nbytes();
  return total;
}

absl::Status DeepseekV3Model::AllReduce(Tensor& t) {
  if (comm_.size() == 1) return absl::OkStatus();
  return comm_.AllReduceSum(t.data<float>(), static_cast<size_t>(t.numel()));
}

absl::Status DeepseekV3Model::Attention(Layer& L, const StepBatch& batch, const Tensor& h,
                                        Tensor& out) {
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int qk = c.qk_head_dim();
  Tensor q = ops_.Activation({T, static_cast<int64_t>(heads_.count) * qk});
  if (c.q_lora_rank > 0) {
    Tensor qa = ops_.Activation({T, c.q_lora_rank});
    ops_.Linear(h, L.q_a, qa);
    ops_.RmsNorm(qa, L.q_a_norm, c.rms_norm_eps, qa);
    ops_.Linear(qa, L.q_b, q);
  } else {
    ops_.Linear(h, L.q_proj, q);
  }
  Tensor kv = ops_.Activation({T, c.kv_lora_rank + c.qk_rope_head_dim});
  ops_.Linear(h, L.kv_a, kv);
  Tensor latent = ops_.Activation({T, c.kv_lora_rank});
  ops_.Columns(kv, 0, latent);
  ops_.RmsNorm(latent, L.kv_a_norm, c.rms_norm_eps, latent);
  Tensor k_rope = ops_.Activation({T, c.qk_rope_head_dim});
  ops_.Columns(kv, c.kv_lora_rank, k_rope);
  ops_.Rope(k_rope, 0, 1, c.qk_rope_head_dim, c.qk_rope_head_dim, batch.positions, inv_freq_,
            rope_scaling_, c.rope.interleaved);
  ops_.Rope(q, c.qk_nope_head_dim, heads_.count, qk, c.qk_rope_head_dim, batch.positions,
            inv_freq_, rope_scaling_, c.rope.interleaved);
  ops_.KvWrite(latent, k_rope, batch.slots, L.kv);

  std::vector<SequenceSlice> naive, absorbed;
  for (const SequenceSlice& s : batch.seqs) {
    (s.context_len == 0 && !options_.force_absorbed ? naive : absorbed).push_back(s);
  }
  Tensor attn = ops_.Activation({T, static_cast<int64_t>(heads_.count) * c.v_head_dim});
  if (!naive.empty()) ops_.MlaNaive(mla_, q, latent, k_rope, L.kv_b, naive, attn);
  if (!absorbed.empty()) ops_.MlaAbsorbed(mla_, q, L.w_kb, L.w_vb, L.kv, absorbed, attn);
  ops_.Linear(attn, L.o_proj, out);
  return AllReduce(out);
}

absl::Status DeepseekV3Model::Mlp(Layer& L, const Tensor& h, Tensor& out) {
  const ModelConfig& c = config_;
  const int64_t T = h.dim(0);
  if (L.moe) {
    Tensor logits = ops_.Activation({T, c.n_routed_experts});
    ops_.Linear(h, L.router, logits);
    Tensor ids = Tensor::Host(DType::kI32, {T, c.num_experts_per_tok});
    Tensor weights = Tensor::Host(DType::kF32, {T, c.num_experts_per_tok});
    if (ops_.device() != Device::kCpu) {
      ids = ops_.Upload(ids);
      weights = ops_.Upload(weights);
    }
    ops_.MoeRoute(routing_, logits, L.router_bias, ids, weights);
    ops_.MoeExperts(h, ids, weights, L.first_expert, L.experts, out);
  }
  if (L.has_mlp) {
    const int64_t I = L.gate.out_features;
    Tensor g = ops_.Activation({T, I});
    Tensor u = ops_.Activation({T, I});
    ops_.Linear(h, L.gate, g);
    ops_.Linear(h, L.up, u);
    ops_.SiluMul(g, u, g);
    if (L.moe) {
      Tensor shared = ops_.Activation({T, c.hidden_size});
      ops_.Linear(g, L.down, shared);
      ops_.Add(shared, out);
    } else {
      ops_.Linear(g, L.down, out);
    }
  }
  return AllReduce(out);
}

absl::Status DeepseekV3Model::Forward(const StepBatch& batch, std::vector<float>* logits) {
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  if (batch.positions.size() != batch.tokens.size() || batch.slots.size() != batch.tokens.size()) {
    return absl::InvalidArgumentError("step batch: tokens, positions and slots differ in length");
  }
  for (int32_t id : batch.tokens) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is outside the vocabulary of ", c.vocab_size));
    }
  }
  const int64_t max_slot = static_cast<int64_t>(options_.num_kv_blocks) * kKvBlockTokens;
  for (int64_t s : batch.slots) {
    if (s < 0 || s >= max_slot) return absl::InvalidArgumentError(absl::StrCat("cache slot ", s, " is outside the pool"));
  }
  Tensor x = ops_.Activation({T, c.hidden_size});
  ops_.Embed(embed_, vocab_.begin, batch.tokens, x);
  if (auto s = AllReduce(x); !s.ok()) return s;
  Tensor h = ops_.Activation({T, c.hidden_size});
  Tensor y = ops_.Activation({T, c.hidden_size});
  for (auto& layer : layers_) {
    ops_.RmsNorm(x, layer->input_norm, c.rms_norm_eps, h);
    if (auto s = Attention(*layer, batch, h, y); !s.ok()) return s;
    ops_.Add(y, x);
    ops_.RmsNorm(x, layer->post_norm, c.rms_norm_eps, h);
    if (auto s = Mlp(*layer, h, y); !s.ok()) return s;
    ops_.Add(y, x);
  }
  // Final norm and lm_head on the rows that need logits.
  const int64_t R = static_cast<int64_t>(batch.logits_rows.size());
  logits->assign(R * c.vocab_size, 0.0f);
  if (R == 0) return absl::OkStatus();
  std::vector<float> host_x(T * c.hidden_size);
  ops_.CopyToHost(x, host_x.data());
  Tensor rows = Tensor::Host(DType::kF32, {R, c.hidden_size});
  for (int64_t i = 0; i < R; ++i) {
    const int32_t row = batch.logits_rows[i];
    if (row < 0 || row >= T) return absl::InvalidArgumentError("logits row outside the step");
    std::copy(host_x.begin() + row * c.hidden_size, host_x.begin() + (row + 1) * c.hidden_size,
              rows.data<float>() + i * c.hidden_size);
  }
  Tensor dev_rows = ops_.Upload(rows);
  ops_.RmsNorm(dev_rows, final_norm_, c.rms_norm_eps, dev_rows);
  Tensor local = ops_.Activation({R, vocab_.count});
  ops_.Linear(dev_rows, lm_head_, local);
  std::vector<float> local_host(R * vocab_.count);
  ops_.CopyToHost(local, local_host.data());
  const int world = comm_.size();
  if (world == 1) {
    *logits = std::move(local_host);
    return absl::OkStatus();
  }
  // Vocab-parallel gather: every rank sends [R, padded] (shards differ by at most one row).
  const int64_t padded = (c.vocab_size + world - 1) / world;
  std::vector<float> send(R * padded, 0.0f), recv(static_cast<size_t>(world) * R * padded);
  for (int64_t i = 0; i < R; ++i) {
    std::copy(local_host.begin() + i * vocab_.count, local_host.begin() + (i + 1) * vocab_.count,
              send.begin() + i * padded);
  }
  if (auto s = comm_.AllGather(send.data(), send.size(), recv.data()); !s.ok()) return s;
  for (int r = 0; r < world; ++r) {
    const ShardRange v = ShardRange::Of(c.vocab_size, r, world);
    for (int64_t i = 0; i < R; ++i) {
      const float* src = recv.data() + (static_cast<int64_t>(r) * R + i) * padded;
      std::copy(src, src + v.count, logits->begin() + i * c.vocab_size + v.begin);
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
