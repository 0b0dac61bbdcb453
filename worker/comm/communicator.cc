#include "worker/comm/communicator.h"

#include <algorithm>
#include <chrono>

namespace mlaserve {

absl::Status TimedCommunicator::AllReduceSum(float* data, size_t count) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = inner_.AllReduceSum(data, count);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++calls_;
  return s;
}

absl::Status TimedCommunicator::AllGather(const float* send, size_t count, float* recv) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = inner_.AllGather(send, count, recv);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++calls_;
  return s;
}

absl::Status SingleRankCommunicator::AllGather(const float* send, size_t count, float* recv) {
  if (send != recv) std::copy(send, send + count, recv);
  return absl::OkStatus();
}

}  // namespace mlaserve
