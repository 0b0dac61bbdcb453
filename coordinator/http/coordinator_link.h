// One ZeroMQ connection to the coordinator shared by every generation mlaserve-openai serves.
//
// A thread of its own owns the Client (ZeroMQ sockets are not thread-safe): it sends the
// submissions and aborts the HTTP threads queue, and routes each reply to the Mailbox of the
// request it belongs to. Against a Client per HTTP thread (the first design) this sends the
// coordinator one client's traffic instead of one per open stream: the coordinator packs a
// client's replies of one step into one frame, so a step of 256 streams costs it one ZeroMQ send
// instead of 256, and the front end one ZeroMQ I/O thread instead of one per stream (measured in
// bench/RESULTS.md, "OpenAI HTTP front end").
//
// Client::Next cannot be woken by another thread, so while replies are awaited the link thread
// waits for them in slices of kLinkPoll and looks at its queue in between: a submission made
// while others stream waits at most that long to be sent. With nothing in flight it sleeps on a
// condition variable (no polling when idle).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/client/client.h"

namespace mlaserve::openai {

// Client::Next truncates what is left of its timeout to whole milliseconds before polling: 1 ms
// would never poll, 2 ms polls for up to 1 ms.
constexpr std::chrono::milliseconds kLinkPoll{2};

class CoordinatorLink {
 public:
  // The replies of one HTTP request's submissions, in the order they came.
  class Mailbox {
   public:
    // Moves every reply that has come into `out` (after what it holds), waiting up to `timeout`
    // for the first; false when none came.
    bool Wait(std::chrono::milliseconds timeout, std::vector<Reply>& out);

   private:
    friend class CoordinatorLink;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Reply> replies_;
    bool submitted_ = false;  // the link has answered the submission
    bool aborted_ = false;    // the link has taken the aborted ids off its routes
    absl::StatusOr<std::vector<uint64_t>> ids_;
  };

  // Connects (ZeroMQ connects lazily: a coordinator not there yet is no error) and starts the
  // link thread.
  // With `security`'s key files the connection is CURVE (a coordinator with --curve-secret-key).
  static absl::StatusOr<std::unique_ptr<CoordinatorLink>> Start(
      const std::string& endpoint, const ClientSecurity& security = {});
  ~CoordinatorLink();

  // Submits every input, their replies to go to `mailbox`; returns their request ids (in input
  // order). Blocks until the link thread has sent them.
  absl::StatusOr<std::vector<uint64_t>> Submit(const std::vector<GenerateInput>& inputs,
                                               Mailbox* mailbox);
  // Aborts requests of `mailbox`; replies to them still on their way are dropped. Blocks until
  // the link thread has taken them off its routes: the mailbox may be destroyed after it.
  void Abort(const std::vector<uint64_t>& ids, Mailbox* mailbox);

 private:
  struct Job {
    const std::vector<GenerateInput>* inputs = nullptr;  // submission, or
    std::vector<uint64_t> abort;                         // abort
    Mailbox* mailbox = nullptr;
  };
  explicit CoordinatorLink(std::unique_ptr<Client> client) : client_(std::move(client)) {}
  void Loop();
  void RunJobs();
  // Ends every routed request with an error reply (the connection itself failed).
  void FailAll(const std::string& why);

  std::unique_ptr<Client> client_;  // the link thread's only
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::atomic<bool> has_jobs_{false};
  std::atomic<bool> stop_{false};
  std::unordered_map<uint64_t, Mailbox*> routes_;  // request id -> its mailbox (link thread)
};

}  // namespace mlaserve::openai
