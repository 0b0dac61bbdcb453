// End to end on the CPU with real processes: coordinator + `mpirun -np 2` workers + clients over
// ZeroMQ. Greedy outputs equal transformers' golden continuation however requests are batched;
// seeded sampling is reproducible; aborts and KV pressure (preemption) change nothing in other
// outputs; prefix reuse hits; malformed input gets an error and the server stays up; every
// request gets exactly one final; a dead worker job fails every request in flight, and the
// coordinator serves the next one.
// The workers use the lossless f32 cache so that outputs can be compared with the oracle
// exactly (see tests/model/golden_test.cc for why bf16 cannot be, on these random models).
#include <cstdlib>
#include <map>
#include <thread>
#include <random>
#include <set>

#include "capnp/message.h"
#include "capnp/serialize.h"
#include "gtest/gtest.h"
#include "mlaserve.capnp.h"
#include "tests/e2e/server_fixture.h"
#include "tests/model/golden_fixture.h"
#include "zmq.hpp"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;

GenerateInput Greedy(std::vector<int32_t> ids, uint32_t max_tokens) {
  GenerateInput in;
  in.token_ids = std::move(ids);
  in.sampling.max_tokens = max_tokens;
  in.sampling.ignore_eos = true;
  return in;
}

// Submits all inputs at once and collects, per request, the streamed tokens and the single
// final. Fails the test if any request gets zero or two finals, or a chunk after its final.
struct Outcome {
  std::vector<int32_t> streamed;
  Reply final;
  int finals = 0;
};

std::vector<Outcome> RunAll(Client& c, const std::vector<GenerateInput>& inputs) {
  std::map<uint64_t, size_t> index;
  std::vector<Outcome> out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto id = c.Submit(inputs[i]);
    EXPECT_TRUE(id.ok());
    if (id.ok()) index[*id] = i;
  }
  size_t done = 0;
  while (done < inputs.size()) {
    auto r = c.Next(120s);
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      break;
    }
    auto it = index.find(r->request_id);
    if (it == index.end()) continue;
    Outcome& o = out[it->second];
    EXPECT_EQ(o.finals, 0) << "reply after the final of request " << r->request_id;
    if (r->kind == Reply::Kind::kChunk) {
      o.streamed.insert(o.streamed.end(), r->token_ids.begin(), r->token_ids.end());
    } else {
      o.final = *r;
      ++o.finals;
      ++done;
    }
  }
  for (const Outcome& o : out) EXPECT_EQ(o.finals, 1);
  return out;
}

class E2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcesses();
    ServerOptions o;
    o.model_dir = FixtureDir(E2eModel());
    o.kv_blocks = 64;
    o.coordinator_args = {"--max-step-tokens", "256", "--prefill-chunk", "48"};
    const std::string err = server_->Start(o);
    ASSERT_EQ(err, "") << err;
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0) << server_->Logs();
    delete server_;
  }
  void SetUp() override {
    auto c = Client::Connect(server_->endpoint());
    ASSERT_TRUE(c.ok());
    client_ = std::move(*c);
  }
  static ServerProcesses* server_;
  std::unique_ptr<Client> client_;
};
ServerProcesses* E2eTest::server_ = nullptr;

// Reply framing on a raw DEALER socket: requests without batchedReplies get exactly one
// ServerReply per frame (what clients written against the original API expect); requests with
// it may share frames, and do when they decode in the same steps. Both see every token once.
TEST_F(E2eTest, ReplyFramesWithAndWithoutBatchedReplies) {
  for (const bool batched : {false, true}) {
    SCOPED_TRACE(batched ? "batchedReplies" : "one reply per frame");
    zmq::context_t ctx(1);
    zmq::socket_t sock(ctx, zmq::socket_type::dealer);
    sock.set(zmq::sockopt::linger, 0);
    sock.connect(server_->endpoint());
    constexpr int kRequests = 3, kTokens = 12;
    for (int i = 0; i < kRequests; ++i) {
      capnp::MallocMessageBuilder msg;
      auto req = msg.initRoot<wire::ClientRequest>();
      req.setRequestId(100 + i);
      auto g = req.initGenerate();
      auto ids = g.getInput().initTokenIds(4);
      for (int j = 0; j < 4; ++j) ids.set(j, 3 + i + j);
      g.getSampling().setMaxTokens(kTokens);
      g.getSampling().setIgnoreEos(true);
      g.setBatchedReplies(batched);
      auto words = capnp::messageToFlatArray(msg);
      auto b = words.asBytes();
      ASSERT_TRUE(sock.send(zmq::const_buffer(b.begin(), b.size()), zmq::send_flags::none));
    }
    std::map<uint64_t, int> tokens, finals;
    int frames = 0, shared_frames = 0;
    while (static_cast<int>(finals.size()) < kRequests) {
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      ASSERT_GT(zmq::poll(&item, 1, std::chrono::milliseconds(60000)), 0) << "no reply";
      zmq::message_t m;
      ASSERT_TRUE(sock.recv(m, zmq::recv_flags::none));
      ASSERT_EQ(m.size() % sizeof(capnp::word), 0u);
      auto words = kj::heapArray<capnp::word>(m.size() / sizeof(capnp::word));
      std::memcpy(words.begin(), m.data(), m.size());
      kj::ArrayPtr<const capnp::word> rest = words.asPtr();
      int in_frame = 0;
      while (rest.size() > 0) {
        capnp::FlatArrayMessageReader reader(rest);
        auto r = reader.getRoot<wire::ServerReply>();
        if (r.isChunk()) tokens[r.getRequestId()] += r.getChunk().getTokenIds().size();
        if (r.isFinal()) {
          EXPECT_EQ(r.getFinal().getTokenIds().size(), static_cast<unsigned>(kTokens));
          ++finals[r.getRequestId()];
        }
        ++in_frame;
        rest = kj::arrayPtr(reader.getEnd(), rest.end());
      }
      ++frames;
      if (in_frame > 1) ++shared_frames;
      if (!batched) EXPECT_EQ(in_frame, 1) << "frame " << frames;
    }
    for (int i = 0; i < kRequests; ++i) {
      EXPECT_EQ(tokens[100 + i], kTokens) << "request " << 100 + i;
      EXPECT_EQ(finals[100 + i], 1) << "request " << 100 + i;
    }
    if (batched) EXPECT_GT(shared_frames, 0) << frames << " frames";
  }
}

TEST_F(E2eTest, GreedyMatchesGoldenAloneAndInABatchOf64) {
  Golden golden(FixtureDir("kimi-tiny"));
  const auto prompt = golden.Get<int32_t>("p2.ids");
  auto want = golden.Get<int32_t>("p2.greedy");
  auto alone = RunAll(*client_, {Greedy(prompt, want.size())});
  ASSERT_EQ(alone[0].final.finish_reason, "length");
  // On a GPU (bf16 activations) the golden fp32 continuation is not expected on these random
  // models (gpu_model_test measures why); the request run alone is the reference instead.
  if (E2eOnGpu()) want = alone[0].final.token_ids;
  EXPECT_EQ(alone[0].final.token_ids, want);
  EXPECT_EQ(alone[0].streamed, want);
  // Mixed lengths: prefixes of the golden prompts, each run alone for its reference, then 64
  // at once (the golden prompt 8 times among them).
  std::vector<GenerateInput> batch;
  std::vector<std::vector<int32_t>> refs;
  std::mt19937 rng(7);
  const auto p1 = golden.Get<int32_t>("p1.ids");
  for (int i = 0; i < 56; ++i) {
    const int len = 1 + static_cast<int>(rng() % p1.size());
    batch.push_back(Greedy(std::vector<int32_t>(p1.begin(), p1.begin() + len), 4 + rng() % 12));
  }
  for (size_t i = 0; i < 8; ++i) batch.push_back(Greedy(prompt, want.size()));
  std::vector<std::vector<int32_t>> alone_outputs;
  for (size_t i = 0; i < 56; i += 7) {  // references for a sample of the mixed requests
    alone_outputs.push_back(RunAll(*client_, {batch[i]})[0].final.token_ids);
  }
  auto together = RunAll(*client_, batch);
  for (size_t i = 0, k = 0; i < 56; i += 7, ++k) EXPECT_EQ(together[i].final.token_ids, alone_outputs[k]) << i;
  for (size_t i = 56; i < 64; ++i) EXPECT_EQ(together[i].final.token_ids, want) << i;
  for (const auto& o : together) EXPECT_EQ(o.streamed, o.final.token_ids);
}

TEST_F(E2eTest, SeededSamplingIsReproducibleAcrossBatching) {
  Golden golden(FixtureDir("kimi-tiny"));
  GenerateInput in = Greedy(golden.Get<int32_t>("p0.ids"), 12);
  in.sampling.temperature = 0.8f;
  in.sampling.top_p = 0.9f;
  in.sampling.seed = 1234;
  const auto a = RunAll(*client_, {in})[0].final.token_ids;
  std::vector<GenerateInput> batch(5, Greedy(golden.Get<int32_t>("p1.ids"), 8));
  batch.push_back(in);
  const auto b = RunAll(*client_, batch).back().final.token_ids;
  EXPECT_EQ(a, b);
  in.sampling.seed = 99;
  const auto c = RunAll(*client_, {in})[0].final.token_ids;
  EXPECT_NE(a, c);  // another seed draws other tokens (12 draws at temperature 0.8)
}

TEST_F(E2eTest, AbortMidStreamFreesBlocks) {
  Golden golden(FixtureDir("kimi-tiny"));
  auto id = client_->Submit(Greedy(golden.Get<int32_t>("p2.ids"), 1900));  // fits every fixture's context
  ASSERT_TRUE(id.ok());
  int chunks = 0;
  Reply final;
  for (;;) {
    auto r = client_->Next(60s);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == Reply::Kind::kChunk && ++chunks == 3) ASSERT_TRUE(client_->Abort(*id).ok());
    if (r->kind == Reply::Kind::kFinal) {
      final = *r;
      break;
    }
  }
  EXPECT_EQ(final.finish_reason, "abort");
  EXPECT_LT(final.completion_tokens, 100u);
  auto h = client_->Health();
  ASSERT_TRUE(h.ok());
  EXPECT_NE(h->text.find("running 0, waiting 0"), std::string::npos) << h->text;
  EXPECT_EQ(server_->MetricValue("mlaserve_kv_cache_usage_ratio"), 0.0);
}

TEST_F(E2eTest, ClientThatDisconnectsFreesItsSequences) {
  {
    auto gone = Client::Connect(server_->endpoint());
    ASSERT_TRUE(gone.ok());
    auto id = (*gone)->Submit(Greedy({9, 8, 7, 6}, 2500));
    ASSERT_TRUE(id.ok());
    auto first = (*gone)->Next(30s);
    ASSERT_TRUE(first.ok());
  }  // the client's socket closes here with its request still running
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  std::string detail;
  while (std::chrono::steady_clock::now() < deadline) {
    auto h = client_->Health();
    ASSERT_TRUE(h.ok());
    detail = h->text;
    if (detail.find("running 0, waiting 0") != std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_NE(detail.find("running 0, waiting 0"), std::string::npos) << detail;
  EXPECT_EQ(server_->MetricValue("mlaserve_kv_cache_usage_ratio"), 0.0);
}

TEST_F(E2eTest, PrefixReuseHitsAndChangesNothing) {
  Golden golden(FixtureDir("kimi-tiny"));
  const auto prompt = golden.Get<int32_t>("p2.ids");  // 77 tokens: one full block to reuse
  auto first = RunAll(*client_, {Greedy(prompt, 8)})[0].final;
  auto second = RunAll(*client_, {Greedy(prompt, 8)})[0].final;
  EXPECT_EQ(second.cached_tokens, 64u);
  EXPECT_EQ(first.token_ids, second.token_ids);
  EXPECT_GT(server_->MetricValue("mlaserve_prefix_cache_hits_total"), 0.0);
}

TEST_F(E2eTest, MalformedInputGetsErrorsAndTheServerStaysUp) {
  std::mt19937 rng(3);
  // Random bytes (whole words and not), a wrong struct, absurd lengths, out-of-range parameters.
  for (int i = 0; i < 20; ++i) {
    std::string junk(8 * (1 + rng() % 16) + (i % 2), '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    ASSERT_TRUE(client_->SendRaw(junk).ok());
    auto r = client_->Next(10s);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->kind, Reply::Kind::kError);
  }
  {
    // A segment table that claims far more words than the frame holds.
    std::string huge(16, '\0');
    huge[0] = 0;
    huge[4] = '\xff';
    huge[5] = '\xff';
    huge[6] = '\xff';
    huge[7] = '\x0f';
    ASSERT_TRUE(client_->SendRaw(huge).ok());
    auto r = client_->Next(10s);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->kind, Reply::Kind::kError);
  }
  {
    // A valid message of another type (a StepPlan) where a ClientRequest is expected.
    capnp::MallocMessageBuilder msg;
    auto p = msg.initRoot<wire::StepPlan>();
    p.setStepId(77);
    p.initStep(3);
    kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
    auto b = words.asBytes();
    ASSERT_TRUE(client_->SendRaw(std::string(reinterpret_cast<const char*>(b.begin()), b.size())).ok());
    auto r = client_->Next(10s);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->kind, Reply::Kind::kError);
  }
  struct Bad {
    const char* what;
    std::function<void(GenerateInput&)> set;
    const char* code;
  };
  const std::vector<Bad> bad = {
      {"temperature", [](GenerateInput& in) { in.sampling.temperature = -1; }, "invalidRequest"},
      {"top_p", [](GenerateInput& in) { in.sampling.top_p = 0; }, "invalidRequest"},
      {"min_tokens", [](GenerateInput& in) { in.sampling.min_tokens = 50; in.sampling.max_tokens = 5; }, "invalidRequest"},
      {"token id", [](GenerateInput& in) { in.token_ids = std::vector<int32_t>{1, 100000}; }, "invalidRequest"},
      {"empty", [](GenerateInput& in) { in.token_ids = std::vector<int32_t>{}; }, "invalidRequest"},
      {"too long", [](GenerateInput& in) { in.sampling.max_tokens = 1000000; }, "promptTooLong"},
      {"text without tokenizer", [](GenerateInput& in) { in.token_ids.reset(); in.text = "hello"; }, "invalidRequest"},
  };
  for (const Bad& b : bad) {
    GenerateInput in = Greedy({1, 2, 3}, 4);
    b.set(in);
    auto r = client_->Generate(in, nullptr, 10s);
    ASSERT_TRUE(r.ok()) << b.what;
    EXPECT_EQ(r->kind, Reply::Kind::kError) << b.what;
    EXPECT_EQ(r->error_code, b.code) << b.what << ": " << r->message;
  }
  auto h = client_->Health();
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->ok);
  auto ok = client_->Generate(Greedy({1, 2, 3}, 4), nullptr, 30s);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->completion_tokens, 4u);
}

// A small cache (8 blocks = 512 tokens) and 12 concurrent requests of 77 + 60 tokens (three
// blocks each at the end): the scheduler must preempt, and every output must still equal the
// output of the same request run alone (and its first 32 tokens the golden continuation).
TEST(E2eKvPressureTest, PreemptionKeepsGreedyOutputs) {
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  o.kv_blocks = 8;
  o.coordinator_args = {"--max-step-tokens", "512"};
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  Golden golden(FixtureDir("kimi-tiny"));
  const auto prompt = golden.Get<int32_t>("p2.ids");
  const auto want = golden.Get<int32_t>("p2.greedy");
  const auto alone = RunAll(**c, {Greedy(prompt, 60)})[0].final.token_ids;
  ASSERT_EQ(alone.size(), 60u);
  if (!E2eOnGpu()) EXPECT_EQ(std::vector<int32_t>(alone.begin(), alone.begin() + want.size()), want);
  std::vector<GenerateInput> batch(12, Greedy(prompt, 60));
  auto out = RunAll(**c, batch);
  for (const auto& o2 : out) EXPECT_EQ(o2.final.token_ids, alone);
  EXPECT_GT(server.MetricValue("mlaserve_preemptions_total"), 0.0) << server.Metrics();
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

// The deterministic mode (--deterministic on, issue 23) under KV pressure: 16 requests of 77 + 60
// tokens on a 12-block pool must preempt (the metric says so), and every one's tokens, seeded
// sampling with top-p, top-k and min-p at temperature 0.9, or greedy, equal the same request run
// alone on an idle server and inside batches of other sizes. A preempted request is recomputed
// by a prefill, which in this mode reads the cache as decode does, so its logits are the same
// bits as the first time and the sampler draws the same token.
TEST(E2eDeterministicTest, SeededSamplingSurvivesPreemptionAndBatching) {
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  o.kv_blocks = 12;
  o.kv_format = "bf16";
  o.coordinator_args = {"--max-step-tokens", "512"};
  o.worker_args = {"--deterministic", "on"};
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  Golden golden(FixtureDir("kimi-tiny"));
  const auto prompt = golden.Get<int32_t>("p2.ids");
  std::vector<GenerateInput> inputs;
  for (int i = 0; i < 16; ++i) {
    GenerateInput in = Greedy(std::vector<int32_t>(prompt.begin(), prompt.end() - i % 3), 60);
    if (i % 4 != 3) {  // every fourth greedy
      in.sampling.temperature = 0.9f;
      in.sampling.seed = 1000 + i;
      if (i % 4 == 0) in.sampling.top_p = 0.95f;
      if (i % 4 == 1) in.sampling.top_k = 20;
      if (i % 4 == 2) in.sampling.min_p = 0.05f;
    }
    inputs.push_back(in);
  }
  const auto together = RunAll(**c, inputs);
  EXPECT_GT(server.MetricValue("mlaserve_preemptions_total"), 0.0) << server.Metrics();
  std::set<std::vector<int32_t>> distinct;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto alone = RunAll(**c, {inputs[i]})[0].final.token_ids;
    ASSERT_EQ(alone.size(), 60u) << i;
    EXPECT_EQ(together[i].final.token_ids, alone) << "request " << i << " (preempted batch of 16)";
    distinct.insert(alone);
  }
  EXPECT_GT(distinct.size(), 8u);  // the seeds draw different continuations
  // Batches of 3 and 7 (no pressure at these sizes), each output equal to the alone one.
  for (size_t n : {3u, 7u}) {
    std::vector<GenerateInput> part(inputs.begin(), inputs.begin() + n);
    const auto got = RunAll(**c, part);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(got[i].final.token_ids, together[i].final.token_ids) << "batch of " << n << ", " << i;
    }
  }
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

// Decode context parallelism (--dcp 2, issue 20) behind the coordinator: 2 CPU ranks splitting
// the cache (4 blocks each, 8 for the coordinator), 12 concurrent greedy requests that must be
// preempted, then the same prompt again for a prefix-cache hit. Every output equals transformers'
// golden continuation for its first 32 tokens and the request run alone for all 60 (f32 cache).
TEST(E2eDcpTest, SplitCacheServesGoldenGreedyThroughPreemptionAndPrefixReuse) {
  // The GPU run of these tests has one worker rank (one GPU); GPU DCP over two ranks is
  // gpu_model_test's DcpOverTwoRanksMatchesOneRank (two threads on one GPU).
  if (E2eOnGpu()) GTEST_SKIP() << "needs 2 worker ranks; the GPU e2e runs one";
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  o.ranks = 2;
  o.kv_blocks = 4;
  o.coordinator_args = {"--max-step-tokens", "512"};
  o.worker_args = {"--dcp", "2"};
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(server.MetricValue("mlaserve_kv_cache_blocks"), 8.0) << server.Metrics();
  EXPECT_EQ(server.MetricValue("mlaserve_kv_cache_dcp_ranks"), 2.0) << server.Metrics();
  Golden golden(FixtureDir("kimi-tiny"));
  const auto prompt = golden.Get<int32_t>("p2.ids");
  const auto want = golden.Get<int32_t>("p2.greedy");
  const auto alone = RunAll(**c, {Greedy(prompt, 60)})[0].final.token_ids;
  ASSERT_EQ(alone.size(), 60u);
  EXPECT_EQ(std::vector<int32_t>(alone.begin(), alone.begin() + want.size()), want);
  std::vector<GenerateInput> batch(12, Greedy(prompt, 60));
  for (const auto& out : RunAll(**c, batch)) EXPECT_EQ(out.final.token_ids, alone);
  EXPECT_GT(server.MetricValue("mlaserve_preemptions_total"), 0.0) << server.Metrics();
  const double hits = server.MetricValue("mlaserve_prefix_cache_hits_total");
  EXPECT_EQ(RunAll(**c, {Greedy(prompt, 60)})[0].final.token_ids, alone);
  EXPECT_GT(server.MetricValue("mlaserve_prefix_cache_hits_total"), hits) << server.Metrics();
  auto info = (*c)->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_NE(info->text.find("\"dcp\":2"), std::string::npos) << info->text;
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

// Text in, text out on the embedded tiny model (DeepSeek-V3's tokenizer and chat template):
// streamed text deltas concatenate to the final text, stop strings cut the text exactly before
// the match (and end the request with reason stop), logprobs come with their alternatives.
TEST(E2eTextTest, ChatStopStringsAndLogprobs) {
  const std::string model = std::string(std::getenv("MLASERVE_BINARY_DIR")) + "/models/tiny-deepseek-v3";
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = model;
  o.kv_format = "bf16";
  o.kv_blocks = 16;
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  GenerateInput chat;
  chat.chat = nlohmann::json::array({{{"role", "system"}, {"content", "Be brief."}},
                                     {{"role", "user"}, {"content", "Name three prime numbers."}}});
  chat.sampling.max_tokens = 24;
  chat.sampling.ignore_eos = true;
  chat.sampling.logprobs = true;
  chat.sampling.top_logprobs = 3;
  std::string streamed;
  std::vector<TokenLogprobInfo> lps;
  auto full = (*c)->Generate(chat, [&](const Reply& r) {
    streamed += r.text;
    lps.insert(lps.end(), r.logprobs.begin(), r.logprobs.end());
  });
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->kind, Reply::Kind::kFinal) << full->message;
  EXPECT_EQ(full->finish_reason, "length");
  EXPECT_EQ(streamed, full->text);
  EXPECT_GT(full->prompt_tokens, 10u);  // the template added its own tokens around the messages
  ASSERT_EQ(lps.size(), full->token_ids.size());
  for (size_t i = 0; i < lps.size(); ++i) {
    EXPECT_EQ(lps[i].token_id, full->token_ids[i]);
    EXPECT_LE(lps[i].logprob, 0.0f);
    ASSERT_EQ(lps[i].top.size(), 3u);
    EXPECT_GE(lps[i].top[0].second, lps[i].top[1].second);
    EXPECT_GE(lps[i].top[0].second, lps[i].logprob);  // greedy: the chosen token is the top one
  }
  // A stop string taken from the middle of that (greedy, so reproducible) completion.
  ASSERT_GT(full->text.size(), 12u);
  const std::string stop = full->text.substr(full->text.size() / 2, 3);
  const std::string expected = full->text.substr(0, full->text.find(stop));
  chat.sampling.stop = {stop};
  chat.sampling.logprobs = false;
  streamed.clear();
  auto cut = (*c)->Generate(chat, [&](const Reply& r) { streamed += r.text; });
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->finish_reason, "stop");
  EXPECT_EQ(cut->text, expected);
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

// SIGTERM drains: a short request in flight finishes normally, a long one is aborted when the
// drain timeout passes, and the coordinator exits 0.
TEST(E2eDrainTest, SigtermDrainsThenAbortsTheRest) {
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  // The GPU decodes the tiny model at ~0.4 ms a step (2040 tokens in ~0.8 s, measured on an
  // H200): a shorter drain still cuts the long request.
  o.coordinator_args = {"--drain-timeout-ms", E2eOnGpu() ? "100" : "2000"};
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  // Longer than the drain timeout allows, within the model's context (2048 for the GPU's model).
  auto long_id = (*c)->Submit(Greedy({5, 6, 7}, E2eOnGpu() ? 2040 : 3000));
  auto short_id = (*c)->Submit(Greedy({1, 2, 3, 4}, 24));
  ASSERT_TRUE(long_id.ok() && short_id.ok());
  auto first = (*c)->Next(30s);
  ASSERT_TRUE(first.ok());
  int rc = -1;
  std::thread stopper([&] { rc = server.Stop(std::chrono::seconds(30)); });
  std::map<uint64_t, Reply> finals;
  while (finals.size() < 2) {
    auto r = (*c)->Next(30s);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->kind == Reply::Kind::kFinal) finals[r->request_id] = *r;
  }
  stopper.join();
  EXPECT_EQ(rc, 0) << server.Logs();
  EXPECT_EQ(finals[*short_id].finish_reason, "length");
  EXPECT_EQ(finals[*short_id].completion_tokens, 24u);
  EXPECT_EQ(finals[*long_id].finish_reason, "abort");
  EXPECT_NE(finals[*long_id].message.find("shut down"), std::string::npos) << finals[*long_id].message;
}

// Killing the worker job (mpirun and every rank) fails the request in flight with finish reason
// error and code workerFailed; the coordinator stays up, says why in its health answer, refuses
// new requests with workerFailed, and serves a new worker job (started here as a launcher would)
// on the same client connection, with the same greedy output as before. The launcher's own
// restarts, killing one rank: tests/e2e/worker_restart_test.cc.
TEST(E2eWorkerFailureTest, DeadWorkerJobFailsRequestsAndTheCoordinatorServesTheNextOne) {
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  const auto before = RunAll(**c, {Greedy({5, 6, 7}, 12)})[0].final.token_ids;
  auto id = (*c)->Submit(Greedy({1, 2, 3, 4}, 2000));  // within every fixture's context
  ASSERT_TRUE(id.ok());
  auto first = (*c)->Next(30s);
  ASSERT_TRUE(first.ok());
  const auto killed = std::chrono::steady_clock::now();
  server.KillWorkers();
  Reply final;
  for (;;) {
    auto r = (*c)->Next(20s);
    ASSERT_TRUE(r.ok()) << r.status() << server.Logs();
    if (r->kind == Reply::Kind::kFinal) {
      final = *r;
      break;
    }
  }
  const double detect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("[e2e] worker job death detected after %.2f s\n", detect_s);
  EXPECT_EQ(final.finish_reason, "error");
  EXPECT_EQ(final.error_code, "workerFailed");
  EXPECT_NE(final.message.find("worker job failed: worker rank"), std::string::npos) << final.message;
  EXPECT_LT(detect_s, 2.0);  // issue 19
  auto h = (*c)->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->ok);
  EXPECT_NE(h->text.find("worker job failed"), std::string::npos) << h->text;
  auto refused = RunAll(**c, {Greedy({1, 2}, 4)});
  EXPECT_EQ(refused[0].final.kind, Reply::Kind::kError);
  EXPECT_EQ(refused[0].final.error_code, "workerFailed");
  EXPECT_EQ(server.WaitCoordinator(std::chrono::seconds(1)), -1) << "the coordinator exited\n" << server.Logs();

  server.RestartWorkers();
  bool healthy = false;
  for (const auto deadline = std::chrono::steady_clock::now() + 90s;
       !healthy && std::chrono::steady_clock::now() < deadline;) {
    auto again = (*c)->Health(1s);
    healthy = again.ok() && again->ok;
    if (!healthy) std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(healthy) << server.Logs();
  EXPECT_EQ(RunAll(**c, {Greedy({5, 6, 7}, 12)})[0].final.token_ids, before);
  EXPECT_EQ(server.MetricValue("mlaserve_worker_restarts_total"), 1.0);
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

}  // namespace
}  // namespace mlaserve
