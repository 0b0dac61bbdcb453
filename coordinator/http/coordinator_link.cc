#include "coordinator/http/coordinator_link.h"

namespace mlaserve::openai {

bool CoordinatorLink::Mailbox::Wait(std::chrono::milliseconds timeout, std::vector<Reply>& out) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_for(l, timeout, [this] { return !replies_.empty(); })) {
    return false;
  }
  for (Reply& r : replies_) {
    out.push_back(std::move(r));
  }
  replies_.clear();
  return true;
}

absl::StatusOr<std::unique_ptr<CoordinatorLink>> CoordinatorLink::Start(
    const std::string& endpoint, const ClientSecurity& security) {
  auto client = Client::Connect(endpoint, security);
  if (!client.ok()) {
    return client.status();
  }
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink(std::move(*client)));
  link->thread_ = std::thread([l = link.get()] { l->Loop(); });
  return link;
}

CoordinatorLink::~CoordinatorLink() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

absl::StatusOr<std::vector<uint64_t>> CoordinatorLink::Submit(
    const std::vector<GenerateInput>& inputs, Mailbox* mailbox) {
  {
    std::lock_guard<std::mutex> l(mailbox->mu_);
    mailbox->submitted_ = false;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back({&inputs, {}, mailbox});
    has_jobs_ = true;
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> l(mailbox->mu_);
  mailbox->cv_.wait(l, [mailbox] { return mailbox->submitted_; });
  return mailbox->ids_;
}

void CoordinatorLink::Abort(const std::vector<uint64_t>& ids, Mailbox* mailbox) {
  if (ids.empty()) {
    return;
  }
  {
    std::lock_guard<std::mutex> l(mailbox->mu_);
    mailbox->aborted_ = false;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back({nullptr, ids, mailbox});
    has_jobs_ = true;
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> l(mailbox->mu_);
  mailbox->cv_.wait(l, [mailbox] { return mailbox->aborted_; });
}

void CoordinatorLink::RunJobs() {
  std::deque<Job> jobs;
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs.swap(jobs_);
    has_jobs_ = false;
  }
  for (Job& job : jobs) {
    if (job.inputs == nullptr) {
      for (uint64_t id : job.abort) {
        (void)client_->Abort(id);
        routes_.erase(id);
      }
      std::lock_guard<std::mutex> l(job.mailbox->mu_);
      job.mailbox->aborted_ = true;
      job.mailbox->cv_.notify_all();
      continue;
    }
    std::vector<uint64_t> ids;
    absl::Status status;
    for (const GenerateInput& in : *job.inputs) {
      auto id = client_->Submit(in);
      if (!id.ok()) {
        status = id.status();
        break;
      }
      ids.push_back(*id);
      routes_[*id] = job.mailbox;
    }
    if (!status.ok()) {  // none of a request's choices runs when one cannot be sent
      for (uint64_t id : ids) {
        (void)client_->Abort(id);
        routes_.erase(id);
      }
    }
    std::lock_guard<std::mutex> l(job.mailbox->mu_);
    job.mailbox->ids_ = status.ok() ? absl::StatusOr<std::vector<uint64_t>>(std::move(ids))
                                    : absl::StatusOr<std::vector<uint64_t>>(status);
    job.mailbox->submitted_ = true;
    job.mailbox->cv_.notify_all();
  }
}

void CoordinatorLink::FailAll(const std::string& why) {
  for (auto& [id, mailbox] : routes_) {
    Reply r;
    r.kind = Reply::Kind::kError;
    r.request_id = id;
    r.error_code = "unavailable";
    r.message = why;
    std::lock_guard<std::mutex> l(mailbox->mu_);
    mailbox->replies_.push_back(std::move(r));
    mailbox->cv_.notify_all();
  }
  routes_.clear();
}

void CoordinatorLink::Loop() {
  while (!stop_) {
    if (has_jobs_) {
      RunJobs();
    }
    if (routes_.empty()) {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [this] { return stop_ || !jobs_.empty(); });
      continue;
    }
    auto r = client_->Next(kLinkPoll);
    if (!r.ok()) {
      if (r.status().code() != absl::StatusCode::kDeadlineExceeded) {
        FailAll(std::string(r.status().message()));  // e.g. a refused CURVE handshake
      }
      continue;
    }
    auto it = routes_.find(r->request_id);
    if (it == routes_.end()) {
      continue;  // an aborted request's late reply
    }
    Mailbox* mailbox = it->second;
    if (r->kind == Reply::Kind::kFinal || r->kind == Reply::Kind::kError) {
      routes_.erase(it);
    }
    bool was_empty;
    {
      std::lock_guard<std::mutex> l(mailbox->mu_);
      was_empty = mailbox->replies_.empty();
      mailbox->replies_.push_back(std::move(*r));
    }
    // A waiter already woken for earlier replies takes these with them. Notified after the
    // unlock: the woken thread does not block on the mutex this thread still holds.
    if (was_empty) {
      mailbox->cv_.notify_all();
    }
  }
}

}  // namespace mlaserve::openai
