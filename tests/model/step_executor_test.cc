// The worker's validation of coordinator step plans (worker/server/step_executor.h) on the CPU
// model: a well-formed plan runs and samples; malformed ones are errors that name the sequence,
// never a crash or an out-of-range index (the plan is the only outside input a worker reads).
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "gtest/gtest.h"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"
#include "worker/server/step_executor.h"

namespace mlaserve {
namespace {

struct SeqSpec {
  uint64_t id = 1;
  std::vector<int32_t> tokens{5, 6, 7};
  uint32_t start = 0;
  std::vector<int32_t> blocks{0};
  uint32_t table_from = 0;
  bool sample = true;
};

class StepExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelOptions o;
    o.num_kv_blocks = 4;
    auto m = DeepseekV3Model::Load(FixtureDir("dsv3-tiny"), o, ops_, comm_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    exec_ = std::make_unique<StepExecutor>(*model_, /*sample_here=*/true);
  }
  absl::StatusOr<ExecutedStep> Run(const std::vector<SeqSpec>& seqs) {
    capnp::MallocMessageBuilder msg;
    auto plan = msg.initRoot<wire::StepPlan>();
    plan.setStepId(++step_);
    auto list = plan.initStep(static_cast<unsigned>(seqs.size()));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SeqSpec& s = seqs[i];
      auto q = list[static_cast<unsigned>(i)];
      q.setSeqId(s.id);
      auto t = q.initTokens(static_cast<unsigned>(s.tokens.size()));
      for (size_t j = 0; j < s.tokens.size(); ++j) t.set(static_cast<unsigned>(j), s.tokens[j]);
      q.setStartPosition(s.start);
      auto b = q.initBlockTable(static_cast<unsigned>(s.blocks.size()));
      for (size_t j = 0; j < s.blocks.size(); ++j) b.set(static_cast<unsigned>(j), s.blocks[j]);
      q.setBlockTableFrom(s.table_from);
      q.setPromptLen(static_cast<uint32_t>(s.start + s.tokens.size()));
      q.setSample(s.sample);
      if (s.sample) q.initSampling().setTemperature(0.0f);
    }
    return exec_->Run(plan.asReader());
  }
  uint64_t step_ = 0;
  CpuOps ops_{2};
  SingleRankCommunicator comm_;
  std::unique_ptr<DeepseekV3Model> model_;
  std::unique_ptr<StepExecutor> exec_;
};

TEST_F(StepExecutorTest, RunsAWellFormedPlan) {
  auto r = Run({SeqSpec{}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tokens.size(), 1u);
  EXPECT_EQ(r->tokens[0].seq_id, 1u);
  // The next step continues at position 3 with the table it holds.
  SeqSpec next;
  next.tokens = {r->tokens[0].out.token};
  next.start = 3;
  next.blocks = {};
  next.table_from = 1;
  auto r2 = Run({next});
  ASSERT_TRUE(r2.ok()) << r2.status();
}

TEST_F(StepExecutorTest, RejectsMalformedPlansWithTheSequenceNamed) {
  struct Case {
    std::string what;
    SeqSpec seq;
    std::string message;
  };
  std::vector<Case> cases;
  {
    Case c{"no tokens", {}, "no tokens"};
    c.seq.tokens.clear();
    cases.push_back(c);
  }
  {
    Case c{"block outside the pool", {}, "outside the pool"};
    c.seq.blocks = {4};
    cases.push_back(c);
  }
  {
    Case c{"table too short", {}, "cannot hold"};
    c.seq.start = 62;
    cases.push_back(c);
  }
  {
    Case c{"table continues past what is known", {}, "only 0 are known"};
    c.seq.table_from = 1;
    cases.push_back(c);
  }
  {
    Case c{"token outside the vocabulary", {}, "outside the vocabulary"};
    c.seq.tokens = {1 << 30};
    cases.push_back(c);
  }
  {
    // Positions past int32 (startPosition is a UInt32): an error, not a narrowed negative
    // position indexing the block table.
    Case c{"position past int32", {}, "past the largest position"};
    c.seq.start = std::numeric_limits<uint32_t>::max() - 1;
    cases.push_back(c);
  }
  {
    Case c{"position just past int32", {}, "past the largest position"};
    c.seq.start = static_cast<uint32_t>(std::numeric_limits<int32_t>::max()) - 1;
    cases.push_back(c);
  }
  uint64_t id = 100;
  for (const Case& c : cases) {
    SeqSpec s = c.seq;
    s.id = id++;  // a fresh sequence each: a rejected plan may leave its table half-updated
    auto r = Run({s});
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    const std::string m(r.status().message());
    EXPECT_NE(m.find(c.message), std::string::npos) << c.what << ": " << m;
  }
  // The executor still runs good plans after the bad ones.
  auto ok = Run({SeqSpec{}});
  EXPECT_TRUE(ok.ok()) << ok.status();
}

}  // namespace
}  // namespace mlaserve
