// GPU sampler (kernels/sampling/sampling.h) against the worker's CPU sampler
// (worker/model/sampler.h SampleToken), row by row over random logits, parameter mixes,
// histories (penalties), min_tokens masks and tied logits.
//
// Expected agreement:
// - tokens and top-n ids: identical. The GPU does the CPU's fp32/double operations in the same
//   order; only the double exp() may differ by 1 ulp (~1e-16 relative), which moves the token
//   only if the uniform lands within ~1e-16 of a cumulative boundary (probability ~1e-13 per
//   draw here).
// - logprobs and top-n logprobs: within 1e-4 absolute. Both are logit - log_z in fp32; the GPU
//   sums exp() in double in a tree rather than serially (relative difference ~1e-15 in the sum,
//   nothing after log()), so log_z differs by at most 1 fp32 ulp (|log_z| < 64: 4e-6) and the
//   subtraction by one more rounding of a value below 64 (4e-6). 1e-4 leaves a margin of ~10x.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/device_buffer.h"
#include "kernels/sampling/sampling.h"
#include "worker/model/sampler.h"

namespace mlaserve {
namespace {

// One sequence of the batch as the worker sees it.
struct RowCase {
  SequenceSampling s;
  std::vector<int32_t> history;
  int prompt_len = 0;
  int generated = 0;
};

RowCase RandomRow(std::mt19937& rng, int vocab) {
  auto pick = [&](std::initializer_list<double> v) {
    std::vector<double> c(v);
    return c[std::uniform_int_distribution<size_t>(0, c.size() - 1)(rng)];
  };
  RowCase r;
  r.s.base.temperature = static_cast<float>(pick({0.0, 0.7, 1.0, 1.3}));
  r.s.base.top_k = static_cast<int>(pick({0, 0, 1, 40}));
  r.s.base.top_p = static_cast<float>(pick({1.0, 0.9, 0.5}));
  r.s.base.min_p = static_cast<float>(pick({0.0, 0.0, 0.05}));
  r.s.base.seed = (uint64_t{rng()} << 32) | rng();
  const bool penalties = rng() % 2 == 0;
  if (penalties) {
    r.s.repetition_penalty = static_cast<float>(pick({1.0, 1.1, 0.9}));
    r.s.presence_penalty = static_cast<float>(pick({0.0, 0.5}));
    r.s.frequency_penalty = static_cast<float>(pick({0.0, 0.3}));
  }
  // History: tokens from a small range so that repeats (counts > 1) and prompt/output overlap
  // occur; sometimes one out-of-range id, which both samplers must ignore.
  std::uniform_int_distribution<int> len(0, 40);
  r.prompt_len = len(rng);
  r.generated = len(rng);
  std::uniform_int_distribution<int32_t> tok(0, std::min(vocab - 1, 60));
  for (int i = 0; i < r.prompt_len + r.generated; ++i) r.history.push_back(tok(rng));
  r.s.min_tokens = static_cast<int>(pick({0, 0, 10, 50}));
  for (int i = 0; i < 2; ++i) r.s.eos_ids.push_back(tok(rng));
  r.s.stop_ids.push_back(tok(rng));
  if (rng() % 4 == 0) r.s.stop_ids.push_back(vocab + 3);
  r.s.top_logprobs = static_cast<int>(pick({0, 5, 20}));
  r.s.want_logprobs = rng() % 2 == 0;
  return r;
}

// What the host builds for the GPU from a RowCase: the distinct history tokens with their output
// counts, and the masked ids while min_tokens is not reached.
void BuildRow(const RowCase& r, SamplingRow* row, std::vector<SamplingPenaltyEntry>* penalties,
              std::vector<int32_t>* masks) {
  row->temperature = r.s.base.temperature;
  row->top_k = r.s.base.top_k;
  row->top_p = r.s.base.top_p;
  row->min_p = r.s.base.min_p;
  row->seed = r.s.base.seed;
  row->step = static_cast<uint64_t>(r.generated);
  row->repetition_penalty = r.s.repetition_penalty;
  row->presence_penalty = r.s.presence_penalty;
  row->frequency_penalty = r.s.frequency_penalty;
  std::map<int32_t, int32_t> counts;
  for (size_t i = 0; i < r.history.size(); ++i) {
    int32_t& c = counts[r.history[i]];
    if (static_cast<int>(i) >= r.prompt_len) ++c;
  }
  row->penalty_begin = static_cast<int32_t>(penalties->size());
  for (const auto& [t, c] : counts) penalties->push_back({t, c});
  row->penalty_count = static_cast<int32_t>(penalties->size()) - row->penalty_begin;
  row->mask_begin = static_cast<int32_t>(masks->size());
  if (r.generated < r.s.min_tokens) {
    for (int32_t t : r.s.eos_ids) masks->push_back(t);
    for (int32_t t : r.s.stop_ids) masks->push_back(t);
  }
  row->mask_count = static_cast<int32_t>(masks->size()) - row->mask_begin;
  row->top_logprobs = r.s.top_logprobs;
  row->want_logprob = r.s.want_logprobs ? 1 : 0;
}

std::string Describe(const RowCase& r) {
  return "T=" + std::to_string(r.s.base.temperature) + " top_k=" + std::to_string(r.s.base.top_k) +
         " top_p=" + std::to_string(r.s.base.top_p) + " min_p=" + std::to_string(r.s.base.min_p) +
         " seed=" + std::to_string(r.s.base.seed) + " step=" + std::to_string(r.generated) +
         " rep=" + std::to_string(r.s.repetition_penalty) +
         " pres=" + std::to_string(r.s.presence_penalty) +
         " freq=" + std::to_string(r.s.frequency_penalty) +
         " min_tokens=" + std::to_string(r.s.min_tokens) +
         " history=" + std::to_string(r.history.size()) + " (prompt " +
         std::to_string(r.prompt_len) + ") top_logprobs=" + std::to_string(r.s.top_logprobs);
}

// ties: 0 = continuous logits; 1 = logits rounded to multiples of 0.5 (many duplicates, and
// -0.0 beside +0.0); 2 = half the vocab at one value (the largest) so sorting ties decide.
void RunCase(int rows, int vocab, int ties, bool all_greedy, int64_t stride_pad, uint32_t seed) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " vocab=" + std::to_string(vocab) +
               " ties=" + std::to_string(ties) + " all_greedy=" + std::to_string(all_greedy) +
               " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t stride = vocab + stride_pad;
  std::vector<float> logits(static_cast<size_t>(rows) * stride,
                            std::numeric_limits<float>::quiet_NaN());  // padding: poison
  for (int r = 0; r < rows; ++r) {
    float* x = logits.data() + r * stride;
    for (int i = 0; i < vocab; ++i) {
      float v = normal(rng);
      if (ties == 1) v = std::round(v * 2.0f) / 2.0f;
      if (ties == 2 && i % 2 == 0) v = 9.0f;
      x[i] = v;
    }
  }
  std::vector<RowCase> cases;
  std::vector<SamplingRow> row_params(rows);
  std::vector<SamplingPenaltyEntry> penalties;
  std::vector<int32_t> masks;
  bool any_sampled = false;
  for (int r = 0; r < rows; ++r) {
    cases.push_back(RandomRow(rng, vocab));
    if (all_greedy) cases.back().s.base.temperature = 0.0f;
    any_sampled = any_sampled || cases.back().s.base.temperature > 0.0f;
    BuildRow(cases.back(), &row_params[r], &penalties, &masks);
  }

  DeviceBuffer<float> d_logits(logits.size());
  DeviceBuffer<SamplingRow> d_rows(rows);
  DeviceBuffer<SamplingPenaltyEntry> d_pen(penalties.size());
  DeviceBuffer<int32_t> d_masks(masks.size());
  DeviceBuffer<int32_t> d_tokens(rows), d_top_ids(static_cast<size_t>(rows) * kMaxTopLogprobs);
  DeviceBuffer<float> d_logprobs(rows), d_top_lp(static_cast<size_t>(rows) * kMaxTopLogprobs);
  const size_t ws_bytes = SamplingWorkspaceBytes(rows, vocab);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer<char> d_ws(ws_bytes);
  ASSERT_NE(d_logits.ptr, nullptr);
  ASSERT_NE(d_ws.ptr, nullptr) << ws_bytes << " bytes";
  CUDA_OK(d_logits.Upload(logits));
  CUDA_OK(d_rows.Upload(row_params));
  if (!penalties.empty()) CUDA_OK(d_pen.Upload(penalties));
  if (!masks.empty()) CUDA_OK(d_masks.Upload(masks));
  for (cudaError_t e : {d_tokens.Poison(), d_top_ids.Poison(), d_logprobs.Poison(),
                        d_top_lp.Poison(), d_ws.Poison()}) {
    CUDA_OK(e);
  }

  SamplingParams p;
  p.rows = rows;
  p.vocab = vocab;
  p.logits = d_logits.ptr;
  p.logits_stride = stride;
  p.row_params = d_rows.ptr;
  p.penalties = d_pen.ptr;
  p.masks = d_masks.ptr;
  p.any_sampled = any_sampled;
  p.tokens = d_tokens.ptr;
  p.logprobs = d_logprobs.ptr;
  p.top_ids = d_top_ids.ptr;
  p.top_logprobs = d_top_lp.ptr;
  p.workspace = d_ws.ptr;
  p.workspace_bytes = ws_bytes;
  const absl::Status st = InvokeSampling(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> tokens = d_tokens.Download(), top_ids = d_top_ids.Download();
  const std::vector<float> logprobs = d_logprobs.Download(), top_lp = d_top_lp.Download();
  ASSERT_EQ(tokens.size(), static_cast<size_t>(rows));

  int mismatches = 0;
  for (int r = 0; r < rows && mismatches < 10; ++r) {
    const RowCase& c = cases[r];
    const float* x = logits.data() + r * stride;
    const SampledOutput want = SampleToken(x, vocab, c.s, c.history, c.prompt_len, c.generated);
    SCOPED_TRACE("row " + std::to_string(r) + ": " + Describe(c));
    const int32_t got = tokens[r];
    if (got != want.token) {
      ++mismatches;
      ADD_FAILURE() << "token: gpu " << got << " (logit "
                    << (got >= 0 && got < vocab ? x[got] : NAN) << "), cpu " << want.token
                    << " (logit " << x[want.token] << ")";
      continue;
    }
    EXPECT_NEAR(logprobs[r], want.logprob, 1e-4) << "token " << got;
    ASSERT_EQ(want.top.size(), static_cast<size_t>(std::min(c.s.top_logprobs, vocab)));
    for (int k = 0; k < kMaxTopLogprobs; ++k) {
      const size_t o = static_cast<size_t>(r) * kMaxTopLogprobs + k;
      if (k < static_cast<int>(want.top.size())) {
        EXPECT_EQ(top_ids[o], want.top[k].first) << "top rank " << k;
        EXPECT_NEAR(top_lp[o], want.top[k].second, 1e-4) << "top rank " << k;
      } else {
        EXPECT_EQ(top_ids[o], -1) << "unused top rank " << k;
        EXPECT_EQ(top_lp[o], 0.0f) << "unused top rank " << k;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(SamplingGpuTest, MatchesCpuSampler) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (int vocab : {512, 32000, 163840}) {
    for (int rows : {1, 7, 64}) {
      for (int ties : {0, 1, 2}) RunCase(rows, vocab, ties, false, 0, seed++);
    }
  }
}

TEST(SamplingGpuTest, ManyRowsAndPaddedStride) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  RunCase(256, 32000, 1, false, 13, 101);
  RunCase(256, 1000, 0, false, 0, 102);
}

TEST(SamplingGpuTest, AllGreedySkipsTheSort) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  RunCase(33, 32000, 1, true, 0, 201);
  RunCase(5, 163840, 0, true, 5, 202);
}

// Many steps of one seeded row: the uniform draws cover [0, 1), so every rank of a flat top-k
// distribution is chosen at some step; all must match the CPU.
TEST(SamplingGpuTest, ManySeededSteps) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  for (uint32_t s = 0; s < 4; ++s) RunCase(64, 4096, static_cast<int>(s % 3), false, 0, 301 + s);
}

TEST(SamplingGpuTest, RejectsBadShapes) {
  SamplingParams p;
  p.rows = 0;
  p.vocab = 10;
  EXPECT_FALSE(InvokeSampling(p, nullptr).ok());
  EXPECT_EQ(SamplingWorkspaceBytes(1, 1 << 25), 0u);
}

}  // namespace
}  // namespace mlaserve
