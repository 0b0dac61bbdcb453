#include "worker/model/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/backend/ops.h"

namespace mlaserve {
namespace {

double MiB(size_t b) { return static_cast<double>(b) / (1 << 20); }

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

size_t RoundUp128(size_t x) { return (x + 127) / 128 * 128; }

bool EndsWith(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// The N of "...layers.N...", or -1.
int LayerIndex(const std::string& name) {
  const size_t at = name.find("layers.");
  if (at == std::string::npos) return -1;
  int n = 0;
  size_t i = at + 7;
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) n = n * 10 + (name[i] - '0');
  return n;
}

}  // namespace

std::string MemoryPlan::Describe() const {
  return absl::StrFormat(
      "weights %.0f MiB + KV cache %.0f MiB (%d blocks x %.2f MiB) + step workspace %.0f MiB = "
      "%.0f MiB of a budget of %.0f MiB",
      MiB(weights), MiB(kv_block_bytes * static_cast<size_t>(kv_blocks)), kv_blocks,
      MiB(kv_block_bytes), MiB(workspace),
      MiB(weights + workspace + kv_block_bytes * static_cast<size_t>(kv_blocks)), MiB(budget));
}

absl::StatusOr<MemoryPlan> PlanDeviceMemory(const TensorSource& ckpt, const ModelConfig& c,
                                            const MemoryPlanInput& in) {
  MemoryPlan p;
  const size_t world = static_cast<size_t>(std::max(in.world, 1));
  // Weights: replicated tensors (the latent projections, norms, routers) whole, the rest split
  // over the ranks (heads, vocabulary, MLP slices, experts). Non-expert NVFP4 projections are
  // held as bf16 on the GPU (4 bytes per packed byte; their scales are folded in); kv_b is held
  // twice (prefill's projection and decode's absorbed halves).
  for (const std::string& name : ckpt.Names()) {
    auto info = ckpt.Info(name);
    if (!info.ok()) return info.status();
    const TensorInfo& t = **info;
    size_t bytes = t.end - t.begin;
    // Layers past num_hidden_layers (DeepSeek's multi-token-prediction layer) are never loaded.
    if (LayerIndex(name) >= c.num_hidden_layers) continue;
    const bool expert = Contains(name, ".experts.");
    // INT4 (compressed-tensors) routed experts stay packed (kernels/moe/int4_moe_layout.h): 4 bits
    // a weight + one bf16 scale per 32 weights (whatever the checkpoint's group size), of the
    // kernels' shapes padded to multiples of 128. FP8 block routed experts stay FP8
    // (kernels/moe/fp8_moe_layout.h): 1 byte a weight + one fp32 scale per 8 x 64 weights, of the
    // padded shapes. The other FP8 projections (attention, dense and shared MLPs, kv_b) are held
    // in bf16 on the GPU (CudaOps::UploadLinear says why), as are other INT4 modules: 8 values
    // per I32 word -> 16 bytes; 1-byte e4m3 -> 2 bytes. Their checkpoint scales are counted in
    // those figures.
    if (t.dtype == DType::kI32 && EndsWith(name, ".weight_packed")) {
      if (expert && t.shape.size() == 2) {
        const size_t rows = RoundUp128(static_cast<size_t>(t.shape[0]));
        const size_t cols = RoundUp128(static_cast<size_t>(t.shape[1]) * 8);
        bytes = rows * cols / 2 + rows * cols / 16;
      } else {
        bytes *= 4;
      }
    }
    if (t.dtype == DType::kF8E4M3 && EndsWith(name, ".weight")) {
      if (expert && t.shape.size() == 2) {
        const size_t rows = RoundUp128(static_cast<size_t>(t.shape[0]));
        const size_t cols = RoundUp128(static_cast<size_t>(t.shape[1]));
        bytes = rows * cols + rows * cols / 128;
      } else {
        bytes *= 2;
      }
    }
    if (EndsWith(name, ".weight_scale_inv") || EndsWith(name, ".weight_shape") ||
        (t.dtype == DType::kBF16 && EndsWith(name, ".weight_scale"))) {
      bytes = 0;
    }
    if (!expert && t.dtype == DType::kU8 && Contains(name, ".weight")) bytes *= 4;
    if (!expert && Contains(name, "weight_scale")) bytes = 0;
    if (t.dtype == DType::kF32 && Contains(name, "proj")) bytes /= 2;  // fp32 weights -> bf16
    if (Contains(name, "kv_b_proj.weight")) bytes *= 2;
    const bool replicated = Contains(name, "kv_a_proj") || Contains(name, "q_a_proj") ||
                            Contains(name, "layernorm") || Contains(name, "norm.weight") ||
                            (Contains(name, "mlp.gate.") && !Contains(name, "gate_proj"));
    p.weights += replicated ? bytes : (bytes + world - 1) / world;
  }
  // KV: every rank holds the whole latent cache of every layer.
  p.kv_block_bytes = static_cast<size_t>(kKvBlockTokens) * KvCacheBytesPerToken(in.kv_format) *
                     static_cast<size_t>(c.num_hidden_layers);
  // Workspace of the largest step (bytes per token of the activations live at once, the MoE
  // dispatch rows, the prefill keys decompressed through kv_b, the logits and the sampler's
  // sort), plus 512 MiB for cuBLAS(Lt) workspaces and the CUDA context's own use.
  const size_t T = static_cast<size_t>(in.max_step_tokens);
  const size_t heads = (static_cast<size_t>(c.num_attention_heads) + world - 1) / world;
  const size_t H = c.hidden_size, qk = c.qk_head_dim(), v = c.v_head_dim;
  const size_t top_k = std::max(c.num_experts_per_tok, 1);
  const size_t inter =
      std::max(c.intermediate_size, c.moe_intermediate_size * std::max(c.n_shared_experts, 1));
  const size_t per_token = 4 * H * 3 + 2 * heads * (qk + v + 2 * kMlaQkDim) + 2 * 3 * 576 +
                           2 * 3 * inter + top_k * (2 * c.moe_intermediate_size + 4 * H + 16) +
                           8 * c.n_routed_experts;
  const size_t prefill = static_cast<size_t>(in.max_prefill_keys) *
                         (2 * kMlaQkDim + 2 * heads * (c.qk_nope_head_dim + v));
  const size_t rows = static_cast<size_t>(std::max(in.max_seqs, 1));
  const size_t vocab = static_cast<size_t>(c.vocab_size);
  const size_t logits = rows * (vocab / world + 1) * 4 + rows * vocab * (4 + 16);
  p.workspace = T * per_token + prefill + logits + (512u << 20);
  if (in.deterministic) p.workspace += Ops::kPerTokenAttentionWorkspaceBytes;
  p.budget = static_cast<size_t>(static_cast<double>(in.free_bytes) * in.memory_fraction);
  const size_t fixed = p.weights + p.workspace;
  if (fixed >= p.budget) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the model does not fit on this GPU: weights %.0f MiB + step workspace %.0f MiB exceed "
        "%.0f MiB (%.2f of %.0f MiB free); use more ranks, a quantized checkpoint, a larger "
        "--gpu-memory-fraction or fewer tokens per step",
        MiB(p.weights), MiB(p.workspace), MiB(p.budget), in.memory_fraction, MiB(in.free_bytes)));
  }
  const int fit =
      static_cast<int>(std::min<size_t>((p.budget - fixed) / p.kv_block_bytes, 1 << 30));
  if (in.kv_blocks > 0) {
    if (in.kv_blocks > fit) {
      p.kv_blocks = in.kv_blocks;
      return absl::ResourceExhaustedError(absl::StrCat("--kv-blocks ", in.kv_blocks,
                                                       " does not fit: at most ", fit,
                                                       " blocks do (", p.Describe(), ")"));
    }
    p.kv_blocks = in.kv_blocks;
  } else {
    p.kv_blocks = fit;
  }
  if (p.kv_blocks < 1) {
    return absl::ResourceExhaustedError(absl::StrCat("no room for the KV cache: ", p.Describe()));
  }
  return p;
}

}  // namespace mlaserve
