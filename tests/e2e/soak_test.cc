// A bounded soak (issue 19): a real coordinator and `mpirun -np 2` CPU workers on a small KV pool
// (preemption forced), driven for MLASERVE_SOAK_SECONDS (default 60) by 8 client threads with
// mixed prompt and output lengths, greedy and seeded sampling, random aborts mid-stream and
// clients that vanish with requests in flight (and reconnect). Checked: every request of a
// client that stayed connected gets exactly one final (abort finals included) and no reply after
// it; the only error is the expected one (an abort that lost the race with its request's end is
// answered notFound); preemptions happened; at
// the end no request is running or waiting and no KV block is in use; the coordinator's resident
// memory after the soak is within 64 MiB of where it was after a warm-up (growth printed). The
// same binary with a larger MLASERVE_SOAK_SECONDS is the long soak of bench/ (bench/RESULTS.md).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/model_config.h"
#include "gtest/gtest.h"
#include "tests/e2e/server_fixture.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;

// VmRSS of a process, in KiB (0 if unreadable).
long RssKib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      long v = 0;
      in >> v;
      return v;
    }
    std::string rest;
    std::getline(in, rest);
  }
  return 0;
}

struct Totals {
  std::atomic<int> submitted{0}, finals{0}, aborted{0}, vanished{0}, tokens{0};
  std::mutex mu;
  std::vector<std::string> problems;  // unexpected events, reported at the end
  void Problem(std::string s) {
    std::lock_guard<std::mutex> l(mu);
    if (problems.size() < 20) problems.push_back(std::move(s));
  }
};

// One client thread: rounds of 1-6 concurrent requests on one connection until `deadline`;
// sometimes aborts one mid-stream, sometimes drops the connection with requests in flight.
void ClientLoop(const std::string& endpoint, int id, std::chrono::steady_clock::time_point deadline,
                const std::vector<int32_t>& ids, int vocab, Totals& t) {
  std::mt19937 rng(1000 + id);
  while (std::chrono::steady_clock::now() < deadline) {
    auto c = Client::Connect(endpoint);
    if (!c.ok()) {
      t.Problem("connect: " + std::string(c.status().message()));
      std::this_thread::sleep_for(100ms);
      continue;
    }
    for (int round = 0; round < 8 && std::chrono::steady_clock::now() < deadline; ++round) {
      const int n = 1 + static_cast<int>(rng() % 6);
      std::map<uint64_t, int> finals;  // request id -> finals seen
      std::map<uint64_t, int> chunks;
      for (int i = 0; i < n; ++i) {
        GenerateInput in;
        const int len = 1 + static_cast<int>(rng() % 200);
        std::vector<int32_t> prompt;
        for (int k = 0; k < len; ++k) {
          prompt.push_back(k < static_cast<int>(ids.size()) && rng() % 4 != 0
                               ? ids[k]
                               : static_cast<int32_t>(rng() % vocab));
        }
        in.token_ids = prompt;
        in.sampling.max_tokens = 1 + rng() % 64;
        in.sampling.ignore_eos = rng() % 2 == 0;
        if (rng() % 2 == 0) {
          in.sampling.temperature = 0.8f;
          in.sampling.top_p = 0.9f;
          in.sampling.seed = rng();
        }
        auto rid = (*c)->Submit(in);
        if (!rid.ok()) {
          t.Problem("submit: " + std::string(rid.status().message()));
          continue;
        }
        finals[*rid] = 0;
        ++t.submitted;
      }
      const bool vanish = rng() % 6 == 0;    // drop the connection after the first chunk
      const bool abort_one = rng() % 4 == 0;  // abort the first request after its first chunk
      bool aborted = false;
      uint64_t aborted_id = 0;
      size_t done = 0;
      while (done < finals.size()) {
        auto r = (*c)->Next(60s);
        if (!r.ok()) {
          t.Problem("no reply within 60 s: " + std::string(r.status().message()));
          break;
        }
        auto it = finals.find(r->request_id);
        if (it == finals.end()) continue;  // accepted frames of other kinds
        if (r->kind == Reply::Kind::kChunk) {
          if (it->second > 0) t.Problem("chunk after the final of " + std::to_string(r->request_id));
          t.tokens += static_cast<int>(r->token_ids.size());
          if (++chunks[r->request_id] == 1) {
            if (vanish) break;
            if (abort_one && !aborted && r->request_id == finals.begin()->first) {
              aborted = true;
              aborted_id = r->request_id;
              ++t.aborted;
              if (!(*c)->Abort(r->request_id).ok()) t.Problem("abort failed");
            }
          }
        } else if (r->kind == Reply::Kind::kFinal) {
          if (++it->second > 1) t.Problem("two finals for " + std::to_string(r->request_id));
          ++t.finals;
          ++done;
        } else if (r->kind == Reply::Kind::kError) {
          // An abort that loses the race with the request's end is answered notFound after
          // the final: expected, and not a second terminal reply.
          if (r->error_code == "notFound" && aborted && r->request_id == aborted_id) continue;
          t.Problem("error reply: " + r->error_code + " " + r->text);
          ++it->second;
          ++done;
        }
      }
      if (vanish && done < finals.size()) {
        ++t.vanished;
        break;  // the Client is destroyed with requests in flight; a new connection follows
      }
    }
  }
}

TEST(SoakTest, MixedLoadWithAbortsDisconnectsAndPreemption) {
  const char* env = std::getenv("MLASERVE_SOAK_SECONDS");
  const int seconds = env != nullptr ? std::atoi(env) : 60;
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  o.kv_blocks = 24;
  o.coordinator_args = {"--max-step-tokens", "256", "--prefill-chunk", "64"};
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  Golden golden(FixtureDir("kimi-tiny"));
  const std::vector<int32_t> ids = golden.Get<int32_t>("p2.ids");
  auto config = LoadModelConfig(o.model_dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const int vocab = config->vocab_size;
  // Warm-up: a few requests, then the baseline RSS.
  Totals warm;
  ClientLoop(server.endpoint(), 99, std::chrono::steady_clock::now() + 3s, ids, vocab, warm);
  const long rss0 = RssKib(server.coordinator_pid());
  Totals t;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<std::thread> clients;
  for (int i = 0; i < 8; ++i) {
    clients.emplace_back(ClientLoop, server.endpoint(), i, deadline, std::cref(ids), vocab,
                         std::ref(t));
  }
  for (auto& th : clients) th.join();
  // Vanished clients' requests are freed by the coordinator; wait for the server to go idle.
  const auto idle_deadline = std::chrono::steady_clock::now() + 30s;
  double running = -1, waiting = -1, usage = -1;
  while (std::chrono::steady_clock::now() < idle_deadline) {
    running = server.MetricValue("mlaserve_requests_running");
    waiting = server.MetricValue("mlaserve_requests_waiting");
    usage = server.MetricValue("mlaserve_kv_cache_usage_ratio");
    if (running == 0 && waiting == 0 && usage == 0) break;
    std::this_thread::sleep_for(200ms);
  }
  const long rss1 = RssKib(server.coordinator_pid());
  const double preemptions = server.MetricValue("mlaserve_preemptions_total");
  std::printf(
      "[soak] %d s, 8 clients: %d requests, %d finals, %d aborted, %d connections dropped with "
      "requests in flight, %d tokens streamed, %.0f preemptions; coordinator RSS %ld -> %ld KiB "
      "(%+ld KiB)\n",
      seconds, t.submitted.load(), t.finals.load(), t.aborted.load(), t.vanished.load(),
      t.tokens.load(), preemptions, rss0, rss1, rss1 - rss0);
  for (const std::string& p : t.problems) ADD_FAILURE() << p;
  for (const std::string& p : warm.problems) ADD_FAILURE() << "warm-up: " << p;
  EXPECT_GT(t.finals.load(), seconds);  // liveness: ~3 finals a second on 2 cores
  EXPECT_GT(preemptions, 0.0);
  EXPECT_EQ(running, 0.0);
  EXPECT_EQ(waiting, 0.0);
  EXPECT_EQ(usage, 0.0) << "KV blocks still in use after every request ended";
  EXPECT_LT(rss1 - rss0, 64 * 1024) << "coordinator RSS grew by " << (rss1 - rss0) << " KiB";
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

}  // namespace
}  // namespace mlaserve
