#include "worker/comm/nccl_communicator.h"

#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "worker/comm/mpi_communicator.h"
#include "worker/comm/peer_all_reduce.h"

namespace mlaserve {
namespace {

constexpr double kDefaultTimeoutS = 60;
// Between two polls of the stream / the communicator: short against a decode step (milliseconds),
// long enough not to keep a core busy.
constexpr auto kPollInterval = std::chrono::microseconds(50);

using Clock = std::chrono::steady_clock;

absl::StatusOr<double> TimeoutFromEnv() {
  const char* env = std::getenv("MLASERVE_NCCL_TIMEOUT_S");
  if (env == nullptr || *env == '\0') {
    return kDefaultTimeoutS;
  }
  double s = 0;
  if (!absl::SimpleAtod(env, &s) || !(s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLASERVE_NCCL_TIMEOUT_S=\"", env, "\": expected a number of seconds > 0"));
  }
  return s;
}

// MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES: the largest bf16 all-reduce for the one-shot path, 0 (the
// default) for none.
absl::StatusOr<size_t> OneShotBytesFromEnv() {
  const char* env = std::getenv("MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES");
  if (env == nullptr || *env == '\0') return 0;
  uint64_t bytes = 0;
  if (!absl::SimpleAtoi(env, &bytes) || bytes > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES=\"", env,
                                                   "\": expected bytes in 0..2^30"));
  }
  return static_cast<size_t>(bytes);
}

// The NCCL type of a tensor's dtype, for the dtypes the collective takes.
absl::StatusOr<ncclDataType_t> NcclType(DType dtype, bool allow_i32, absl::string_view op) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      if (allow_i32) {
        return ncclInt32;
      }
      break;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(op, ": dtype ", std::string(DTypeName(dtype)),
                                                 " not supported (takes F32, BF16",
                                                 allow_i32 ? ", I32)" : ")"));
}

std::string Describe(absl::string_view op, const Tensor& t) {
  return absl::StrCat(op, " ", std::string(DTypeName(t.dtype())), "[", t.numel(), "]");
}

// The checks of a collective from send into recv (AllGatherDevice, AllToAllDevice): both on the
// GPU, one dtype NCCL takes (F32, BF16, I32), recv's size right (`size_ok`, stated by `rule`).
// Returns the NCCL type, or an InvalidArgument naming the rank and the collective (`what`).
absl::StatusOr<ncclDataType_t> DevicePairType(int rank, absl::string_view op,
                                              const std::string& what, const Tensor& send,
                                              const Tensor& recv, bool size_ok,
                                              absl::string_view rule) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": NCCL ", what, ": ", why));
  };
  if (send.device() != Device::kCuda || recv.device() != Device::kCuda) {
    return invalid("both tensors must be Device::kCuda");
  }
  if (send.dtype() != recv.dtype()) {
    return invalid("send and recv dtypes differ");
  }
  if (!size_ok) {
    return invalid(rule);
  }
  absl::StatusOr<ncclDataType_t> type = NcclType(send.dtype(), /*allow_i32=*/true, op);
  if (!type.ok()) {
    return invalid(type.status().message());
  }
  return type;
}

}  // namespace

NcclCommunicator::NcclCommunicator(ncclComm* comm, int rank, int size, cudaStream_t stream,
                                   double timeout_s, MPI_Comm mpi, bool owns_mpi)
    : comm_(comm),
      rank_(rank),
      size_(size),
      stream_(stream),
      timeout_s_(timeout_s),
      mpi_(mpi),
      owns_mpi_(owns_mpi) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(MPI_Comm comm,
                                                                           cudaStream_t stream) {
  // Read before any collective: a bad value fails every rank alike, none is left waiting.
  absl::StatusOr<double> timeout_s = TimeoutFromEnv();
  if (!timeout_s.ok()) {
    return timeout_s.status();
  }
  absl::StatusOr<size_t> one_shot_bytes = OneShotBytesFromEnv();
  if (!one_shot_bytes.ok()) {
    return one_shot_bytes.status();
  }
  MpiCommunicator mpi(comm);
  const int rank = mpi.rank();
  const int size = mpi.size();

  absl::Status mine;
  int device = -1;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    mine = absl::FailedPreconditionError(
        absl::StrCat("NCCL communicator: no CUDA device: ", cudaGetErrorString(e)));
  }
  ncclUniqueId id{};
  if (rank == 0 && mine.ok()) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      mine = absl::InternalError(absl::StrCat("ncclGetUniqueId failed: ", ncclGetErrorString(r),
                                              " (", ncclGetLastError(nullptr), ")"));
    }
  }
  if (absl::Status s = mpi.AgreeOnStatus(mine); !s.ok()) {
    return s;
  }
  if (int rc = MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm); rc != MPI_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, ": MPI_Bcast of the ncclUniqueId failed"));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nccl = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nccl, size, id, rank, &config);
  // The object owns `nccl` from here: on a failure its destructor aborts it.
  std::unique_ptr<NcclCommunicator> self(
      new NcclCommunicator(nccl, rank, size, stream, *timeout_s, comm, /*owns_mpi=*/false));
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->last_op_ = absl::StrCat("ncclCommInitRankConfig (", size, " ranks, device ", device, ")");
    if (r != ncclSuccess && r != ncclInProgress) {
      mine = self->FailLocked(self->NcclErrorLocked(self->last_op_, r));
    } else {
      mine = self->WaitForCommLocked(*timeout_s);
    }
  }
  // AgreeOnStatus prefixes the first failing rank ("rank R: "): pass the cause without ours.
  if (!mine.ok()) {
    mine = absl::Status(mine.code(),
                        absl::StripPrefix(mine.message(), absl::StrCat("rank ", rank, ": ")));
  }
  if (absl::Status s = mpi.AgreeOnStatus(mine); !s.ok()) {
    return s;
  }
  // The smallest setting of any rank, so that every rank takes the same path (the setup below is
  // collective).
  uint64_t one_shot_setting = *one_shot_bytes;
  if (MPI_Allreduce(MPI_IN_PLACE, &one_shot_setting, 1, MPI_UINT64_T, MPI_MIN, comm) !=
      MPI_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "rank ", rank, ": MPI_Allreduce of MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES failed"));
  }
  *one_shot_bytes = static_cast<size_t>(one_shot_setting);
  if (*one_shot_bytes >= 2 && size > 1) {
    // Collective; every rank gets the same outcome.
    absl::StatusOr<std::unique_ptr<PeerAllReduce>> one_shot =
        PeerAllReduce::Create(comm, static_cast<int64_t>(*one_shot_bytes / 2), *timeout_s);
    if (one_shot.ok()) {
      self->one_shot_ = *std::move(one_shot);
      self->one_shot_max_bytes_ = *one_shot_bytes / 2 * 2;
    } else if (absl::IsUnavailable(one_shot.status())) {
      if (rank == 0) {
        std::fprintf(stderr, "mlaserve: one-shot all-reduce off, every all-reduce on NCCL: %s\n",
                     std::string(one_shot.status().message()).c_str());
      }
    } else {
      return one_shot.status();
    }
  }
  return self;
}

size_t NcclCommunicator::one_shot_max_bytes() const { return one_shot_max_bytes_; }

NcclCommunicator::~NcclCommunicator() {
  std::lock_guard<std::mutex> lock(mu_);
  one_shot_.reset();
  if (owns_mpi_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    MPI_Comm mpi = mpi_;
    if (!finalized) MPI_Comm_free(&mpi);
  }
  if (comm_ == nullptr) {
    return;
  }
  // Finalize flushes the collectives still queued; in non-blocking mode it returns
  // ncclInProgress until the communicator is quiescent, which a dead peer may prevent.
  const ncclResult_t r = ncclCommFinalize(comm_);
  bool clean = r == ncclSuccess || r == ncclInProgress;
  if (clean) {
    clean = WaitForCommLocked(timeout_s_).ok();  // aborts on failure
  }
  if (comm_ == nullptr) {
    return;
  }
  if (clean) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(int color, int key) {
  MpiCommunicator mpi(mpi_);
  // The MPI side first (every rank reaches it): the group's own MPI communicator.
  MPI_Comm group = MPI_COMM_NULL;
  if (const int err = MPI_Comm_split(mpi_, color, key, &group); err != MPI_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, ": MPI_Comm_split failed (error ", err, ")"));
  }
  int group_rank = 0, group_size = 1;
  MPI_Comm_rank(group, &group_rank);
  MPI_Comm_size(group, &group_size);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  absl::Status mine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) {
      mine = failure_.ok() ? absl::FailedPreconditionError("the communicator is closed") : failure_;
    } else {
      last_op_ = absl::StrCat("ncclCommSplit (color ", color, ", key ", key, ")");
      const ncclResult_t r = ncclCommSplit(comm_, color, key, &child, &config);
      if (r != ncclSuccess && r != ncclInProgress) {
        mine = FailLocked(NcclErrorLocked(last_op_, r));
      } else {
        mine = WaitForCommLocked(timeout_s_);  // the parent's part of the split
      }
    }
  }
  // The child owns `child` from here (its destructor aborts it on a failure) and `group`.
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(child, group_rank, group_size, stream_,
                                                           timeout_s_, group, /*owns_mpi=*/true));
  if (mine.ok()) {
    std::lock_guard<std::mutex> lock(c->mu_);
    c->last_op_ = absl::StrCat("ncclCommSplit (", group_size, " ranks)");
    if (child == nullptr) {
      c->failure_ = absl::InternalError("ncclCommSplit made no communicator");
      mine = c->failure_;
    } else {
      mine = c->WaitForCommLocked(timeout_s_);
    }
  }
  if (!mine.ok()) {
    mine = absl::Status(mine.code(),
                        absl::StripPrefix(mine.message(), absl::StrCat("rank ", rank_, ": ")));
  }
  if (absl::Status s = mpi.AgreeOnStatus(mine); !s.ok()) {
    return s;
  }
  return std::unique_ptr<Communicator>(std::move(c));
}

absl::Status NcclCommunicator::AllReduceSum(float*, size_t) {
  return absl::FailedPreconditionError(
      absl::StrCat("rank ", rank_,
                   ": NcclCommunicator::AllReduceSum(float*, count) takes no host memory; pass a "
                   "Device::kCuda Tensor (or use MpiCommunicator for host buffers)"));
}

absl::Status NcclCommunicator::AllGather(const float*, size_t, float*) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank_,
      ": NcclCommunicator::AllGather(float*) takes no host memory; use AllGatherDevice with "
      "Device::kCuda Tensors (or MpiCommunicator for host buffers)"));
}

absl::Status NcclCommunicator::AllReduceSum(Tensor& t) {
  const std::string what = Describe("AllReduceSum", t);
  if (t.device() != Device::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank_, ": NCCL ", what, ": the tensor is in host memory (needs Device::kCuda)"));
  }
  absl::StatusOr<ncclDataType_t> type = NcclType(t.dtype(), /*allow_i32=*/false, "AllReduceSum");
  if (!type.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank_, ": NCCL ", type.status().message()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) {
    return failure_;
  }
  if (t.numel() == 0) {
    return absl::OkStatus();
  }
  const size_t count = static_cast<size_t>(t.numel());
  if (one_shot_ != nullptr && t.dtype() == DType::kBF16 && 2 * count <= one_shot_max_bytes_ &&
      reinterpret_cast<uintptr_t>(t.data<void>()) % 16 == 0) {
    last_op_ = absl::StrCat(what, " (one-shot)");
    if (absl::Status s = one_shot_->Run(t.data<void>(), static_cast<int64_t>(count), stream_);
        !s.ok()) {
      return FailLocked(absl::InternalError(absl::StrCat("rank ", rank_, ": ", s.message())));
    }
    return absl::OkStatus();
  }
  last_op_ = what;
  return EnqueuedLocked(
      ncclAllReduce(t.data<void>(), t.data<void>(), count, *type, ncclSum, comm_, stream_));
}

absl::Status NcclCommunicator::AllGatherDevice(const Tensor& send, Tensor& recv) {
  const std::string what =
      absl::StrCat(Describe("AllGatherDevice", send), " -> ", std::string(DTypeName(recv.dtype())),
                   "[", recv.numel(), "]");
  absl::StatusOr<ncclDataType_t> type = DevicePairType(
      rank_, "AllGatherDevice", what, send, recv, recv.numel() == send.numel() * size_,
      absl::StrCat("recv needs size() * send.numel() = ", send.numel() * size_, " elements"));
  if (!type.ok()) {
    return type.status();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) {
    return failure_;
  }
  if (send.numel() == 0) {
    return absl::OkStatus();
  }
  last_op_ = what;
  const size_t count = static_cast<size_t>(send.numel());
  return EnqueuedLocked(
      ncclAllGather(send.data<void>(), recv.data<void>(), count, *type, comm_, stream_));
}

absl::Status NcclCommunicator::AllToAllDevice(const Tensor& send, Tensor& recv) {
  const std::string what =
      absl::StrCat(Describe("AllToAllDevice", send), " -> ", std::string(DTypeName(recv.dtype())),
                   "[", recv.numel(), "]");
  absl::StatusOr<ncclDataType_t> type =
      DevicePairType(rank_, "AllToAllDevice", what, send, recv,
                     recv.numel() == send.numel() && send.numel() % size_ == 0,
                     absl::StrCat("send and recv need the same numel, a multiple of ", size_));
  if (!type.ok()) {
    return type.status();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) {
    return failure_;
  }
  if (send.numel() == 0) {
    return absl::OkStatus();
  }
  last_op_ = what;
  const size_t count = static_cast<size_t>(send.numel() / size_);
  const size_t chunk = count * DTypeBits(send.dtype()) / 8;
  const char* src = static_cast<const char*>(send.data<void>());
  char* dst = static_cast<char*>(recv.data<void>());
  // One group: NCCL pairs every rank's send to p with p's receive from it, no ordering deadlock.
  ncclResult_t r = ncclGroupStart();
  for (int p = 0; p < size_ && (r == ncclSuccess || r == ncclInProgress); ++p) {
    r = ncclSend(src + p * chunk, count, *type, p, comm_, stream_);
    if (r == ncclSuccess || r == ncclInProgress) {
      r = ncclRecv(dst + p * chunk, count, *type, p, comm_, stream_);
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  return EnqueuedLocked(r == ncclSuccess || r == ncclInProgress ? end : r);
}

absl::Status NcclCommunicator::CheckAsyncError() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) {
    return failure_;
  }
  ncclResult_t async = ncclSuccess;
  if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
    async = r;
  }
  if (async == ncclSuccess || async == ncclInProgress) {
    return absl::OkStatus();
  }
  return FailLocked(NcclErrorLocked(absl::StrCat(last_op_, " (asynchronous error)"), async));
}

absl::Status NcclCommunicator::WaitForStream(double timeout_s) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_, &capture) == cudaSuccess &&
      capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank_,
                     ": WaitForStream while the stream is captured into a CUDA graph; wait "
                     "after launching the graph"));
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) {
        return failure_;
      }
      const cudaError_t e = cudaStreamQuery(stream_);
      ncclResult_t async = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
        async = r;
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        return FailLocked(NcclErrorLocked(absl::StrCat(last_op_, " (asynchronous error)"), async));
      }
      if (e == cudaSuccess) {
        return absl::OkStatus();
      }
      if (e != cudaErrorNotReady) {
        // A kernel fault or launch error: the context is unusable, the peers must not wait.
        const std::string diagnosis = one_shot_ != nullptr ? one_shot_->Diagnosis() : "";
        return FailLocked(absl::InternalError(
            absl::StrCat("rank ", rank_, ": CUDA error on the stream after NCCL ",
                         last_op_.empty() ? "(no collective yet)" : last_op_, ": ",
                         cudaGetErrorString(e), diagnosis.empty() ? "" : " (", diagnosis,
                         diagnosis.empty() ? "" : ")", "; the communicator was aborted")));
      }
      if (Clock::now() >= deadline) {
        return FailLocked(absl::DeadlineExceededError(absl::StrCat(
            "rank ", rank_, ": NCCL collective ", last_op_.empty() ? "(none yet)" : last_op_,
            " (or work queued before it on the stream) did not complete within ", timeout_s,
            " s (a peer rank died or hangs); the communicator was aborted")));
      }
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

absl::Status NcclCommunicator::WaitForCommLocked(double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
      async = r;
    }
    if (async == ncclSuccess) {
      return absl::OkStatus();
    }
    if (async != ncclInProgress) {
      return FailLocked(NcclErrorLocked(last_op_, async));
    }
    if (Clock::now() >= deadline) {
      return FailLocked(absl::DeadlineExceededError(
          absl::StrCat("rank ", rank_, ": NCCL ", last_op_, " did not complete within ", timeout_s,
                       " s (a peer rank died or hangs); the communicator was aborted")));
    }
    // Holding mu_ here is fine: only init, enqueue and finalize wait, and they are short unless
    // something is already wrong.
    std::this_thread::sleep_for(kPollInterval);
  }
}

absl::Status NcclCommunicator::EnqueuedLocked(int result) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess) {
    return absl::OkStatus();
  }
  if (r == ncclInProgress) {
    return WaitForCommLocked(timeout_s_);
  }
  return FailLocked(NcclErrorLocked(last_op_, r));
}

absl::Status NcclCommunicator::NcclErrorLocked(const std::string& what, int result) const {
  const auto r = static_cast<ncclResult_t>(result);
  const char* last = ncclGetLastError(comm_);
  return absl::InternalError(
      absl::StrCat("rank ", rank_, ": NCCL ", what, " failed: ", ncclGetErrorString(r),
                   last != nullptr && *last != '\0' ? " (" : "", last != nullptr ? last : "",
                   last != nullptr && *last != '\0' ? ")" : ""));
}

absl::Status NcclCommunicator::FailLocked(absl::Status status) {
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (failure_.ok()) {
    failure_ = std::move(status);
  }
  return failure_;
}

}  // namespace mlaserve
