#include "worker/model/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/linear/fp8_block_ref.h"
#include "kernels/linear/int4_group_ref.h"
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
  RoutedExperts experts;
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

// A host fp32 tensor in the backend's activation dtype (bf16 on the GPU), then uploaded.
absl::StatusOr<Tensor> UploadAs(Ops& ops, const Tensor& host_f32) {
  if (ops.activation_dtype() == DType::kF32) return ops.Upload(host_f32);
  Tensor t = Tensor::Host(DType::kBF16, host_f32.shape());
  for (int64_t i = 0; i < host_f32.numel(); ++i) {
    t.data<uint16_t>()[i] = FloatToBf16(host_f32.data<float>()[i]);
  }
  return ops.Upload(t);
}

float ScalarF32(const TensorRef& ref) {
  float v;
  std::memcpy(&v, ref.bytes.data(), 4);
  return v;
}

class WeightReader {
 public:
  WeightReader(const TensorSource& ckpt, std::string prefix, Ops& ops, size_t& bytes,
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
    auto t = ops_.Upload(ToF32(ReadSlice(*ref, 0, dim, 0, 1)));
    if (!t.ok()) return t.status();
    bytes_ += t->nbytes();
    return t;
  }

  // Rows [rows.begin, +count) and columns [cols.begin, +count) of module.weight on the backend.
  // keep_fp8: a DeepSeek FP8 block module is handed over in FP8 (LinearWeight::fp8_*), for
  // modules the backend reads only through Ops::Linear.
  absl::StatusOr<LinearWeight> Linear(const std::string& module, int64_t out, int64_t in,
                                      ShardRange rows, ShardRange cols, bool keep_fp8 = false) {
    auto host =
        HostLinear(module, out, in, rows, cols, keep_fp8 && Has(module + ".weight_scale_inv"));
    if (!host.ok()) return host.status();
    auto w = ops_.UploadLinear(*host);
    if (!w.ok()) {
      return absl::Status(w.status().code(), absl::StrCat("tensor ", Name(module + ".weight"), ": ",
                                                          w.status().message()));
    }
    bytes_ += w->weight.nbytes() + w->block_scale.nbytes() + w->fp8_codes.nbytes() +
              w->fp8_scale_inv.nbytes();
    return w;
  }

  // The same in host memory: dense in the checkpoint's dtype, or NVFP4 when the checkpoint has
  // module.weight_scale (ModelOpt layout). With keep_packed, INT4 (compressed-tensors
  // module.weight_packed) and FP8 block (DeepSeek module.weight_scale_inv) modules stay
  // quantized: INT4 as their rows of the checkpoint's words and scales (LinearWeight::int4_*), FP8
  // as the shard's window of e4m3 codes and the tensor's scale grid (LinearWeight::fp8_*). The
  // loader keeps routed experts of both, and every FP8 module but kv_b (Linear's keep_fp8). The
  // CPU backend dequantizes them exactly; the CUDA backend reads 4 bits + a bf16 scale per 32
  // weights (kernels/moe/int4_moe_layout.h; weight bf16(q * s)) or 1 byte + an fp32 scale per 8 x
  // 64 weights (kernels/moe/fp8_moe_layout.h; weight bf16(fp32(e4m3 * s)), in the expert GEMMs
  // and in Linear). Other INT4 modules (none in Kimi's releases, whose ignore list keeps
  // attention, shared experts and dense MLPs in bf16) and FP8 kv_b are dequantized here into a
  // dense fp32 weight of the shard, which both backends take as they take an fp32 checkpoint: the
  // CPU backend as is (exact), the CUDA backend rounded once to bf16 in UploadLinear. That
  // rounding: INT4 q * bf16 scale has up to 11 significant bits, so bf16 (8) keeps it to a
  // relative 2^-9, and the result is the bf16 product compressed-tensors' decompress_weight
  // itself returns (dequantize() outputs the scale's dtype); FP8 e4m3 * fp32 scale_inv is rounded
  // to fp32 then to bf16, as DeepSeek's weight_dequant stores it (relative <= 2^-9 + 2^-24; the
  // same bits as the GPU's FP8 weights). Memory: the GPU holds 2 bytes a weight for those (4x an
  // INT4 checkpoint, 2x an FP8 one).
  absl::StatusOr<LinearWeight> HostLinear(const std::string& module, int64_t out, int64_t in,
                                          ShardRange rows, ShardRange cols,
                                          bool keep_packed = false) {
    LinearWeight w;
    w.out_features = rows.count;
    w.in_features = cols.count;
    const std::string wn = module + ".weight";
    if (Has(module + ".weight_packed")) return Int4Linear(module, out, in, rows, cols, keep_packed);
    if (Has(module + ".weight_scale_inv")) {
      return Fp8BlockLinear(module, out, in, rows, cols, keep_packed);
    }
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
      w.weight = ReadSlice(*packed, rows.begin, rows.count, cols.begin / 2, cols.count / 2);
      w.block_scale = ReadSlice(*scale, rows.begin, rows.count, cols.begin / 16, cols.count / 16);
      return w;
    }
    auto ref = Dense(wn, {out, in});
    if (!ref.ok()) return ref.status();
    w.weight = ReadSlice(*ref, rows.begin, rows.count, cols.begin, cols.count);
    return w;
  }

  // A compressed-tensors INT4 module (format: kernels/linear/int4_group_ref.h): packed rows
  // (keep_packed) or dequantized to fp32.
  absl::StatusOr<LinearWeight> Int4Linear(const std::string& module, int64_t out, int64_t in,
                                          ShardRange rows, ShardRange cols, bool keep_packed) {
    const std::string pn = Name(module + ".weight_packed");
    if (quant_ == nullptr || quant_->method != QuantConfig::Method::kInt4Group) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", pn, ": an INT4 packed weight, but the checkpoint's quantization_config is "
          "not compressed-tensors pack-quantized"));
    }
    if (quant_->IsExcluded(Name(module))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", pn, ": module ", Name(module), " is INT4 in the checkpoint but its "
          "quantization config's \"ignore\" list keeps it unquantized"));
    }
    if (Has(module + ".weight_zero_point")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Name(module + ".weight_zero_point"),
          ": zero points (asymmetric INT4) are not supported"));
    }
    const int g = quant_->group_size;
    const int64_t words = (in + kInt4PerWord - 1) / kInt4PerWord, groups = (in + g - 1) / g;
    auto packed = ckpt_.Get(pn, DType::kI32, {out, words});
    if (!packed.ok()) return packed.status();
    auto shape = ckpt_.Get(Name(module + ".weight_shape"));
    if (!shape.ok()) return shape.status();
    {
      std::vector<int64_t> dims;
      const TensorInfo& si = *shape->info;
      if ((si.dtype == DType::kI32 || si.dtype == DType::kI64) && si.NumElements() == 2) {
        for (int i = 0; i < 2; ++i) {
          if (si.dtype == DType::kI32) {
            int32_t v;
            std::memcpy(&v, shape->bytes.data() + 4 * i, 4);
            dims.push_back(v);
          } else {
            int64_t v;
            std::memcpy(&v, shape->bytes.data() + 8 * i, 8);
            dims.push_back(v);
          }
        }
      }
      if (dims != std::vector<int64_t>{out, in}) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", Name(module + ".weight_shape"), ": expected I32 [2] holding ",
            Shape({out, in}), ", found ", si.Describe(),
            dims.size() == 2 ? absl::StrCat(" holding ", Shape(dims)) : ""));
      }
    }
    auto scale = ckpt_.Get(Name(module + ".weight_scale"));
    if (!scale.ok()) return scale.status();
    if (!IsDenseFloat(scale->info->dtype) ||
        scale->info->shape != std::vector<int64_t>{out, groups}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Name(module + ".weight_scale"), ": expected BF16 (or F16, F32) ",
          Shape({out, groups}), " (one scale per ", g, " columns), found ",
          scale->info->Describe()));
    }
    Tensor p = ReadSlice(*packed, rows.begin, rows.count, 0, words);
    LinearWeight w;
    w.out_features = rows.count;
    w.in_features = cols.count;
    if (keep_packed) {
      w.int4_packed = std::move(p);
      w.int4_scale = ReadSlice(*scale, rows.begin, rows.count, 0, groups);
      w.int4_in = in;
      w.int4_col0 = cols.begin;
      w.int4_group = g;
      return w;
    }
    Tensor sc = ToF32(ReadSlice(*scale, rows.begin, rows.count, 0, groups));
    w.weight = Tensor::Host(DType::kF32, {rows.count, cols.count});
    DequantizeInt4Group({p.data<int32_t>(), sc.data<float>(), rows.count, in, g}, 0, rows.count,
                        cols.begin, cols.count, w.weight.data<float>());
    return w;
  }

  // A DeepSeek FP8 block-quantized module (format: kernels/linear/fp8_block_ref.h): the shard's
  // codes and the scale grid (keep_packed), or dequantized to fp32.
  absl::StatusOr<LinearWeight> Fp8BlockLinear(const std::string& module, int64_t out, int64_t in,
                                              ShardRange rows, ShardRange cols, bool keep_packed) {
    const std::string sn = Name(module + ".weight_scale_inv");
    if (quant_ == nullptr || quant_->method != QuantConfig::Method::kFp8Block ||
        quant_->weight_block_size.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", sn, ": an FP8 block scale, but the checkpoint's quantization_config is not "
          "{\"quant_method\": \"fp8\", \"weight_block_size\": [..]}"));
    }
    const int br = quant_->weight_block_size[0], bc = quant_->weight_block_size[1];
    auto weight = ckpt_.Get(Name(module + ".weight"), DType::kF8E4M3, {out, in});
    if (!weight.ok()) return weight.status();
    auto scale = ckpt_.Get(sn, DType::kF32, {(out + br - 1) / br, (in + bc - 1) / bc});
    if (!scale.ok()) return scale.status();
    // The mapped bytes need not be 4-aligned: copy the (small) scale grid.
    std::vector<float> s(scale->info->NumElements());
    std::memcpy(s.data(), scale->bytes.data(), s.size() * sizeof(float));
    LinearWeight w;
    w.out_features = rows.count;
    w.in_features = cols.count;
    if (keep_packed) {
      w.fp8_codes = ReadSlice(*weight, rows.begin, rows.count, cols.begin, cols.count);
      w.fp8_scale_inv = Tensor::Host(DType::kF32, scale->info->shape);
      std::copy(s.begin(), s.end(), w.fp8_scale_inv.data<float>());
      w.fp8_origin_row = rows.begin;
      w.fp8_origin_col = cols.begin;
      w.fp8_block_rows = br;
      w.fp8_block_cols = bc;
      return w;
    }
    w.weight = Tensor::Host(DType::kF32, {rows.count, cols.count});
    DequantizeFp8Block({weight->bytes.data(), s.data(), out, in, br, bc}, rows.begin, rows.count,
                       cols.begin, cols.count, w.weight.data<float>());
    return w;
  }

  // kv_b rows of the local heads as fp32 on the host: [heads, nope + v, 512].
  absl::StatusOr<Tensor> KvBHost(const std::string& module, int64_t all_heads, ShardRange heads,
                                 int nope, int v, int kv_lora) {
    const int64_t per = nope + v;
    if (Has(module + ".weight_packed") || Has(module + ".weight_scale_inv")) {
      const int p = static_cast<int>(per);
      const ShardRange rows{heads.begin * p, heads.count * p};
      auto lw = HostLinear(module, all_heads * per, kv_lora, rows, {0, kv_lora});
      if (!lw.ok()) return lw.status();
      return lw->weight.Reshaped({heads.count, per, kv_lora});
    }
    if (Has(module + ".weight_scale")) {
      auto lw = HostLinear(module, all_heads * per, kv_lora,
                           {heads.begin * static_cast<int>(per), heads.count * static_cast<int>(per)},
                           {0, kv_lora});
      if (!lw.ok()) return lw.status();
      Tensor out = Tensor::Host(DType::kF32, {heads.count, per, kv_lora});
      DequantizeNvfp4(lw->weight.data<uint8_t>(), lw->block_scale.data<uint8_t>(), lw->global_scale,
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
  const TensorSource& ckpt_;
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
  auto ckpt = Checkpoint::Open(folder);
  if (!ckpt.ok()) return ckpt.status();
  return Load(*ckpt, *config, options, ops, comm);
}

absl::StatusOr<std::unique_ptr<DeepseekV3Model>> DeepseekV3Model::Load(const TensorSource& source,
                                                                       const ModelConfig& config,
                                                                       const ModelOptions& options,
                                                                       Ops& ops, Communicator& comm) {
  const std::string origin = source.Origin();
  if (config.kv_lora_rank != kMlaLatentDim || config.qk_rope_head_dim != kMlaRopeDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ": kv_lora_rank ", config.kv_lora_rank, " and qk_rope_head_dim ",
        config.qk_rope_head_dim, " are not the 512 and 64 of DeepSeek-V2/V3 and Kimi models, "
        "which the MLA cache formats are built for"));
  }
  if (options.shard_world > 0 &&
      (options.shard_rank < 0 || options.shard_rank >= options.shard_world || comm.size() != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard rank ", options.shard_rank, " of ", options.shard_world,
        ": the rank must be in [0, world) and the communicator single-rank (found ", comm.size(),
        " ranks)"));
  }
  if (options.dcp < 1 || comm.size() % options.dcp != 0 ||
      (options.dcp > 1 && options.shard_world > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode context parallelism over ", options.dcp, " ranks: it must divide the rank count (",
        comm.size(), ") and cannot be combined with a shard override"));
  }
  std::unique_ptr<DeepseekV3Model> m(new DeepseekV3Model(ops, comm));
  m->config_ = config;
  m->options_ = options;
  m->dcp_comm_ = &comm;
  if (options.dcp > 1 && options.dcp < comm.size()) {
    auto group = comm.Split(comm.rank() / options.dcp, comm.rank());
    if (!group.ok()) return group.status();
    m->dcp_group_ = *std::move(group);
    m->dcp_comm_ = m->dcp_group_.get();
  }
  if (auto s = ops.SetBatchInvariant(options.deterministic); !s.ok()) return s;
  ops.SetMlaFp8TensorCores(options.mla_fp8_tensor_cores);
  if (auto s = m->LoadWeights(source); !s.ok()) return s;
  return m;
}

absl::Status DeepseekV3Model::LoadWeights(const TensorSource& ckpt) {
  const ModelConfig& c = config_;
  const bool override_shard = options_.shard_world > 0;
  const int rank = override_shard ? options_.shard_rank : comm_.rank();
  const int world = override_shard ? options_.shard_world : comm_.size();
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
    auto dev = ops_.Upload(t);
    if (!dev.ok()) return dev.status();
    inv_freq_ = *dev;
    rope_scaling_ = static_cast<float>(c.RopeAttentionScaling());
  }

  // Layers past num_hidden_layers (DeepSeek's MTP layer 61, num_nextn_predict_layers) are in
  // the released checkpoints and are never read.
  WeightReader r(ckpt, c.tensor_prefix, ops_, weight_bytes_,
                 c.quant.method == QuantConfig::Method::kNone ? nullptr : &c.quant);
  const int64_t H = c.hidden_size;
  {
    auto emb = r.Dense("model.embed_tokens.weight", {c.vocab_size, H});
    if (!emb.ok()) return emb.status();
    auto dev = ops_.Upload(ReadSlice(*emb, vocab_.begin, vocab_.count, 0, H));
    if (!dev.ok()) return dev.status();
    embed_ = *dev;
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
    // FP8 modules stay FP8 (the loader's comment on HostLinear), but kv_b: MLA reads it as a
    // dense weight (Ops::MlaPrefill), and its absorbed halves are built here in fp32.
    auto set_lin = [&](LinearWeight& dst, const std::string& n, int64_t out, int64_t in,
                       ShardRange rows, ShardRange cols) -> absl::Status {
      const bool kv_b = n.size() >= 9 && n.compare(n.size() - 9, 9, "kv_b_proj") == 0;
      auto w = r.Linear(n, out, in, rows, cols, /*keep_fp8=*/!kv_b);
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
      auto dkb = UploadAs(ops_, kb);
      if (!dkb.ok()) return dkb.status();
      auto dvb = UploadAs(ops_, vb);
      if (!dvb.ok()) return dvb.status();
      layer->w_kb = *dkb;
      layer->w_vb = *dvb;
      weight_bytes_ += layer->w_kb.nbytes() + layer->w_vb.nbytes();
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
      const int I = c.moe_intermediate_size;
      std::vector<ExpertWeights> host;  // the layer's local experts, read from the checkpoint
      auto host_lin = [&](LinearWeight& dst, const std::string& n, int64_t out, int64_t in,
                          ShardRange rows, ShardRange cols) -> absl::Status {
        auto w = r.HostLinear(n, out, in, rows, cols, /*keep_packed=*/true);
        if (!w.ok()) return w.status();
        dst = *std::move(w);
        return absl::OkStatus();
      };
      for (int e = experts_.begin; e < experts_.begin + experts_.count; ++e) {
        const std::string ex = absl::StrCat(mlp, "experts.", e, ".");
        ExpertWeights w;
        MLASERVE_TRY(host_lin(w.gate, ex + "gate_proj", I, H, expert_inter_, all_h));
        MLASERVE_TRY(host_lin(w.up, ex + "up_proj", I, H, expert_inter_, all_h));
        MLASERVE_TRY(host_lin(w.down, ex + "down_proj", H, I, all_h, expert_inter_));
        host.push_back(std::move(w));
      }
      auto experts = ops_.UploadExperts(experts_.begin, c.n_routed_experts, host);
      if (!experts.ok()) {
        return absl::Status(experts.status().code(),
                            absl::StrCat("layer ", i, " routed experts: ", experts.status().message()));
      }
      layer->experts = *std::move(experts);
      weight_bytes_ += layer->experts.bytes;
    }
    // The projections of one x, side by side where the backend merges them (Ops::AdjoinLinears),
    // in the order Attention and Mlp pass them to Linears.
    MLASERVE_TRY(
        ops_.AdjoinLinears({c.q_lora_rank > 0 ? &layer->q_a : &layer->q_proj, &layer->kv_a}));
    if (layer->has_mlp) MLASERVE_TRY(ops_.AdjoinLinears({&layer->gate, &layer->up}));
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
    auto pool = ops_.Allocate(DType::kU8, {options_.num_kv_blocks, kKvBlockTokens,
                                           static_cast<int64_t>(KvCacheBytesPerToken(options_.kv_format))});
    if (!pool.ok()) {
      return absl::Status(pool.status().code(), absl::StrCat("layer ", i, " KV cache: ", pool.status().message()));
    }
    layer->kv.pool = *std::move(pool);
    layers_.push_back(std::move(layer));
  }
  return absl::OkStatus();
}

absl::Status DeepseekV3Model::set_deterministic(bool on) {
  if (auto s = ops_.SetBatchInvariant(on); !s.ok()) return s;
  if (on != options_.deterministic) graphs_.clear();
  options_.deterministic = on;
  return absl::OkStatus();
}

float DeepseekV3Model::kv_fp8_scale(int layer) const { return layers_[layer]->kv.fp8_scale; }

size_t DeepseekV3Model::expert_bytes() const {
  size_t total = 0;
  for (const auto& l : layers_) total += l->experts.bytes;
  return total;
}

size_t DeepseekV3Model::kv_cache_bytes() const {
  size_t total = 0;
  for (const auto& l : layers_) total += l->kv.pool.nbytes();
  return total;
}

bool DeepseekV3Model::CapturableCollectives() const {
  if (comm_.size() == 1) return true;
  return options_.multi_rank_graphs && comm_.CapturesDeviceCollectives() &&
         (dcp_comm_ == nullptr || dcp_comm_->CapturesDeviceCollectives());
}

absl::Status DeepseekV3Model::AllReduce(Tensor& t) {
  if (comm_.size() == 1) return absl::OkStatus();
  ops_.Phase("allreduce");
  return comm_.AllReduceSum(t);
}

absl::Status DeepseekV3Model::Attention(Layer& L, const StepTensors& step, const Tensor& h,
                                        Tensor& out) {
  const ModelConfig& c = config_;
  const int64_t T = h.dim(0);
  const int qk = c.qk_head_dim();
  ops_.Phase("attn.proj");
  Tensor q = ops_.Activation({T, static_cast<int64_t>(heads_.count) * qk});
  Tensor kv = ops_.Activation({T, c.kv_lora_rank + c.qk_rope_head_dim});
  if (c.q_lora_rank > 0) {
    Tensor qa = ops_.Activation({T, c.q_lora_rank});
    ops_.Linears(h, {{&L.q_a, &qa}, {&L.kv_a, &kv}});
    ops_.RmsNormLinear(qa, L.q_a_norm, c.rms_norm_eps, L.q_b, q);
  } else {
    ops_.Linears(h, {{&L.q_proj, &q}, {&L.kv_a, &kv}});
  }
  Tensor latent = ops_.Activation({T, c.kv_lora_rank});
  Tensor k_rope = ops_.Activation({T, c.qk_rope_head_dim});
  // q_abs: q absorbed for MlaDecode where the backend does it here (empty otherwise).
  Tensor q_abs;
  ops_.MlaInputPrep(kv, L.kv_a_norm, c.rms_norm_eps, step, inv_freq_, rope_scaling_,
                    c.rope.interleaved, L.kv, latent, k_rope, q, c.qk_nope_head_dim, heads_.count,
                    qk, options_.dcp > 1 ? Tensor() : L.w_kb, q_abs);
  ops_.Phase("attn.mla");

  Tensor attn = ops_.Activation({T, static_cast<int64_t>(heads_.count) * c.v_head_dim});
  if (options_.dcp > 1) {
    // Every rank attends with all heads over its own cache rows: gather q, attend, exchange the
    // partial outputs with their log-sum-exp, merge this rank's heads, expand.
    const int N = options_.dcp;
    Communicator& group = *dcp_comm_;
    DcpShape d;
    d.ranks = N;
    d.rank = group.rank();
    // Head slots per rank: the most heads any rank holds (heads are split over every rank).
    d.heads_per_rank = (c.num_attention_heads + comm_.size() - 1) / comm_.size();
    const int64_t slots = d.heads_per_rank;
    Tensor q_abs = ops_.Activation({T, slots, kMlaQkDim});
    ops_.MlaAbsorb(mla_, d, q, L.w_kb, q_abs);
    Tensor q_all = ops_.Activation({N, T, slots, kMlaQkDim});
    if (auto s = group.AllGatherDevice(q_abs, q_all); !s.ok()) return s;
    // Partial latents in the activation dtype (bf16 on GPUs: half the traffic), lse in fp32.
    Tensor latent_part = ops_.Activation({N, T, slots, kMlaLatentDim});
    Tensor lse_part = ops_.Activation({N, T, slots}, DType::kF32);
    for (size_t g = 0; g < step.layout->decode.size(); ++g) {
      ops_.MlaAttend(mla_, d, q_all, L.kv, step, static_cast<int>(g), latent_part, lse_part);
    }
    // Each rank gets the partials of its own head slots from every rank (an all-to-all: the
    // slots of rank j's heads are chunk j of latent_part and lse_part).
    Tensor latent_all = ops_.Activation({N, T, slots, kMlaLatentDim});
    Tensor lse_all = ops_.Activation({N, T, slots}, DType::kF32);
    if (auto s = group.AllToAllDevice(latent_part, latent_all); !s.ok()) return s;
    if (auto s = group.AllToAllDevice(lse_part, lse_all); !s.ok()) return s;
    ops_.MlaMergeExpand(mla_, d, latent_all, lse_all, L.w_vb, attn);
    ops_.Phase("attn.o_proj");
    ops_.Linear(attn, L.o_proj, out);
    return AllReduce(out);
  }
  if (step.layout->prefill.num_seqs > 0) {
    ops_.MlaPrefill(mla_, q, latent, k_rope, L.kv_b, L.kv, step, attn);
  }
  for (size_t g = 0; g < step.layout->decode.size(); ++g) {
    ops_.MlaDecode(mla_, q, L.w_kb, L.w_vb, L.kv, step, static_cast<int>(g), attn, q_abs);
  }
  ops_.Phase("attn.o_proj");
  ops_.Linear(attn, L.o_proj, out);
  return AllReduce(out);
}

absl::Status DeepseekV3Model::Mlp(Layer& L, const Tensor& h, Tensor& out) {
  const ModelConfig& c = config_;
  const int64_t T = h.dim(0);
  // Dense MLP, or the shared experts (into `shared`, added to the routed experts' sum).
  // The router's logits come from the same h as gate and up: one Linears call (the shared
  // MLP's phase times the three products).
  Tensor shared, logits;
  if (L.moe) logits = ops_.Activation({T, c.n_routed_experts}, DType::kF32);
  ops_.Phase(L.moe ? "mlp.shared" : "mlp.dense");
  // Where the backend has side branches (Ops::SideBranches), the shared expert runs beside the
  // router, the dispatch and the routed experts, which join it before they add its output; the
  // router then has its own launch, before the branch.
  const bool branch = L.moe && L.has_mlp && ops_.SideBranches();
  if (branch) {
    ops_.Linear(h, L.router, logits);
    ops_.BeginSideBranch();
  }
  if (L.has_mlp) {
    const int64_t I = L.gate.out_features;
    Tensor g = ops_.Activation({T, I});
    Tensor u = ops_.Activation({T, I});
    if (branch) {
      ops_.Linears(h, {{&L.gate, &g}, {&L.up, &u}});
    } else if (L.moe) {
      ops_.Linears(h, {{&L.gate, &g}, {&L.up, &u}, {&L.router, &logits}});
    } else {
      ops_.Linears(h, {{&L.gate, &g}, {&L.up, &u}});
    }
    if (L.moe) {
      shared = ops_.Activation({T, c.hidden_size});
      ops_.SiluMulLinear(g, u, L.down, shared);
    } else {
      ops_.SiluMulLinear(g, u, L.down, out);
    }
  } else if (L.moe) {
    ops_.Linear(h, L.router, logits);
  }
  if (branch) ops_.EndSideBranch();
  if (L.moe) {
    ops_.Phase("moe.router");
    Tensor ids = ops_.Activation({T, c.num_experts_per_tok}, DType::kI32);
    Tensor weights = ops_.Activation({T, c.num_experts_per_tok}, DType::kF32);
    ops_.MoeRouteExperts(routing_, logits, L.router_bias, h, L.experts, shared, ids, weights, out);
  }
  return AllReduce(out);
}

absl::StatusOr<Tensor> DeepseekV3Model::Forward(const StepBatch& batch) {
  const ModelConfig& c = config_;
  StepLayoutOptions lo;
  lo.vocab_size = c.vocab_size;
  lo.num_blocks = options_.num_kv_blocks;
  lo.num_slots = static_cast<int64_t>(options_.num_kv_blocks) * kKvBlockTokens;
  lo.force_absorbed = options_.force_absorbed;
  lo.per_token_attention = options_.deterministic;
  if (options_.dcp > 1) {
    lo.dcp_size = options_.dcp;
    lo.dcp_rank = dcp_comm_->rank();
    lo.num_blocks = options_.num_kv_blocks * options_.dcp;
    lo.num_slots = static_cast<int64_t>(lo.num_blocks) * kKvBlockTokens;
  }
  auto layout = BuildStepLayout(batch, lo);
  if (!layout.ok()) return layout.status();
  layout_ = *std::move(layout);
  if (layout_.num_tokens == 0) return ops_.Activation({0, c.vocab_size}, DType::kF32);
  if (options_.graphs && ops_.SupportsGraphs() && CapturableCollectives() &&
      IsSingleTokenDecode(layout_)) {
    return ForwardGraph();
  }
  StepTensors step;
  if (auto s = ops_.BeginStep(layout_, &step); !s.ok()) return s;
  return Layers(step);
}

namespace {

// Decode batch buckets (SGLang's and vLLM's shape: small powers of two, then steps of 32).
int DecodeBucket(int n) {
  for (int b : {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256}) {
    if (n <= b) return b;
  }
  return -1;
}

Tensor RowsView(const Tensor& t, int64_t rows) {
  return Tensor(t.dtype(), {rows, t.dim(1)}, nullptr, const_cast<void*>(t.data<void>()), t.device());
}

}  // namespace

absl::StatusOr<Tensor> DeepseekV3Model::ForwardGraph() {
  const int64_t R = static_cast<int64_t>(layout_.logits_rows.size());
  const int batch = DecodeBucket(layout_.num_seqs);
  int width = 16;
  while (width < layout_.max_blocks) width *= 2;
  StepTensors step;
  if (batch < 0 || R > batch) {
    if (auto s = ops_.BeginStep(layout_, &step); !s.ok()) return s;
    return Layers(step);
  }
  PadDecodeLayout(&layout_, batch, width);
  if (auto s = ops_.BeginStep(layout_, &step); !s.ok()) return s;
  DecodeGraph& g = graphs_[{batch, width}];
  if (g.id >= 0 && g.epoch == ops_.memory_epoch()) {
    absl::Status s = ops_.LaunchGraph(g.id);
    if (s.ok()) return RowsView(g.logits, R);
    if (!absl::IsFailedPrecondition(s)) return s;
  }
  if (g.eager_runs++ == 0) {
    // The first step of a shape runs eagerly: it sizes the scratch the graph will use.
    auto logits = Layers(step);
    if (!logits.ok()) return logits.status();
    return RowsView(*logits, R);
  }
  if (auto s = ops_.BeginCapture(); !s.ok()) return s;
  auto logits = Layers(step);
  auto id = ops_.EndCapture();
  if (!logits.ok()) return logits.status();
  if (!id.ok()) return id.status();
  g.id = *id;
  g.epoch = ops_.memory_epoch();
  g.logits = *logits;
  if (auto s = ops_.LaunchGraph(g.id); !s.ok()) return s;
  return RowsView(g.logits, R);
}

absl::StatusOr<Tensor> DeepseekV3Model::Layers(const StepTensors& step) {
  const ModelConfig& c = config_;
  const int64_t T = layout_.num_tokens;
  const int64_t R = static_cast<int64_t>(layout_.logits_rows.size());
  // The residual stream is fp32 on every backend; h (normalised) is in the activation dtype.
  Tensor x = ops_.Activation({T, c.hidden_size}, DType::kF32);
  ops_.Phase("embed");
  ops_.Embed(embed_, vocab_.begin, step, x);
  if (auto s = AllReduce(x); !s.ok()) return s;
  Tensor h = ops_.Activation({T, c.hidden_size});
  Tensor y = ops_.Activation({T, c.hidden_size});
  ops_.RmsNorm(x, layers_[0]->input_norm, c.rms_norm_eps, h);
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& layer = *layers_[i];
    // x, h and y live across layers; everything a layer makes besides is dead at its end.
    const uint64_t scratch = ops_.ScratchMark();
    if (auto s = Attention(layer, step, h, y); !s.ok()) return s;
    ops_.Phase("norm");
    ops_.AddRmsNorm(y, x, layer.post_norm, c.rms_norm_eps, h);
    if (auto s = Mlp(layer, h, y); !s.ok()) return s;
    // The next layer's input norm, or the final norm after the last layer.
    const Tensor& next = i + 1 < layers_.size() ? layers_[i + 1]->input_norm : final_norm_;
    ops_.Phase("norm");
    ops_.AddRmsNorm(y, x, next, c.rms_norm_eps, h);
    ops_.ScratchRelease(scratch);
  }
  // lm_head on the rows that need logits.
  ops_.Phase("lm_head");
  Tensor rows = ops_.Activation({R, c.hidden_size});
  ops_.LogitsRows(h, step, rows);
  Tensor local = ops_.Activation({R, vocab_.count}, DType::kF32);
  ops_.Linear(rows, lm_head_, local);
  const int world = comm_.size();
  if (world == 1) return local;
  // Vocab-parallel gather on the backend's device: every rank sends [R, padded] (shards differ by
  // at most one row; the columns past its shard are dropped after the gather).
  const int64_t padded = (c.vocab_size + world - 1) / world;
  Tensor send = ops_.Activation({R, padded}, DType::kF32);
  ops_.CopyColumns(local, 0, send, 0, vocab_.count);
  Tensor recv = ops_.Activation({world * R, padded}, DType::kF32);
  if (auto s = comm_.AllGatherDevice(send, recv); !s.ok()) return s;
  Tensor logits = ops_.Activation({R, c.vocab_size}, DType::kF32);
  for (int r = 0; r < world; ++r) {
    const ShardRange v = ShardRange::Of(c.vocab_size, r, world);
    ops_.CopyColumns(recv.Rows(int64_t{r} * R, R), 0, logits, v.begin, v.count);
  }
  return logits;
}

absl::Status DeepseekV3Model::Forward(const StepBatch& batch, std::vector<float>* logits) {
  auto dev = Forward(batch);
  if (!dev.ok()) return dev.status();
  logits->assign(static_cast<size_t>(dev->numel()), 0.0f);
  if (dev->numel() == 0) return ops_.Synchronize();
  return ops_.CopyToHost(*dev, logits->data());
}

}  // namespace mlaserve
