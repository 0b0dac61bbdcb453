#include "coordinator/http/large_stack.h"

#include <pthread.h>

#include <cstring>
#include <exception>

#include "absl/strings/str_cat.h"

namespace mlaserve::openai {
namespace {

struct Job {
  absl::FunctionRef<void()> fn;
  std::exception_ptr error;
};

void* RunJob(void* arg) {
  Job* job = static_cast<Job*>(arg);
  try {
    job->fn();
  } catch (...) {
    job->error = std::current_exception();
  }
  return nullptr;
}

}  // namespace

absl::Status RunWithStack(size_t stack_bytes, absl::FunctionRef<void()> fn) {
  Job job{fn, nullptr};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  int rc = pthread_attr_setstacksize(&attr, stack_bytes);
  pthread_t thread;
  if (rc == 0) rc = pthread_create(&thread, &attr, RunJob, &job);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot start a thread with a ", stack_bytes >> 10, " KiB stack: ", std::strerror(rc)));
  }
  pthread_join(thread, nullptr);
  if (job.error) std::rethrow_exception(job.error);
  return absl::OkStatus();
}

}  // namespace mlaserve::openai
