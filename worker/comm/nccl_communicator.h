// Communicator over NCCL: the GPU backend's collectives, on device buffers, on the compute stream.
//
// One rank per process, one GPU per rank (the current CUDA device at Create). Collectives are
// enqueued on the stream given at Create (CudaOps::stream()), so they are ordered with the
// model's kernels without a host sync and are captured into a CUDA graph with them.
//
// Failure handling. The communicator is created non-blocking (ncclConfig_t::blocking = 0): no
// NCCL call blocks the host, and every wait is a poll with a deadline (MLASERVE_NCCL_TIMEOUT_S,
// default 60 s). What is handled:
//   - a peer that dies or errors while a collective runs, when NCCL notices it (network and
//     socket transports report ncclRemoteError / ncclSystemError): CheckAsyncError and
//     WaitForStream return the error, naming this rank and the last collective enqueued;
//   - a peer that dies or hangs and NCCL does not notice (NVLink / P2P / SHM: the kernel spins
//     waiting for data): WaitForStream returns DeadlineExceeded after the timeout;
//   - in both cases the communicator is aborted (ncclCommAbort), which also ends the spinning
//     kernel so that the stream drains; every later call returns the first error.
// Small bf16 all-reduces may take the one-shot path instead (peer_all_reduce.h): with
// MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES=B (> 0) at Create, an AllReduceSum of a bf16 tensor of at most
// B bytes runs our one-shot kernel through CUDA IPC, where every pair of GPUs can map each other's
// memory (else Create says so on stderr and every all-reduce stays on NCCL). Off (0) by default
// until measured on several GPUs (issue 22; bench/comm/all_reduce_bench.cc). Its sums are fp32 in
// rank order, rounded once (NCCL's are bf16 at each hop), so the two paths' bits differ. A peer
// that never arrives makes the kernel trap after MLASERVE_NCCL_TIMEOUT_S; WaitForStream then names
// it. What is not handled: a hang detected only by a caller that waits on the stream some other way
// (cudaStreamSynchronize in CudaOps::Synchronize blocks forever): such a caller needs a watchdog
// thread calling CheckAsyncError, and CheckAsyncError sees only errors NCCL reports, not silent
// hangs; recovery (shrinking or re-creating the communicator) is left to the caller, which is
// expected to exit with the message.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

struct ncclComm;  // nccl.h's ncclComm_t is ncclComm*; nccl.h stays out of this header.

namespace mlaserve {

class PeerAllReduce;

class NcclCommunicator : public Communicator {
 public:
  // Collective over `comm`'s ranks: rank 0 makes the ncclUniqueId, MPI_Bcast shares it, every
  // rank joins with ncclCommInitRankConfig on its current CUDA device. All ranks agree on the
  // outcome: any rank's failure comes back on every rank as "rank R: <cause>". `stream` must
  // outlive the communicator.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(MPI_Comm comm,
                                                                  cudaStream_t stream);
  // ncclCommFinalize (waits for issued collectives, at most timeout_s()) then ncclCommDestroy;
  // ncclCommAbort when a collective failed or the finalize timed out.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Every device collective is enqueued on stream() (a nonblocking communicator's ncclInProgress
  // is waited for on the host, which capture allows); WaitForStream refuses during a capture.
  bool CapturesDeviceCollectives() const override { return true; }

  // Host fp32 buffers: an error (this communicator reduces device buffers; MpiCommunicator
  // reduces host memory).
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;

  // Sum over ranks, in place, of a Device::kCuda tensor of F32 or BF16 (NCCL sums bf16 in bf16
  // at each step of its ring or tree). Enqueued on stream(); returns once enqueued.
  absl::Status AllReduceSum(Tensor& t) override;
  // recv [size() * send.numel()] gets every rank's send in rank order; both Device::kCuda, same
  // dtype, F32, BF16 or I32. Enqueued on stream().
  absl::Status AllGatherDevice(const Tensor& send, Tensor& recv) override;
  // send and recv: Device::kCuda, same dtype (F32, BF16 or I32) and numel, a multiple of size();
  // grouped ncclSend / ncclRecv of each chunk. Enqueued on stream().
  absl::Status AllToAllDevice(const Tensor& send, Tensor& recv) override;
  // The ranks of one `color`, ordered by `key`, as a communicator of their own on the same
  // stream (ncclCommSplit, non-blocking like this one; collective over every rank, which agree on
  // the outcome through MPI as Create's ranks do). Decode context parallelism's groups.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;

  // OK, or the asynchronous error NCCL recorded (a peer failed, a network error), naming this
  // rank and the last collective; the communicator is then aborted. Safe to call from a watchdog
  // thread while another thread uses the communicator.
  absl::Status CheckAsyncError();
  // Waits until stream() has drained (the collectives and everything queued before them),
  // polling cudaStreamQuery and ncclCommGetAsyncError. After timeout_s seconds: aborts the
  // communicator and returns DeadlineExceeded. Not while stream() is being captured into a graph
  // (waiting is then meaningless): FailedPrecondition.
  absl::Status WaitForStream(double timeout_s);
  absl::Status WaitForStream() { return WaitForStream(timeout_s_); }
  absl::Status WaitForDevice() override { return WaitForStream(timeout_s_); }

  cudaStream_t stream() const { return stream_; }
  // MLASERVE_NCCL_TIMEOUT_S (seconds, > 0) at Create, default 60.
  double timeout_s() const { return timeout_s_; }
  // The largest bf16 all-reduce (bytes) that takes the one-shot path; 0 when it is off.
  size_t one_shot_max_bytes() const;

 private:
  NcclCommunicator(ncclComm* comm, int rank, int size, cudaStream_t stream, double timeout_s,
                   MPI_Comm mpi, bool owns_mpi);
  // The callers below hold mu_.
  // Polls ncclCommGetAsyncError until the communicator leaves ncclInProgress (an init, enqueue or
  // finalize finished), at most timeout_s.
  absl::Status WaitForCommLocked(double timeout_s);
  // Turns a collective's return code into a status; waits out ncclInProgress.
  absl::Status EnqueuedLocked(int result);
  // "rank R: NCCL <what> failed: <error string> (<last error>)".
  absl::Status NcclErrorLocked(const std::string& what, int result) const;
  // Aborts the communicator and keeps `status` as the answer to every later call.
  absl::Status FailLocked(absl::Status status);

  std::mutex mu_;
  ncclComm* comm_ = nullptr;  // null once aborted or destroyed
  absl::Status failure_;      // the first failure; every call after it returns it
  std::string last_op_;  // the last collective enqueued, for messages ("AllReduceSum BF16[7168]")
  const int rank_;
  const int size_;
  cudaStream_t const stream_;
  const double timeout_s_;
  MPI_Comm const mpi_;   // the same ranks over MPI: agreeing on outcomes, splitting
  const bool owns_mpi_;  // made by Split: freed with the object
  std::unique_ptr<PeerAllReduce> one_shot_;  // null when the one-shot path is off
  size_t one_shot_max_bytes_ = 0;
};

}  // namespace mlaserve
