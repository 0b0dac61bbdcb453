#include "worker/model/synthetic_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace mlaserve {
namespace {

// SplitMix64's output for counter value `x` (Steele, Lea, Flood 2014; the constants of
// java.util.SplittableRandom): word i of a tensor is Mix(seed + (i + 1) * golden gamma).
inline uint64_t Mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

uint64_t NameHash(std::string_view s) {  // FNV-1a
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return h;
}

constexpr float kWeightStd = 0.02f;
// Irwin-Hall of four 16-bit uniforms: mean 2 * 65535, std 2 * 65536 / sqrt(12).
constexpr float kIrwinHallMean = 131070.0f;
constexpr float kIrwinHallStd = 37837.9f;
// rms of an e2m1 code drawn uniformly from the 16 codes: sqrt(mean(0, .25, 1, 2.25, 4, 9, 16, 36))
// = 2.9262; of a block scale drawn from e4m3 {0.875, 0.9375, 1.0, 1.125} (codes 0x36..0x39):
// 0.9887. The global scale makes the dequantized rms 0.02.
constexpr float kNvfp4GlobalScale = kWeightStd / (2.9262f * 0.9887f);
// rms of q uniform over [-8, 7]: sqrt(344 / 16) = 4.637.
constexpr float kInt4Scale = kWeightStd / 4.637f;
// FP8 codes: sign and mantissa uniform, exponent field uniform over 4..11 (|v| in 2^-3 .. 30):
// rms sqrt(mean(4^(e - 7)) * mean((1 + m / 8)^2)) = sqrt(42.67 * 2.148) = 9.574.
constexpr float kFp8Scale = kWeightStd / 9.574f;
constexpr float kInputScale = 1.0f / 448.0f;

}  // namespace

SyntheticCheckpoint::SyntheticCheckpoint(const ModelConfig& c, SyntheticCheckpointOptions options)
    : config_(c), options_(options) {
  const int64_t H = c.hidden_size;
  Add("model.embed_tokens.weight", DType::kBF16, {c.vocab_size, H}, Kind::kWeight);
  Add("model.norm.weight", DType::kBF16, {H}, Kind::kOnes);
  if (!c.tie_word_embeddings) AddLinear("lm_head", c.vocab_size, H);
  const int64_t qk = c.qk_head_dim();
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::string a = p + "self_attn.";
    Add(p + "input_layernorm.weight", DType::kBF16, {H}, Kind::kOnes);
    Add(p + "post_attention_layernorm.weight", DType::kBF16, {H}, Kind::kOnes);
    if (c.q_lora_rank > 0) {
      AddLinear(a + "q_a_proj", c.q_lora_rank, H);
      Add(a + "q_a_layernorm.weight", DType::kBF16, {c.q_lora_rank}, Kind::kOnes);
      AddLinear(a + "q_b_proj", c.num_attention_heads * qk, c.q_lora_rank);
    } else {
      AddLinear(a + "q_proj", c.num_attention_heads * qk, H);
    }
    AddLinear(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H);
    Add(a + "kv_a_layernorm.weight", DType::kBF16, {c.kv_lora_rank}, Kind::kOnes);
    AddLinear(a + "kv_b_proj", int64_t{c.num_attention_heads} * (c.qk_nope_head_dim + c.v_head_dim),
              c.kv_lora_rank);
    AddLinear(a + "o_proj", H, int64_t{c.num_attention_heads} * c.v_head_dim);
    const std::string mlp = p + "mlp.";
    if (!c.IsMoeLayer(i)) {
      AddLinear(mlp + "gate_proj", c.intermediate_size, H);
      AddLinear(mlp + "up_proj", c.intermediate_size, H);
      AddLinear(mlp + "down_proj", H, c.intermediate_size);
      continue;
    }
    if (c.n_shared_experts > 0) {
      const int64_t si = int64_t{c.moe_intermediate_size} * c.n_shared_experts;
      AddLinear(mlp + "shared_experts.gate_proj", si, H);
      AddLinear(mlp + "shared_experts.up_proj", si, H);
      AddLinear(mlp + "shared_experts.down_proj", H, si);
    }
    AddLinear(mlp + "gate", c.n_routed_experts, H);
    if (c.has_score_correction_bias) {
      Add(mlp + "gate.e_score_correction_bias", DType::kBF16, {c.n_routed_experts}, Kind::kBias);
    }
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string ex = absl::StrCat(mlp, "experts.", e, ".");
      AddLinear(ex + "gate_proj", c.moe_intermediate_size, H);
      AddLinear(ex + "up_proj", c.moe_intermediate_size, H);
      AddLinear(ex + "down_proj", H, c.moe_intermediate_size);
    }
  }
}

SyntheticCheckpoint::~SyntheticCheckpoint() = default;

SyntheticCheckpoint::Entry& SyntheticCheckpoint::Add(std::string name, DType dtype,
                                                     std::vector<int64_t> shape, Kind kind) {
  Entry e;
  e.info.name = config_.tensor_prefix + name;
  e.info.dtype = dtype;
  e.info.shape = std::move(shape);
  e.info.begin = 0;
  e.info.end = e.info.NumElements() * static_cast<uint64_t>(DTypeBits(dtype)) / 8;
  e.kind = kind;
  total_bytes_ += e.info.end;
  std::string key = e.info.name;
  return entries_.insert_or_assign(std::move(key), std::move(e)).first->second;
}

void SyntheticCheckpoint::AddLinear(const std::string& module, int64_t out, int64_t in) {
  bool nvfp4 = config_.quant.method == QuantConfig::Method::kNvfp4 &&
               !config_.quant.IsExcluded(module) && in % 16 == 0;
  const bool routed_expert = module.find(".mlp.experts.") != std::string::npos;
  const bool modelopt =
      options_.nvfp4_modules == SyntheticCheckpointOptions::Nvfp4Modules::kModelOpt;
  if (!modelopt && !routed_expert) nvfp4 = false;
  const bool router = module.size() >= 9 && module.compare(module.size() - 9, 9, ".mlp.gate") == 0;
  const int group = config_.quant.group_size;
  // DeepSeek's FP8 release quantizes every linear layer but the router and lm_head (embed_tokens is
  // not a linear module here).
  if (config_.quant.method == QuantConfig::Method::kFp8Block && !router && module != "lm_head" &&
      config_.quant.weight_block_size.size() == 2 && !config_.quant.IsExcluded(module)) {
    const int64_t br = config_.quant.weight_block_size[0], bc = config_.quant.weight_block_size[1];
    Add(module + ".weight", DType::kF8E4M3, {out, in}, Kind::kFp8Code);
    Add(module + ".weight_scale_inv", DType::kF32, {(out + br - 1) / br, (in + bc - 1) / bc},
        Kind::kFp8Scale);
    return;
  }
  if (config_.quant.method == QuantConfig::Method::kInt4Group && !router && group > 0 &&
      !config_.quant.IsExcluded(module)) {
    Add(module + ".weight_packed", DType::kI32, {out, (in + 7) / 8}, Kind::kPacked);
    Add(module + ".weight_scale", DType::kBF16, {out, (in + group - 1) / group}, Kind::kInt4Scale);
    Entry& shape = Add(module + ".weight_shape", DType::kI32, {2}, Kind::kInt4Shape);
    shape.rows = out;
    shape.cols = in;
    return;
  }
  if (!nvfp4) {
    Add(module + ".weight", DType::kBF16, {out, in}, Kind::kWeight);
    return;
  }
  Add(module + ".weight", DType::kU8, {out, in / 2}, Kind::kPacked);
  Add(module + ".weight_scale", DType::kF8E4M3, {out, in / 16}, Kind::kBlockScale);
  Add(module + ".weight_scale_2", DType::kF32, {}, Kind::kGlobalScale);
  if (modelopt) Add(module + ".input_scale", DType::kF32, {}, Kind::kInputScale);
}

bool SyntheticCheckpoint::Has(std::string_view name) const {
  return entries_.find(name) != entries_.end();
}

absl::StatusOr<const TensorInfo*> SyntheticCheckpoint::Info(std::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor ", std::string(name), " not found in ", Origin()));
  }
  return &it->second.info;
}

std::vector<std::string> SyntheticCheckpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, _] : entries_) names.push_back(name);
  return names;
}

std::string SyntheticCheckpoint::Origin() const {
  return absl::StrCat("synthetic checkpoint (", config_.architecture, ", ",
                      config_.num_hidden_layers, " layers, seed ", options_.seed, ")");
}

uint64_t SyntheticCheckpoint::generated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generated_;
}

absl::StatusOr<TensorRef> SyntheticCheckpoint::Get(std::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor ", std::string(name), " not found in ", Origin()));
  }
  const Entry& e = it->second;
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<uint8_t[]> bytes;
  for (const auto& [entry, b] : recent_) {
    if (entry == &e) bytes = b;
  }
  if (bytes == nullptr) {
    // Drop the oldest first, so that at most keep_tensors buffers (this one included) are held.
    while (!recent_.empty() &&
           static_cast<int>(recent_.size()) >= std::max(options_.keep_tensors, 1)) {
      recent_.pop_front();
    }
    // Whole 8-byte words, so that the generator needs no tail case; not zeroed first (every byte
    // is written).
    bytes.reset(new uint8_t[(e.info.end + 7) / 8 * 8]);
    Generate(e, bytes.get());
    generated_ += e.info.end;
    recent_.emplace_back(&e, bytes);
  }
  TensorRef ref;
  ref.info = &e.info;
  ref.bytes = {bytes.get(), static_cast<size_t>(e.info.end)};
  return ref;
}

void SyntheticCheckpoint::Generate(const Entry& e, uint8_t* out) const {
  const uint64_t seed = Mix(options_.seed ^ NameHash(e.info.name));
  const Kind kind = e.kind;
  const uint64_t bytes = e.info.end;
  if (kind == Kind::kGlobalScale || kind == Kind::kInputScale) {
    const float v = kind == Kind::kGlobalScale ? kNvfp4GlobalScale : kInputScale;
    std::memcpy(out, &v, 4);
    return;
  }
  if (kind == Kind::kInt4Shape) {
    const int32_t v[2] = {static_cast<int32_t>(e.rows), static_cast<int32_t>(e.cols)};
    std::memcpy(out, v, 8);
    return;
  }
  // One 64-bit word per bf16 value (weights, biases, INT4 scales) or fp32 value (FP8 scales), or
  // per 8 bytes (codes, scales).
  const bool per_value = kind == Kind::kWeight || kind == Kind::kOnes || kind == Kind::kBias ||
                         kind == Kind::kInt4Scale;
  const uint64_t words = kind == Kind::kFp8Scale ? bytes / 4
                         : per_value             ? bytes / 2
                                                 : (bytes + 7) / 8;
  auto run = [&](uint64_t w0, uint64_t w1) {
    for (uint64_t w = w0; w < w1; ++w) {
      const uint64_t r = Mix(seed + (w + 1) * kGamma);
      switch (kind) {
        case Kind::kWeight: {
          const float s = static_cast<float>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) +
                                             ((r >> 32) & 0xFFFF) + (r >> 48));
          const uint16_t b = FloatToBf16((s - kIrwinHallMean) * (kWeightStd / kIrwinHallStd));
          std::memcpy(out + 2 * w, &b, 2);
          break;
        }
        case Kind::kOnes: {
          const uint16_t b = 0x3F80;  // bf16 1.0
          std::memcpy(out + 2 * w, &b, 2);
          break;
        }
        case Kind::kBias: {
          const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
          const uint16_t b = FloatToBf16(u * kWeightStd);
          std::memcpy(out + 2 * w, &b, 2);
          break;
        }
        case Kind::kPacked:
          std::memcpy(out + 8 * w, &r, 8);
          break;
        case Kind::kInt4Scale: {
          const uint16_t b =
              FloatToBf16(kInt4Scale * (0.875f + 0.0625f * static_cast<float>(r & 3)));
          std::memcpy(out + 2 * w, &b, 2);
          break;
        }
        case Kind::kFp8Code: {
          // Per byte b: the sign and mantissa of b, exponent field 4 + (b >> 3 & 7); (b & 0xbf) +
          // 0x20 <= 0xdf carries into no other byte.
          const uint64_t v = (r & 0xbfbfbfbfbfbfbfbfull) + 0x2020202020202020ull;
          std::memcpy(out + 8 * w, &v, 8);
          break;
        }
        case Kind::kFp8Scale: {
          const float v = kFp8Scale * (0.875f + 0.0625f * static_cast<float>(r & 3));
          std::memcpy(out + 4 * w, &v, 4);
          break;
        }
        case Kind::kBlockScale: {
          uint64_t v = 0x3636363636363636ull + (r & 0x0303030303030303ull);
          std::memcpy(out + 8 * w, &v, 8);
          break;
        }
        default:
          break;
      }
    }
  };
  const uint64_t kChunk = uint64_t{1} << 18;  // words a thread takes at least
  int threads = options_.threads > 0 ? options_.threads
                                     : static_cast<int>(std::thread::hardware_concurrency());
  threads = static_cast<int>(std::clamp<uint64_t>(words / kChunk, 1, std::max(threads, 1)));
  if (threads == 1) {
    run(0, words);
    return;
  }
  std::vector<std::thread> pool;
  const uint64_t per = (words + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const uint64_t w0 = std::min(words, t * per), w1 = std::min(words, w0 + per);
    pool.emplace_back(run, w0, w1);
  }
  for (auto& th : pool) th.join();
}

}  // namespace mlaserve
