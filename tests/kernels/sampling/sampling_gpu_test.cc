// GPU sampler (kernels/sampling/sampling.h) against the worker's CPU sampler
// (worker/model/sampler.h SampleToken), row by row over random logits, parameter mixes,
// histories (penalties), min_tokens masks and tied logits; rows without a filter (the race over
// the whole vocabulary, before the sort) and with one (the race over the sorted kept prefix);
// and one row's token wherever it sits in batches of other sizes and neighbours.
//
// Expected agreement:
// - tokens and top-n ids: identical. The GPU does the CPU's fp32/double operations that decide
//   the kept set in the same order, and the race's block max uses the CPU's total order (score,
//   then lower id). Only the device's double exp() and log() may differ from glibc's by 1 ulp:
//   a kept set moves only if a cumulative sum lands within ~1e-16 of top_p or a min_p threshold
//   (probability ~1e-13 per row here), and a race score moves by ~1e-15, which changes the pick
//   only if the two best scores of the row are that close. Such a near tie is accepted, and
//   counted, when the GPU's token is in the CPU's kept set and its CPU score is within 1e-12 of
//   the CPU winner's (scores are below ~150 in magnitude here, an ulp ~3e-14; 1e-12 leaves a
//   margin of 30x while no bug that picks another token would land that close by chance).
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
#include "kernels/sampling/sampling.h"
#include "kernels/sampling/sampling_race.h"
#include "kernels/sampling/sampling_ref.h"
#include "tests/kernels/device_buffer.h"
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

// Which filters the random rows get: the mix below; none (every sampled row races over the whole
// vocabulary: top_k 0 or >= vocab, top_p 1, min_p 0); or always at least one.
enum class Filters { kMixed, kNone, kAlways };

RowCase RandomRow(std::mt19937& rng, int vocab, Filters filters) {
  auto pick = [&](std::initializer_list<double> v) {
    std::vector<double> c(v);
    return c[std::uniform_int_distribution<size_t>(0, c.size() - 1)(rng)];
  };
  RowCase r;
  r.s.base.temperature = static_cast<float>(pick({0.0, 0.7, 1.0, 1.3}));
  r.s.base.top_k = static_cast<int>(pick({0, 0, 1, 40}));
  r.s.base.top_p = static_cast<float>(pick({1.0, 0.9, 0.5}));
  r.s.base.min_p = static_cast<float>(pick({0.0, 0.0, 0.05}));
  if (filters == Filters::kNone) {
    r.s.base.top_k = static_cast<int>(pick({0, 0, static_cast<double>(vocab), vocab + 7.0}));
    r.s.base.top_p = static_cast<float>(pick({1.0, 1.5}));
    r.s.base.min_p = static_cast<float>(pick({0.0, -0.1}));
  } else if (filters == Filters::kAlways &&
             !SamplingRowFiltered(r.s.base.top_k, r.s.base.top_p, r.s.base.min_p, vocab)) {
    r.s.base.top_k = std::max(1, vocab / 3);
  }
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
// -0.0 beside +0.0); 2 = half the vocab at one value (the largest) so sorting ties decide; 3 = the
// whole vocabulary at one value (only the ids and the race decide); 4 = continuous logits of
// LM-head scale (sigma 12: scores up to ~150).
std::vector<float> RandomLogits(std::mt19937& rng, int rows, int vocab, int64_t stride, int ties) {
  std::normal_distribution<float> normal(0.0f, ties == 4 ? 12.0f : 3.0f);
  std::vector<float> logits(static_cast<size_t>(rows) * stride,
                            std::numeric_limits<float>::quiet_NaN());  // padding: poison
  for (int r = 0; r < rows; ++r) {
    float* x = logits.data() + r * stride;
    for (int i = 0; i < vocab; ++i) {
      float v = normal(rng);
      if (ties == 1) v = std::round(v * 2.0f) / 2.0f;
      if (ties == 2 && i % 2 == 0) v = 9.0f;
      if (ties == 3) v = 1.5f;
      x[i] = v;
    }
  }
  return logits;
}

struct GpuResult {
  std::vector<int32_t> tokens, top_ids;
  std::vector<float> logprobs, top_logprobs;
};

// InvokeSampling over `rows` rows of `logits` ([rows, stride], the first vocab of each row used).
// any_sampled is set from the rows unless `any_sampled_override` is 0 or 1.
void RunGpu(const std::vector<float>& logits, int64_t stride, int vocab,
            const std::vector<RowCase>& cases, GpuResult* out, int any_sampled_override = -1) {
  const int rows = static_cast<int>(cases.size());
  std::vector<SamplingRow> row_params(rows);
  std::vector<SamplingPenaltyEntry> penalties;
  std::vector<int32_t> masks;
  bool any_sampled = false;
  for (int r = 0; r < rows; ++r) {
    any_sampled = any_sampled || cases[r].s.base.temperature > 0.0f;
    BuildRow(cases[r], &row_params[r], &penalties, &masks);
  }
  if (any_sampled_override >= 0) any_sampled = any_sampled_override != 0;

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
  out->tokens = d_tokens.Download();
  out->top_ids = d_top_ids.Download();
  out->logprobs = d_logprobs.Download();
  out->top_logprobs = d_top_lp.Download();
  ASSERT_EQ(out->tokens.size(), static_cast<size_t>(rows));
}

// Whether the GPU's `got` differs from the CPU's `want` only by a near tie of the race (see the
// file comment): both in the CPU's kept set, CPU scores within 1e-12.
bool NearTie(const float* x, int vocab, const RowCase& c, int32_t got, int32_t want) {
  if (!(c.s.base.temperature > 0.0f) || got < 0 || got >= vocab) return false;
  const std::vector<float> w = PenalizedLogits(x, vocab, c.s, c.history, c.prompt_len, c.generated);
  const std::vector<int32_t> kept = SamplingKeptIds(w.data(), vocab, c.s.base);
  if (std::find(kept.begin(), kept.end(), got) == kept.end()) return false;
  const uint64_t key = SamplingStepKey(c.s.base.seed, static_cast<uint64_t>(c.generated));
  const float t = c.s.base.temperature;
  return std::abs(SamplingRaceScore(w[got] / t, key, got) -
                  SamplingRaceScore(w[want] / t, key, want)) <= 1e-12;
}

// Every row of a GPU result against SampleToken; returns the number of near ties accepted.
int CheckAgainstCpu(const std::vector<float>& logits, int64_t stride, int vocab,
                    const std::vector<RowCase>& cases, const GpuResult& g) {
  int mismatches = 0, near_ties = 0;
  for (size_t r = 0; r < cases.size() && mismatches < 10; ++r) {
    const RowCase& c = cases[r];
    const float* x = logits.data() + r * stride;
    const SampledOutput want = SampleToken(x, vocab, c.s, c.history, c.prompt_len, c.generated);
    SCOPED_TRACE("row " + std::to_string(r) + ": " + Describe(c));
    const int32_t got = g.tokens[r];
    if (got != want.token) {
      if (NearTie(x, vocab, c, got, want.token)) {
        ++near_ties;
        std::printf("[sampling] near tie accepted: row %zu gpu %d cpu %d\n", r, got, want.token);
        continue;
      }
      ++mismatches;
      ADD_FAILURE() << "token: gpu " << got << " (logit "
                    << (got >= 0 && got < vocab ? x[got] : NAN) << "), cpu " << want.token
                    << " (logit " << x[want.token] << ")";
      continue;
    }
    if (c.s.want_logprobs) {
      EXPECT_NEAR(g.logprobs[r], want.logprob, 1e-4) << "token " << got;
    } else {
      EXPECT_EQ(g.logprobs[r], 0.0f) << "a row without want_logprob gets 0";
    }
    EXPECT_EQ(want.top.size(), static_cast<size_t>(std::min(c.s.top_logprobs, vocab)));
    for (int k = 0; k < kMaxTopLogprobs; ++k) {
      const size_t o = r * kMaxTopLogprobs + k;
      if (k < static_cast<int>(want.top.size())) {
        EXPECT_EQ(g.top_ids[o], want.top[k].first) << "top rank " << k;
        EXPECT_NEAR(g.top_logprobs[o], want.top[k].second, 1e-4) << "top rank " << k;
      } else {
        EXPECT_EQ(g.top_ids[o], -1) << "unused top rank " << k;
        EXPECT_EQ(g.top_logprobs[o], 0.0f) << "unused top rank " << k;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  return near_ties;
}

void RunCase(int rows, int vocab, int ties, bool all_greedy, int64_t stride_pad, uint32_t seed,
             Filters filters = Filters::kMixed) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " vocab=" + std::to_string(vocab) +
               " ties=" + std::to_string(ties) + " all_greedy=" + std::to_string(all_greedy) +
               " filters=" + std::to_string(static_cast<int>(filters)) +
               " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t stride = vocab + stride_pad;
  const std::vector<float> logits = RandomLogits(rng, rows, vocab, stride, ties);
  std::vector<RowCase> cases;
  for (int r = 0; r < rows; ++r) {
    cases.push_back(RandomRow(rng, vocab, filters));
    if (all_greedy) cases.back().s.base.temperature = 0.0f;
  }
  GpuResult g;
  ASSERT_NO_FATAL_FAILURE(RunGpu(logits, stride, vocab, cases, &g));
  CheckAgainstCpu(logits, stride, vocab, cases, g);
}

TEST(SamplingGpuTest, MatchesCpuSampler) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (int vocab : {512, 32000, 163840}) {
    for (int rows : {1, 7, 64}) {
      for (int ties : {0, 1, 2, 3, 4}) RunCase(rows, vocab, ties, false, 0, seed++);
    }
  }
}

// Vocabularies below the block size, not a multiple of a warp, and of one token.
TEST(SamplingGpuTest, SmallAndOddVocabularies) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 401;
  for (int vocab : {1, 2, 5, 33, 1000, 1025, 4097}) {
    for (int ties : {0, 1, 3}) RunCase(16, vocab, ties, false, 3, seed++);
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

// Sampled rows without a filter only: the race over the whole vocabulary in the prepare kernel,
// every segment of the sort empty. With greedy rows mixed in (RandomRow's temperature 0 share).
TEST(SamplingGpuTest, UnfilteredRowsRaceOverTheWholeVocabulary) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 501;
  for (int vocab : {512, 32000, 163840}) {
    for (int ties : {0, 1, 2, 3, 4}) RunCase(64, vocab, ties, false, 0, seed++, Filters::kNone);
  }
  RunCase(256, 163840, 0, false, 0, seed++, Filters::kNone);
}

// Every sampled row with a filter: every sampled row goes through the sort and the draw kernel.
TEST(SamplingGpuTest, FilteredRowsRaceOverTheSortedKeptPrefix) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 601;
  for (int vocab : {512, 32000, 163840}) {
    for (int ties : {0, 1, 2, 3, 4}) RunCase(64, vocab, ties, false, 0, seed++, Filters::kAlways);
  }
}

// any_sampled = false still gives unfiltered sampled rows their token (decided before the sort).
TEST(SamplingGpuTest, UnfilteredRowsNeedNoSort) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(701);
  const int rows = 24, vocab = 32000;
  const std::vector<float> logits = RandomLogits(rng, rows, vocab, vocab, 1);
  std::vector<RowCase> cases;
  cases.reserve(rows);
  for (int r = 0; r < rows; ++r) cases.push_back(RandomRow(rng, vocab, Filters::kNone));
  GpuResult g;
  ASSERT_NO_FATAL_FAILURE(RunGpu(logits, vocab, vocab, cases, &g, /*any_sampled_override=*/0));
  CheckAgainstCpu(logits, vocab, vocab, cases, g);
}

// Many steps of seeded rows: every rank of flat top-k distributions wins the race at some step;
// all must match the CPU.
TEST(SamplingGpuTest, ManySeededSteps) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  for (uint32_t s = 0; s < 4; ++s) RunCase(64, 4096, static_cast<int>(s % 3), false, 0, 301 + s);
}

// One row, fixed logits and parameters, at every position of batches of 1 to 64 rows whose other
// rows (logits, parameters, filters) are random: always the same token, the CPU's. The batch
// changes the grid and the sort's segments, never the row's own arithmetic.
TEST(SamplingGpuTest, ARowsTokenDoesNotDependOnItsBatch) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const int vocab = 163840;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    std::mt19937 rng(801 + variant);
    const std::vector<float> mine = RandomLogits(rng, 1, vocab, vocab, variant == 1 ? 1 : 0);
    RowCase me = RandomRow(rng, vocab, Filters::kMixed);
    me.s.base.temperature = 0.9f;
    me.s.base.top_k = variant == 2 ? 50 : 0;
    me.s.base.top_p = variant == 0 ? 1.0f : 0.95f;
    me.s.base.min_p = 0.0f;
    const int32_t want =
        SampleToken(mine.data(), vocab, me.s, me.history, me.prompt_len, me.generated).token;
    for (int rows : {1, 2, 17, 64}) {
      for (int pos : {0, rows / 2, rows - 1}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " pos " + std::to_string(pos));
        std::vector<float> logits = RandomLogits(rng, rows, vocab, vocab, 0);
        std::copy(mine.begin(), mine.end(), logits.begin() + static_cast<int64_t>(pos) * vocab);
        std::vector<RowCase> cases;
        cases.reserve(rows);
        for (int r = 0; r < rows; ++r) {
          cases.push_back(r == pos ? me : RandomRow(rng, vocab, Filters::kMixed));
        }
        GpuResult g;
        ASSERT_NO_FATAL_FAILURE(RunGpu(logits, vocab, vocab, cases, &g));
        EXPECT_EQ(g.tokens[pos], want);
      }
    }
  }
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
