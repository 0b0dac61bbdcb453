#include "worker/comm/peer_all_reduce.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/mpi_communicator.h"

namespace mlaserve {
namespace {

// What a rank tells the others: its workspace's handle and its GPU (PCI bus id, for messages).
struct Exported {
  cudaIpcMemHandle_t handle;
  char bus_id[32];
};

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " failed: ", cudaGetErrorString(e)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerAllReduce>> PeerAllReduce::Create(MPI_Comm comm,
                                                                     int64_t max_elems,
                                                                     double timeout_s) {
  MpiCommunicator mpi(comm);
  const int rank = mpi.rank(), size = mpi.size();
  std::unique_ptr<PeerAllReduce> self(new PeerAllReduce());
  self->params_.rank = rank;
  self->params_.ranks = size;
  self->params_.max_elems = max_elems;
  self->params_.timeout_ns =
      timeout_s > 0 ? static_cast<uint64_t>(timeout_s * 1e9) : self->params_.timeout_ns;

  // The same answer on every rank, before any collective.
  if (size > kOneShotMaxRanks) {
    return absl::UnavailableError(absl::StrCat("the one-shot all-reduce takes at most ",
                                               kOneShotMaxRanks, " ranks (", size, " here)"));
  }
  absl::Status mine;
  const size_t bytes = OneShotWorkspaceBytes(size, max_elems);
  if (bytes == 0) {
    mine = absl::InvalidArgumentError(
        absl::StrCat("one-shot all-reduce: max_elems ", max_elems, " must be > 0"));
  }
  Exported me{};
  int device = 0;
  if (mine.ok()) mine = CudaStatus(cudaGetDevice(&device), "cudaGetDevice");
  if (mine.ok()) {
    mine = CudaStatus(cudaDeviceGetPCIBusId(me.bus_id, sizeof(me.bus_id), device),
                      "cudaDeviceGetPCIBusId");
  }
  // The kernel's grid cap, once here rather than queried at every call (a decode step makes two
  // all-reduces a layer).
  if (mine.ok()) {
    mine = CudaStatus(
        cudaDeviceGetAttribute(&self->params_.max_blocks, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  }
  if (mine.ok()) {
    mine = CudaStatus(cudaMalloc(&self->own_, bytes),
                      absl::StrCat("cudaMalloc of the one-shot workspace (", bytes, " B)").c_str());
  }
  if (mine.ok()) mine = InitOneShotWorkspace(self->own_, size, max_elems, nullptr);
  if (mine.ok()) mine = CudaStatus(cudaDeviceSynchronize(), "initializing the one-shot workspace");
  if (mine.ok()) {
    mine = CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&self->error_host_), sizeof(uint32_t),
                                    cudaHostAllocMapped),
                      "cudaHostAlloc of the error word");
  }
  if (mine.ok()) {
    *self->error_host_ = 0;
    mine = CudaStatus(cudaHostGetDevicePointer(reinterpret_cast<void**>(&self->params_.error),
                                               self->error_host_, 0),
                      "cudaHostGetDevicePointer");
  }
  if (mine.ok())
    mine = CudaStatus(cudaIpcGetMemHandle(&me.handle, self->own_), "cudaIpcGetMemHandle");
  if (absl::Status s = mpi.AgreeOnStatus(mine); !s.ok()) return s;

  std::vector<Exported> all(size);
  if (MPI_Allgather(&me, sizeof(Exported), MPI_BYTE, all.data(), sizeof(Exported), MPI_BYTE,
                    comm) != MPI_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, ": MPI_Allgather of the one-shot workspaces' handles failed"));
  }
  for (int q = 0; q < size && mine.ok(); ++q) {
    if (q == rank) {
      self->params_.peers[q] = self->own_;
      continue;
    }
    const cudaError_t e =
        cudaIpcOpenMemHandle(&self->opened_[q], all[q].handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      self->opened_[q] = nullptr;
      mine = absl::UnavailableError(absl::StrCat(
          "cannot map rank ", q, "'s memory (GPU ", all[q].bus_id, ") from GPU ", me.bus_id, ": ",
          cudaGetErrorString(e), " (no peer access between these GPUs?)"));
    }
    self->params_.peers[q] = self->opened_[q];
  }
  if (absl::Status s = mpi.AgreeOnStatus(mine); !s.ok()) {
    // Only a mapping fails here: Unavailable on every rank (the caller falls back to NCCL on it).
    return absl::UnavailableError(s.message());
  }
  return self;
}

PeerAllReduce::~PeerAllReduce() {
  for (void* p : opened_) {
    if (p != nullptr) cudaIpcCloseMemHandle(p);
  }
  if (own_ != nullptr) cudaFree(own_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
}

absl::Status PeerAllReduce::Run(void* data, int64_t count, cudaStream_t stream) {
  OneShotAllReduceParams p = params_;
  p.data = data;
  p.count = count;
  return InvokeOneShotAllReduce(p, stream);
}

std::string PeerAllReduce::Diagnosis() const {
  const uint32_t waited =
      error_host_ != nullptr ? *static_cast<volatile uint32_t*>(error_host_) : 0;
  if (waited == 0) return "";
  return absl::StrCat("the one-shot all-reduce of rank ", params_.rank,
                      " timed out waiting for rank ", waited - 1);
}

}  // namespace mlaserve
