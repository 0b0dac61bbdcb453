// NcclCommunicator over `mpirun -np N` ranks, one GPU each (label gpu;mpi): every rank runs every
// test; the oracle is the host, which regenerates every rank's input from (seed, rank).
//
// Values are chosen so that every partial sum is exact in the dtype (bf16: integers in [-8, 8],
// |sum| <= 8 N <= 256 for N <= 32; fp32: multiples of 1/64 below 2^9, |sum| < 2^24 / 64), so the
// result does not depend on NCCL's reduction order or algorithm (ring, tree, NVLS) and is compared
// bit for bit. With N = 1 an in-place all-reduce is the identity: the 1-GPU run checks launch,
// stream ordering, dtype checks, graph capture and the sentinel bytes; the arithmetic needs
// N >= 2 (MLASERVE_MULTI_GPU_TESTS). The all-gather copies even with N = 1, so its byte count
// is checked on one GPU.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "worker/comm/mpi_communicator.h"
#include "worker/comm/nccl_communicator.h"

namespace mlaserve {
namespace {

// Set by main before the tests run.
std::string g_skip;  // non-empty: why the GPU tests are skipped
absl::Status g_create = absl::UnknownError("NcclCommunicator::Create not called");
std::unique_ptr<NcclCommunicator> g_comm;
cudaStream_t g_stream = nullptr;

// Bytes after every device tensor, filled with kSentinel: a collective that writes past the
// tensor (a count in bytes instead of elements, a wrong dtype size) changes them.
constexpr size_t kSentinelBytes = 256;
constexpr uint8_t kSentinel = 0xA5;

// A device tensor at the start of an allocation that continues with kSentinelBytes sentinels.
struct DeviceBuffer {
  Tensor tensor;
  size_t tensor_bytes = 0;
};

DeviceBuffer ToDevice(DType dtype, int64_t numel, const std::vector<uint8_t>& bytes) {
  DeviceBuffer b;
  b.tensor_bytes = static_cast<size_t>(numel) * DTypeBits(dtype) / 8;
  EXPECT_EQ(bytes.size(), b.tensor_bytes);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, b.tensor_bytes + kSentinelBytes), cudaSuccess);
  std::shared_ptr<void> storage(p, [](void* q) { cudaFree(q); });
  std::vector<uint8_t> all(bytes);
  all.resize(b.tensor_bytes + kSentinelBytes, kSentinel);
  // On the communicator's stream: ordered before the collective (pageable memory is staged
  // before cudaMemcpyAsync returns, so `all` may go).
  EXPECT_EQ(cudaMemcpyAsync(p, all.data(), all.size(), cudaMemcpyHostToDevice, g_stream),
            cudaSuccess);
  b.tensor = Tensor(dtype, {numel}, std::move(storage), p, Device::kCuda);
  return b;
}

// The tensor's bytes; checks the sentinels. Waits through WaitForStream (with its timeout), so a
// hung collective fails the test instead of blocking in the copy.
std::vector<uint8_t> ToHost(const DeviceBuffer& b) {
  std::vector<uint8_t> all(b.tensor_bytes + kSentinelBytes);
  absl::Status s = g_comm->WaitForStream();
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) {
    return {};
  }
  EXPECT_EQ(cudaMemcpy(all.data(), b.tensor.data<void>(), all.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (size_t i = b.tensor_bytes; i < all.size(); ++i) {
    if (all[i] != kSentinel) {
      ADD_FAILURE() << "byte " << i - b.tensor_bytes << " after the tensor was overwritten";
      break;
    }
  }
  all.resize(b.tensor_bytes);
  return all;
}

template <class T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Rank `rank`'s all-reduce input, exact-sum values (see the top of the file), as fp32.
std::vector<float> ReduceInput(DType dtype, int64_t numel, int rank, uint32_t seed) {
  std::mt19937 rng(seed * 1009u + static_cast<uint32_t>(rank));
  std::vector<float> v(numel);
  if (dtype == DType::kBF16) {
    std::uniform_int_distribution<int> d(-8, 8);
    for (float& x : v) {
      x = static_cast<float>(d(rng));
    }
  } else {
    std::uniform_int_distribution<int> d(-(1 << 15), 1 << 15);
    for (float& x : v) {
      x = static_cast<float>(d(rng)) / 64.0f;
    }
  }
  return v;
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<float>& v) {
  if (dtype == DType::kF32) {
    return Bytes(v);
  }
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    h[i] = FloatToBf16(v[i]);
  }
  return Bytes(h);
}

// Create with MLASERVE_NCCL_TIMEOUT_S set to `timeout`, then the variable as it was.
absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateWithTimeout(const char* timeout,
                                                                    cudaStream_t stream) {
  const char* old = std::getenv("MLASERVE_NCCL_TIMEOUT_S");
  const std::string saved = old != nullptr ? old : "";
  const bool had = old != nullptr;
  setenv("MLASERVE_NCCL_TIMEOUT_S", timeout, 1);
  auto comm = NcclCommunicator::Create(MPI_COMM_WORLD, stream);
  if (had) {
    setenv("MLASERVE_NCCL_TIMEOUT_S", saved.c_str(), 1);
  } else {
    unsetenv("MLASERVE_NCCL_TIMEOUT_S");
  }
  return comm;
}

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) {
      GTEST_SKIP() << g_skip;
    }
    ASSERT_TRUE(g_create.ok()) << g_create;
  }
};

struct Case {
  DType dtype;
  int64_t numel;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(DTypeName(info.param.dtype)) + "_" + std::to_string(info.param.numel);
}

class NcclAllReduceTest : public NcclCommunicatorTest,
                          public ::testing::WithParamInterface<Case> {};

TEST_P(NcclAllReduceTest, EqualsHostSumOverRanks) {
  const Case c = GetParam();
  const int n = g_comm->size();
  const uint32_t seed = static_cast<uint32_t>(c.numel) * 7u + static_cast<uint32_t>(c.dtype);
  std::vector<float> sum(c.numel, 0.0f);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> in = ReduceInput(c.dtype, c.numel, r, seed);
    for (int64_t i = 0; i < c.numel; ++i) {
      sum[i] += in[i];  // exact: see the top of the file
    }
  }
  DeviceBuffer b = ToDevice(c.dtype, c.numel,
                            Encode(c.dtype, ReduceInput(c.dtype, c.numel, g_comm->rank(), seed)));
  absl::Status s = g_comm->AllReduceSum(b.tensor);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<uint8_t> got = ToHost(b);
  const std::vector<uint8_t> want = Encode(c.dtype, sum);
  ASSERT_EQ(got.size(), want.size());
  // Report the first mismatching element, not a byte dump.
  const size_t elem = DTypeBits(c.dtype) / 8;
  for (size_t i = 0; i < want.size(); i += elem) {
    if (std::memcmp(&got[i], &want[i], elem) != 0) {
      FAIL() << "element " << i / elem << " of " << DTypeName(c.dtype) << "[" << c.numel
             << "] on rank " << g_comm->rank() << " of " << n << ": expected " << sum[i / elem];
    }
  }
  EXPECT_TRUE(g_comm->CheckAsyncError().ok());
}

INSTANTIATE_TEST_SUITE_P(Shapes, NcclAllReduceTest,
                         ::testing::Values(Case{DType::kBF16, 1}, Case{DType::kBF16, 4099},
                                           Case{DType::kBF16, (1 << 20) + 5}, Case{DType::kF32, 1},
                                           Case{DType::kF32, 4099},
                                           Case{DType::kF32, (1 << 20) + 5}),
                         CaseName);

// MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES: bf16 all-reduces up to that size take the one-shot kernel
// (worker/comm/peer_all_reduce.h) and must give the exact sums NCCL gives (integer inputs, exact
// in any order); larger ones stay on NCCL. One rank has nothing to exchange: the path stays off.
TEST_F(NcclCommunicatorTest, OneShotPathSumsLikeNccl) {
  setenv("MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES", "65536", 1);
  auto comm = NcclCommunicator::Create(MPI_COMM_WORLD, g_stream);
  setenv("MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES", "64k", 1);
  auto refused = NcclCommunicator::Create(MPI_COMM_WORLD, g_stream);
  unsetenv("MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int n = (*comm)->size();
  if (n == 1) {
    EXPECT_EQ((*comm)->one_shot_max_bytes(), 0u);
  } else if ((*comm)->one_shot_max_bytes() == 0) {
    GTEST_SKIP() << "these GPUs cannot map each other's memory (the reason is on stderr)";
  } else {
    EXPECT_EQ((*comm)->one_shot_max_bytes(), 65536u);
  }
  // 7168 and 32768 elements take the one-shot path, 32769 NCCL.
  for (int64_t numel : {int64_t{7168}, int64_t{32768}, int64_t{32769}, int64_t{7168}}) {
    const uint32_t seed = static_cast<uint32_t>(numel) * 3u + 11u;
    std::vector<float> sum(numel, 0.0f);
    for (int r = 0; r < n; ++r) {
      const std::vector<float> in = ReduceInput(DType::kBF16, numel, r, seed);
      for (int64_t i = 0; i < numel; ++i) sum[i] += in[i];
    }
    DeviceBuffer b =
        ToDevice(DType::kBF16, numel,
                 Encode(DType::kBF16, ReduceInput(DType::kBF16, numel, (*comm)->rank(), seed)));
    absl::Status s = (*comm)->AllReduceSum(b.tensor);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE((*comm)->WaitForStream().ok());
    EXPECT_TRUE(ToHost(b) == Encode(DType::kBF16, sum))
        << numel << " elements on rank " << (*comm)->rank() << " of " << n;
  }
}

// Rank r's all-gather input: distinct, exactly representable values.
std::vector<uint8_t> GatherInput(DType dtype, int64_t numel, int rank) {
  if (dtype == DType::kI32) {
    std::vector<int32_t> v(numel);
    for (int64_t i = 0; i < numel; ++i) {
      v[i] = rank * 1000003 + static_cast<int32_t>(i);
    }
    return Bytes(v);
  }
  std::vector<float> v(numel);
  for (int64_t i = 0; i < numel; ++i) {
    // bf16 holds the integers up to 256 exactly; fp32 those up to 2^24.
    v[i] = dtype == DType::kBF16 ? static_cast<float>((rank * 37 + i) % 256 - 128)
                                 : static_cast<float>(rank * numel + i);
  }
  return Encode(dtype, v);
}

class NcclAllGatherTest : public NcclCommunicatorTest,
                          public ::testing::WithParamInterface<Case> {};

TEST_P(NcclAllGatherTest, RanksInOrder) {
  const Case c = GetParam();
  const int n = g_comm->size();
  std::vector<uint8_t> want;
  for (int r = 0; r < n; ++r) {
    const std::vector<uint8_t> in = GatherInput(c.dtype, c.numel, r);
    want.insert(want.end(), in.begin(), in.end());
  }
  DeviceBuffer send = ToDevice(c.dtype, c.numel, GatherInput(c.dtype, c.numel, g_comm->rank()));
  DeviceBuffer recv = ToDevice(c.dtype, n * c.numel, std::vector<uint8_t>(want.size(), 0));
  absl::Status s = g_comm->AllGatherDevice(send.tensor, recv.tensor);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<uint8_t> got = ToHost(recv);
  ASSERT_EQ(got.size(), want.size());
  const size_t per_rank = want.size() / n;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      FAIL() << "byte " << i % per_rank << " of rank " << i / per_rank << "'s part differs ("
             << DTypeName(c.dtype) << "[" << c.numel << "] per rank, " << n << " ranks)";
    }
  }
  EXPECT_EQ(ToHost(send), GatherInput(c.dtype, c.numel, g_comm->rank())) << "send was modified";
}

INSTANTIATE_TEST_SUITE_P(Shapes, NcclAllGatherTest,
                         ::testing::Values(Case{DType::kF32, 1}, Case{DType::kF32, 65537},
                                           Case{DType::kBF16, 3}, Case{DType::kBF16, 65537},
                                           Case{DType::kI32, 1000}, Case{DType::kI32, 65537}),
                         CaseName);

// AllToAllDevice: rank r's chunk j (for rank j) holds values made from (r, j); rank j's chunk i
// of recv must be rank i's chunk j, byte for byte (bf16 integers below 256 and I32 are exact).
TEST_F(NcclCommunicatorTest, AllToAllDeliversEachChunkToItsRank) {
  const int n = g_comm->size(), rank = g_comm->rank();
  for (const Case c : {Case{DType::kBF16, 1031}, Case{DType::kI32, 4}, Case{DType::kF32, 65537}}) {
    const auto chunk_of = [&](int from, int to) {
      return GatherInput(c.dtype, c.numel, from * 64 + to);  // distinct per (from, to)
    };
    std::vector<uint8_t> mine, want;
    for (int j = 0; j < n; ++j) {
      const std::vector<uint8_t> out = chunk_of(rank, j), in = chunk_of(j, rank);
      mine.insert(mine.end(), out.begin(), out.end());
      want.insert(want.end(), in.begin(), in.end());
    }
    DeviceBuffer send = ToDevice(c.dtype, n * c.numel, mine);
    DeviceBuffer recv = ToDevice(c.dtype, n * c.numel, std::vector<uint8_t>(want.size(), 0));
    absl::Status s = g_comm->AllToAllDevice(send.tensor, recv.tensor);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(ToHost(recv), want) << DTypeName(c.dtype) << "[" << c.numel << "] a chunk";
    EXPECT_EQ(ToHost(send), mine) << "send was modified";
  }
  if (n > 1) {  // a numel that does not split into n chunks
    DeviceBuffer a = ToDevice(DType::kF32, n + 1, std::vector<uint8_t>((n + 1) * 4, 0));
    DeviceBuffer b = ToDevice(DType::kF32, n + 1, std::vector<uint8_t>((n + 1) * 4, 0));
    EXPECT_EQ(g_comm->AllToAllDevice(a.tensor, b.tensor).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// Split (decode context parallelism's groups): ranks of one parity form a group, ordered by
// rank; the group all-gathers its members' inputs in that order, on the same stream. With one
// rank the group is the rank itself (ncclCommSplit into a single-rank communicator).
TEST_F(NcclCommunicatorTest, SplitGroupsGatherTheirOwnRanks) {
  const int n = g_comm->size(), rank = g_comm->rank();
  auto group = g_comm->Split(rank % 2, rank);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<int> members;
  for (int r = rank % 2; r < n; r += 2) members.push_back(r);
  ASSERT_EQ((*group)->size(), static_cast<int>(members.size()));
  EXPECT_EQ((*group)->rank(), rank / 2);
  const int64_t numel = 4099;
  std::vector<uint8_t> want;
  for (int r : members) {
    const std::vector<uint8_t> in = GatherInput(DType::kBF16, numel, r);
    want.insert(want.end(), in.begin(), in.end());
  }
  DeviceBuffer send = ToDevice(DType::kBF16, numel, GatherInput(DType::kBF16, numel, rank));
  DeviceBuffer recv = ToDevice(DType::kBF16, static_cast<int64_t>(members.size()) * numel,
                               std::vector<uint8_t>(want.size(), 0));
  absl::Status s = (*group)->AllGatherDevice(send.tensor, recv.tensor);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE((*group)->WaitForDevice().ok());
  EXPECT_EQ(ToHost(recv), want);
  group->reset();  // destroyed before the parent's next collective
  // The parent still works after its group is gone.
  DeviceBuffer all = ToDevice(DType::kBF16, n * numel, std::vector<uint8_t>(n * numel * 2, 0));
  ASSERT_TRUE(g_comm->AllGatherDevice(send.tensor, all.tensor).ok());
  EXPECT_EQ(ToHost(all).size(), static_cast<size_t>(n * numel * 2));
}

TEST_F(NcclCommunicatorTest, RejectsUnsupportedDtypesAndHostMemory) {
  const int n = g_comm->size();
  DeviceBuffer i64 = ToDevice(DType::kI64, 4, std::vector<uint8_t>(32, 0));
  absl::Status s = g_comm->AllReduceSum(i64.tensor);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("I64"), std::string::npos) << s;
  DeviceBuffer i32 = ToDevice(DType::kI32, 4, std::vector<uint8_t>(16, 0));
  EXPECT_EQ(g_comm->AllReduceSum(i32.tensor).code(), absl::StatusCode::kInvalidArgument)
      << "all-reduce takes F32 and BF16 only";
  DeviceBuffer i64_recv = ToDevice(DType::kI64, 4 * n, std::vector<uint8_t>(32 * n, 0));
  s = g_comm->AllGatherDevice(i64.tensor, i64_recv.tensor);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  DeviceBuffer f32 = ToDevice(DType::kF32, 4, std::vector<uint8_t>(16, 0));
  DeviceBuffer short_recv = ToDevice(DType::kF32, 4 * n - 1, std::vector<uint8_t>(16 * n - 4, 0));
  s = g_comm->AllGatherDevice(f32.tensor, short_recv.tensor);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  DeviceBuffer bf16_recv = ToDevice(DType::kBF16, 4 * n, std::vector<uint8_t>(8 * n, 0));
  EXPECT_EQ(g_comm->AllGatherDevice(f32.tensor, bf16_recv.tensor).code(),
            absl::StatusCode::kInvalidArgument);

  std::vector<float> host(8, 1.0f);
  std::vector<float> host_recv(8 * n);
  EXPECT_FALSE(g_comm->AllReduceSum(host.data(), host.size()).ok());
  EXPECT_FALSE(g_comm->AllGather(host.data(), host.size(), host_recv.data()).ok());
  Tensor host_tensor = Tensor::Host(DType::kF32, {8});
  s = g_comm->AllReduceSum(host_tensor);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // Argument errors do not abort the communicator: a collective still works afterwards.
  s = g_comm->AllReduceSum(f32.tensor);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(g_comm->WaitForStream().ok());
  EXPECT_TRUE(g_comm->CheckAsyncError().ok());
}

TEST_F(NcclCommunicatorTest, BadTimeoutEnvironmentIsAnError) {
  // Every rank reads the same environment and fails before any collective: no rank waits.
  auto comm = CreateWithTimeout("soon", g_stream);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("MLASERVE_NCCL_TIMEOUT_S"), std::string::npos);
}

TEST_F(NcclCommunicatorTest, AllReduceIsCapturedIntoAGraph) {
  const int n = g_comm->size();
  const int64_t numel = 4099;
  const std::vector<float> in = ReduceInput(DType::kBF16, numel, g_comm->rank(), 99);
  std::vector<float> in_sum(numel, 0.0f);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> x = ReduceInput(DType::kBF16, numel, r, 99);
    for (int64_t i = 0; i < numel; ++i) {
      in_sum[i] += x[i];
    }
  }
  DeviceBuffer b = ToDevice(DType::kBF16, numel, Encode(DType::kBF16, in));
  // Warm-up outside the capture: NCCL connects peers on a communicator's first collective.
  ASSERT_TRUE(g_comm->AllReduceSum(b.tensor).ok());
  ASSERT_TRUE(g_comm->WaitForStream().ok());

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  absl::Status s = g_comm->AllReduceSum(b.tensor);
  const absl::Status wait = g_comm->WaitForStream();  // refused: the stream is being captured
  ASSERT_EQ(cudaStreamEndCapture(g_stream, &graph), cudaSuccess);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(wait.code(), absl::StatusCode::kFailedPrecondition) << wait;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // After the warm-up the buffer holds S = the sum over ranks; each replay multiplies it by N:
  // two replays give N^2 S (integers <= 8 N^3 <= 256 for N <= 3, exact in bf16).
  ASSERT_EQ(cudaGraphLaunch(exec, g_stream), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, g_stream), cudaSuccess);
  const std::vector<uint8_t> got = ToHost(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (n > 3) {
    GTEST_SKIP() << "N^2 S would not be exact in bf16 for " << n << " ranks";
  }
  std::vector<float> want(numel);
  for (int64_t i = 0; i < numel; ++i) {
    want[i] = in_sum[i] * n * n;
  }
  EXPECT_EQ(got, Encode(DType::kBF16, want));
}

TEST_F(NcclCommunicatorTest, MissingPeerTimesOutInsteadOfHanging) {
  if (g_comm->size() < 2) {
    GTEST_SKIP() << "needs 2 ranks (MLASERVE_MULTI_GPU_TESTS)";
  }
  // A communicator of its own (its abort must not touch g_comm) on a stream of its own, with a
  // short timeout. Rank 1 does not join the second all-reduce: rank 0's kernel waits for its data.
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto comm = CreateWithTimeout("5", stream);
  ASSERT_TRUE(comm.ok()) << comm.status();
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 4096 * sizeof(float)), cudaSuccess);
  Tensor t(DType::kF32, {4096}, std::shared_ptr<void>(p, [](void* q) { cudaFree(q); }), p,
           Device::kCuda);
  // Both ranks once, so that the peers are connected (NCCL connects on the first collective) and
  // the second all-reduce is enqueued at once and then waits on the device.
  ASSERT_TRUE((*comm)->AllReduceSum(t).ok());
  ASSERT_TRUE((*comm)->WaitForStream().ok());
  MPI_Barrier(MPI_COMM_WORLD);
  if ((*comm)->rank() == 0) {
    absl::Status s = (*comm)->AllReduceSum(t);
    if (s.ok()) {
      s = (*comm)->WaitForStream();
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s;
    EXPECT_NE(s.message().find("AllReduceSum F32[4096]"), std::string::npos) << s;
    // Aborted: later calls return the first error, and the stream drains.
    EXPECT_EQ((*comm)->CheckAsyncError().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  comm->reset();  // rank 1: finalize with a peer that aborted, bounded by the 5 s timeout
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mlaserve

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  // GoogleTest took its --gtest_* flags; anything left is a mistake (this test has no flags of
  // its own). A usage error exits every rank with 2, rank 0 saying why.
  mlaserve::FinalizeMpiAtExit();
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  mlaserve::ParseFlags(argc, argv, "mpirun -np N nccl_test [--gtest_* flags]", world_rank != 0);
  using mlaserve::g_comm;
  using mlaserve::g_create;
  using mlaserve::g_skip;
  using mlaserve::g_stream;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    g_skip = "no CUDA device";
  } else {
    // One GPU per rank of this host, as the worker assigns them.
    const mlaserve::HostRanks host = mlaserve::RanksOnHost(MPI_COMM_WORLD);
    const int local_rank = host.rank, local_size = host.size;
    if (local_size > devices) {
      g_create = absl::FailedPreconditionError("this host runs " + std::to_string(local_size) +
                                               " ranks but has " + std::to_string(devices) +
                                               " GPU(s); NCCL needs one GPU per rank");
    } else if (cudaSetDevice(local_rank) != cudaSuccess ||
               cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) != cudaSuccess) {
      g_create = absl::InternalError("cannot use GPU " + std::to_string(local_rank));
    } else {
      auto comm = mlaserve::NcclCommunicator::Create(MPI_COMM_WORLD, g_stream);
      g_create = comm.status();
      if (comm.ok()) {
        g_comm = *std::move(comm);
      }
    }
  }
  const int rc = RUN_ALL_TESTS();
  g_comm.reset();
  if (g_stream != nullptr) {
    cudaStreamDestroy(g_stream);
  }
  MPI_Finalize();
  return rc;
}
