// The tensors a DeepSeek-V3 / Kimi-K2 checkpoint of a given config would hold, made on demand
// from a seed: full-size models (Kimi-K2.5, DeepSeek-R1) benchmarked without their 540 GB
// checkpoints (issue "NCCL, CUDA graphs and the full-size Kimi-K2.5 shard").
//
// Names, dtypes and shapes are those of the released checkpoints (config.tensor_prefix, then
// model.embed_tokens, model.layers.L.{input_layernorm, post_attention_layernorm, self_attn.*,
// mlp.*}, model.norm, lm_head); a linear module is NVFP4 (ModelOpt layout: .weight U8
// [out, in/2], .weight_scale F8_E4M3 [out, in/16], .weight_scale_2 F32 [], .input_scale F32 [])
// when the config's quantization is NVFP4 and its exclude list does not name the module, and
// compressed-tensors INT4 (.weight_packed I32 [out, in/8], .weight_scale BF16 [out, in/group],
// .weight_shape I32 [2]) when it is pack-quantized INT4 and its ignore list does not name the
// module (the router, not a Linear for compressed-tensors, stays BF16), and DeepSeek FP8 block
// (.weight F8_E4M3 [out, in], .weight_scale_inv F32 [ceil(out / 128), ceil(in / 128)]) for every
// linear module but the router and lm_head when it is FP8 block (DeepSeek-V3 / R1's release).
//
// Values (plausible, not trained): bf16 weights ~ N(0, 0.02) (Irwin-Hall of four 16-bit
// uniforms), norm weights 1.0, e_score_correction_bias uniform [0, 0.02); NVFP4 codes uniform
// over the 16 e2m1 codes (rms 2.93), block scales e4m3 uniform over {0.875, 0.9375, 1.0, 1.125},
// weight_scale_2 = 0.02 / 2.93 so that a dequantized weight has std ~0.02, input_scale 1/448;
// INT4 nibbles uniform (q uniform over [-8, 7], rms 4.64), group scales bf16 uniform over
// {0.875, 0.9375, 1.0, 1.0625} x 0.02 / 4.64; FP8 codes with a uniform sign, mantissa and exponent
// field in 4..11 (|v| in 2^-3 .. 30, rms 9.57; no NaN codes), block scales fp32 uniform over
// {0.875, 0.9375, 1.0, 1.0625} x 0.02 / 9.57.
// Every 8 bytes come from SplitMix64 of (tensor seed, word index): the bytes depend on the seed
// and the tensor name only, not on the order of Get calls or the thread count.
//
// Memory: a tensor is generated whole when Get asks for it and kept among the `keep_tensors`
// most recent ones; a TensorRef stays valid until that many later Gets (the loader reads a
// module's 2-4 tensors, then copies its slice). Kimi-K2.5's largest tensors (embed_tokens,
// lm_head) are 2.3 GB each.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/safetensors.h"

namespace mlaserve {

struct SyntheticCheckpointOptions {
  uint64_t seed = 1;
  // Which linear modules an NVFP4 config quantizes:
  //   kModelOpt: every one the exclude list does not name, each with an input_scale (NVIDIA's
  //     ModelOpt exports, e.g. nvidia/DeepSeek-R1-FP4 quantizes layers.0.mlp too);
  //   kRoutedExperts: routed experts only, no input_scale (the layout mlaserve-quantize writes,
  //     as tests/fixtures/models/kimi-tiny-nvfp4).
  enum class Nvfp4Modules { kModelOpt, kRoutedExperts };
  Nvfp4Modules nvfp4_modules = Nvfp4Modules::kModelOpt;
  int keep_tensors = 6;
  int threads = 0;  // generator threads for large tensors; 0: hardware concurrency
};

class SyntheticCheckpoint : public TensorSource {
 public:
  explicit SyntheticCheckpoint(const ModelConfig& config, SyntheticCheckpointOptions options = {});
  ~SyntheticCheckpoint() override;

  using TensorSource::Get;
  bool Has(std::string_view name) const override;
  absl::StatusOr<TensorRef> Get(std::string_view name) const override;
  absl::StatusOr<const TensorInfo*> Info(std::string_view name) const override;
  std::vector<std::string> Names() const override;
  std::string Origin() const override;

  // Bytes of all tensors (what the checkpoint would occupy on disk, less headers).
  uint64_t total_bytes() const { return total_bytes_; }
  // Bytes generated so far (every Get generates; a benchmark prints the rate).
  uint64_t generated_bytes() const;

 private:
  enum class Kind : uint8_t {
    kWeight,
    kOnes,
    kBias,
    kPacked,
    kBlockScale,
    kGlobalScale,
    kInputScale,
    kInt4Scale,
    kInt4Shape,
    kFp8Code,
    kFp8Scale
  };
  struct Entry {
    TensorInfo info;
    Kind kind;
    int64_t rows = 0, cols = 0;  // kInt4Shape: the module's weight shape
  };
  Entry& Add(std::string name, DType dtype, std::vector<int64_t> shape, Kind kind);
  void AddLinear(const std::string& module, int64_t out, int64_t in);
  void Generate(const Entry& e, uint8_t* out) const;

  ModelConfig config_;
  SyntheticCheckpointOptions options_;
  std::map<std::string, Entry, std::less<>> entries_;
  uint64_t total_bytes_ = 0;
  mutable std::mutex mu_;
  mutable std::deque<std::pair<const Entry*, std::shared_ptr<uint8_t[]>>> recent_;
  mutable uint64_t generated_ = 0;
};

}  // namespace mlaserve
