// The device memory plan of one rank, made before any weight is loaded (issue: "one memory
// plan"): weights + KV pool + step workspace must fit in the GPU's free memory times
// --gpu-memory-fraction. The KV pool takes what is left (or --kv-blocks, checked), and a plan
// that does not fit fails with the numbers of each part.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

struct MemoryPlanInput {
  int rank = 0, world = 1;
  bool expert_parallel = true;
  KvCacheFormat kv_format = KvCacheFormat::kBf16;
  size_t free_bytes = 0;         // cudaMemGetInfo's free, before loading
  double memory_fraction = 0.9;  // of free_bytes
  int kv_blocks = 0;             // 0: as many as fit
  int max_step_tokens = 2048;    // the scheduler's tokens per step
  int max_seqs = 256;            // the scheduler's running sequences (logits rows per step)
  int max_prefill_keys = 32768;  // keys (cached prefix + new) one step's prefills decompress
  bool deterministic = false;    // adds Ops::kPerTokenAttentionWorkspaceBytes
};

struct MemoryPlan {
  size_t weights = 0;    // this rank's share, in the CUDA backend's formats
  size_t workspace = 0;  // the largest step's scratch (activations, MoE, prefill keys, sampling)
  size_t kv_block_bytes = 0;  // one 64-token block over all layers
  size_t budget = 0;          // free_bytes * memory_fraction
  int kv_blocks = 0;
  std::string Describe() const;  // one line with every part in MiB
};

// Estimates each part from the checkpoint's tensor headers (no weight bytes are read) and the
// config. Errors name the part that does not fit.
absl::StatusOr<MemoryPlan> PlanDeviceMemory(const TensorSource& ckpt, const ModelConfig& config,
                                            const MemoryPlanInput& in);

}  // namespace mlaserve
