#include "worker/comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/mpi_wait.h"

namespace mlaserve {

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  // Errors come back as return codes (then as absl::Status), not as an abort inside MPI.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized) MPI_Comm_free(&comm_);
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicator::Split(int color, int key) {
  MPI_Comm group = MPI_COMM_NULL;
  if (const int err = MPI_Comm_split(comm_, color, key, &group); err != MPI_SUCCESS) {
    return absl::InternalError(absl::StrCat("MPI_Comm_split failed (error ", err, ")"));
  }
  auto c = std::make_unique<MpiCommunicator>(group);
  c->owned_ = true;
  return std::unique_ptr<Communicator>(std::move(c));
}

absl::Status MpiCommunicator::AllReduceSum(float* data, size_t count) {
  // MPI counts are int: reduce in pieces of at most INT_MAX / 2 elements.
  for (size_t done = 0; done < count;) {
    const int n = static_cast<int>(std::min<size_t>(count - done, INT_MAX / 2));
    if (auto s = MpiCallStatus(MPI_Allreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_),
                           "MPI_Allreduce");
        !s.ok()) {
      return s;
    }
    done += n;
  }
  return absl::OkStatus();
}

absl::Status MpiCommunicator::AllGather(const float* send, size_t count, float* recv) {
  if (count > INT_MAX / 2) return absl::InvalidArgumentError("AllGather: count too large for MPI");
  return MpiCallStatus(MPI_Allgather(send, static_cast<int>(count), MPI_FLOAT, recv,
                                 static_cast<int>(count), MPI_FLOAT, comm_),
                   "MPI_Allgather");
}

absl::Status MpiCommunicator::AllToAll(const float* send, size_t count, float* recv) {
  if (count > INT_MAX / 2) return absl::InvalidArgumentError("AllToAll: count too large for MPI");
  return MpiCallStatus(MPI_Alltoall(send, static_cast<int>(count), MPI_FLOAT, recv,
                                    static_cast<int>(count), MPI_FLOAT, comm_),
                       "MPI_Alltoall");
}

absl::Status MpiCommunicator::AgreeOnStatus(const absl::Status& mine) {
  const int failed = mine.ok() ? INT_MAX : rank_;
  int first = INT_MAX;
  if (auto s = MpiCallStatus(MPI_Allreduce(&failed, &first, 1, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
      !s.ok()) {
    return s;
  }
  if (first == INT_MAX) return absl::OkStatus();
  // The failing rank broadcasts its message.
  std::string msg = first == rank_ ? std::string(mine.message()) : std::string();
  int len = static_cast<int>(msg.size());
  MPI_Bcast(&len, 1, MPI_INT, first, comm_);
  msg.resize(len);
  MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm_);
  return absl::Status(first == rank_ ? mine.code() : absl::StatusCode::kAborted,
                      absl::StrCat("rank ", first, ": ", msg));
}

HostRanks RanksOnHost(MPI_Comm comm) {
  HostRanks r;
  MPI_Comm local;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) != MPI_SUCCESS) {
    return r;
  }
  MPI_Comm_rank(local, &r.rank);
  MPI_Comm_size(local, &r.size);
  MPI_Comm_free(&local);
  return r;
}

void FinalizeMpiAtExit() {
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
}

}  // namespace mlaserve
