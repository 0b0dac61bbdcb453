// Waiting for a non-blocking MPI operation without holding a CPU core.
//
// Open MPI's blocking collectives busy-poll (mpi_yield_when_idle only adds sched_yield), so a
// worker rank waiting in MPI_Bcast for the next step plan used a whole core while the server was
// idle. WaitMpiRequest tests the request in a tight loop for a short spin window, which covers a
// busy server (the next plan follows the previous step within microseconds), then sleeps between
// tests with a growing interval, which bounds the idle cost at one MPI_Test per max_sleep.
#pragma once

#include <mpi.h>

#include <chrono>

#include "absl/status/status.h"

namespace mlaserve {

// The backoff: MPI_Test without sleeping for `spin`, then sleeps of first_sleep, doubling up to
// max_sleep, with an MPI_Test after each. The added latency when the request completes during a
// sleep is at most max_sleep plus the wake-up (the kernel's 50 us timer slack, a VM's vCPU
// wake); the idle cost is 1 / max_sleep wake-ups a second. 700 us, measured on the 2-core dev
// VM (bench/RESULTS.md, "Idle worker ranks"): 1-3% of a core idle and +0.4-0.9 ms to the first
// token after idle; 500 us cost 3.5% of a core for +0.4-0.6 ms, 1 ms 1-1.4% for +0.9-1.4 ms.
struct MpiWaitPolicy {
  std::chrono::microseconds spin{100};
  std::chrono::microseconds first_sleep{100};
  std::chrono::microseconds max_sleep{700};
};

// OK for MPI_SUCCESS, else an internal error "<what>: <MPI's error string>". (MpiCommunicator
// has a private copy of this conversion.)
absl::Status MpiCallStatus(int rc, const char* what);

// Returns when *request completes (it is then MPI_REQUEST_NULL), or the error MPI_Test reported
// (the communicator must use MPI_ERRORS_RETURN for that; MpiCommunicator sets it). `what` names
// the operation in the error message. Waits without a deadline, as MPI_Wait does.
absl::Status WaitMpiRequest(MPI_Request* request, const char* what,
                            const MpiWaitPolicy& policy = MpiWaitPolicy());

}  // namespace mlaserve
