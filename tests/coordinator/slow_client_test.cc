// Clients that stop reading or vanish (issue 19), at a real Coordinator with a fake worker that
// produces tokens as fast as the coordinator asks. A client that stops reading fills ZeroMQ's
// queue for it (its high-water mark) and then a backlog in the coordinator; the coordinator must
// go on serving everyone else (health and another client's stream answered throughout), abort
// the slow client's requests once its backlog passes --client-backlog-limit-bytes, hold no more
// than that plus the finals, and lose nothing it owes: when the client reads again it gets every
// chunk and exactly one final per request (finish reason abort, saying why). A client that goes
// away with a backlog has it freed, and its requests with it.
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client/client.h"
#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/metrics_scrape.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int64_t kLimit = 256 << 10;  // the backlog limit under test, bytes

GenerateInput Ids(std::vector<int32_t> ids, uint32_t max_tokens) {
  GenerateInput in;
  in.token_ids = std::move(ids);
  in.sampling.max_tokens = max_tokens;
  in.sampling.ignore_eos = true;
  return in;
}

class SlowClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    FakeWorker::Options w;
    w.endpoint = "ipc://" + (dir_ / "worker");
    job_ = std::make_unique<FakeWorker>(w);
    CoordinatorOptions o;
    o.model_dir = FixtureDir("kimi-tiny");  // no tokenizer: token-id requests
    o.client_endpoint = "ipc://" + (dir_ / "clients");
    o.worker_endpoint = "ipc://" + (dir_ / "worker");
    o.metrics_address = "127.0.0.1:0";
    o.client_backlog_limit_bytes = kLimit;
    ASSERT_TRUE(coordinator_.Start(o).ok());
    fast_ = Connect();
    ASSERT_NE(fast_, nullptr);
  }
  std::unique_ptr<Client> Connect() {
    auto c = Client::Connect("ipc://" + (dir_ / "clients"));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  double Metric(const std::string& name) const {
    return MetricSample(ScrapeMetrics(coordinator_.metrics_port()), name);
  }
  // Health on the fast client until `done` holds, each answer timed; returns the slowest.
  template <typename Done>
  double HealthUntil(Done done, std::chrono::seconds timeout, double* max_backlog) {
    double slowest = 0;
    const auto deadline = Clock::now() + timeout;
    while (!done() && Clock::now() < deadline) {
      const auto t = Clock::now();
      auto h = fast_->Health(10s);
      EXPECT_TRUE(h.ok()) << h.status();
      slowest = std::max(slowest, std::chrono::duration<double>(Clock::now() - t).count());
      if (max_backlog != nullptr) {
        *max_backlog = std::max(*max_backlog, Metric("mlaserve_client_backlog_bytes"));
      }
      std::this_thread::sleep_for(20ms);
    }
    return slowest;
  }

  TempDir dir_;
  std::unique_ptr<FakeWorker> job_;
  InProcessCoordinator coordinator_;
  std::unique_ptr<Client> fast_;
};

TEST_F(SlowClientTest, ClientThatStopsReadingNeitherBlocksNorGrowsTheCoordinatorAndLosesNothing) {
  std::unique_ptr<Client> slow = Connect();
  ASSERT_NE(slow, nullptr);
  constexpr int kRequests = 4;
  std::map<uint64_t, int> index;
  for (int i = 0; i < kRequests; ++i) {
    auto id = slow->Submit(Ids({1 + i, 2, 3}, 200000));  // far more than its queues hold
    ASSERT_TRUE(id.ok());
    index[*id] = i;
  }
  // Meanwhile another client streams to the end.
  std::unique_ptr<Client> other = Connect();
  ASSERT_NE(other, nullptr);
  absl::StatusOr<Reply> other_final = absl::UnknownError("not run");
  int other_chunks = 0;
  std::thread stream([&] {
    other_final = other->Generate(
        Ids({9, 9}, 3000), [&](const Reply&) { ++other_chunks; }, 60s);
  });
  double max_backlog = 0;
  const double slowest =
      HealthUntil([&] { return Metric("mlaserve_client_backlog_aborts_total") >= kRequests; }, 60s,
                  &max_backlog);
  stream.join();
  const double peak = Metric("mlaserve_client_backlog_peak_bytes");
  std::printf(
      "[coordinator] slow client: its %d requests aborted, backlog peak %.0f bytes (limit %lld; "
      "largest seen by the scrapes %.0f), slowest health answer meanwhile %.1f ms\n",
      kRequests, peak, static_cast<long long>(kLimit), max_backlog, slowest * 1e3);
  ASSERT_EQ(Metric("mlaserve_client_backlog_aborts_total"), kRequests);
  ASSERT_TRUE(other_final.ok()) << other_final.status();
  EXPECT_EQ(other_final->finish_reason, "length");
  EXPECT_EQ(other_final->completion_tokens, 3000u);
  EXPECT_GT(other_chunks, 0);
  // Every health call was answered: the loop never waited on the slow client (a blocked loop
  // answers none; the bound only says "answered", not how fast on a loaded machine).
  EXPECT_LT(slowest, 10.0);
  auto h = fast_->Health(5s);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->text.find("running 0, waiting 0") != std::string::npos) << h->text;
  EXPECT_EQ(Metric("mlaserve_kv_cache_usage_ratio"), 0.0);

  // It reads again: every chunk and one final per request, in order, nothing lost.
  std::map<uint64_t, std::vector<int32_t>> streamed;
  std::map<uint64_t, Reply> finals;
  while (finals.size() < kRequests) {
    auto r = slow->Next(10s);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(index.count(r->request_id)) << r->request_id;
    ASSERT_EQ(finals.count(r->request_id), 0u) << "reply after the final";
    if (r->kind == Reply::Kind::kChunk) {
      auto& s = streamed[r->request_id];
      s.insert(s.end(), r->token_ids.begin(), r->token_ids.end());
    } else {
      ASSERT_EQ(r->kind, Reply::Kind::kFinal) << r->message;
      finals[r->request_id] = *r;
    }
  }
  int64_t final_bytes = 0;
  for (const auto& [id, f] : finals) {
    EXPECT_EQ(f.finish_reason, "abort");
    EXPECT_NE(f.message.find("not reading its replies"), std::string::npos) << f.message;
    EXPECT_EQ(streamed[id], f.token_ids) << "request " << id;
    EXPECT_GT(f.token_ids.size(), 0u);
    final_bytes += 512 + 4 * static_cast<int64_t>(f.token_ids.size());  // a final's size, at most
  }
  // Held: the limit, what one step added before the aborts (a chunk per request), the finals.
  EXPECT_GT(peak, static_cast<double>(kLimit));
  EXPECT_LE(peak, static_cast<double>(kLimit + kRequests * 512 + final_bytes));
  EXPECT_LE(max_backlog, peak);
  auto late = slow->Next(300ms);
  EXPECT_FALSE(late.ok()) << "a reply after every final";
  for (const auto deadline = Clock::now() + 5s;
       Metric("mlaserve_client_backlog_bytes") != 0 && Clock::now() < deadline;)
    std::this_thread::sleep_for(20ms);
  EXPECT_EQ(Metric("mlaserve_client_backlog_bytes"), 0.0);
  // Served again once it reads.
  auto again = slow->Generate(Ids({1, 2}, 5), nullptr, 10s);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->finish_reason, "length");
}

TEST_F(SlowClientTest, ClientThatVanishesWithABacklogIsForgottenWithItsRequests) {
  std::unique_ptr<Client> slow = Connect();
  ASSERT_NE(slow, nullptr);
  ASSERT_TRUE(slow->Submit(Ids({5, 6}, 200000)).ok());
  // Until the coordinator holds replies it could not send (the client's queues are full).
  HealthUntil([&] { return Metric("mlaserve_client_backlog_bytes") > 0; }, 60s, nullptr);
  ASSERT_GT(Metric("mlaserve_client_backlog_bytes"), 0.0);
  slow.reset();  // gone, without a word
  std::string detail;
  HealthUntil(
      [&] {
        auto h = fast_->Health(2s);
        detail = h.ok() ? h->text : "";
        return Metric("mlaserve_client_backlog_bytes") == 0 &&
               detail.find("running 0, waiting 0") != std::string::npos;
      },
      20s, nullptr);
  EXPECT_EQ(Metric("mlaserve_client_backlog_bytes"), 0.0);
  EXPECT_NE(detail.find("running 0, waiting 0"), std::string::npos) << detail;
  EXPECT_EQ(Metric("mlaserve_kv_cache_usage_ratio"), 0.0);
}

}  // namespace
}  // namespace mlaserve
