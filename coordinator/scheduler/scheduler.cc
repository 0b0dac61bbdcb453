#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mlaserve {

struct Scheduler::Sequence {
  Request request;              // prompt moved into `tokens`
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int32_t prompt_len = 0;
  int32_t num_generated = 0;
  int32_t num_computed = 0;    // tokens whose KV is committed to the cache
  int32_t num_registered = 0;  // leading full blocks already offered to the prefix cache
  std::vector<int32_t> table;  // block ids; covers at least num_computed tokens
  PrefixChainTip tip;
  uint64_t arrival = 0;
  bool running = false;
  uint64_t scheduled_stamp = 0;  // == step_stamp_ when scheduled in the current Schedule()
};

bool Scheduler::QueueOrder::operator()(const Sequence* a, const Sequence* b) const {
  if (a->request.priority != b->request.priority) {
    return a->request.priority > b->request.priority;
  }
  return a->arrival < b->arrival;
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return "";
}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerConfig& config) {
  const std::pair<const char*, int32_t> positive[] = {
      {"num_blocks", config.num_blocks},
      {"block_size", config.block_size},
      {"max_running_seqs", config.max_running_seqs},
      {"max_tokens_per_step", config.max_tokens_per_step},
      {"max_model_len", config.max_model_len},
      {"max_waiting", config.max_waiting},
  };
  for (const auto& [name, value] : positive) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("scheduler config: ", name, " must be positive, got ", value));
    }
  }
  if (config.max_prefill_chunk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheduler config: max_prefill_chunk must be >= 0 (0: no limit), got ",
                     config.max_prefill_chunk));
  }
  const int64_t pool_tokens = static_cast<int64_t>(config.num_blocks) * config.block_size;
  if (pool_tokens < config.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scheduler config: the KV pool (", config.num_blocks, " blocks of ", config.block_size,
        " tokens = ", pool_tokens, " tokens) cannot hold one sequence of max_model_len ",
        config.max_model_len, " tokens; lower max_model_len or give the cache more memory"));
  }
  return std::unique_ptr<Scheduler>(new Scheduler(config));
}

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config), blocks_(config.num_blocks, config.block_size, config.block_hasher) {
  running_.reserve(config.max_running_seqs);
  next_step_id_ = config.first_step_id;
}

Scheduler::~Scheduler() = default;

absl::Status Scheduler::Add(Request request) {
  const int64_t prompt_len = static_cast<int64_t>(request.prompt.size());
  const std::string who = absl::StrCat("request ", request.id, ": ");
  if (prompt_len == 0) {
    return absl::InvalidArgumentError(who + "the prompt is empty; send at least one token");
  }
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "max_tokens must be at least 1, got ", request.max_tokens));
  }
  if (request.min_tokens < 0 || request.min_tokens > request.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(who, "min_tokens (", request.min_tokens,
                                                   ") must be between 0 and max_tokens (",
                                                   request.max_tokens, ")"));
  }
  const int64_t context = config_.max_model_len;
  if (prompt_len >= context) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, "the prompt has ", prompt_len, " tokens but the model's context is ", context,
        " tokens (prompt and output together); shorten the prompt to at most ", context - 1,
        " tokens"));
  }
  if (prompt_len + request.max_tokens > context) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, "the prompt (", prompt_len, " tokens) plus max_tokens (", request.max_tokens,
        ") exceeds the model's context of ", context, " tokens; lower max_tokens to at most ",
        context - prompt_len, " or shorten the prompt"));
  }
  const auto check_ids = [&](std::span<const int32_t> ids, const char* what) -> absl::Status {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || (config_.vocab_size > 0 && ids[i] >= config_.vocab_size)) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, what, "[", i, "] = ", ids[i], " is not a token id (vocabulary of ",
            config_.vocab_size > 0 ? absl::StrCat(config_.vocab_size) : "unknown", " size)"));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_ids(request.prompt, "prompt"); !s.ok()) return s;
  if (absl::Status s = check_ids(request.stop_token_ids, "stop_token_ids"); !s.ok()) return s;
  if (absl::Status s = check_ids(request.eos_token_ids, "eos_token_ids"); !s.ok()) return s;
  if (seqs_.contains(request.id)) {
    return absl::AlreadyExistsError(
        absl::StrCat(who, "a request with this id is already waiting or running"));
  }
  if (static_cast<int32_t>(waiting_.size()) >= config_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("overloaded: ", waiting_.size(), " requests waiting; retry later"));
  }

  auto seq = std::make_unique<Sequence>();
  seq->tokens = std::move(request.prompt);
  seq->tokens.reserve(seq->tokens.size() + request.max_tokens);
  seq->prompt_len = static_cast<int32_t>(prompt_len);
  seq->request = std::move(request);
  seq->arrival = next_arrival_++;
  Sequence* raw = seq.get();
  seqs_.emplace(raw->request.id, std::move(seq));
  waiting_.insert(raw);
  return absl::OkStatus();
}

void Scheduler::ReleaseBlocks(Sequence* seq) {
  // Last block first: released blocks become evictable in release order, so a chain's tail is
  // evicted before its head (the head is what other prompts share).
  for (auto it = seq->table.rbegin(); it != seq->table.rend(); ++it) blocks_.Release(*it);
  seq->table.clear();
}

void Scheduler::Preempt(Sequence* seq, StepPlan* plan) {
  ReleaseBlocks(seq);
  // Recompute restarts from token 0; registered full blocks stay in the prefix cache and are
  // usually found again on re-admission.
  seq->num_computed = 0;
  seq->num_registered = 0;
  seq->tip = PrefixChainTip{};
  seq->running = false;
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  waiting_.insert(seq);
  plan->preempted.push_back(seq->request.id);
  ++num_preemptions_;
}

int32_t Scheduler::GrowTable(Sequence* seq, int32_t tokens, size_t index, StepPlan* plan) {
  const size_t needed = static_cast<size_t>(BlocksFor(tokens));
  while (seq->table.size() < needed) {
    const int32_t block = blocks_.Allocate();
    if (block >= 0) {
      seq->table.push_back(block);
      continue;
    }
    Sequence* victim = nullptr;
    for (size_t j = running_.size(); j-- > index + 1;) {
      if (running_[j]->scheduled_stamp != step_stamp_) {
        victim = running_[j];
        break;
      }
    }
    if (victim == nullptr) break;
    Preempt(victim, plan);
  }
  return std::min<int32_t>(tokens, static_cast<int32_t>(seq->table.size()) * config_.block_size);
}

void Scheduler::AppendToPlan(Sequence* seq, int32_t num_tokens, StepPlan* plan) {
  ScheduledSeq s;
  s.seq_id = seq->request.id;
  s.start_pos = seq->num_computed;
  s.token_offset = static_cast<int32_t>(plan->token_ids.size());
  s.num_tokens = num_tokens;
  s.block_offset = static_cast<int32_t>(plan->block_ids.size());
  s.num_blocks = static_cast<int32_t>(seq->table.size());
  s.sample = seq->num_computed + num_tokens == static_cast<int32_t>(seq->tokens.size());
  s.prompt_len = seq->prompt_len;
  s.num_generated = seq->num_generated;
  const auto first = seq->tokens.begin() + seq->num_computed;
  plan->token_ids.insert(plan->token_ids.end(), first, first + num_tokens);
  plan->block_ids.insert(plan->block_ids.end(), seq->table.begin(), seq->table.end());
  plan->seqs.push_back(s);
  seq->scheduled_stamp = step_stamp_;
  in_flight_seqs_.push_back(InFlight{seq, s.seq_id, num_tokens, s.sample});
}

bool Scheduler::TryAdmit(Sequence* seq, int32_t* budget, StepPlan* plan) {
  PrefixMatch match;
  if (config_.enable_prefix_caching) match = blocks_.FindPrefix(seq->tokens);
  const int32_t reused = static_cast<int32_t>(match.blocks.size()) * config_.block_size;
  int32_t chunk = std::min(static_cast<int32_t>(seq->tokens.size()) - reused, *budget);
  if (config_.max_prefill_chunk > 0) chunk = std::min(chunk, config_.max_prefill_chunk);
  const int32_t new_blocks = BlocksFor(reused + chunk) - static_cast<int32_t>(match.blocks.size());
  // Admission never preempts: a request waits until its first chunk fits in free blocks.
  if (new_blocks > blocks_.num_allocatable() - match.num_unreferenced) return false;

  for (const int32_t block : match.blocks) blocks_.Acquire(block);
  if (config_.enable_prefix_caching) {
    blocks_.RecordPrefixQuery(static_cast<int64_t>(seq->tokens.size()), reused);
  }
  seq->table = std::move(match.blocks);
  seq->tip = match.tip;
  seq->num_registered = static_cast<int32_t>(seq->table.size());
  seq->num_computed = reused;
  for (int32_t i = 0; i < new_blocks; ++i) seq->table.push_back(blocks_.Allocate());

  waiting_.erase(seq);
  seq->running = true;
  running_.insert(std::upper_bound(running_.begin(), running_.end(), seq, QueueOrder()), seq);
  AppendToPlan(seq, chunk, plan);
  *budget -= chunk;
  return true;
}

absl::StatusOr<StepPlan> Scheduler::Schedule() {
  if (in_flight_) {
    return absl::FailedPreconditionError(
        "Schedule called while a step is in flight; deliver its result with OnStepResult first");
  }
  ++step_stamp_;
  StepPlan plan;
  plan.seqs.reserve(running_.size() + 1);
  in_flight_seqs_.clear();
  int32_t budget = config_.max_tokens_per_step;

  // 1. Decodes, highest priority first. A decode that finds no free block preempts from the back
  // of the running order; if it is the back itself, it is the one preempted.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    if (static_cast<int32_t>(seq->tokens.size()) - seq->num_computed != 1) continue;
    if (GrowTable(seq, seq->num_computed + 1, i, &plan) <= seq->num_computed) {
      Preempt(seq, &plan);
      break;  // it was the last running sequence
    }
    AppendToPlan(seq, 1, &plan);
    --budget;
  }

  // 2. Prefill chunks of running sequences that are part-way through their known tokens. With
  // no victim left, a chunk shrinks to the blocks it has instead of preempting itself.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    if (seq->scheduled_stamp == step_stamp_) continue;
    int32_t chunk = std::min(static_cast<int32_t>(seq->tokens.size()) - seq->num_computed, budget);
    if (config_.max_prefill_chunk > 0) chunk = std::min(chunk, config_.max_prefill_chunk);
    const int32_t covered = GrowTable(seq, seq->num_computed + chunk, i, &plan);
    chunk = covered - seq->num_computed;
    if (chunk <= 0) continue;
    AppendToPlan(seq, chunk, &plan);
    budget -= chunk;
  }

  // 3. Admissions, queue order, stopping at the first that does not fit (strict FCFS within a
  // priority). Skipped after a preemption: blocks are short, and re-admitting what was just
  // preempted would only thrash.
  if (plan.preempted.empty()) {
    while (budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_running_seqs &&
           !waiting_.empty()) {
      if (!TryAdmit(*waiting_.begin(), &budget, &plan)) break;
    }
  }

  if (!plan.empty()) {
    plan.step_id = next_step_id_++;
    // Releases ride on the next step that is sent; an empty plan is not sent, so it keeps none.
    plan.released = std::move(released_);
    released_.clear();
    in_flight_ = true;
  }
  return plan;
}

FinishReason Scheduler::StopRule(const Sequence& seq, int32_t token) const {
  const Request& r = seq.request;
  if (seq.num_generated >= r.min_tokens) {
    const auto contains = [token](const std::vector<int32_t>& ids) {
      return std::find(ids.begin(), ids.end(), token) != ids.end();
    };
    if ((!r.ignore_eos && contains(r.eos_token_ids)) || contains(r.stop_token_ids)) {
      return FinishReason::kStop;
    }
  }
  if (seq.num_generated >= r.max_tokens ||
      static_cast<int32_t>(seq.tokens.size()) >= config_.max_model_len) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

void Scheduler::Remove(Sequence* seq) {
  if (seq->running) {
    ReleaseBlocks(seq);
    running_.erase(std::find(running_.begin(), running_.end(), seq));
  } else {
    waiting_.erase(seq);
  }
  const uint64_t id = seq->request.id;
  released_.push_back(id);
  seqs_.erase(id);  // destroys *seq
}

absl::StatusOr<std::vector<SeqEvent>> Scheduler::OnStepResult(
    std::span<const SampledToken> sampled) {
  if (!in_flight_) {
    return absl::FailedPreconditionError("OnStepResult called with no step in flight");
  }
  // Validate everything before changing anything.
  absl::flat_hash_map<uint64_t, int32_t> token_of;
  token_of.reserve(sampled.size());
  size_t for_aborted = 0;
  for (const SampledToken& s : sampled) {
    if (!token_of.emplace(s.seq_id, s.token_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("step result has two tokens for sequence ", s.seq_id));
    }
    if (s.token_id < 0 || (config_.vocab_size > 0 && s.token_id >= config_.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("step result: sequence ", s.seq_id,
                                                     " sampled invalid token id ", s.token_id));
    }
    if (aborted_in_flight_.contains(s.seq_id)) ++for_aborted;
  }
  size_t expected = 0;
  for (const InFlight& e : in_flight_seqs_) {
    if (e.seq == nullptr || !e.sample) continue;
    ++expected;
    if (!token_of.contains(e.seq_id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("step result lacks the sampled token of sequence ", e.seq_id));
    }
  }
  if (expected + for_aborted != sampled.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step result has ", sampled.size() - expected - for_aborted,
                     " tokens for sequences that were not sampled in this step"));
  }

  std::vector<SeqEvent> events;
  events.reserve(expected);
  for (const InFlight& e : in_flight_seqs_) {
    Sequence* seq = e.seq;
    if (seq == nullptr) continue;
    seq->num_computed += e.num_tokens;
    if (config_.enable_prefix_caching) {
      const int32_t bs = config_.block_size;
      while ((seq->num_registered + 1) * bs <= seq->num_computed) {
        const std::span<const int32_t> tokens(seq->tokens.data() + seq->num_registered * bs,
                                              static_cast<size_t>(bs));
        seq->tip = blocks_.Register(seq->table[seq->num_registered], seq->tip, tokens);
        ++seq->num_registered;
      }
    }
    if (!e.sample) continue;
    const int32_t token = token_of.find(e.seq_id)->second;
    seq->tokens.push_back(token);
    ++seq->num_generated;
    SeqEvent event{e.seq_id, true, token, StopRule(*seq, token), seq->num_generated};
    if (event.finish != FinishReason::kNone) Remove(seq);
    events.push_back(event);
  }
  in_flight_ = false;
  in_flight_seqs_.clear();
  aborted_in_flight_.clear();
  return events;
}

absl::StatusOr<SeqEvent> Scheduler::Finish(uint64_t id, FinishReason reason) {
  if (reason == FinishReason::kNone) {
    return absl::InvalidArgumentError("Finish needs a finish reason");
  }
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) {
    return absl::NotFoundError(absl::StrCat("no waiting or running request with id ", id));
  }
  Sequence* seq = it->second.get();
  if (in_flight_) {
    for (InFlight& e : in_flight_seqs_) {
      if (e.seq == seq) {
        e.seq = nullptr;
        aborted_in_flight_.insert(id);
      }
    }
  }
  const SeqEvent event{id, false, 0, reason, seq->num_generated};
  Remove(seq);
  return event;
}

std::optional<Scheduler::SeqView> Scheduler::View(uint64_t id) const {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return std::nullopt;
  const Sequence& s = *it->second;
  return SeqView{s.tokens, s.prompt_len, s.num_generated, s.num_computed, s.table, s.running};
}

std::vector<uint64_t> Scheduler::RunningIds() const {
  std::vector<uint64_t> ids;
  for (const Sequence* s : running_) ids.push_back(s->request.id);
  return ids;
}

std::vector<uint64_t> Scheduler::WaitingIds() const {
  std::vector<uint64_t> ids;
  for (const Sequence* s : waiting_) ids.push_back(s->request.id);
  return ids;
}

}  // namespace mlaserve
