// A worker rank's Prometheus metrics (served by each rank on its own port): step phases,
// time inside collectives (the communication share), memory held by the shard.
#pragma once

#include <sys/resource.h>

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mlaserve {

class WorkerMetrics {
 public:
  WorkerMetrics(const std::string& model, int rank, const std::string& bind_address)
      : registry_(std::make_shared<prometheus::Registry>()) {
    using namespace prometheus;
    const Labels l{{"model", model}, {"rank", std::to_string(rank)}};
    const Histogram::BucketBoundaries b = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                           0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0};
    auto& phase = BuildHistogram().Name("mlaserve_worker_step_phase_seconds")
                      .Help("Time per step by phase: forward (model), sample (rank 0), comm (inside collectives)")
                      .Register(*registry_);
    forward_ = &phase.Add({{"model", model}, {"rank", std::to_string(rank)}, {"phase", "forward"}}, b);
    sample_ = &phase.Add({{"model", model}, {"rank", std::to_string(rank)}, {"phase", "sample"}}, b);
    comm_ = &phase.Add({{"model", model}, {"rank", std::to_string(rank)}, {"phase", "comm"}}, b);
    steps_ = &BuildCounter().Name("mlaserve_worker_steps_total").Help("Steps run").Register(*registry_).Add(l);
    tokens_ = &BuildCounter().Name("mlaserve_worker_step_tokens_total").Help("Tokens fed to the model").Register(*registry_).Add(l);
    comm_total_ = &BuildCounter().Name("mlaserve_worker_comm_seconds_total").Help("Seconds inside collectives").Register(*registry_).Add(l);
    forward_total_ = &BuildCounter().Name("mlaserve_worker_forward_seconds_total").Help("Seconds in forward passes").Register(*registry_).Add(l);
    auto& mem = BuildGauge().Name("mlaserve_worker_memory_bytes")
                    .Help("Memory held by this rank: weights and kv_cache on its device, resident host memory")
                    .Register(*registry_);
    weights = &mem.Add({{"model", model}, {"rank", std::to_string(rank)}, {"kind", "weights"}});
    kv_cache = &mem.Add({{"model", model}, {"rank", std::to_string(rank)}, {"kind", "kv_cache"}});
    resident_ = &mem.Add({{"model", model}, {"rank", std::to_string(rank)}, {"kind", "host_resident_peak"}});
    gpu_used = &mem.Add({{"model", model}, {"rank", std::to_string(rank)}, {"kind", "gpu_used"}});
    workspace = &mem.Add({{"model", model}, {"rank", std::to_string(rank)}, {"kind", "gpu_step_workspace"}});
    exposer_ = std::make_unique<Exposer>(bind_address);
    exposer_->RegisterCollectable(registry_);
  }

  // Called once per step with this step's times and the communicator's running total.
  void Observe(double forward_s, double sample_s, double comm_total_s, int64_t tokens) {
    forward_->Observe(forward_s);
    sample_->Observe(sample_s);
    comm_->Observe(comm_total_s - last_comm_);
    comm_total_->Increment(comm_total_s - last_comm_);
    forward_total_->Increment(forward_s);
    last_comm_ = comm_total_s;
    steps_->Increment();
    tokens_->Increment(static_cast<double>(tokens));
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    resident_->Set(static_cast<double>(u.ru_maxrss) * 1024.0);
  }

  prometheus::Gauge* weights;
  prometheus::Gauge* kv_cache;
  prometheus::Gauge* gpu_used;   // device memory in use (cudaMemGetInfo), GPU backend only
  prometheus::Gauge* workspace;  // the step arena's size, GPU backend only

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Histogram* forward_;
  prometheus::Histogram* sample_;
  prometheus::Histogram* comm_;
  prometheus::Counter* steps_;
  prometheus::Counter* tokens_;
  prometheus::Counter* comm_total_;
  prometheus::Counter* forward_total_;
  prometheus::Gauge* resident_;
  double last_comm_ = 0;
};

}  // namespace mlaserve
