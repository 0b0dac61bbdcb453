// PeerAllReduce (worker/comm/peer_all_reduce.h) over `mpirun -np N` processes (label gpu;mpi):
// the one-shot kernel with every peer's workspace mapped through CUDA IPC. Ranks take GPU
// local_rank % device_count, so on a one-GPU host the processes share the GPU and meet through
// IPC mappings of the same device (the kernels of different processes take turns on it, which
// makes the calls slow but checks the same protocol); on a host with a GPU per rank the mappings
// are peer mappings (NVLink or PCIe).
//
// Oracle: every rank regenerates every rank's input from (seed, rank) and sums them on the host
// in rank order in fp32 (-0.0 as +0.0), rounded once to bf16, as the kernel does
// (tests/kernels/comm/one_shot_all_reduce_gpu_test.cc says why that is exact).
#include "worker/comm/peer_all_reduce.h"

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "worker/comm/mpi_communicator.h"

namespace mlaserve {
namespace {

std::string g_skip;  // non-empty: why the tests are skipped (the same on every rank)
cudaStream_t g_stream = nullptr;
int g_rank = 0, g_size = 1;

std::vector<uint16_t> RankInput(int rank, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed * 131 + rank);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> v(count);
  for (auto& x : v) {
    const float f = normal(rng);
    x = f > 2.5f ? uint16_t{0x8000} : FloatToBf16(f * (f < -2.0f ? 1000.0f : 1.0f));
  }
  return v;
}

std::vector<uint16_t> Expected(int64_t count, uint32_t seed) {
  std::vector<float> acc(count, 0.0f);
  for (int r = 0; r < g_size; ++r) {
    const auto in = RankInput(r, count, seed);
    for (int64_t i = 0; i < count; ++i) acc[i] += Bf16ToFloat(in[i] == 0x8000 ? 0 : in[i]);
  }
  std::vector<uint16_t> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = FloatToBf16(acc[i]);
  return out;
}

class PeerAllReduceTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
  }
};

TEST_F(PeerAllReduceTest, SumsOverRanksInPlace) {
  auto ar = PeerAllReduce::Create(MPI_COMM_WORLD, 32768, 30.0);
  ASSERT_TRUE(ar.ok()) << ar.status();
  EXPECT_EQ((*ar)->size(), g_size);
  EXPECT_EQ((*ar)->rank(), g_rank);
  void* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, 32768 * 2), cudaSuccess);
  const std::vector<int64_t> counts = {7168, 1, 2049, 3 * 7168 + 5, 7168, 8, 32768};
  for (size_t round = 0; round < counts.size(); ++round) {
    const int64_t count = counts[round];
    const uint32_t seed = static_cast<uint32_t>(round + 1);
    const auto in = RankInput(g_rank, count, seed);
    ASSERT_EQ(cudaMemcpyAsync(data, in.data(), count * 2, cudaMemcpyHostToDevice, g_stream),
              cudaSuccess);
    ASSERT_TRUE((*ar)->Run(data, count, g_stream).ok());
    std::vector<uint16_t> got(count);
    ASSERT_EQ(cudaMemcpyAsync(got.data(), data, count * 2, cudaMemcpyDeviceToHost, g_stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(g_stream), cudaSuccess) << (*ar)->Diagnosis();
    const auto want = Expected(count, seed);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin()))
        << "rank " << g_rank << " of " << g_size << ", round " << round << ", count " << count;
  }
  EXPECT_EQ((*ar)->Diagnosis(), "");
  cudaFree(data);
  // Collective teardown: no rank unmaps a workspace a peer's kernel may still write.
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(PeerAllReduceTest, ReplaysFromACudaGraph) {
  auto ar = PeerAllReduce::Create(MPI_COMM_WORLD, 8192, 30.0);
  ASSERT_TRUE(ar.ok()) << ar.status();
  const int64_t count = 7168;
  void* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, count * 2), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE((*ar)->Run(data, count, g_stream).ok());
  ASSERT_EQ(cudaStreamEndCapture(g_stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (uint32_t replay = 0; replay < 5; ++replay) {
    const auto in = RankInput(g_rank, count, 100 + replay);
    ASSERT_EQ(cudaMemcpyAsync(data, in.data(), count * 2, cudaMemcpyHostToDevice, g_stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, g_stream), cudaSuccess);
    std::vector<uint16_t> got(count);
    ASSERT_EQ(cudaMemcpyAsync(got.data(), data, count * 2, cudaMemcpyDeviceToHost, g_stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(g_stream), cudaSuccess) << (*ar)->Diagnosis();
    const auto want = Expected(count, 100 + replay);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(data);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(PeerAllReduceTest, EveryRankRefusesAnEmptyCapacity) {
  auto ar = PeerAllReduce::Create(MPI_COMM_WORLD, 0, 30.0);
  ASSERT_FALSE(ar.ok());
  // Rank 0's own error; the others hear it as "rank 0: ...".
  EXPECT_NE(ar.status().message().find("max_elems 0 must be > 0"), absl::string_view::npos)
      << ar.status();
  if (g_rank == 0) EXPECT_EQ(ar.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mlaserve

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  mlaserve::FinalizeMpiAtExit();
  using mlaserve::g_rank;
  using mlaserve::g_size;
  using mlaserve::g_skip;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  mlaserve::ParseFlags(argc, argv, "mpirun -np N peer_all_reduce_test [--gtest_* flags]",
                       g_rank != 0);
  int devices = 0;
  std::string mine;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    mine = "no CUDA device";
  } else {
    const mlaserve::HostRanks host = mlaserve::RanksOnHost(MPI_COMM_WORLD);
    const int local_rank = host.rank, local_size = host.size;
    const int device = local_rank % devices;
    int mode = cudaComputeModeDefault;
    cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device);
    if (local_size > devices && mode != cudaComputeModeDefault) {
      mine = "ranks share a GPU whose compute mode admits one process";
    } else if (cudaSetDevice(device) != cudaSuccess ||
               cudaStreamCreateWithFlags(&mlaserve::g_stream, cudaStreamNonBlocking) !=
                   cudaSuccess) {
      mine = "cannot use GPU " + std::to_string(device);
    }
  }
  // Every rank skips if any does (the tests are collective).
  int skip = mine.empty() ? 0 : 1, any = 0;
  MPI_Allreduce(&skip, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any) g_skip = mine.empty() ? "another rank cannot run the GPU tests" : mine;
  const int rc = RUN_ALL_TESTS();
  if (mlaserve::g_stream != nullptr) cudaStreamDestroy(mlaserve::g_stream);
  MPI_Finalize();
  return rc;
}
