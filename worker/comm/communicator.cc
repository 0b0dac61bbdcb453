#include "worker/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace mlaserve {

absl::Status TimedCommunicator::AllReduceSum(float* data, size_t count) {
  return Time([&] { return inner_.AllReduceSum(data, count); });
}

absl::Status Communicator::AllReduceSum(Tensor& t) {
  if (t.device() != Device::kCpu || t.dtype() != DType::kF32) {
    return absl::UnimplementedError(
        "all-reduce of device tensors needs a GPU communicator (NCCL); this one reduces fp32 host "
        "memory");
  }
  return AllReduceSum(t.data<float>(), static_cast<size_t>(t.numel()));
}

absl::Status Communicator::AllGatherDevice(const Tensor& send, Tensor& recv) {
  if (send.device() != Device::kCpu || send.dtype() != DType::kF32 || recv.dtype() != DType::kF32 ||
      recv.numel() != send.numel() * size()) {
    return absl::UnimplementedError(
        "all-gather of device tensors needs a GPU communicator (NCCL); this one gathers fp32 host "
        "memory of matching sizes");
  }
  return AllGather(send.data<float>(), static_cast<size_t>(send.numel()), recv.data<float>());
}

absl::Status Communicator::AllToAll(const float* send, size_t count, float* recv) {
  std::vector<float> all(count * static_cast<size_t>(size()) * static_cast<size_t>(size()));
  if (auto s = AllGather(send, count * static_cast<size_t>(size()), all.data()); !s.ok()) return s;
  // Rank i's chunk for this rank: chunk rank() of rank i's send.
  for (int i = 0; i < size(); ++i) {
    const float* chunk = all.data() + (static_cast<size_t>(i) * size() + rank()) * count;
    std::copy(chunk, chunk + count, recv + static_cast<size_t>(i) * count);
  }
  return absl::OkStatus();
}

absl::Status Communicator::AllToAllDevice(const Tensor& send, Tensor& recv) {
  if (send.device() != Device::kCpu || send.dtype() != DType::kF32 || recv.dtype() != DType::kF32 ||
      recv.numel() != send.numel() || send.numel() % size() != 0) {
    return absl::UnimplementedError(
        "all-to-all of device tensors needs a GPU communicator (NCCL); this one exchanges fp32 "
        "host memory of equal sizes, a multiple of the rank count");
  }
  return AllToAll(send.data<float>(), static_cast<size_t>(send.numel() / size()),
                  recv.data<float>());
}

absl::Status TimedCommunicator::AllToAll(const float* send, size_t count, float* recv) {
  return Time([&] { return inner_.AllToAll(send, count, recv); });
}

absl::Status TimedCommunicator::AllToAllDevice(const Tensor& send, Tensor& recv) {
  return Time([&] { return inner_.AllToAllDevice(send, recv); });
}

absl::Status TimedCommunicator::AllGatherDevice(const Tensor& send, Tensor& recv) {
  return Time([&] { return inner_.AllGatherDevice(send, recv); });
}

absl::Status TimedCommunicator::AllReduceSum(Tensor& t) {
  return Time([&] { return inner_.AllReduceSum(t); });
}

absl::Status TimedCommunicator::AllGather(const float* send, size_t count, float* recv) {
  return Time([&] { return inner_.AllGather(send, count, recv); });
}

absl::Status SingleRankCommunicator::AllGather(const float* send, size_t count, float* recv) {
  if (send != recv) std::copy(send, send + count, recv);
  return absl::OkStatus();
}

}  // namespace mlaserve
