// The DeepSeek-V3 forward pass (also DeepSeek-V2 and Kimi-K2/K2.5), written once against Ops.
//
// One instance is one rank's shard of the model (DESIGN.md "Model"): attention heads split
// across ranks (the MLA latent cache, needed by every head, is held on every rank), dense and
// shared-expert MLPs split along their intermediate dimension, routed experts either whole per
// rank (expert-parallel) or split along their intermediate dimension (tensor-parallel), the
// embedding and lm_head split along the vocabulary. Partial sums are all-reduced; logits are
// gathered so that every rank holds the full vocabulary row for sampling.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "worker/backend/ops.h"
#include "worker/comm/communicator.h"

namespace mlaserve {

enum class MoeParallelism { kExpert, kTensor };

struct ModelOptions {
  KvCacheFormat kv_format = KvCacheFormat::kBf16;
  int num_kv_blocks = 64;  // per layer, 64 tokens each
  MoeParallelism moe = MoeParallelism::kExpert;
  // Run every sequence through the absorbed (cache-reading) attention, also fresh prefills.
  bool force_absorbed = false;
  // Replay single-token decode steps as graphs (backends that have them, one rank), one graph
  // per (batch bucket, block-table width bucket), captured on the second step of its shape.
  bool graphs = false;
  // With `graphs`, also capture the decode steps of several ranks when their communicators'
  // device collectives can be captured (Communicator::CapturesDeviceCollectives: NCCL, and the
  // DCP group's as well): every rank captures and replays the same steps, so the collectives in
  // the graphs stay in the same order on every rank. Off by default until it has run on a machine
  // with several GPUs (issue 22); tested on one GPU with a capturable two-rank stand-in
  // (gpu_model_test MultiRankGraphReplayMatchesEager).
  bool multi_rank_graphs = false;
  // The deterministic mode (issue 23): a request's logits do not depend on what shares its steps
  // nor on whether its tokens were decoded, prefilled or recomputed after preemption. Every
  // token's attention runs as a one-token decode over the cache (StepLayoutOptions::
  // per_token_attention) and the backend's ops are batch-invariant (Ops::SetBatchInvariant).
  // Prefill then costs O(prompt x context) attention through the decode kernel.
  bool deterministic = false;
  // The fp8 caches' MLA decode on e4m3 tensor cores where the backend has such a kernel (SM90,
  // 64+ query rows: Ops::SetMlaFp8TensorCores); false keeps the exact form.
  bool mla_fp8_tensor_cores = true;
  // Decode context parallelism (issue 20): the ranks split the latent cache by blocks (global
  // block g on rank g % dcp) instead of each holding all of it, and each attends with every head
  // over its own rows; partial outputs are merged by log-sum-exp (StepLayoutOptions::dcp_size,
  // Ops::MlaAbsorb / MlaAttend / MlaMergeExpand). 1: off; otherwise the rank count (the only
  // grouping so far). num_kv_blocks stays per rank; the step plans' block ids count all ranks'
  // pools (dcp x num_kv_blocks). Every token's attention runs as a one-token decode over the
  // cache (as in the deterministic mode), prefills included. dcp divides the rank count: ranks
  // r and r' with r / dcp == r' / dcp form a group that splits the cache (rank r stores blocks
  // g with g % dcp == r % dcp), and the groups hold the same shares of it (replicas).
  int dcp = 1;
  // Load the shard of rank `shard_rank` of `shard_world` (heads, vocabulary, MLP slices and
  // experts split as a world of that size splits them) instead of the communicator's own rank
  // and size, when shard_world > 0. Meant for a single-rank communicator (a one-GPU benchmark of
  // one rank of a multi-GPU deployment): the collectives are then skipped, so each step computes
  // this rank's partial sums only and returns its own vocabulary slice of the logits
  // [rows, vocab_shard().count]. Tokens outside the rank's vocabulary slice embed to zeros.
  int shard_rank = 0;
  int shard_world = 0;
};

// A contiguous range [begin, begin + count) of `total` items owned by one rank: the first
// total % world ranks get one more.
struct ShardRange {
  int begin = 0;
  int count = 0;
  static ShardRange Of(int total, int rank, int world);
};

class DeepseekV3Model {
 public:
  // A checkpoint folder: its config.json (+ hf_quant_config.json) and safetensors.
  static absl::StatusOr<std::unique_ptr<DeepseekV3Model>> Load(const std::string& folder,
                                                               const ModelOptions& options,
                                                               Ops& ops, Communicator& comm);
  // Any tensor source (a Checkpoint, a SyntheticCheckpoint) for `config`. The source is read
  // only while loading.
  static absl::StatusOr<std::unique_ptr<DeepseekV3Model>> Load(const TensorSource& source,
                                                               const ModelConfig& config,
                                                               const ModelOptions& options,
                                                               Ops& ops, Communicator& comm);
  ~DeepseekV3Model();

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }

  // Runs the step; returns the logits [logits_rows.size(), vocab_size] fp32 on the backend's
  // device, on every rank, valid until the next Forward.
  absl::StatusOr<Tensor> Forward(const StepBatch& batch);
  // The same, with the logits copied to the host (tests, tools).
  absl::Status Forward(const StepBatch& batch, std::vector<float>* logits);

  Ops& ops() { return ops_; }
  Communicator& comm() { return comm_; }
  // Turns graph replay of decode steps on or off (benchmarks compare the two).
  void set_graphs(bool on) { options_.graphs = on; }
  // Decode graphs captured so far (one per batch and table-width bucket; tests).
  int captured_graphs() const {
    int n = 0;
    for (const auto& [shape, g] : graphs_) n += g.id >= 0;
    return n;
  }
  // Switches the deterministic mode (ModelOptions::deterministic) between steps; the graphs
  // captured so far hold the other mode's kernels and are dropped (captured again as needed).
  absl::Status set_deterministic(bool on);

  // This rank's shard: attention heads, vocabulary rows, routed experts (all of them under
  // tensor-parallel MoE) and each expert's intermediate slice.
  const ShardRange& heads_shard() const { return heads_; }
  const ShardRange& vocab_shard() const { return vocab_; }
  const ShardRange& experts_shard() const { return experts_; }
  const ShardRange& expert_inter_shard() const { return expert_inter_; }

  // Bytes of weights and KV cache this rank holds.
  size_t weight_bytes() const { return weight_bytes_; }
  // Of which the embedding table's slice (a step reads only its tokens' rows of it).
  size_t embedding_bytes() const { return embed_.nbytes(); }
  // Of which the routed experts (all layers; a decode step reads only the chosen experts').
  size_t expert_bytes() const;
  size_t kv_cache_bytes() const;
  // The per-layer scale of the fp8 cache format (1.0 unless the checkpoint exports one).
  float kv_fp8_scale(int layer) const;

 private:
  struct Layer;
  DeepseekV3Model(Ops& ops, Communicator& comm);
  absl::Status LoadWeights(const TensorSource& ckpt);
  absl::Status Attention(Layer& layer, const StepTensors& step, const Tensor& h, Tensor& out);
  absl::Status Mlp(Layer& layer, const Tensor& h, Tensor& out);
  absl::Status AllReduce(Tensor& t);
  // Whether a step's collectives may be captured into a graph (one rank, or
  // ModelOptions::multi_rank_graphs with capturable communicators).
  bool CapturableCollectives() const;
  // Embedding to logits for a step whose metadata is uploaded (the graphs record this part).
  absl::StatusOr<Tensor> Layers(const StepTensors& step);
  absl::StatusOr<Tensor> ForwardGraph();

  Ops& ops_;
  Communicator& comm_;
  // The rank's decode-context-parallel group (ModelOptions::dcp): comm_ itself when the group is
  // every rank, else a split of it.
  std::unique_ptr<Communicator> dcp_group_;
  Communicator* dcp_comm_ = nullptr;
  ModelConfig config_;
  ModelOptions options_;
  ShardRange heads_;
  ShardRange vocab_;
  ShardRange dense_inter_;
  ShardRange shared_inter_;
  ShardRange experts_;       // expert-parallel: local experts
  ShardRange expert_inter_;  // tensor-parallel: local slice of each expert
  MlaShape mla_;
  MoeRouting routing_;
  Tensor embed_;  // [vocab_.count, hidden]
  Tensor final_norm_;
  LinearWeight lm_head_;  // [vocab_.count, hidden]
  Tensor inv_freq_;
  float rope_scaling_ = 1.0f;
  std::vector<std::unique_ptr<Layer>> layers_;
  size_t weight_bytes_ = 0;
  StepLayout layout_;  // the running step's layout (the backend's StepTensors point into it)
  struct DecodeGraph {
    int id = -1;
    uint64_t epoch = 0;
    int eager_runs = 0;
    Tensor logits;  // where the replays leave the logits
  };
  std::map<std::pair<int, int>, DecodeGraph> graphs_;  // by (batch bucket, table width)
};

}  // namespace mlaserve
