#include "worker/comm/mpi_wait.h"

#include <time.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace mlaserve {
namespace {

absl::Status TestOnce(MPI_Request* request, const char* what, bool* done) {
  int flag = 0;
  absl::Status s = MpiCallStatus(MPI_Test(request, &flag, MPI_STATUS_IGNORE), what);
  *done = flag != 0;
  return s;
}

}  // namespace

absl::Status MpiCallStatus(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return absl::InternalError(absl::StrCat(what, ": ", std::string(msg, len)));
}

absl::Status WaitMpiRequest(MPI_Request* request, const char* what, const MpiWaitPolicy& policy) {
  using Clock = std::chrono::steady_clock;
  bool done = false;
  const auto spin_until = Clock::now() + policy.spin;
  do {
    if (auto s = TestOnce(request, what, &done); !s.ok() || done) return s;
  } while (Clock::now() < spin_until);
  std::chrono::microseconds sleep = policy.first_sleep;
  for (;;) {
    // nanosleep rather than sched_yield: a yield returns at once on an otherwise idle core.
    const timespec ts{static_cast<time_t>(sleep.count() / 1000000),
                      static_cast<long>(sleep.count() % 1000000) * 1000};
    nanosleep(&ts, nullptr);
    if (auto s = TestOnce(request, what, &done); !s.ok() || done) return s;
    sleep = std::min(sleep * 2, policy.max_sleep);
  }
}

}  // namespace mlaserve
