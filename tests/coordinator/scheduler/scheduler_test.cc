#include "coordinator/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlaserve {
namespace {

constexpr int32_t kVocab = 64;
constexpr int32_t kEos = 0;

// The simulated model: the next token is a fixed function of every token before it (FNV-1a over
// the ids), so any wrong, stale or missing KV entry changes the output.
int32_t NextToken(std::span<const int32_t> context) {
  uint64_t h = 1469598103934665603ULL;
  for (const int32_t t : context) {
    h ^= static_cast<uint32_t>(t);
    h *= 1099511628211ULL;
  }
  h ^= h >> 29;
  return static_cast<int32_t>(h % kVocab);
}

// Executes plans like the workers do: writes every new token of the step into the paged cache
// (a token id stands for its KV entry), then each sampling sequence reads its whole context back
// through its block table and samples NextToken. Writes come before all reads, as in a batched
// forward, so two sequences sharing a block they write would corrupt each other.
class SimWorker {
 public:
  SimWorker(int32_t num_blocks, int32_t block_size)
      : block_size_(block_size), cache_(static_cast<size_t>(num_blocks) * block_size, -1) {}

  std::vector<SampledToken> Run(const StepPlan& plan) {
    for (const ScheduledSeq& s : plan.seqs) {
      const std::span<const int32_t> tokens = plan.tokens(s);
      for (int32_t k = 0; k < s.num_tokens; ++k) Slot(plan, s, s.start_pos + k) = tokens[k];
    }
    std::vector<SampledToken> out;
    for (const ScheduledSeq& s : plan.seqs) {
      if (!s.sample) continue;
      std::vector<int32_t> context(s.start_pos + s.num_tokens);
      for (size_t p = 0; p < context.size(); ++p) context[p] = Slot(plan, s, p);
      out.push_back({s.seq_id, NextToken(context)});
    }
    return out;
  }

 private:
  int32_t& Slot(const StepPlan& plan, const ScheduledSeq& s, size_t pos) {
    const std::span<const int32_t> table = plan.blocks(s);
    EXPECT_LT(pos / block_size_, table.size()) << "block table too short, seq " << s.seq_id;
    if (pos / block_size_ >= table.size()) return scratch_;
    return cache_[static_cast<size_t>(table[pos / block_size_]) * block_size_ + pos % block_size_];
  }

  int32_t block_size_;
  std::vector<int32_t> cache_;
  int32_t scratch_ = -1;
};

struct Outcome {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  bool operator==(const Outcome&) const = default;
};

// The oracle: one request alone, stop rules written out independently of the scheduler.
Outcome RunAlone(const Request& r) {
  std::vector<int32_t> context = r.prompt;
  Outcome out;
  while (true) {
    const int32_t t = NextToken(context);
    context.push_back(t);
    out.tokens.push_back(t);
    const int32_t n = static_cast<int32_t>(out.tokens.size());
    const bool is_eos = std::count(r.eos_token_ids.begin(), r.eos_token_ids.end(), t) > 0;
    const bool is_stop = std::count(r.stop_token_ids.begin(), r.stop_token_ids.end(), t) > 0;
    if (n >= r.min_tokens && ((is_eos && !r.ignore_eos) || is_stop)) {
      out.finish = FinishReason::kStop;
      return out;
    }
    if (n >= r.max_tokens) {
      out.finish = FinishReason::kLength;
      return out;
    }
  }
}

std::unique_ptr<Scheduler> MakeScheduler(const SchedulerConfig& config) {
  absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Create(config);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

// Reference counts implied by the tables of live sequences must equal the manager's; waiting
// sequences hold nothing; running tables cover their computed tokens.
void CheckBlockInvariants(const Scheduler& s) {
  const KvBlockManager& m = s.blocks();
  std::vector<int32_t> refs(m.num_blocks(), 0);
  for (const uint64_t id : s.RunningIds()) {
    const Scheduler::SeqView v = *s.View(id);
    ASSERT_TRUE(v.running);
    ASSERT_GE(static_cast<int64_t>(v.block_table.size()) * m.block_size(), v.num_computed) << id;
    for (const int32_t b : v.block_table) {
      ASSERT_GE(b, 0);
      ASSERT_LT(b, m.num_blocks());
      ++refs[b];
    }
  }
  for (const uint64_t id : s.WaitingIds()) {
    const Scheduler::SeqView v = *s.View(id);
    ASSERT_FALSE(v.running);
    ASSERT_TRUE(v.block_table.empty()) << id;
    ASSERT_EQ(v.num_computed, 0);
  }
  int32_t used = 0;
  for (int32_t b = 0; b < m.num_blocks(); ++b) {
    ASSERT_EQ(refs[b], m.ref_count(b)) << "block " << b;
    used += refs[b] > 0;
  }
  ASSERT_EQ(used, m.num_used());
  ASSERT_EQ(m.num_used() + m.num_allocatable(), m.num_blocks());
}

// A plan may only write blocks that no other sequence can read: held once and not cached.
void CheckPlanWritesPrivateBlocks(const Scheduler& s, const StepPlan& plan) {
  const KvBlockManager& m = s.blocks();
  const int32_t bs = m.block_size();
  for (const ScheduledSeq& q : plan.seqs) {
    ASSERT_GT(q.num_tokens, 0);
    ASSERT_GE(q.num_blocks * bs, q.start_pos + q.num_tokens);
    const std::span<const int32_t> table = plan.blocks(q);
    for (int32_t p = q.start_pos; p < q.start_pos + q.num_tokens; ++p) {
      ASSERT_EQ(m.ref_count(table[p / bs]), 1) << "seq " << q.seq_id << " pos " << p;
      ASSERT_FALSE(m.is_cached(table[p / bs])) << "seq " << q.seq_id << " pos " << p;
    }
    const Scheduler::SeqView v = *s.View(q.seq_id);
    ASSERT_EQ(q.sample, q.start_pos + q.num_tokens == static_cast<int32_t>(v.tokens.size()));
  }
}

// Runs requests through the scheduler and the simulated worker; requests are added at their
// arrival step, some are aborted at a given step. Returns outcomes and a digest of all plans.
struct Workload {
  std::vector<Request> requests;
  std::vector<int32_t> arrival_step;
  std::map<uint64_t, int32_t> abort_at_step;
};

struct RunResult {
  std::map<uint64_t, Outcome> outcomes;
  std::string plan_digest;
  int64_t preemptions = 0;
  int64_t prefix_hit_tokens = 0;
  int32_t steps = 0;
};

RunResult RunThrough(const SchedulerConfig& config, const Workload& w) {
  RunResult result;
  std::unique_ptr<Scheduler> s = MakeScheduler(config);
  SimWorker worker(config.num_blocks, config.block_size);
  size_t added = 0;
  std::string& digest = result.plan_digest;
  for (int32_t step = 0; step < 100000; ++step) {
    for (size_t i = 0; i < w.requests.size(); ++i) {
      if (w.arrival_step[i] == step) {
        EXPECT_TRUE(s->Add(w.requests[i]).ok());
        ++added;
      }
    }
    for (const auto& [id, at] : w.abort_at_step) {
      if (at != step) continue;
      absl::StatusOr<SeqEvent> e = s->Abort(id);
      if (e.ok()) result.outcomes[id].finish = FinishReason::kAbort;
    }
    absl::StatusOr<StepPlan> plan = s->Schedule();
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) break;
    CheckPlanWritesPrivateBlocks(*s, *plan);
    CheckBlockInvariants(*s);
    if (::testing::Test::HasFatalFailure()) break;
    for (const ScheduledSeq& q : plan->seqs) {
      absl::StrAppend(&digest, q.seq_id, ":", q.start_pos, "+", q.num_tokens, q.sample ? "s" : "",
                      "[");
      for (int32_t b : plan->blocks(q)) absl::StrAppend(&digest, b, ",");
      digest += "]";
    }
    for (uint64_t id : plan->preempted) absl::StrAppend(&digest, "P", id);
    digest += ";";
    if (plan->empty()) {
      if (added == w.requests.size() && !s->has_unfinished()) break;
      EXPECT_TRUE(s->num_running() == 0 && s->num_waiting() == 0 || added < w.requests.size())
          << "no progress with work queued at step " << step;
      continue;
    }
    ++result.steps;
    // An abort while the step is in flight: its blocks go back at once.
    for (const auto& [id, at] : w.abort_at_step) {
      if (at != -step - 1) continue;
      const int32_t used_before = s->blocks().num_used();
      absl::StatusOr<SeqEvent> e = s->Abort(id);
      if (e.ok()) {
        result.outcomes[id].finish = FinishReason::kAbort;
        EXPECT_LE(s->blocks().num_used(), used_before);
      }
    }
    absl::StatusOr<std::vector<SeqEvent>> events = s->OnStepResult(worker.Run(*plan));
    EXPECT_TRUE(events.ok()) << events.status();
    if (!events.ok()) break;
    for (const SeqEvent& e : *events) {
      Outcome& o = result.outcomes[e.seq_id];
      EXPECT_TRUE(e.has_token);
      o.tokens.push_back(e.token_id);
      EXPECT_EQ(e.num_generated, static_cast<int32_t>(o.tokens.size()));
      if (e.finish != FinishReason::kNone) o.finish = e.finish;
    }
    CheckBlockInvariants(*s);
    if (::testing::Test::HasFatalFailure()) break;
  }
  EXPECT_FALSE(s->has_unfinished());
  EXPECT_EQ(s->blocks().num_used(), 0) << "blocks leaked";
  EXPECT_EQ(s->blocks().num_allocatable(), config.num_blocks);
  result.preemptions = s->num_preemptions();
  result.prefix_hit_tokens = s->blocks().prefix_hit_tokens();
  return result;
}

Workload RandomWorkload(uint32_t seed, int32_t num_requests, int32_t block_size, bool aborts) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // Shared heads (a system prompt) so that prefix reuse happens across requests.
  std::vector<std::vector<int32_t>> heads(3);
  for (auto& h : heads) {
    h.resize(uniform(1, 4) * block_size + uniform(0, block_size - 1));
    for (auto& t : h) t = uniform(1, kVocab - 1);
  }
  Workload w;
  for (int32_t i = 0; i < num_requests; ++i) {
    Request r;
    r.id = 1000 + i;
    if (uniform(0, 3) > 0) r.prompt = heads[uniform(0, 2)];
    const int tail = uniform(r.prompt.empty() ? 1 : 0, 3 * block_size);
    for (int k = 0; k < tail; ++k) r.prompt.push_back(uniform(0, kVocab - 1));
    if (uniform(0, 4) == 0 && i > 0) r.prompt = w.requests[uniform(0, i - 1)].prompt;  // same
    r.max_tokens = uniform(1, 40);
    r.min_tokens = uniform(0, 2) == 0 ? uniform(0, r.max_tokens) : 0;
    r.eos_token_ids = {kEos};
    r.ignore_eos = uniform(0, 5) == 0;
    if (uniform(0, 2) == 0) r.stop_token_ids = {uniform(1, kVocab - 1), uniform(1, kVocab - 1)};
    r.priority = uniform(0, 3) == 0 ? uniform(-1, 2) : 0;
    w.requests.push_back(r);
    w.arrival_step.push_back(uniform(0, 3) == 0 ? 0 : uniform(0, 60));
    if (aborts && uniform(0, 9) == 0) {
      // Positive: before Schedule of that step; negative: while that step is in flight.
      const int at = uniform(0, 80);
      w.abort_at_step[r.id] = uniform(0, 1) ? at : -at - 1;
    }
  }
  return w;
}

void ExpectMatchesRunningAlone(const Workload& w, const RunResult& got) {
  for (const Request& r : w.requests) {
    const Outcome alone = RunAlone(r);
    const auto it = got.outcomes.find(r.id);
    const bool aborted = w.abort_at_step.contains(r.id) && it != got.outcomes.end() &&
                         it->second.finish == FinishReason::kAbort;
    if (aborted) {
      // Aborted part-way: what it produced is a prefix of the solo run.
      ASSERT_LE(it->second.tokens.size(), alone.tokens.size()) << r.id;
      EXPECT_TRUE(
          std::equal(it->second.tokens.begin(), it->second.tokens.end(), alone.tokens.begin()))
          << r.id;
      continue;
    }
    ASSERT_NE(it, got.outcomes.end()) << "request " << r.id << " produced nothing";
    EXPECT_EQ(it->second.tokens, alone.tokens) << "request " << r.id;
    EXPECT_EQ(it->second.finish, alone.finish) << "request " << r.id;
  }
}

struct Pressure {
  const char* name;
  int32_t num_blocks;
  int32_t max_running_seqs;
  int32_t max_tokens_per_step;
  int32_t max_prefill_chunk;
  bool prefix_caching;
  KvBlockHasher hasher;
};

uint64_t WeakHash(uint64_t parent, std::span<const int32_t> tokens) {
  return (parent + static_cast<uint64_t>(tokens[0])) % 5;  // collides constantly
}

TEST(SchedulerTest, OutputsEqualEachRequestRunAloneUnderAnyLimitsAndPressure) {
  constexpr int32_t kBs = 8;
  // The largest request: 4*8+7 + 24 prompt tokens + 40 generated = 103 tokens = 13 blocks.
  const Pressure cases[] = {
      {"roomy", 512, 64, 4096, 0, true, nullptr},
      {"one_at_a_time", 512, 1, 4096, 0, true, nullptr},
      {"tiny_budget", 512, 16, 5, 0, true, nullptr},
      {"chunked", 512, 32, 64, 7, true, nullptr},
      {"block_pressure", 16, 32, 256, 0, true, nullptr},
      {"block_pressure_chunked", 14, 8, 19, 5, true, nullptr},
      {"block_pressure_no_cache", 16, 32, 256, 0, false, nullptr},
      {"colliding_hash", 24, 32, 64, 0, true, &WeakHash},
  };
  int64_t total_preemptions = 0, total_hits = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    const Workload w = RandomWorkload(seed, 40, kBs, /*aborts=*/seed % 2 == 0);
    for (const Pressure& p : cases) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " case " << p.name);
      SchedulerConfig c;
      c.block_size = kBs;
      c.num_blocks = p.num_blocks;
      c.max_running_seqs = p.max_running_seqs;
      c.max_tokens_per_step = p.max_tokens_per_step;
      c.max_prefill_chunk = p.max_prefill_chunk;
      c.enable_prefix_caching = p.prefix_caching;
      c.block_hasher = p.hasher;
      c.max_model_len = 110;
      c.vocab_size = kVocab;
      const RunResult got = RunThrough(c, w);
      if (::testing::Test::HasFatalFailure()) return;
      ExpectMatchesRunningAlone(w, got);
      if (std::string(p.name).starts_with("block_pressure")) {
        EXPECT_GT(got.preemptions, 0) << "the pressure case did not preempt";
      }
      if (!p.prefix_caching) EXPECT_EQ(got.prefix_hit_tokens, 0);
      if (p.prefix_caching && p.hasher == nullptr) {
        EXPECT_GT(got.prefix_hit_tokens, 0) << "shared prompt heads were never reused";
      }
      total_preemptions += got.preemptions;
      total_hits += got.prefix_hit_tokens;
      // Determinism: the same calls give the same plans.
      EXPECT_EQ(RunThrough(c, w).plan_digest, got.plan_digest);
    }
  }
  EXPECT_GT(total_preemptions, 0);
  EXPECT_GT(total_hits, 0);
}

TEST(SchedulerTest, FullSizeBlocksAndLongPromptsMatchRunningAlone) {
  SchedulerConfig c;  // 64-token blocks as the workers use them
  c.num_blocks = 40;
  c.max_running_seqs = 8;
  c.max_tokens_per_step = 300;
  c.max_model_len = 1024;
  const Workload w = RandomWorkload(99, 16, kKvBlockTokens, /*aborts=*/false);
  const RunResult got = RunThrough(c, w);
  ExpectMatchesRunningAlone(w, got);
  EXPECT_GT(got.prefix_hit_tokens, 0);
}

Request Req(uint64_t id, int32_t prompt_len, int32_t max_tokens, int32_t priority = 0) {
  Request r;
  r.id = id;
  r.prompt.resize(prompt_len);
  std::iota(r.prompt.begin(), r.prompt.end(), static_cast<int32_t>(id * 7 % 50 + 1));
  for (auto& t : r.prompt) t %= kVocab;
  r.max_tokens = max_tokens;
  r.priority = priority;
  return r;
}

SchedulerConfig SmallConfig() {
  SchedulerConfig c;
  c.block_size = 4;
  c.num_blocks = 64;
  c.max_running_seqs = 8;
  c.max_tokens_per_step = 1000;
  c.max_model_len = 100;
  c.max_waiting = 4;
  c.vocab_size = kVocab;
  return c;
}

TEST(SchedulerTest, RejectsInvalidRequestsWithActionableErrors) {
  std::unique_ptr<Scheduler> s = MakeScheduler(SmallConfig());
  Request r = Req(1, 0, 5);
  EXPECT_EQ(s->Add(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->Add(r).message().find("prompt is empty"), std::string::npos);
  r = Req(1, 100, 1);
  EXPECT_NE(s->Add(r).message().find("shorten the prompt to at most 99 tokens"), std::string::npos)
      << s->Add(r);
  r = Req(1, 90, 20);
  EXPECT_EQ(s->Add(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->Add(r).message().find("lower max_tokens to at most 10"), std::string::npos)
      << s->Add(r);
  EXPECT_TRUE(s->Add(Req(1, 90, 10)).ok());  // exactly the context
  EXPECT_EQ(s->Add(Req(1, 5, 5)).code(), absl::StatusCode::kAlreadyExists);
  r = Req(2, 5, 0);
  EXPECT_EQ(s->Add(r).code(), absl::StatusCode::kInvalidArgument);
  r = Req(2, 5, 5);
  r.min_tokens = 6;
  EXPECT_EQ(s->Add(r).code(), absl::StatusCode::kInvalidArgument);
  r = Req(2, 5, 5);
  r.prompt[3] = kVocab;
  EXPECT_NE(s->Add(r).message().find("prompt[3] = 64"), std::string::npos) << s->Add(r);
  r = Req(2, 5, 5);
  r.eos_token_ids = {-1};
  EXPECT_EQ(s->Add(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->num_waiting(), 1);
}

TEST(SchedulerTest, FullWaitingQueueRejectsAsOverloaded) {
  std::unique_ptr<Scheduler> s = MakeScheduler(SmallConfig());  // max_waiting 4
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(s->Add(Req(id, 5, 5)).ok());
  const absl::Status st = s->Add(Req(5, 5, 5));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "overloaded: 4 requests waiting; retry later");
  // Once they run, the queue has room again.
  ASSERT_TRUE(s->Schedule().ok());
  EXPECT_EQ(s->num_waiting(), 0);
  EXPECT_TRUE(s->Add(Req(5, 5, 5)).ok());
}

TEST(SchedulerTest, RejectsConfigsThatCannotWork) {
  SchedulerConfig c = SmallConfig();
  c.num_blocks = 24;  // 96 tokens < max_model_len 100
  absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Create(c);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("cannot hold one sequence"), std::string::npos);
  c = SmallConfig();
  c.max_tokens_per_step = 0;
  EXPECT_NE(Scheduler::Create(c).status().message().find("max_tokens_per_step"), std::string::npos);
}

TEST(SchedulerTest, ChunkedPrefillSplitsAtTheBudgetAndSamplesOnlyAtTheEnd) {
  SchedulerConfig c = SmallConfig();
  c.max_tokens_per_step = 10;
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  SimWorker worker(c.num_blocks, c.block_size);
  ASSERT_TRUE(s->Add(Req(1, 25, 3)).ok());
  const int32_t expect_start[] = {0, 10, 20};
  const int32_t expect_len[] = {10, 10, 5};
  const int32_t expect_blocks[] = {3, 5, 7};  // ceil(10/4), ceil(20/4), ceil(25/4)
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<StepPlan> plan = s->Schedule();
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->seqs.size(), 1u);
    const ScheduledSeq& q = plan->seqs[0];
    EXPECT_EQ(q.start_pos, expect_start[i]);
    EXPECT_EQ(q.num_tokens, expect_len[i]);
    EXPECT_EQ(q.num_blocks, expect_blocks[i]);
    EXPECT_EQ(q.sample, i == 2);
    EXPECT_EQ(q.prompt_len, 25);
    const std::vector<SampledToken> out = worker.Run(*plan);
    EXPECT_EQ(out.size(), i == 2 ? 1u : 0u);
    ASSERT_TRUE(s->OnStepResult(out).ok());
  }
  // A second request arrives: the decode goes first, the prefill takes the remaining budget.
  ASSERT_TRUE(s->Add(Req(2, 30, 3)).ok());
  absl::StatusOr<StepPlan> plan = s->Schedule();
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->seqs.size(), 2u);
  EXPECT_EQ(plan->seqs[0].seq_id, 1u);
  EXPECT_EQ(plan->seqs[0].start_pos, 25);
  EXPECT_EQ(plan->seqs[0].num_tokens, 1);
  EXPECT_TRUE(plan->seqs[0].sample);
  EXPECT_EQ(plan->seqs[1].seq_id, 2u);
  EXPECT_EQ(plan->seqs[1].num_tokens, 9);
  EXPECT_FALSE(plan->seqs[1].sample);
  EXPECT_EQ(plan->num_tokens(), 10);
}

TEST(SchedulerTest, MaxPrefillChunkCapsEachSequence) {
  SchedulerConfig c = SmallConfig();
  c.max_prefill_chunk = 6;
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  ASSERT_TRUE(s->Add(Req(1, 13, 2)).ok());
  ASSERT_TRUE(s->Add(Req(2, 4, 2)).ok());
  absl::StatusOr<StepPlan> plan = s->Schedule();
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->seqs.size(), 2u);
  EXPECT_EQ(plan->seqs[0].num_tokens, 6);
  EXPECT_EQ(plan->seqs[1].num_tokens, 4);
  EXPECT_TRUE(plan->seqs[1].sample);
}

TEST(SchedulerTest, HigherPriorityFirstThenArrivalOrder) {
  SchedulerConfig c = SmallConfig();
  c.max_running_seqs = 1;
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  SimWorker worker(c.num_blocks, c.block_size);
  ASSERT_TRUE(s->Add(Req(1, 5, 1, 0)).ok());
  ASSERT_TRUE(s->Add(Req(2, 5, 1, 5)).ok());
  ASSERT_TRUE(s->Add(Req(3, 5, 1, 5)).ok());
  ASSERT_TRUE(s->Add(Req(4, 5, 1, -1)).ok());
  EXPECT_EQ(s->WaitingIds(), (std::vector<uint64_t>{2, 3, 1, 4}));
  std::vector<uint64_t> order;
  while (s->has_unfinished()) {
    absl::StatusOr<StepPlan> plan = s->Schedule();
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->seqs.size(), 1u);
    order.push_back(plan->seqs[0].seq_id);
    absl::StatusOr<std::vector<SeqEvent>> ev = s->OnStepResult(worker.Run(*plan));
    ASSERT_TRUE(ev.ok());
    ASSERT_EQ(ev->size(), 1u);
    EXPECT_EQ((*ev)[0].finish, FinishReason::kLength);
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{2, 3, 1, 4}));
}

TEST(SchedulerTest, PreemptsTheLatestArrivalByRecomputeAndResumesIt) {
  SchedulerConfig c = SmallConfig();
  c.num_blocks = 25;  // 100 tokens
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  SimWorker worker(c.num_blocks, c.block_size);
  Request a = Req(1, 40, 50), b = Req(2, 40, 50);
  a.prompt[0] = 60;  // distinct prompts: no sharing
  ASSERT_TRUE(s->Add(a).ok());
  ASSERT_TRUE(s->Add(b).ok());
  std::map<uint64_t, std::vector<int32_t>> out;
  bool preempted = false, resumed = false;
  std::vector<int32_t> tokens_at_preemption;
  while (s->has_unfinished()) {
    absl::StatusOr<StepPlan> plan = s->Schedule();
    ASSERT_TRUE(plan.ok());
    if (!plan->preempted.empty()) {
      ASSERT_EQ(plan->preempted, std::vector<uint64_t>{2});  // later arrival, equal priority
      EXPECT_EQ(s->View(2)->block_table.size(), 0u);
      EXPECT_FALSE(s->View(2)->running);
      tokens_at_preemption.assign(s->View(2)->tokens.begin(), s->View(2)->tokens.end());
      preempted = true;
    }
    for (const ScheduledSeq& q : plan->seqs) {
      if (q.seq_id == 2 && preempted && !resumed) {
        // Re-prefill of prompt + generated tokens (possibly after cached blocks), ending at the
        // last generated token, which samples the next one.
        EXPECT_EQ(q.start_pos % c.block_size, 0);
        const std::span<const int32_t> t = plan->tokens(q);
        EXPECT_TRUE(std::equal(t.begin(), t.end(), tokens_at_preemption.begin() + q.start_pos));
        EXPECT_EQ(q.prompt_len, 40);
        EXPECT_GT(q.num_generated, 0);
        resumed = true;
      }
    }
    absl::StatusOr<std::vector<SeqEvent>> ev = s->OnStepResult(worker.Run(*plan));
    ASSERT_TRUE(ev.ok());
    for (const SeqEvent& e : *ev) out[e.seq_id].push_back(e.token_id);
  }
  EXPECT_TRUE(preempted);
  EXPECT_TRUE(resumed);
  EXPECT_EQ(out[1], RunAlone(a).tokens);
  EXPECT_EQ(out[2], RunAlone(b).tokens);
  EXPECT_EQ(s->blocks().num_used(), 0);
}

TEST(SchedulerTest, ReusesCachedPrefixBlocksOfAFinishedRequest) {
  SchedulerConfig c = SmallConfig();
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  SimWorker worker(c.num_blocks, c.block_size);
  auto run_to_end = [&](Request r) {
    EXPECT_TRUE(s->Add(r).ok());
    std::vector<StepPlan> plans;
    std::vector<int32_t> out;
    while (s->has_unfinished()) {
      absl::StatusOr<StepPlan> plan = s->Schedule();
      EXPECT_TRUE(plan.ok());
      absl::StatusOr<std::vector<SeqEvent>> ev = s->OnStepResult(worker.Run(*plan));
      EXPECT_TRUE(ev.ok());
      for (const SeqEvent& e : *ev) out.push_back(e.token_id);
      plans.push_back(*plan);
    }
    return std::make_pair(plans, out);
  };
  Request a = Req(1, 10, 3);
  auto [plans_a, out_a] = run_to_end(a);
  const std::vector<int32_t> table_a(plans_a[0].block_ids.begin(), plans_a[0].block_ids.end());
  EXPECT_EQ(s->blocks().num_used(), 0);
  // a computed 12 tokens (10 prompt + 2 of 3 generated): 3 full blocks registered, now free.
  EXPECT_EQ(s->blocks().num_cached_free(), 3);

  Request b = a;  // same prompt: 10 tokens -> floor(9/4) = 2 blocks reused, 2 tokens recomputed
  b.id = 2;
  auto [plans_b, out_b] = run_to_end(b);
  EXPECT_EQ(plans_b[0].seqs[0].start_pos, 8);
  EXPECT_EQ(plans_b[0].seqs[0].num_tokens, 2);
  EXPECT_EQ(plans_b[0].block_ids[0], table_a[0]);
  EXPECT_EQ(plans_b[0].block_ids[1], table_a[1]);
  EXPECT_EQ(out_b, out_a);
  EXPECT_EQ(s->blocks().prefix_query_tokens(), 20);
  EXPECT_EQ(s->blocks().prefix_hit_tokens(), 8);

  // a's prompt plus its first two outputs plus more: 3 blocks reused (12 of 13 tokens cached).
  Request d = a;
  d.id = 3;
  d.prompt.push_back(out_a[0]);
  d.prompt.push_back(out_a[1]);
  d.prompt.push_back(5);
  auto [plans_d, out_d] = run_to_end(d);
  EXPECT_EQ(plans_d[0].seqs[0].start_pos, 12);
  EXPECT_EQ(out_d, RunAlone(d).tokens);
}

TEST(SchedulerTest, AbortFreesBlocksAtOnceWaitingRunningOrInFlight) {
  SchedulerConfig c = SmallConfig();
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  SimWorker worker(c.num_blocks, c.block_size);
  ASSERT_TRUE(s->Add(Req(1, 9, 20)).ok());
  ASSERT_TRUE(s->Add(Req(2, 9, 20)).ok());
  absl::StatusOr<StepPlan> plan = s->Schedule();
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(s->blocks().num_used(), 6);
  // In flight: abort 2; its 3 blocks are free before the result arrives.
  absl::StatusOr<SeqEvent> ev = s->Abort(2);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->finish, FinishReason::kAbort);
  EXPECT_STREQ(FinishReasonName(ev->finish), "abort");
  EXPECT_EQ(s->blocks().num_used(), 3);
  EXPECT_EQ(s->Abort(2).status().code(), absl::StatusCode::kNotFound);
  // The worker still returns a token for 2; it is dropped.
  absl::StatusOr<std::vector<SeqEvent>> events = s->OnStepResult(worker.Run(*plan));
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].seq_id, 1u);
  // Running (between steps) and waiting.
  ASSERT_TRUE(s->Add(Req(3, 9, 20)).ok());
  EXPECT_TRUE(s->Abort(1).ok());
  EXPECT_EQ(s->blocks().num_used(), 0);
  EXPECT_TRUE(s->Abort(3).ok());
  EXPECT_FALSE(s->has_unfinished());
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->empty());
  EXPECT_TRUE(plan->released.empty());  // an empty plan is not sent: releases wait
  ASSERT_TRUE(s->Add(Req(4, 3, 1)).ok());
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->released, (std::vector<uint64_t>{2, 1, 3}));
}

TEST(SchedulerTest, FinishReasonsAndMinTokens) {
  SchedulerConfig c = SmallConfig();
  c.max_model_len = 60;
  std::unique_ptr<Scheduler> s = MakeScheduler(c);
  // Step the scheduler, answering with the scripted tokens, until the sequence finishes.
  auto run = [&](Request r, std::vector<int32_t> script) {
    EXPECT_TRUE(s->Add(r).ok());
    size_t next = 0;
    std::vector<int32_t> out;
    FinishReason reason = FinishReason::kNone;
    while (reason == FinishReason::kNone && next < script.size()) {
      absl::StatusOr<StepPlan> plan = s->Schedule();
      EXPECT_TRUE(plan.ok());
      std::vector<SampledToken> sampled;
      for (const ScheduledSeq& q : plan->seqs) {
        if (q.sample) sampled.push_back({q.seq_id, script[next++]});
      }
      absl::StatusOr<std::vector<SeqEvent>> ev = s->OnStepResult(sampled);
      EXPECT_TRUE(ev.ok());
      for (const SeqEvent& e : *ev) {
        out.push_back(e.token_id);
        reason = e.finish;
      }
    }
    return std::make_pair(out, reason);
  };
  Request r = Req(1, 5, 10);
  r.eos_token_ids = {7};
  r.stop_token_ids = {9};
  using V = std::vector<int32_t>;
  EXPECT_EQ(run(r, {3, 4, 7, 1}), std::make_pair(V{3, 4, 7}, FinishReason::kStop));
  r.id = 2;
  EXPECT_EQ(run(r, {9, 1}), std::make_pair(V{9}, FinishReason::kStop));
  r.id = 3;
  r.max_tokens = 3;
  EXPECT_EQ(run(r, {1, 2, 3, 4}), std::make_pair(V{1, 2, 3}, FinishReason::kLength));
  r.id = 4;
  r.ignore_eos = true;
  EXPECT_EQ(run(r, {7, 7, 7, 7}), std::make_pair(V{7, 7, 7}, FinishReason::kLength));
  r.id = 5;
  r.ignore_eos = false;
  r.max_tokens = 10;
  r.min_tokens = 3;  // eos and stop ids are ignored for the first 3 tokens
  EXPECT_EQ(run(r, {7, 9, 7, 9, 1}), std::make_pair(V{7, 9, 7}, FinishReason::kStop));
  EXPECT_EQ(s->blocks().num_used(), 0);
}

TEST(SchedulerTest, StepProtocolErrorsChangeNothing) {
  std::unique_ptr<Scheduler> s = MakeScheduler(SmallConfig());
  EXPECT_EQ(s->OnStepResult({}).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s->Add(Req(1, 5, 5)).ok());
  ASSERT_TRUE(s->Add(Req(2, 5, 5)).ok());
  ASSERT_TRUE(s->Schedule().ok());
  EXPECT_EQ(s->Schedule().status().code(), absl::StatusCode::kFailedPrecondition);
  const SampledToken only_one[] = {{1, 3}};
  EXPECT_NE(s->OnStepResult(only_one).status().message().find("lacks the sampled token of "
                                                              "sequence 2"),
            std::string::npos);
  const SampledToken extra[] = {{1, 3}, {2, 3}, {7, 3}};
  EXPECT_EQ(s->OnStepResult(extra).status().code(), absl::StatusCode::kInvalidArgument);
  const SampledToken bad_id[] = {{1, 3}, {2, kVocab}};
  EXPECT_EQ(s->OnStepResult(bad_id).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->View(1)->num_computed, 0);
  const SampledToken both[] = {{2, 3}, {1, 4}};
  absl::StatusOr<std::vector<SeqEvent>> ev = s->OnStepResult(both);
  ASSERT_TRUE(ev.ok());
  ASSERT_EQ(ev->size(), 2u);
  EXPECT_EQ((*ev)[0].token_id, 4);  // plan order, not result order
  EXPECT_EQ(s->View(1)->num_computed, 5);
}

}  // namespace
}  // namespace mlaserve
