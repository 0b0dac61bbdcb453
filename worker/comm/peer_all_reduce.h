// The one-shot all-reduce (kernels/comm/one_shot_all_reduce.h) between the ranks of an MPI
// communicator, one GPU a rank: each rank's workspace is exported with CUDA IPC, the handles are
// exchanged over MPI, and every rank maps every peer's workspace. The NCCL communicator routes
// small bf16 all-reduces through it when MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES allows
// (nccl_communicator.h); bench/comm/all_reduce_bench.cc measures it against NCCL.
//
// Peer access: the mapping needs the GPUs to reach each other's memory (NVLink, or PCIe P2P).
// cudaIpcOpenMemHandle opens handles of devices the process cannot see (CUDA runtime API
// reference; each worker rank sees one GPU through CUDA_VISIBLE_DEVICES), so whether a peer is
// reachable is decided by opening its handle, as UCX's cuda_ipc transport does, not by
// cudaDeviceCanAccessPeer. Ranks that share one GPU (tests) map each other's workspaces the same
// way, without peer access.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/comm/one_shot_all_reduce.h"

namespace mlaserve {

class PeerAllReduce {
 public:
  // Collective over `comm` (every rank calls it, on its current CUDA device): allocates and
  // exports this rank's workspace for vectors of up to max_elems bf16, maps every peer's. All
  // ranks agree on the outcome: Unavailable (naming the rank and the peer it could not map) when
  // any pair of GPUs cannot reach each other or there are more than kOneShotMaxRanks ranks;
  // "rank R: <cause>" on every rank for other failures. timeout_s bounds a wait for a peer
  // inside the kernel (the kernel then traps; Diagnosis() names the peer).
  static absl::StatusOr<std::unique_ptr<PeerAllReduce>> Create(MPI_Comm comm, int64_t max_elems,
                                                               double timeout_s);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  int rank() const { return params_.rank; }
  int size() const { return params_.ranks; }
  int64_t max_elems() const { return params_.max_elems; }

  // Sums data (bf16 [count] on this rank's GPU, 16-byte aligned, count <= max_elems) over the
  // ranks in place, enqueued on `stream`. Every rank makes the same calls with the same counts.
  absl::Status Run(void* data, int64_t count, cudaStream_t stream);

  // After the stream reported an error: "waiting for rank Q timed out" when a kernel of this
  // object trapped on a peer, else empty.
  std::string Diagnosis() const;

 private:
  PeerAllReduce() = default;

  OneShotAllReduceParams params_;
  void* own_ = nullptr;                  // cudaMalloc'd workspace
  void* opened_[kOneShotMaxRanks] = {};  // peers' workspaces mapped by cudaIpcOpenMemHandle
  uint32_t* error_host_ = nullptr;       // cudaHostAlloc'd, mapped
};

}  // namespace mlaserve
