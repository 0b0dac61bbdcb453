// Coordinator overhead per decode step, model excluded: Scheduler::Schedule() (building the plan:
// token ids and full block tables of every sequence) plus Scheduler::OnStepResult() (committing,
// block registration for prefix reuse, stop rules, finishing), at 1, 64 and 256 running decode
// sequences. Plan encoding (Cap'n Proto) is the frontend's and not included.
//
// Each round admits N requests of 960 prompt tokens (15 blocks of 64; 4096 blocks in the pool),
// prefills them untimed, then times the 64 decode steps that fill their 16th block: one block
// allocation at the first step, one registration in the prefix cache at the last, where the
// sequences also finish (max_tokens 65) and free 16 blocks each. So the timed steps are a full
// block cycle of steady decoding.
//
// Usage: scheduler_bench [rounds_scale=1]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/command_line.h"
#include "coordinator/scheduler/scheduler.h"

namespace mlaserve {
namespace {

constexpr int32_t kPromptTokens = 960;
constexpr int32_t kDecodeSteps = 64;

struct Figures {
  double mean_us = 0, p50_us = 0, p99_us = 0, max_us = 0;
  double schedule_mean_us = 0, result_mean_us = 0;
  size_t steps = 0;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "scheduler_bench: %s\n", s.ToString().c_str());
  std::exit(1);
}

Figures Measure(int32_t num_seqs, int32_t rounds) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> step_us, schedule_us, result_us;
  std::mt19937 rng(num_seqs);
  std::uniform_int_distribution<int32_t> token(0, 129279);
  std::vector<SampledToken> sampled;
  for (int32_t round = 0; round < rounds; ++round) {
    SchedulerConfig config;
    config.num_blocks = 4096;
    config.max_running_seqs = 256;
    // All prompts prefill in one step, so every sequence then decodes in lockstep; the budget
    // does not change the cost of a decode step.
    config.max_tokens_per_step = 256 * kPromptTokens;
    config.max_model_len = 4096;
    config.vocab_size = 129280;
    absl::StatusOr<std::unique_ptr<Scheduler>> created = Scheduler::Create(config);
    if (!created.ok()) Fail(created.status());
    Scheduler& s = **created;
    for (int32_t i = 0; i < num_seqs; ++i) {
      Request r;
      r.id = static_cast<uint64_t>(i) + 1;
      r.prompt.resize(kPromptTokens);
      for (int32_t& t : r.prompt) t = token(rng);
      r.max_tokens = kDecodeSteps + 1;
      r.eos_token_ids = {1};
      r.ignore_eos = true;  // every sequence runs the full 64 steps
      if (absl::Status st = s.Add(std::move(r)); !st.ok()) Fail(st);
    }
    bool decoding = false;
    int32_t timed = 0;
    while (s.has_unfinished()) {
      const Clock::time_point t0 = Clock::now();
      absl::StatusOr<StepPlan> plan = s.Schedule();
      const Clock::time_point t1 = Clock::now();
      if (!plan.ok()) Fail(plan.status());
      // The model's part (untimed): one token per sampling sequence.
      sampled.clear();
      for (const ScheduledSeq& q : plan->seqs) {
        if (q.sample) sampled.push_back({q.seq_id, token(rng)});
      }
      decoding = !plan->seqs.empty() && plan->seqs.front().num_tokens == 1 &&
                 static_cast<int32_t>(plan->seqs.size()) == num_seqs &&
                 plan->num_tokens() == num_seqs;
      const Clock::time_point t2 = Clock::now();
      absl::StatusOr<std::vector<SeqEvent>> events = s.OnStepResult(sampled);
      const Clock::time_point t3 = Clock::now();
      if (!events.ok()) Fail(events.status());
      if (!decoding) continue;  // prefill steps are not what is measured
      const auto us = [](Clock::duration d) {
        return std::chrono::duration<double, std::micro>(d).count();
      };
      schedule_us.push_back(us(t1 - t0));
      result_us.push_back(us(t3 - t2));
      step_us.push_back(us(t1 - t0) + us(t3 - t2));
      ++timed;
    }
    if (timed != kDecodeSteps) {
      std::fprintf(stderr, "scheduler_bench: expected %d decode steps per round, timed %d\n",
                   kDecodeSteps, timed);
      std::exit(1);
    }
  }
  Figures f;
  f.steps = step_us.size();
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / static_cast<double>(v.size());
  };
  f.mean_us = mean(step_us);
  f.schedule_mean_us = mean(schedule_us);
  f.result_mean_us = mean(result_us);
  std::sort(step_us.begin(), step_us.end());
  f.p50_us = step_us[step_us.size() / 2];
  f.p99_us = step_us[std::min(step_us.size() - 1, step_us.size() * 99 / 100)];
  f.max_us = step_us.back();
  return f;
}

}  // namespace
}  // namespace mlaserve

int main(int argc, char** argv) {
  // SCALE multiplies the timed rounds (400, 40 and 20 at 1, 64 and 256 running).
  const std::vector<std::string> args =
      mlaserve::ParseCommandLine(argc, argv, "scheduler_bench [SCALE]");
  int scale = 1;
  if (args.size() > 1 ||
      (args.size() == 1 && !(absl::SimpleAtoi(args[0], &scale) && scale >= 1 && scale <= 10000))) {
    mlaserve::UsageError("takes one optional SCALE in [1, 10000]");
  }
  std::printf(
      "scheduling + result handling per decode step (Schedule + OnStepResult; model and plan "
      "encoding excluded)\nprompt %d tokens, 64-token blocks, 4096-block pool, %d timed decode "
      "steps per round\n",
      mlaserve::kPromptTokens, mlaserve::kDecodeSteps);
  std::printf("%8s %7s %10s %10s %10s %10s %12s %12s %10s\n", "running", "steps", "mean_us",
              "p50_us", "p99_us", "max_us", "schedule_us", "result_us", "vs_100us");
  const int32_t sizes[] = {1, 64, 256};
  const int32_t rounds[] = {400, 40, 20};
  for (int i = 0; i < 3; ++i) {
    const mlaserve::Figures f = mlaserve::Measure(sizes[i], rounds[i] * scale);
    std::printf("%8d %7zu %10.2f %10.2f %10.2f %10.2f %12.2f %12.2f %9.0f%%\n", sizes[i], f.steps,
                f.mean_us, f.p50_us, f.p99_us, f.max_us, f.schedule_mean_us, f.result_mean_us,
                100.0 * f.mean_us / 100.0);
  }
  return 0;
}
