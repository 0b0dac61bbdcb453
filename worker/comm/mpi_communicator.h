// Communicator over MPI (the CPU backend's collectives, and the control path of every job).
#pragma once

#include <mpi.h>

#include "worker/comm/communicator.h"

namespace mlaserve {

class MpiCommunicator : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  using Communicator::AllReduceSum;
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status AllToAll(const float* send, size_t count, float* recv) override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;

  // Every rank passes its own status; all get back the first failure in rank order, as
  // "rank R: <message>", or OK. Used after loading so that one rank's bad shard stops the job
  // everywhere with the cause, instead of leaving the others waiting in a collective.
  absl::Status AgreeOnStatus(const absl::Status& mine);

 private:
  MPI_Comm comm_;
  bool owned_ = false;  // made by Split: freed with the object
  int rank_ = 0;
  int size_ = 1;
};

// This process's rank and the number of ranks among `comm`'s ranks on its host
// (MPI_COMM_TYPE_SHARED; collective over comm): rank i of a host takes GPU i % device count in
// the programs that see every GPU of the host (the GPU tests over MPI, the multi-GPU benches; the
// worker gets its GPU from deploy/mlaserve-rank instead).
struct HostRanks {
  int rank = 0;
  int size = 1;
};
HostRanks RanksOnHost(MPI_Comm comm);

// Registers an exit handler that calls MPI_Finalize unless it has been called: an MPI program
// that exits on a usage error (common/command_line.h exits 2 on every rank) then ends as a
// program that finalized, and mpirun reports only the exit status.
void FinalizeMpiAtExit();

}  // namespace mlaserve
