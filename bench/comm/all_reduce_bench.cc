// The decode step's all-reduce between the GPUs of one node: NCCL's ncclAllReduce (bf16, sum, in
// place) against our one-shot kernel (kernels/comm/one_shot_all_reduce.h through PeerAllReduce,
// CUDA IPC), at the sizes of Kimi-K2.5 / DeepSeek-V3 (hidden 7,168 bf16 a token) times the decode
// batch. Issue 22 asks for both at 7,168 elements, and for NCCL_PROTO=LL against NCCL's default:
// run the bench twice, the second time with NCCL_PROTO=LL in the environment (printed in the
// header).
//
//   mpirun -np N all_reduce_bench [--tokens 1,2,4,8,16,32,64,128,256] [--iters 200]
//                                 [--graph-calls 50] [--graph-reps 10]
//
// One rank a GPU (GPU local_rank % device count). For each size: microseconds a call, eager
// (back-to-back launches, event to event over --iters calls) and from a CUDA graph (--graph-calls
// calls captured once, replayed --graph-reps times: what the model's decode graphs pay), the
// slowest rank's figure; the bus bandwidth NCCL's tests define (2 (N - 1) / N x bytes / time) for
// scale. Before timing, both paths reduce the same integer-valued inputs (exact in bf16 for any
// order) and the bench checks them bit for bit against the host's sum.
//
// Ranks that share a GPU (more ranks than GPUs on a host) skip NCCL, which refuses that; the
// one-shot kernel still runs, but its kernels then take turns on the GPU, so its times mean
// nothing there.
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/command_line.h"
#include "common/dtype.h"
#include "worker/comm/mpi_communicator.h"
#include "worker/comm/peer_all_reduce.h"

namespace {

#define CHECK_CUDA(e)                                                                  \
  do {                                                                                 \
    cudaError_t err_ = (e);                                                            \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, #e, cudaGetErrorString(err_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                    \
    }                                                                                  \
  } while (0)
#define CHECK_NCCL(e)                                                                \
  do {                                                                               \
    ncclResult_t r_ = (e);                                                           \
    if (r_ != ncclSuccess) {                                                         \
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, #e, ncclGetErrorString(r_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                  \
    }                                                                                \
  } while (0)

int g_rank = 0, g_size = 1;
constexpr int64_t kHidden = 7168;

// Rank r's input element i: an integer in [-8, 8] (every partial sum of up to 8 ranks is exact in
// bf16, so NCCL's order and ours give the same bits).
uint16_t Input(int rank, int64_t i) {
  return mlaserve::FloatToBf16(static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 17) - 8));
}

// The slowest rank's value.
double MaxOverRanks(double v) {
  double m = v;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

// Microseconds a call of `call` (which enqueues one all-reduce on stream): eager and from a graph.
template <class Call>
std::pair<double, double> Time(Call&& call, cudaStream_t stream, int iters, int graph_calls,
                               int graph_reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 20; ++i) call();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK_CUDA(cudaEventRecord(a, stream));
  for (int i = 0; i < iters; ++i) call();
  CHECK_CUDA(cudaEventRecord(b, stream));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  const double eager = MaxOverRanks(1e3 * ms / iters);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < graph_calls; ++i) call();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm
  CHECK_CUDA(cudaStreamSynchronize(stream));
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK_CUDA(cudaEventRecord(a, stream));
  for (int i = 0; i < graph_reps; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaEventRecord(b, stream));
  CHECK_CUDA(cudaEventSynchronize(b));
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  const double graphed = MaxOverRanks(1e3 * ms / (graph_reps * graph_calls));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return {eager, graphed};
}

// Uploads every element's input, runs `call` once, and counts the elements that differ from the
// host's sum (all ranks' counts added).
template <class Call>
int64_t Check(Call&& call, void* data, int64_t count, cudaStream_t stream) {
  std::vector<uint16_t> in(count), out(count);
  for (int64_t i = 0; i < count; ++i) in[i] = Input(g_rank, i);
  CHECK_CUDA(cudaMemcpyAsync(data, in.data(), count * 2, cudaMemcpyHostToDevice, stream));
  call();
  CHECK_CUDA(cudaMemcpyAsync(out.data(), data, count * 2, cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    float want = 0;
    for (int r = 0; r < g_size; ++r) want += mlaserve::Bf16ToFloat(Input(r, i));
    bad += out[i] != mlaserve::FloatToBf16(want);
  }
  int64_t total = 0;
  MPI_Allreduce(&bad, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

}  // namespace

ABSL_FLAG(mlaserve::IntList, tokens, (mlaserve::IntList{{1, 2, 4, 8, 16, 32, 64, 128, 256}}),
          "Decode tokens a call: the vector is tokens x 7168 bf16.");
ABSL_FLAG(int32_t, iters, 200, "Eager calls timed per size, 1..100000.");
ABSL_FLAG(int32_t, graph_calls, 50, "Calls captured in the graph per size, 1..10000.");
ABSL_FLAG(int32_t, graph_reps, 10, "Replays of the graph timed per size, 1..10000.");

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  mlaserve::FinalizeMpiAtExit();
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  mlaserve::ParseFlags(argc, argv, "mpirun -np N all_reduce_bench [flags]", g_rank != 0);
  const int iters = mlaserve::FlagInRange(FLAGS_iters, 1, 100000);
  const int graph_calls = mlaserve::FlagInRange(FLAGS_graph_calls, 1, 10000);
  const int graph_reps = mlaserve::FlagInRange(FLAGS_graph_reps, 1, 10000);
  std::vector<int64_t> tokens = absl::GetFlag(FLAGS_tokens).values;
  for (int64_t t : tokens) {
    if (t < 1 || t > 4096) mlaserve::UsageError("--tokens: each in 1..4096");
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    if (g_rank == 0) std::fprintf(stderr, "all_reduce_bench: no CUDA device\n");
    MPI_Finalize();
    return 1;
  }
  const mlaserve::HostRanks host = mlaserve::RanksOnHost(MPI_COMM_WORLD);
  const int local_rank = host.rank, local_size = host.size;
  int shared_local = local_size > devices ? 1 : 0, shared = 0;
  MPI_Allreduce(&shared_local, &shared, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  CHECK_CUDA(cudaSetDevice(local_rank % devices));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, local_rank % devices));

  const int64_t max_elems = *std::max_element(tokens.begin(), tokens.end()) * kHidden;
  ncclComm_t nccl = nullptr;
  if (!shared) {
    ncclUniqueId id;
    if (g_rank == 0) CHECK_NCCL(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    CHECK_NCCL(ncclCommInitRank(&nccl, g_size, id, g_rank));
  }
  auto one_shot = mlaserve::PeerAllReduce::Create(MPI_COMM_WORLD, max_elems, 60.0);
  if (g_rank == 0) {
    int version = 0;
    ncclGetVersion(&version);
    const char* proto = std::getenv("NCCL_PROTO");
    const char* algo = std::getenv("NCCL_ALGO");
    std::printf(
        "all_reduce_bench: %d ranks on %s (%d GPU(s) on rank 0's host%s), NCCL %d, "
        "NCCL_PROTO=%s NCCL_ALGO=%s; bf16 sum in place, tokens x %lld elements; "
        "us a call, the slowest rank's\n",
        g_size, prop.name, devices, shared ? ", ranks share GPUs: NCCL skipped" : "", version,
        proto != nullptr ? proto : "(default)", algo != nullptr ? algo : "(default)",
        static_cast<long long>(kHidden));
    if (!one_shot.ok()) {
      std::printf("one-shot all-reduce unavailable: %s\n",
                  std::string(one_shot.status().message()).c_str());
    }
    std::printf("%6s %10s %12s %12s %12s %12s %10s %10s %9s\n", "tokens", "bytes", "nccl_eager",
                "nccl_graph", "oneshot_eager", "oneshot_graph", "busbw_nccl", "busbw_1shot",
                "graph_x");
  }
  void* data = nullptr;
  CHECK_CUDA(cudaMalloc(&data, max_elems * 2));
  for (int64_t t : tokens) {
    const int64_t count = t * kHidden;
    const double bytes = 2.0 * count;
    auto nccl_call = [&] {
      CHECK_NCCL(ncclAllReduce(data, data, count, ncclBfloat16, ncclSum, nccl, stream));
    };
    auto one_shot_call = [&] {
      if (auto s = (*one_shot)->Run(data, count, stream); !s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", g_rank, std::string(s.message()).c_str());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    };
    double ne = -1, ng = -1, oe = -1, og = -1;
    if (nccl != nullptr) {
      if (int64_t bad = Check(nccl_call, data, count, stream); bad != 0 && g_rank == 0) {
        std::printf("NCCL: %lld elements differ from the host's sum at %lld tokens\n",
                    static_cast<long long>(bad), static_cast<long long>(t));
      }
      std::tie(ne, ng) = Time(nccl_call, stream, iters, graph_calls, graph_reps);
    }
    if (one_shot.ok()) {
      if (int64_t bad = Check(one_shot_call, data, count, stream); bad != 0 && g_rank == 0) {
        std::printf("one-shot: %lld elements differ from the host's sum at %lld tokens\n",
                    static_cast<long long>(bad), static_cast<long long>(t));
      }
      std::tie(oe, og) = Time(one_shot_call, stream, iters, graph_calls, graph_reps);
    }
    if (g_rank == 0) {
      const double bus = 2.0 * (g_size - 1) / g_size * bytes / 1e3;  // GB/s x us
      std::printf("%6lld %10.0f %12.2f %12.2f %12.2f %12.2f %10.1f %10.1f %9.2f\n",
                  static_cast<long long>(t), bytes, ne, ng, oe, og, ng > 0 ? bus / ng : 0.0,
                  og > 0 ? bus / og : 0.0, og > 0 && ng > 0 ? ng / og : 0.0);
      std::fflush(stdout);
    }
  }
  CHECK_CUDA(cudaFree(data));
  one_shot = absl::UnknownError("released");
  MPI_Barrier(MPI_COMM_WORLD);
  if (nccl != nullptr) ncclCommDestroy(nccl);
  MPI_Finalize();
  return 0;
}
