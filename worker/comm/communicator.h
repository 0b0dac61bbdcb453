// Collective communication between the worker ranks of one model replica. One interface; MPI
// implements it on the CPU backend, NCCL on GPUs. Buffers live on the backend's device.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/backend/tensor.h"

namespace mlaserve {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sum over ranks, in place: data[count] fp32.
  virtual absl::Status AllReduceSum(float* data, size_t count) = 0;
  // Sum over ranks, in place, of a tensor on the backend's device. This base version takes fp32
  // host tensors (the CPU backend); a GPU communicator takes device buffers on its stream.
  virtual absl::Status AllReduceSum(Tensor& t);
  // recv [size() * send.numel()] gets every rank's send in rank order, tensors on the backend's
  // device. This base version takes fp32 host tensors (through AllGather).
  virtual absl::Status AllGatherDevice(const Tensor& send, Tensor& recv);
  // Waits until this rank's collectives have completed (a GPU communicator bounds the wait and
  // names a peer that died); OK at once for host collectives, which complete before returning.
  virtual absl::Status WaitForDevice() { return absl::OkStatus(); }
  // Whether the device collectives (AllReduceSum(Tensor&), AllGatherDevice, AllToAllDevice) only
  // enqueue work on the backend's stream, with no host wait or host copy, so that a step calling
  // them can be captured into a CUDA graph and replayed (NCCL; one rank, which has nothing to
  // exchange). Host-staged communicators (MPI, the tests' thread groups) cannot.
  virtual bool CapturesDeviceCollectives() const { return false; }
  // Every rank contributes send[count]; recv[size() * count] gets them in rank order.
  virtual absl::Status AllGather(const float* send, size_t count, float* recv) = 0;
  // Personalised exchange: send and recv are size() chunks of `count`; chunk j of send goes to
  // rank j, chunk i of recv comes from rank i. This base version gathers everything and keeps
  // its chunks (size() times the traffic); MPI and NCCL exchange only the chunks.
  virtual absl::Status AllToAll(const float* send, size_t count, float* recv);
  // AllToAll of tensors on the backend's device (send and recv of the same dtype and numel, a
  // multiple of size()). This base version takes fp32 host tensors (through AllToAll).
  virtual absl::Status AllToAllDevice(const Tensor& send, Tensor& recv);
  // The ranks of the same `color`, ordered by `key`, as a communicator of their own (collective:
  // every rank calls it). Decode context parallelism's groups use it.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) {
    (void)color;
    (void)key;
    return absl::UnimplementedError("this communicator cannot be split into groups");
  }
};

// Wraps a communicator and adds up the wall time spent inside its collectives (the
// communication share of a step, exported as a metric).
class TimedCommunicator : public Communicator {
 public:
  explicit TimedCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllReduceSum(Tensor& t) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status AllGatherDevice(const Tensor& send, Tensor& recv) override;
  absl::Status AllToAll(const float* send, size_t count, float* recv) override;
  absl::Status AllToAllDevice(const Tensor& send, Tensor& recv) override;
  absl::Status WaitForDevice() override { return inner_.WaitForDevice(); }
  // (A replayed graph calls no collective from the host: its steps add no time here.)
  bool CapturesDeviceCollectives() const override { return inner_.CapturesDeviceCollectives(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    return inner_.Split(color, key);
  }
  double seconds() const { return seconds_; }
  uint64_t calls() const { return calls_; }

 private:
  // Runs one collective, adding its wall time and a call to the totals.
  template <class F>
  absl::Status Time(F&& collective) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = collective();
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++calls_;
    return s;
  }

  Communicator& inner_;
  double seconds_ = 0;
  uint64_t calls_ = 0;
};

// The world of one rank: collectives are copies.
class SingleRankCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  bool CapturesDeviceCollectives() const override { return true; }
  absl::Status AllReduceSum(float*, size_t) override { return absl::OkStatus(); }
  absl::Status AllReduceSum(Tensor&) override { return absl::OkStatus(); }
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status AllToAll(const float* send, size_t count, float* recv) override {
    return AllGather(send, count, recv);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int) override {
    return std::unique_ptr<Communicator>(new SingleRankCommunicator());
  }
};

}  // namespace mlaserve
