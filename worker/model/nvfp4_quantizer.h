// BF16/FP32 checkpoint folder in, ModelOpt-layout NVFP4 checkpoint folder out.
//
// Routed-expert linear weights become NVFP4 (kernels/moe/nvfp4_ref.h: per-16 block scale
// amax/6 in e4m3 relative to the global scale amax/(6*448), e2m1 with ModelOpt's tie rule):
//   <module>.weight        U8 [out, in/2]     two e2m1 codes a byte, low nibble = even column
//   <module>.weight_scale  F8_E4M3 [out, in/16]
//   <module>.weight_scale_2 F32 []            global scale
// Everything NVIDIA's NVFP4 exports keep in BF16 is copied unchanged: attention, the router
// (mlp.gate), shared experts, the dense MLPs of the first layers, embeddings, norms, lm_head.
// No input_scale is written: it needs activation calibration, which this tool does not run; the
// weight-only kernels do not use it.
// The conversion streams tensor by tensor: at most one tensor's fp32 copy is in memory.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace mlaserve {

struct QuantizeProgress {
  std::string tensor;
  size_t index = 0;  // tensors done, of `total`
  size_t total = 0;
  bool quantized = false;
};

struct QuantizeOptions {
  // Module patterns (fnmatch '*') that stay unquantized, written to hf_quant_config.json.
  std::vector<std::string> exclude_modules = {"lm_head", "*self_attn*", "*mlp.gate",
                                              "*shared_experts*", "*embed_tokens*"};
  std::function<void(const QuantizeProgress&)> progress;
};

absl::Status QuantizeCheckpointToNvfp4(const std::string& in_dir, const std::string& out_dir,
                                       const QuantizeOptions& options);

}  // namespace mlaserve
