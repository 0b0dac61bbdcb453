// An idle server's worker ranks sleep rather than spin: each uses under 10% of a core over 5 s
// without requests (a spinning rank measures 81-100%), and the first request after the idle
// time reaches its first token within 100 ms of a warm one (a wait that slept in steps of a
// second would add ~500 ms). The targets (under 5% of a core, +1 ms at most) are
// figures of the wait on a quiet machine, measured in bench/RESULTS.md ("Idle worker ranks":
// 1.2-3.0% and +0.4-0.9 ms on the dev VM); this test asserts what a shared 2-core VM can
// still tell apart, since such VMs add their own costs: clean-clone CI runs measured rank 1 at
// 3.8-4.4% of a core with this wait, and +8.3 to +24.6 ms to the first token after 2-5 s idle
// (warm 2.7-3.3 ms), the test running alone. The VM's part, measured the same day on the dev
// VM: a bare pipe round trip between two processes took 0.07-0.08 ms warm and 1.8-3.1 ms after
// 2-5 s idle, and a request here wakes about ten threads in turn (client, coordinator and its
// ZeroMQ I/O threads, both ranks, the CPU backend's pool).
// Before worker/comm/mpi_wait.h, ranks other than 0 waited for the next step plan in Open MPI's
// MPI_Bcast, which busy-polls: a whole core per rank, all the time.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/e2e/server_fixture.h"
#include "tests/model/golden_fixture.h"

namespace mlaserve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// utime + stime of a process (all its threads), in seconds; -1 if it is gone.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), {});
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 2));
  std::vector<std::string> f;
  for (std::string t; fields >> t;) f.push_back(t);
  if (f.size() < 13) return -1;
  // Fields 14 and 15 of proc(5) (utime, stime, clock ticks); f[0] is field 3.
  return static_cast<double>(std::stoull(f[11]) + std::stoull(f[12])) / sysconf(_SC_CLK_TCK);
}

// The rank mpirun gave the process (OMPI_COMM_WORLD_RANK in its environment), or -1.
int MpiRank(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
  const std::string env((std::istreambuf_iterator<char>(in)), {});
  const std::string key = std::string("OMPI_COMM_WORLD_RANK=");
  const size_t at = env.find(key);
  if (at == std::string::npos || (at > 0 && env[at - 1] != '\0')) return -1;
  return std::atoi(env.c_str() + at + key.size());
}

// Client-side time to first token of a short greedy request, in milliseconds.
double TimeToFirstTokenMs(Client& c) {
  GenerateInput in;
  in.token_ids = std::vector<int32_t>{1, 2, 3, 4};
  in.sampling.max_tokens = 2;
  in.sampling.ignore_eos = true;
  const auto start = Clock::now();
  double ttft = -1;
  auto final = c.Generate(
      in,
      [&](const Reply&) {
        if (ttft < 0)
          ttft = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      },
      30s);
  EXPECT_TRUE(final.ok()) << final.status();
  if (final.ok()) EXPECT_EQ(final->kind, Reply::Kind::kFinal) << final->message;
  return ttft;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(E2eIdleTest, IdleRanksSleepAndWakeWithinMilliseconds) {
  ServerProcesses server;
  ServerOptions o;
  o.model_dir = FixtureDir(E2eModel());
  const std::string err = server.Start(o);
  ASSERT_EQ(err, "") << err;
  auto c = Client::Connect(server.endpoint());
  ASSERT_TRUE(c.ok());
  ASSERT_GT(TimeToFirstTokenMs(**c), 0);  // one request: every rank has run a step

  const std::vector<pid_t> pids = server.WorkerPids();
  ASSERT_EQ(pids.size(), static_cast<size_t>(E2eOnGpu() ? 1 : o.ranks)) << server.Logs();
  std::map<pid_t, double> before;
  for (pid_t p : pids) before[p] = CpuSeconds(p);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(5s);  // idle: only the coordinator's ping plan, once a second
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  // Bound: a rank that busy-polls measures 81-100% here; the sleeping wait costs one MPI_Test
  // per 0.7 ms plus one ping step a second (1-3% on the dev VM, 3.8-4.4% on CI's VMs, where a
  // wake-up costs more). 10% leaves room for the clock-tick resolution (10 ms in 5 s: 0.2%) and
  // such VMs, and still fails a polling rank by a factor of 8 or more.
  for (pid_t p : pids) {
    const double after = CpuSeconds(p);
    ASSERT_GE(after, 0) << "worker process " << p << " is gone\n" << server.Logs();
    const double share = (after - before[p]) / wall;
    std::printf("[idle] rank %d (pid %d): %.2f%% of a core over %.2f s idle\n", MpiRank(p), p,
                100 * share, wall);
    EXPECT_LT(share, 0.10) << "rank " << MpiRank(p) << " (pid " << p << ")";
  }

  // Latency: requests after idle time against warm ones (back to back). The first request
  // after the 5 s idle, and two more each after 2 s idle (by then a rank has long been in the
  // wait's longest sleep, 0.7 ms, the same state as after 5 s): their median, since one sample on
  // a shared 2-core VM can catch a scheduling delay of several ms (seen with the old,
  // busy-polling wait too). Also a median over requests each after 300 ms idle.
  std::vector<double> after_idle = {TimeToFirstTokenMs(**c)};
  std::vector<double> warm, short_idle;
  for (int i = 0; i < 9; ++i) warm.push_back(TimeToFirstTokenMs(**c));
  for (int i = 0; i < 9; ++i) {
    std::this_thread::sleep_for(300ms);
    short_idle.push_back(TimeToFirstTokenMs(**c));
  }
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(2s);
    after_idle.push_back(TimeToFirstTokenMs(**c));
  }
  const double warm_ms = Median(warm), short_idle_ms = Median(short_idle);
  const double idle_ms = Median(after_idle);
  std::printf(
      "[idle] time to first token: %.3f ms first after 5 s idle, %.3f ms median after "
      "idle (5 s, 2 s, 2 s: %.3f %.3f %.3f), %.3f ms warm (median of 9), %.3f ms after "
      "300 ms idle (median of 9); after idle - warm = %.3f ms, after 300 ms idle - warm "
      "= %.3f ms\n",
      after_idle[0], idle_ms, after_idle[0], after_idle[1], after_idle[2], warm_ms, short_idle_ms,
      idle_ms - warm_ms, short_idle_ms - warm_ms);
  // The wait adds at most its longest sleep (0.7 ms) and a wake-up; that figure is measured in
  // bench/RESULTS.md ("Idle worker ranks", +0.4-0.9 ms), not here: shared VMs add far more by
  // themselves after seconds of idle (+8.3 and +24.6 ms in two clean-clone CI runs, this wait
  // unchanged, its rank sleeping at 3.8-4.4% of a core). The bound only fails a wait that sleeps
  // for hundreds of milliseconds: 100 ms, or the warm time to first token if that is larger
  // (a loaded box: 49.6 ms warm and 56.0 after idle with a build beside the test).
  const double bound_ms = std::max(100.0, warm_ms);
  EXPECT_LT(idle_ms - warm_ms, bound_ms);
  EXPECT_LT(short_idle_ms - warm_ms, bound_ms);
  EXPECT_EQ(server.Stop(), 0) << server.Logs();
}

}  // namespace
}  // namespace mlaserve
