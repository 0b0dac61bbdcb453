#include "worker/comm/communicator.h"

#include <algorithm>
#include <chrono>

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
