// InvokeL2Prefetch (kernels/prefetch/l2_prefetch.h): a hint, so what can be checked is that it
// runs for every shape of range (unaligned starts and ends, ranges shorter than 16 bytes or than
// one per lane, empty ones, the most ranges), in both request modes, plainly, programmatically
// and inside a captured graph; that it leaves memory as it was; and that malformed calls are
// refused. Whether it saves time is measured by mlaserve-model-bench --l2-prefetch.
#include "kernels/prefetch/l2_prefetch.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

TEST(L2PrefetchGpuTest, RunsOnEveryRangeShapeAndWritesNothing) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kBytes = (size_t{3} << 20) + 77;
  DeviceBuffer<uint8_t> buf(kBytes);
  ASSERT_TRUE(buf.ptr);
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  CUDA_OK(buf.Upload(pattern));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  L2PrefetchRanges r;
  const std::pair<size_t, size_t> ranges[L2PrefetchRanges::kMaxRanges] = {
      {0, kBytes},        {3, 5},          {17, 30},       {1, 100000},
      {4096, 0},          {kBytes - 9, 9}, {12345, 777},   {64, size_t{1} << 20}};
  for (const auto& [offset, bytes] : ranges) {
    r.base[r.count] = buf.ptr + offset;
    r.bytes[r.count++] = bytes;
  }
  for (int mode : {0, 1}) {
    for (bool programmatic : {false, true}) {
      for (int blocks : {0, 1, 7, 1000}) {
        r.mode = mode;
        r.programmatic = programmatic;
        r.blocks = blocks;
        CUDA_OK(InvokeL2Prefetch(r, stream));
      }
    }
  }
  // Captured in a graph and replayed (the decode step's graphs hold these launches).
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  r.mode = 0;
  r.blocks = 0;
  r.programmatic = true;
  const cudaError_t captured = InvokeL2Prefetch(r, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(captured);
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  EXPECT_EQ(buf.Download(), pattern);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));

  // Nothing to do: no launch, success.
  L2PrefetchRanges empty;
  CUDA_OK(InvokeL2Prefetch(empty, stream));
  // Malformed: a count outside [0, kMaxRanges].
  L2PrefetchRanges bad;
  bad.count = L2PrefetchRanges::kMaxRanges + 1;
  EXPECT_EQ(InvokeL2Prefetch(bad, stream), cudaErrorInvalidValue);
  bad.count = -1;
  EXPECT_EQ(InvokeL2Prefetch(bad, stream), cudaErrorInvalidValue);
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace mlaserve
