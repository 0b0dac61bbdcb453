// Continuous-batching scheduler: decides, one iteration at a time, which sequences run, which of
// their tokens are computed, and which KV blocks hold them.
//
// Per step (Schedule): decodes of running sequences first (1 token each, in priority order), then
// prefill chunks of partially prefilled running sequences, then admission of waiting requests
// (highest priority first, first come first served among equals), all within max_running_seqs
// and max_tokens_per_step. When blocks run out, the lowest-priority, latest-arrived running
// sequence not yet scheduled this step is preempted by recompute: its blocks are freed and it
// returns to the waiting queue with its generated tokens kept after its prompt, so prefilling it
// again continues it exactly (its full blocks usually survive in the prefix cache). A step's
// results (OnStepResult) commit the computed tokens, register newly filled blocks for prefix
// reuse, append sampled tokens and apply the stop rules.
//
// One step is in flight at a time: Schedule, then OnStepResult, then Schedule again. Abort and
// Finish may be called at any point; they free blocks at once (safe even while a step is in
// flight: the workers run steps in order, so a block reused by the next step is written after the
// in-flight step is done with it). Everything is deterministic: the same calls give the same plans.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/scheduler/kv_block_manager.h"

namespace mlaserve {

struct SchedulerConfig {
  int32_t num_blocks = 4096;  // KV blocks in the workers' pool
  int32_t block_size = kKvBlockTokens;
  int32_t max_running_seqs = 256;      // sequences holding KV blocks at once
  int32_t max_tokens_per_step = 8192;  // tokens computed per step, decodes and prefill chunks
  int32_t max_model_len = 163840;      // context: prompt + generated tokens
  int32_t max_waiting = 4096;          // queued requests beyond this are rejected as overloaded
  // Largest prefill chunk of one sequence in one step (0: limited only by the step budget).
  // Smaller chunks bound the latency a long prompt adds to the decodes batched with it.
  int32_t max_prefill_chunk = 0;
  bool enable_prefix_caching = true;
  int32_t vocab_size = 0;                // > 0: token ids are checked against it on admission
  KvBlockHasher block_hasher = nullptr;  // null: KvBlockManager::BlockHash (tests weaken it)
  // The first plan's step id. A scheduler made for a restarted worker job continues its
  // predecessor's ids, so that a late result of the failed job never matches a new step.
  uint64_t first_step_id = 0;
};

struct Request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 16;  // generated tokens at most (>= 1)
  int32_t min_tokens = 0;   // no stop rule applies before this many generated tokens
  std::vector<int32_t> stop_token_ids;
  std::vector<int32_t> eos_token_ids;
  bool ignore_eos = false;
  int32_t priority = 0;  // higher runs first; equal priorities run in arrival order
};

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* FinishReasonName(FinishReason reason);  // "stop", "length", "abort", ""

// One sequence's work in a step. Its token and block ids are slices of StepPlan's flat arrays.
struct ScheduledSeq {
  uint64_t seq_id = 0;
  int32_t start_pos = 0;     // tokens already in the KV cache; the new ones follow
  int32_t token_offset = 0;  // into StepPlan::token_ids
  int32_t num_tokens = 0;
  int32_t block_offset = 0;   // into StepPlan::block_ids: the full block table of the sequence
  int32_t num_blocks = 0;     // covers start_pos + num_tokens tokens
  bool sample = false;        // this chunk ends at the last known token: sample the next one
  int32_t prompt_len = 0;     // the request's own prompt (generated tokens follow it)
  int32_t num_generated = 0;  // tokens generated so far (the sampling step index)
};

struct StepPlan {
  uint64_t step_id = 0;
  std::vector<ScheduledSeq> seqs;   // decodes first, then prefill chunks
  std::vector<int32_t> token_ids;   // all new tokens of the step, sequence after sequence
  std::vector<int32_t> block_ids;   // all block tables, sequence after sequence
  std::vector<uint64_t> preempted;  // running sequences sent back to waiting in this step
  // Sequences that ended (finished or aborted) since the previous non-empty plan: workers drop
  // their state. Empty plans carry none (they are not sent); the ids wait for the next step.
  std::vector<uint64_t> released;

  bool empty() const { return seqs.empty(); }
  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  std::span<const int32_t> tokens(const ScheduledSeq& s) const {
    return {token_ids.data() + s.token_offset, static_cast<size_t>(s.num_tokens)};
  }
  std::span<const int32_t> blocks(const ScheduledSeq& s) const {
    return {block_ids.data() + s.block_offset, static_cast<size_t>(s.num_blocks)};
  }
};

struct SampledToken {
  uint64_t seq_id = 0;
  int32_t token_id = 0;
};

// What happened to one sequence: a token appended and/or the sequence finished.
struct SeqEvent {
  uint64_t seq_id = 0;
  bool has_token = false;
  int32_t token_id = 0;
  FinishReason finish = FinishReason::kNone;
  int32_t num_generated = 0;
};

class Scheduler {
 public:
  // Checks the configuration (positive sizes; the pool holds at least one max_model_len sequence,
  // otherwise such a sequence could never finish).
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const SchedulerConfig& config);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. InvalidArgument for an empty prompt, prompt + max_tokens beyond the
  // context, or parameters out of range; AlreadyExists for an id in use; ResourceExhausted
  // ("overloaded: N requests waiting") when the waiting queue is full.
  absl::Status Add(Request request);

  // Builds the next step (possibly empty). FailedPrecondition if the previous step's result has
  // not been delivered.
  absl::StatusOr<StepPlan> Schedule();

  // Commits the step in flight: every scheduled chunk is now in the cache; `sampled` has one
  // token per sequence scheduled with sample = true (sequences aborted meanwhile may be present
  // or absent). Returns events in plan order. On error nothing is changed.
  absl::StatusOr<std::vector<SeqEvent>> OnStepResult(std::span<const SampledToken> sampled);

  // Ends a waiting or running sequence now (client disconnect or abort), freeing its blocks.
  // NotFound for an unknown or already finished id.
  absl::StatusOr<SeqEvent> Abort(uint64_t id) { return Finish(id, FinishReason::kAbort); }
  // Ends a sequence for a reason found outside the scheduler (kStop: a stop string matched).
  absl::StatusOr<SeqEvent> Finish(uint64_t id, FinishReason reason);

  const SchedulerConfig& config() const { return config_; }
  const KvBlockManager& blocks() const { return blocks_; }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  bool has_unfinished() const { return !seqs_.empty(); }
  bool step_in_flight() const { return in_flight_; }
  int64_t num_preemptions() const { return num_preemptions_; }
  uint64_t next_step_id() const { return next_step_id_; }

  // Read-only view of a live sequence, for tests and metrics. Null if unknown or finished.
  struct SeqView {
    std::span<const int32_t> tokens;  // prompt then generated tokens
    int32_t prompt_len;
    int32_t num_generated;
    int32_t num_computed;  // tokens whose KV is in the cache (committed)
    std::span<const int32_t> block_table;
    bool running;
  };
  std::optional<SeqView> View(uint64_t id) const;
  // Ids of running sequences in scheduling order, then waiting ones in queue order.
  std::vector<uint64_t> RunningIds() const;
  std::vector<uint64_t> WaitingIds() const;

 private:
  struct Sequence;
  struct QueueOrder {
    bool operator()(const Sequence* a, const Sequence* b) const;
  };

  explicit Scheduler(const SchedulerConfig& config);

  int32_t BlocksFor(int32_t tokens) const {
    return (tokens + config_.block_size - 1) / config_.block_size;
  }
  // Grows `seq`'s table to cover `tokens` tokens, preempting unscheduled running sequences after
  // position `index` in running_ when the pool is empty. Returns the tokens covered (<= tokens).
  int32_t GrowTable(Sequence* seq, int32_t tokens, size_t index, StepPlan* plan);
  void Preempt(Sequence* seq, StepPlan* plan);
  void ReleaseBlocks(Sequence* seq);
  void AppendToPlan(Sequence* seq, int32_t num_tokens, StepPlan* plan);
  bool TryAdmit(Sequence* seq, int32_t* budget, StepPlan* plan);
  FinishReason StopRule(const Sequence& seq, int32_t token) const;
  void Remove(Sequence* seq);

  SchedulerConfig config_;
  KvBlockManager blocks_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  std::set<Sequence*, QueueOrder> waiting_;
  std::vector<Sequence*> running_;  // sorted by QueueOrder
  uint64_t next_arrival_ = 0;
  uint64_t next_step_id_ = 0;
  bool in_flight_ = false;
  struct InFlight {
    Sequence* seq;  // null once aborted
    uint64_t seq_id;
    int32_t num_tokens;
    bool sample;
  };
  std::vector<InFlight> in_flight_seqs_;
  absl::flat_hash_set<uint64_t> aborted_in_flight_;
  std::vector<uint64_t> released_;
  int64_t num_preemptions_ = 0;
  uint64_t step_stamp_ = 0;  // marks sequences scheduled in the current Schedule() call
};

}  // namespace mlaserve
