// The one-shot all-reduce (kernels/comm/one_shot_all_reduce.h) with N ranks simulated on one GPU:
// each rank's workspace is a plain allocation on the same device, each rank's kernel runs on its
// own stream, and the kernels meet through the same slots and generations as across GPUs (only
// the mapping of peers' memory differs: CUDA IPC, tested by tests/mpi/peer_all_reduce_test.cc).
// The blocks of every rank must be resident at once for the ranks to meet, so max_blocks is small.
//
// Oracle: the host sums every rank's input in rank order in fp32, with -0.0 taken as +0.0 (the
// kernel sends it so), and rounds once to bf16 (RNE): every rank's output must equal it bit for
// bit. The kernel does exactly these operations (fp32 adds of bf16 values in the same order, one
// rounding), so there is no tolerance; and all ranks must agree with each other, which is what an
// all-reduce promises.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/comm/one_shot_all_reduce.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

constexpr int64_t kMaxElems = 32768;

// N simulated ranks: workspaces, data buffers and streams on the one GPU.
class Group {
 public:
  Group(int ranks, int64_t max_elems) : ranks_(ranks), max_elems_(max_elems) {
    const size_t bytes = OneShotWorkspaceBytes(ranks, max_elems);
    for (int r = 0; r < ranks; ++r) {
      void* ws = nullptr;
      void* data = nullptr;
      cudaStream_t s = nullptr;
      ok_ &= cudaMalloc(&ws, bytes) == cudaSuccess;
      // 16 spare bytes after the data: a write past count would show there.
      ok_ &= cudaMalloc(&data, max_elems * 2 + 16) == cudaSuccess;
      ok_ &= cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
      ok_ &= InitOneShotWorkspace(ws, ranks, max_elems, s).ok();
      ws_.push_back(ws);
      data_.push_back(data);
      streams_.push_back(s);
    }
    ok_ &= cudaDeviceSynchronize() == cudaSuccess;
  }
  ~Group() {
    for (int r = 0; r < ranks_; ++r) {
      cudaFree(ws_[r]);
      cudaFree(data_[r]);
      cudaStreamDestroy(streams_[r]);
    }
  }
  bool ok() const { return ok_; }
  int ranks() const { return ranks_; }
  cudaStream_t stream(int r) const { return streams_[r]; }
  void* data(int r) const { return data_[r]; }

  OneShotAllReduceParams Params(int r, int64_t count, int max_blocks) const {
    OneShotAllReduceParams p;
    p.rank = r;
    p.ranks = ranks_;
    p.max_elems = max_elems_;
    for (int q = 0; q < ranks_; ++q) p.peers[q] = ws_[q];
    p.data = data_[r];
    p.count = count;
    p.max_blocks = max_blocks;
    p.timeout_ns = 20ull * 1000 * 1000 * 1000;  // a hang fails the test instead of the CI job
    return p;
  }

  // Every rank's input [count] plus 8 sentinel elements after it.
  void Upload(const std::vector<std::vector<uint16_t>>& in) {
    for (int r = 0; r < ranks_; ++r) {
      std::vector<uint16_t> padded(in[r]);
      padded.resize(in[r].size() + 8, 0x7fc1);  // a NaN the kernel never writes
      ASSERT_EQ(cudaMemcpy(data_[r], padded.data(), padded.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    // (A pageable copy may return before its last DMA; the kernels run on non-blocking streams.)
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<uint16_t> Download(int r, int64_t count) const {
    std::vector<uint16_t> out(count + 8);
    EXPECT_EQ(cudaMemcpy(out.data(), data_[r], out.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  int ranks_;
  int64_t max_elems_;
  bool ok_ = true;
  std::vector<void*> ws_;
  std::vector<void*> data_;
  std::vector<cudaStream_t> streams_;
};

// Inputs with every kind of value the sums meet: small and large magnitudes, both zeros, values
// that cancel between ranks.
std::vector<std::vector<uint16_t>> Inputs(int ranks, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<std::vector<uint16_t>> in(ranks, std::vector<uint16_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const float base = normal(rng);
    for (int r = 0; r < ranks; ++r) {
      switch (kind(rng)) {
        case 0:
          in[r][i] = 0x8000;  // -0.0
          break;
        case 1:
          in[r][i] = 0x0000;
          break;
        case 2:
          in[r][i] = FloatToBf16(r % 2 == 0 ? base : -base);  // cancels in pairs
          break;
        case 3:
          in[r][i] = FloatToBf16(normal(rng) * 3000.0f);
          break;
        default:
          in[r][i] = FloatToBf16(normal(rng) * 0.01f);
          break;
      }
    }
  }
  return in;
}

std::vector<uint16_t> Expected(const std::vector<std::vector<uint16_t>>& in, int64_t count) {
  std::vector<uint16_t> out(count);
  for (int64_t i = 0; i < count; ++i) {
    float acc = 0.0f;
    for (const auto& rank_in : in) {
      const uint16_t v = rank_in[i] == 0x8000 ? 0 : rank_in[i];
      acc += Bf16ToFloat(v);
    }
    out[i] = FloatToBf16(acc);
  }
  return out;
}

// One all-reduce on every rank (launched in rank order, run concurrently), then the check.
void RunAndCheck(Group& g, int64_t count, int max_blocks, uint32_t seed) {
  const auto in = Inputs(g.ranks(), count, seed);
  g.Upload(in);
  for (int r = 0; r < g.ranks(); ++r) {
    ASSERT_TRUE(InvokeOneShotAllReduce(g.Params(r, count, max_blocks), g.stream(r)).ok());
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto want = Expected(in, count);
  for (int r = 0; r < g.ranks(); ++r) {
    const auto got = g.Download(r, count);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < count; ++i) {
      if (got[i] != want[i] && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0) << "rank " << r << " of " << g.ranks() << ", count " << count << ": first at "
                      << first << " got 0x" << std::hex << (first >= 0 ? got[first] : 0)
                      << " want 0x" << (first >= 0 ? want[first] : 0);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(got[count + i], 0x7fc1)
          << "rank " << r << ": element " << count + i << " past count was written";
    }
  }
}

TEST(OneShotAllReduce, SumsEveryRankInRankOrderOverRounds) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  // Counts that leave chunks partial (1, 7, 2049, 7168: 3.5 chunks), whole (2048), several chunks a
  // block (3 x 7168 + 5 over 4 blocks), alternating between calls so the chunks' generation
  // counters move at different rates; 9 rounds: each generation used three times.
  const std::vector<int64_t> counts = {7168, 1, 2048, 7, 2049, 3 * 7168 + 5, 7168, 8, kMaxElems};
  for (int ranks : {1, 2, 3, 4, 8}) {
    Group g(ranks, kMaxElems);
    ASSERT_TRUE(g.ok());
    for (size_t round = 0; round < counts.size(); ++round) {
      SCOPED_TRACE(testing::Message() << ranks << " ranks, round " << round);
      RunAndCheck(g, counts[round], /*max_blocks=*/4, static_cast<uint32_t>(ranks * 100 + round));
      if (HasFatalFailure()) return;
    }
  }
}

TEST(OneShotAllReduce, ReplaysFromCudaGraphs) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  // One call captured per rank, replayed with new inputs: the generations advance on the device.
  const int ranks = 4;
  const int64_t count = 7168;
  Group g(ranks, kMaxElems);
  ASSERT_TRUE(g.ok());
  std::vector<cudaGraphExec_t> execs(ranks);
  for (int r = 0; r < ranks; ++r) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(g.stream(r), cudaStreamCaptureModeThreadLocal));
    ASSERT_TRUE(InvokeOneShotAllReduce(g.Params(r, count, 4), g.stream(r)).ok());
    CUDA_OK(cudaStreamEndCapture(g.stream(r), &graph));
    CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  for (int replay = 0; replay < 7; ++replay) {
    SCOPED_TRACE(testing::Message() << "replay " << replay);
    const auto in = Inputs(ranks, count, 7000 + replay);
    g.Upload(in);
    for (int r = 0; r < ranks; ++r) CUDA_OK(cudaGraphLaunch(execs[r], g.stream(r)));
    CUDA_OK(cudaDeviceSynchronize());
    const auto want = Expected(in, count);
    for (int r = 0; r < ranks; ++r) {
      const auto got = g.Download(r, count);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "rank " << r;
    }
    // An eager call between replays shares the counters with the graphs.
    if (replay == 3) RunAndCheck(g, count, 4, 99);
  }
  for (auto e : execs) cudaGraphExecDestroy(e);
}

TEST(OneShotAllReduce, RefusesBadArguments) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  Group g(2, 4096);
  ASSERT_TRUE(g.ok());
  OneShotAllReduceParams p = g.Params(0, 4097, 0);
  EXPECT_EQ(InvokeOneShotAllReduce(p, g.stream(0)).code(), absl::StatusCode::kInvalidArgument);
  p = g.Params(0, 16, 0);
  p.data = static_cast<char*>(p.data) + 2;
  EXPECT_EQ(InvokeOneShotAllReduce(p, g.stream(0)).code(), absl::StatusCode::kInvalidArgument);
  p = g.Params(0, 16, 0);
  p.ranks = kOneShotMaxRanks + 1;
  EXPECT_EQ(InvokeOneShotAllReduce(p, g.stream(0)).code(), absl::StatusCode::kInvalidArgument);
  p = g.Params(2, 16, 0);
  EXPECT_EQ(InvokeOneShotAllReduce(p, g.stream(0)).code(), absl::StatusCode::kInvalidArgument);
  p = g.Params(0, 16, 0);
  p.peers[1] = nullptr;
  EXPECT_EQ(InvokeOneShotAllReduce(p, g.stream(0)).code(), absl::StatusCode::kInvalidArgument);
  // count 0: nothing to do, nothing launched (rank 1 never comes).
  EXPECT_TRUE(InvokeOneShotAllReduce(g.Params(0, 0, 0), g.stream(0)).ok());
  CUDA_OK(cudaStreamSynchronize(g.stream(0)));
  EXPECT_EQ(OneShotWorkspaceBytes(0, 16), 0u);
  EXPECT_EQ(OneShotWorkspaceBytes(kOneShotMaxRanks + 1, 16), 0u);
  EXPECT_EQ(OneShotWorkspaceBytes(2, 0), 0u);
}

// A peer that never comes: the kernel names it in the error word and traps, so the stream fails
// instead of hanging. A trap ends the CUDA context, so this runs in a child process (gtest's
// threadsafe death-test style re-executes the binary for it).
void WaitForAbsentPeer() {
  Group g(2, 4096);
  if (!g.ok()) std::_Exit(3);
  uint32_t* error_host = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&error_host), 4, cudaHostAllocMapped) != cudaSuccess) {
    std::_Exit(4);
  }
  *error_host = 0;
  OneShotAllReduceParams p = g.Params(0, 100, 1);
  if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&p.error), error_host, 0) != cudaSuccess) {
    std::_Exit(5);
  }
  p.timeout_ns = 200ull * 1000 * 1000;
  if (!InvokeOneShotAllReduce(p, g.stream(0)).ok()) std::_Exit(6);
  const cudaError_t e = cudaStreamSynchronize(g.stream(0));
  std::fprintf(stderr, "stream: %s; waited for rank %u\n", cudaGetErrorString(e), *error_host - 1);
  std::_Exit(e != cudaSuccess && *error_host == 2 ? 0 : 7);
}

TEST(OneShotAllReduceDeathTest, TrapsNamingAnAbsentPeer) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(WaitForAbsentPeer(), testing::ExitedWithCode(0), "waited for rank 1");
}

}  // namespace
}  // namespace mlaserve
