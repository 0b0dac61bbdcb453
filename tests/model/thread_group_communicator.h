// N communicators over the threads of one process, for running N model ranks on one GPU in tests
// (NCCL refuses two ranks on one GPU, and the lent GPU machines have one). Every collective
// waits for the rank's stream, copies the rank's part to host memory, meets the other ranks at a
// barrier, computes its result from every rank's part, copies it back, and meets them again
// before anyone's part is overwritten. Reductions add the ranks in rank order in fp32 (the result
// rounded once to the tensor's dtype), so every rank gets the same bits. Slow (two host copies
// and two barriers a collective): a test's stand-in for NCCL, not a transport.
#pragma once

#include <cuda_runtime_api.h>

#include <barrier>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"

namespace mlaserve {

class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), barrier_(size), parts_(size) {}
  int size() const { return size_; }

 private:
  friend class ThreadGroupCommunicator;
  const int size_;
  std::barrier<> barrier_;
  std::vector<std::vector<uint8_t>> parts_;  // each rank's staged bytes
};

class ThreadGroupCommunicator : public Communicator {
 public:
  // `stream`: the rank's compute stream (CudaOps::stream()), waited for before each collective.
  ThreadGroupCommunicator(ThreadGroup& group, int rank, cudaStream_t stream)
      : group_(group), rank_(rank), stream_(stream) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  absl::Status AllReduceSum(float* data, size_t count) override {
    Stage(data, count * sizeof(float));
    std::vector<float> sum(count, 0.0f);
    for (int r = 0; r < size(); ++r) {
      const float* part = reinterpret_cast<const float*>(group_.parts_[r].data());
      for (size_t i = 0; i < count; ++i) sum[i] += part[i];
    }
    group_.barrier_.arrive_and_wait();
    std::memcpy(data, sum.data(), count * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status AllGather(const float* send, size_t count, float* recv) override {
    Stage(send, count * sizeof(float));
    for (int r = 0; r < size(); ++r) {
      std::memcpy(recv + r * count, group_.parts_[r].data(), count * sizeof(float));
    }
    group_.barrier_.arrive_and_wait();
    return absl::OkStatus();
  }
  absl::Status AllReduceSum(Tensor& t) override {
    if (t.device() != Device::kCuda || (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16)) {
      return Communicator::AllReduceSum(t);
    }
    std::vector<float> mine(static_cast<size_t>(t.numel()));
    if (auto s = ToHostFloats(t, mine.data()); !s.ok()) return s;
    if (auto s = AllReduceSum(mine.data(), mine.size()); !s.ok()) return s;
    return FromHostFloats(mine.data(), t);
  }
  absl::Status AllGatherDevice(const Tensor& send, Tensor& recv) override {
    if (send.device() != Device::kCuda) return Communicator::AllGatherDevice(send, recv);
    const size_t bytes = send.nbytes();
    if (recv.nbytes() != bytes * size() || recv.dtype() != send.dtype()) {
      return absl::InvalidArgumentError("ThreadGroupCommunicator::AllGatherDevice: sizes differ");
    }
    std::vector<uint8_t> mine(bytes), all(bytes * size());
    if (auto s = Download(send, mine.data()); !s.ok()) return s;
    Stage(mine.data(), bytes);
    for (int r = 0; r < size(); ++r)
      std::memcpy(all.data() + r * bytes, group_.parts_[r].data(), bytes);
    group_.barrier_.arrive_and_wait();
    return Upload(all.data(), recv);
  }
  absl::Status AllToAllDevice(const Tensor& send, Tensor& recv) override {
    if (send.device() != Device::kCuda) return Communicator::AllToAllDevice(send, recv);
    const size_t bytes = send.nbytes(), chunk = bytes / size();
    if (recv.nbytes() != bytes || recv.dtype() != send.dtype() || bytes % size() != 0) {
      return absl::InvalidArgumentError("ThreadGroupCommunicator::AllToAllDevice: sizes differ");
    }
    std::vector<uint8_t> mine(bytes), got(bytes);
    if (auto s = Download(send, mine.data()); !s.ok()) return s;
    Stage(mine.data(), bytes);
    for (int r = 0; r < size(); ++r) {
      std::memcpy(got.data() + r * chunk, group_.parts_[r].data() + rank_ * chunk, chunk);
    }
    group_.barrier_.arrive_and_wait();
    return Upload(got.data(), recv);
  }

 private:
  // Copies this rank's part in, then waits until every rank has.
  void Stage(const void* data, size_t bytes) {
    group_.parts_[rank_].assign(static_cast<const uint8_t*>(data),
                                static_cast<const uint8_t*>(data) + bytes);
    group_.barrier_.arrive_and_wait();
  }
  absl::Status Check(cudaError_t e, const char* what) const {
    if (e == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("ThreadGroupCommunicator rank ", rank_, ": ", what,
                                            ": ", cudaGetErrorString(e)));
  }
  absl::Status Download(const Tensor& t, void* host) const {
    if (auto s = Check(cudaStreamSynchronize(stream_), "stream"); !s.ok()) return s;
    return Check(cudaMemcpy(host, t.data<void>(), t.nbytes(), cudaMemcpyDeviceToHost), "copy out");
  }
  // On the rank's stream (a plain cudaMemcpy from pageable memory may return before its DMA
  // lands, and the rank's non-blocking stream would not wait for it), then waited for.
  absl::Status Upload(const void* host, Tensor& t) const {
    if (auto s = Check(
            cudaMemcpyAsync(t.data<void>(), host, t.nbytes(), cudaMemcpyHostToDevice, stream_),
            "copy in");
        !s.ok()) {
      return s;
    }
    return Check(cudaStreamSynchronize(stream_), "copy in");
  }
  absl::Status ToHostFloats(const Tensor& t, float* out) const {
    if (t.dtype() == DType::kF32) return Download(t, out);
    std::vector<uint16_t> b(static_cast<size_t>(t.numel()));
    if (auto s = Download(t, b.data()); !s.ok()) return s;
    for (size_t i = 0; i < b.size(); ++i) out[i] = Bf16ToFloat(b[i]);
    return absl::OkStatus();
  }
  absl::Status FromHostFloats(const float* in, Tensor& t) const {
    if (t.dtype() == DType::kF32) return Upload(in, t);
    std::vector<uint16_t> b(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < b.size(); ++i) b[i] = FloatToBf16(in[i]);
    return Upload(b.data(), t);
  }

  ThreadGroup& group_;
  const int rank_;
  cudaStream_t const stream_;
};

}  // namespace mlaserve
