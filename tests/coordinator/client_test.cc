// The C++ client (coordinator/client/client.h) against a real Coordinator and a fake worker:
// Next() with a timeout of 0 or 1 ms returns replies that have already arrived (it used to give
// up before looking: a poll loop asking with short timeouts never saw a reply), and says
// DeadlineExceeded only when there is none.
#include "coordinator/client/client.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_fixture.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;

TEST(ClientTest, NextWithAZeroOrOneMillisecondTimeoutReadsRepliesAlreadyThere) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  FakeWorker::Options w;
  w.endpoint = "ipc://" + (dir / "worker");
  FakeWorker job(w);
  CoordinatorOptions o;
  o.model_dir = FixtureDir("kimi-tiny");  // no tokenizer: token-id requests
  o.client_endpoint = "ipc://" + (dir / "clients");
  o.worker_endpoint = "ipc://" + (dir / "worker");
  o.metrics_address = "";
  InProcessCoordinator coordinator;
  ASSERT_TRUE(coordinator.Start(o).ok());
  auto c = Client::Connect(o.client_endpoint);
  ASSERT_TRUE(c.ok()) << c.status();
  auto h = (*c)->Health(5s);  // connected
  ASSERT_TRUE(h.ok()) << h.status();

  for (const auto timeout : {0ms, 1ms}) {
    GenerateInput in;
    in.token_ids = std::vector<int32_t>{1, 2, 3};
    in.sampling.max_tokens = 8;
    in.sampling.ignore_eos = true;
    auto id = (*c)->Submit(in);
    ASSERT_TRUE(id.ok());
    std::this_thread::sleep_for(500ms);  // every reply is in the client's queue by now
    int chunks = 0;
    bool final = false;
    for (int calls = 0; calls < 100 && !final; ++calls) {
      auto r = (*c)->Next(timeout);
      ASSERT_TRUE(r.ok()) << "timeout " << timeout.count() << " ms, call " << calls << ": "
                          << r.status();
      if (r->kind == Reply::Kind::kChunk) chunks += static_cast<int>(r->token_ids.size());
      final = r->kind == Reply::Kind::kFinal;
    }
    EXPECT_TRUE(final);
    EXPECT_EQ(chunks, 8);
    auto none = (*c)->Next(timeout);
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  }
}

}  // namespace
}  // namespace mlaserve
