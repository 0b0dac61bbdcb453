#include "coordinator/server/metrics.h"

namespace mlaserve {
namespace {

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
          1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0};
}
prometheus::Histogram::BucketBoundaries LengthBuckets() {
  return {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
}
prometheus::Histogram::BucketBoundaries FastBuckets() {
  return {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5};
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(const std::string& model, const std::string& bind_address,
                                       int ranks)
    : registry_(std::make_shared<prometheus::Registry>()), model_(model) {
  using namespace prometheus;
  const Labels m{{"model", model}};
  auto counter = [&](const char* name, const char* help) {
    return &BuildCounter().Name(name).Help(help).Register(*registry_).Add(m);
  };
  auto gauge = [&](const char* name, const char* help) {
    return &BuildGauge().Name(name).Help(help).Register(*registry_).Add(m);
  };
  auto hist = [&](const char* name, const char* help, Histogram::BucketBoundaries b) {
    return &BuildHistogram().Name(name).Help(help).Register(*registry_).Add(m, std::move(b));
  };
  finished_ = &BuildCounter().Name("mlaserve_requests_total").Help("Requests finished, by finish reason").Register(*registry_);
  rejected_ = &BuildCounter().Name("mlaserve_requests_rejected_total").Help("Requests rejected before scheduling, by error code").Register(*registry_);
  for (const char* r : {"stop", "length", "abort", "error"}) Finished(r);
  for (const char* c : {"invalidRequest", "promptTooLong", "overloaded"}) Rejected(c);
  prompt_tokens = counter("mlaserve_prompt_tokens_total", "Prompt tokens of admitted requests");
  generation_tokens = counter("mlaserve_generation_tokens_total", "Tokens generated");
  prefix_queries = counter("mlaserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache");
  prefix_hits = counter("mlaserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache");
  preemptions = counter("mlaserve_preemptions_total", "Sequences preempted (recomputed later) for lack of KV blocks");
  steps = counter("mlaserve_steps_total", "Model steps run");
  running = gauge("mlaserve_requests_running", "Requests being processed by the model");
  waiting = gauge("mlaserve_requests_waiting", "Requests waiting to be scheduled");
  kv_usage = gauge("mlaserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use");
  kv_blocks_total = gauge("mlaserve_kv_cache_blocks", "KV cache blocks (64 tokens each)");
  kv_dcp_ranks = gauge("mlaserve_kv_cache_dcp_ranks",
                       "Ranks the KV cache is split over (decode context parallelism; 1: none)");
  worker_up = gauge("mlaserve_worker_up", "1 while the worker job answers, 0 once it failed");
  worker_failures = counter("mlaserve_worker_failures_total",
                            "Worker jobs found failed (a rank died or hung, a step failed)");
  worker_restarts = counter("mlaserve_worker_restarts_total",
                            "Worker jobs that joined after a failed one (restarts)");
  worker_restart_time = hist("mlaserve_worker_restart_seconds",
                             "Worker job failure detected to the next job's ready message",
                             {0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200});
  client_backlog_bytes = gauge("mlaserve_client_backlog_bytes",
                               "Reply bytes held for clients that are not reading (all clients)");
  client_backlog_peak_bytes = gauge("mlaserve_client_backlog_peak_bytes",
                                    "Largest reply backlog one client has had, bytes");
  client_backlog_aborts = counter("mlaserve_client_backlog_aborts_total",
                                  "Requests aborted because their client stopped reading replies");
  client_replies_dropped = counter("mlaserve_client_replies_dropped_total",
                                   "Replies dropped for clients that stopped reading");
  ttft = hist("mlaserve_time_to_first_token_seconds", "Arrival to first token", LatencyBuckets());
  itl = hist("mlaserve_inter_token_latency_seconds", "Time between consecutive tokens of a request", LatencyBuckets());
  e2e = hist("mlaserve_e2e_request_latency_seconds", "Arrival to final reply", LatencyBuckets());
  queue_time = hist("mlaserve_request_queue_time_seconds", "Arrival to first scheduling", LatencyBuckets());
  prefill_time = hist("mlaserve_request_prefill_time_seconds", "First scheduling to first token", LatencyBuckets());
  decode_time = hist("mlaserve_request_decode_time_seconds", "First token to final token", LatencyBuckets());
  step_tokens = hist("mlaserve_step_tokens", "Tokens fed to the model per step", LengthBuckets());
  prompt_length = hist("mlaserve_request_prompt_tokens", "Prompt length of finished requests", LengthBuckets());
  generation_length = hist("mlaserve_request_generation_tokens", "Generated length of finished requests", LengthBuckets());
  step_time = hist("mlaserve_step_seconds", "Step round trip seen by the coordinator", FastBuckets());
  coordinator_time = hist("mlaserve_coordinator_step_overhead_seconds", "Scheduling, plan encoding and result handling per step", FastBuckets());
  sample_time = hist("mlaserve_worker_sample_seconds", "Sampling time on rank 0 per step", FastBuckets());
  forward_ = &BuildHistogram()
                  .Name("mlaserve_worker_forward_seconds")
                  .Help("Forward pass time per step, by rank")
                  .Register(*registry_);
  AddRanks(ranks);
  if (!bind_address.empty()) {
    exposer_ = std::make_unique<Exposer>(bind_address);
    exposer_->RegisterCollectable(registry_);
  }
}

void CoordinatorMetrics::AddRanks(int ranks) {
  for (int r = static_cast<int>(rank_forward.size()); r < ranks; ++r) {
    rank_forward.push_back(
        &forward_->Add({{"model", model_}, {"rank", std::to_string(r)}}, FastBuckets()));
  }
}

int CoordinatorMetrics::port() const {
  if (!exposer_) return 0;
  auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports[0];
}

prometheus::Counter& CoordinatorMetrics::Finished(const std::string& reason) {
  auto it = finished_by_.find(reason);
  if (it != finished_by_.end()) return *it->second;
  auto* c = &finished_->Add({{"model", model_}, {"finish_reason", reason}});
  finished_by_[reason] = c;
  return *c;
}

prometheus::Counter& CoordinatorMetrics::Rejected(const std::string& code) {
  auto it = rejected_by_.find(code);
  if (it != rejected_by_.end()) return *it->second;
  auto* c = &rejected_->Add({{"model", model_}, {"code", code}});
  rejected_by_[code] = c;
  return *c;
}

}  // namespace mlaserve
