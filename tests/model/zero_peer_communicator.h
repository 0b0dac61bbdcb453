// A two-rank world on one GPU whose other rank contributes zeros: rank 0 of size 2, every
// collective computed from this rank's part alone (sums are the part itself, gathers and
// all-to-alls put zeros where the peer's chunks go). The device collectives are
// cudaMemcpyAsync / cudaMemsetAsync on the rank's stream and nothing else, so a step that calls
// them can be captured into a CUDA graph (CapturesDeviceCollectives), as NCCL's can. The model
// it serves computes a function of its own (half the heads and experts, zero logits in the peer's
// vocabulary slice) that is deterministic: for comparing the multi-rank graph path with eager
// steps on one GPU (NCCL refuses two ranks on one GPU). A test's stand-in, not a transport.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"

namespace mlaserve {

class ZeroPeerCommunicator : public Communicator {
 public:
  // `stream`: the rank's compute stream (CudaOps::stream()).
  explicit ZeroPeerCommunicator(cudaStream_t stream) : stream_(stream) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  bool CapturesDeviceCollectives() const override { return true; }

  absl::Status AllReduceSum(float*, size_t) override { return absl::OkStatus(); }
  absl::Status AllReduceSum(Tensor& t) override { return OnDevice(t, "AllReduceSum"); }
  absl::Status AllGather(const float* send, size_t count, float* recv) override {
    std::memcpy(recv, send, count * sizeof(float));
    std::memset(recv + count, 0, count * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status AllToAll(const float* send, size_t count, float* recv) override {
    return AllGather(send, count, recv);  // chunk 0 from this rank, chunk 1 (the peer's) zeros
  }
  absl::Status AllGatherDevice(const Tensor& send, Tensor& recv) override {
    if (auto s = OnDevice(send, "AllGatherDevice"); !s.ok()) return s;
    if (recv.numel() != 2 * send.numel() || recv.dtype() != send.dtype()) {
      return absl::InvalidArgumentError("ZeroPeerCommunicator AllGatherDevice: recv shape");
    }
    return Halves(send.data<void>(), recv.data<void>(), send.nbytes());
  }
  absl::Status AllToAllDevice(const Tensor& send, Tensor& recv) override {
    if (auto s = OnDevice(send, "AllToAllDevice"); !s.ok()) return s;
    if (recv.numel() != send.numel() || recv.dtype() != send.dtype() || send.numel() % 2 != 0) {
      return absl::InvalidArgumentError("ZeroPeerCommunicator AllToAllDevice: shapes");
    }
    return Halves(send.data<void>(), recv.data<void>(), send.nbytes() / 2);
  }

 private:
  static absl::Status OnDevice(const Tensor& t, const char* what) {
    if (t.device() != Device::kCuda) {
      return absl::InvalidArgumentError(
          absl::StrCat("ZeroPeerCommunicator ", what, ": the tensor is not on the GPU"));
    }
    return absl::OkStatus();
  }
  // recv's first `bytes` = send's first `bytes`, its next `bytes` zeros, on the stream.
  absl::Status Halves(const void* send, void* recv, size_t bytes) {
    cudaError_t e = cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream_);
    if (e == cudaSuccess) e = cudaMemsetAsync(static_cast<char*>(recv) + bytes, 0, bytes, stream_);
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("ZeroPeerCommunicator: ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  cudaStream_t stream_;
};

}  // namespace mlaserve
