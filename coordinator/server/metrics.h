// The coordinator's Prometheus metrics (prometheus-cpp), all named mlaserve_*, labelled with the
// model name, times in seconds. Per-rank step timings come from the workers' step results.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mlaserve {

class CoordinatorMetrics {
 public:
  // Serves /metrics on `bind_address` ("127.0.0.1:9400"); empty: metrics kept but not served.
  CoordinatorMetrics(const std::string& model, const std::string& bind_address, int ranks);

  prometheus::Counter& Finished(const std::string& reason);   // stop | length | abort | error
  prometheus::Counter& Rejected(const std::string& code);     // invalidRequest | overloaded | ...
  prometheus::Counter* prompt_tokens;
  prometheus::Counter* generation_tokens;
  prometheus::Counter* prefix_queries;   // prompt tokens looked up in the prefix cache
  prometheus::Counter* prefix_hits;      // of which found
  prometheus::Counter* preemptions;
  prometheus::Counter* steps;
  prometheus::Gauge* running;
  prometheus::Gauge* waiting;
  prometheus::Gauge* kv_usage;           // used blocks / total, 0..1
  prometheus::Gauge* kv_blocks_total;
  prometheus::Gauge* kv_dcp_ranks;  // ranks the KV cache is split over (1: every rank holds all)
  prometheus::Gauge* worker_up;          // 1 while the worker job answers
  prometheus::Counter* worker_failures;  // worker jobs found failed (a rank died, hung, erred)
  prometheus::Counter* worker_restarts;  // worker jobs that joined after a failed one
  prometheus::Histogram* worker_restart_time;  // failure detected -> the next job's `ready`
  // Replies a client has not taken yet (beyond ZeroMQ's queue for it): bytes held, over all
  // clients; requests aborted because their client's backlog passed the limit; replies other
  // than chunks and finals dropped for such a client, and backlogs dropped whole for a client
  // that read nothing for a minute with no request left (counted per reply).
  prometheus::Gauge* client_backlog_bytes;
  prometheus::Gauge* client_backlog_peak_bytes;  // the largest one client's backlog has been
  prometheus::Counter* client_backlog_aborts;
  prometheus::Counter* client_replies_dropped;
  prometheus::Histogram* ttft;
  prometheus::Histogram* itl;
  prometheus::Histogram* e2e;
  prometheus::Histogram* queue_time;
  prometheus::Histogram* prefill_time;
  prometheus::Histogram* decode_time;
  prometheus::Histogram* step_tokens;
  prometheus::Histogram* prompt_length;
  prometheus::Histogram* generation_length;
  prometheus::Histogram* step_time;         // coordinator-observed step round trip
  prometheus::Histogram* coordinator_time;  // scheduling + encoding + result handling per step
  prometheus::Histogram* sample_time;       // sampling on rank 0
  std::vector<prometheus::Histogram*> rank_forward;  // forward pass per rank
  int port() const;
  // Adds forward-time series for ranks up to `ranks` (a restarted worker job may have more).
  void AddRanks(int ranks);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>* finished_;
  prometheus::Family<prometheus::Counter>* rejected_;
  prometheus::Family<prometheus::Histogram>* forward_;
  std::map<std::string, prometheus::Counter*> finished_by_;
  std::map<std::string, prometheus::Counter*> rejected_by_;
  std::string model_;
};

}  // namespace mlaserve
