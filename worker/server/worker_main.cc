// mlaserve-worker: one rank of a model replica, launched by mpirun (one rank per GPU, or on CPU).
//
//   mpirun -np N mlaserve-worker --model DIR --coordinator tcp://HOST:PORT
//       [--device auto|cuda|cpu] [--kv-format bf16|fp8|fp8_tiled] [--kv-blocks N]
//       [--gpu-memory-fraction F] [--max-step-tokens N] [--max-seqs N]
//       [--moe expert|tensor] [--threads N] [--cuda-graphs on|off] [--cuda-graphs-multi-rank
//       on|off]
//       [--deterministic on|off] [--mla-fp8-tensor-cores on|off]
//       [--coordinator-curve-key FILE] [--dcp N] [--metrics-host H --metrics-port N]
//       [--name NAME] [--coordinator-timeout-s S]   (--help lists every flag)
//
// --dcp N (decode context parallelism, issues 20 and 22; N divides the rank count; CPU and GPU):
// groups of N ranks split the latent cache by blocks instead of each holding all of it;
// --kv-blocks is per rank and the coordinator gets N times as many (ModelOptions::dcp).
// --deterministic on (issue 23): a request's tokens do not depend on what it is batched with nor
// on preemption: batch-invariant kernels and every token's attention through the decode path
// (ModelOptions::deterministic; its cost is in bench/RESULTS.md).
// --mla-fp8-tensor-cores off: the fp8 KV formats' attention in the exact form; on (the default)
// lets the GPU's decode kernel run q.k and P.V on e4m3 tensor cores where it has such a kernel
// (SM90, 64+ query rows; kernels/mla/mla_decode_fp8mma64.cuh; within issue 18's accuracy bounds).
// --device defaults to cuda where the build has the CUDA backend and a GPU is visible, else cpu.
// On a GPU the memory plan (worker/model/memory_plan.h) is made before loading: the KV pool gets
// what the weights and the largest step's workspace leave of the free memory times
// --gpu-memory-fraction (default 0.9), or --kv-blocks if given (checked); the CPU backend
// defaults to 256 blocks. The blocks it got go to the coordinator in the `ready` message.
//
// Every rank loads its shard; if any rank fails, every rank exits with "rank R: cause". Rank 0
// connects to the coordinator's worker socket, announces itself with a `ready` result, then
// receives step plans, broadcasts them to the other ranks over MPI, runs the step on every rank
// and answers with the sampled tokens. Every rank that can reach the coordinator (rank 0's
// host, or any host when the worker socket is not on loopback; with CURVE, only ranks that can
// read the key file) sends a heartbeat every 250 ms on a socket of its own, so that the
// coordinator names the rank that dies (its connection closes) or hangs (its beats stop). When
// the coordinator gives up on the job it sends a shutdown to rank 0's heartbeat socket too: a
// rank 0 whose main loop has not stopped 5 s later (stuck in a step) exits, and mpirun ends the
// rest of the job, so that the launcher can start a new one.
// --coordinator-curve-key FILE (the job's CURVE key pair, mode 0600; deploy/mlaserve-launch makes
// one when the coordinator's worker socket is not on loopback and passes the same file to the
// coordinator's --worker-curve-key): rank 0's two sockets, and the heartbeat sockets of the
// ranks that can read the file, authenticate and encrypt with it.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capnp/message.h"
#include "capnp/serialize.h"
#include "common/command_line.h"
#include "coordinator/auth/curve_keys.h"
#include "kj/array.h"
#include "mlaserve.capnp.h"
#include "nlohmann/json.hpp"
#include "worker/backend/cpu_ops.h"
#include "worker/backend/cuda_backend_module.h"
#include "worker/comm/mpi_communicator.h"
#include "worker/comm/mpi_wait.h"
#include "worker/model/memory_plan.h"
#include "worker/server/step_executor.h"
#include "worker/server/worker_metrics.h"
#include "zmq.hpp"

ABSL_FLAG(std::string, model, "", "The model folder (config.json, safetensors); required.");
ABSL_FLAG(std::string, coordinator, "",
          "The coordinator's worker endpoint rank 0 connects to (its --worker-listen); required.");
ABSL_FLAG(
    std::string, device, "auto",
    "auto, cuda or cpu (auto: cuda where the build has the CUDA backend and a GPU is visible).");
ABSL_FLAG(std::string, kv_format, "bf16",
          "KV cache format: bf16, fp8, fp8_tiled (or f32, exact tests only).");
ABSL_FLAG(int32_t, kv_blocks, 0,
          "KV cache blocks of 64 tokens per rank, in [0, 16777216] (0: what the memory plan leaves "
          "on a GPU, 256 on the CPU).");
ABSL_FLAG(double, gpu_memory_fraction, 0.9,
          "Fraction of the GPU's free memory the rank may use, in (0, 1].");
ABSL_FLAG(int32_t, max_step_tokens, 2048,
          "Most tokens in one step (sizes the GPU step workspace), in [1, 1048576].");
ABSL_FLAG(int32_t, max_seqs, 256, "Most sequences in one step, in [1, 65536].");
ABSL_FLAG(std::string, moe, "expert",
          "MoE parallelism: expert (whole experts per rank) or tensor (every expert split).");
ABSL_FLAG(int32_t, threads, 1, "CPU backend threads per rank, in [1, 1024].");
ABSL_FLAG(mlaserve::OnOff, cuda_graphs, mlaserve::OnOff{true},
          "Replay single-token decode steps as CUDA graphs.");
ABSL_FLAG(mlaserve::OnOff, cuda_graphs_multi_rank, mlaserve::OnOff{false},
          "With --cuda-graphs on, also replay the decode steps of several GPU ranks (NCCL) as "
          "graphs. Not yet run on several GPUs.");
ABSL_FLAG(mlaserve::OnOff, deterministic, mlaserve::OnOff{false},
          "Tokens independent of batching and preemption (README, Deterministic serving).");
ABSL_FLAG(mlaserve::OnOff, mla_fp8_tensor_cores, mlaserve::OnOff{true},
          "The fp8 KV formats' attention on e4m3 tensor cores where the GPU kernel has that form "
          "(SM90, 64+ query rows); off: the exact form.");
ABSL_FLAG(int32_t, dcp, 1,
          "Decode context parallelism: groups of N ranks split the KV cache, N in [1, 1024] "
          "dividing the rank count.");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "The address of each rank's /metrics endpoint.");
ABSL_FLAG(int32_t, metrics_port, 0,
          "Rank r serves /metrics on this port + r, in [0, 65535] (0: off).");
ABSL_FLAG(std::string, name, "", "The model name in metrics (default: the folder's name).");
ABSL_FLAG(std::string, coordinator_curve_key, "",
          "The job's CURVE key pair file (mode 0600; the coordinator's --worker-curve-key): rank "
          "0's sockets authenticate and encrypt.");
ABSL_FLAG(
    int32_t, coordinator_timeout_s, 15,
    "No message from the coordinator (plans or idle pings) for this long: stop, in [1, 86400].");

namespace {

using namespace mlaserve;

constexpr char kUsage[] =
    "mpirun -np N mlaserve-worker --model DIR --coordinator tcp://HOST:PORT [flags]";

// The flags' values, checked (the flags above say what each means).
struct Args {
  std::string model, coordinator, kv, moe, device;
  int kv_blocks = 0, threads = 1;
  double gpu_memory_fraction = 0.9;
  int max_step_tokens = 0, max_seqs = 0;
  bool cuda_graphs = true;
  bool cuda_graphs_multi_rank = false;
  bool deterministic = false;
  bool mla_fp8_tensor_cores = true;
  int dcp = 1;
  std::string metrics_host;
  int metrics_port = 0;
  int coordinator_timeout_s = 0;
  std::string name;
  std::string coordinator_curve_key;  // empty: NULL mechanism (loopback)
};

std::string Serialize(capnp::MessageBuilder& msg) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(msg);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

void SendResult(zmq::socket_t& sock, capnp::MessageBuilder& msg) {
  const std::string bytes = Serialize(msg);
  sock.send(zmq::buffer(bytes), zmq::send_flags::none);
}

int Fail(int rank, const std::string& msg) {
  if (rank == 0) std::fprintf(stderr, "mlaserve-worker: %s\n", msg.c_str());
  MPI_Finalize();
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MpiCommunicator mpi;
  TimedCommunicator comm(mpi);
  const int rank = comm.rank();
  // A usage error exits every rank with status 2 (all parse the same arguments); rank 0 says why.
  FinalizeMpiAtExit();
  ParseFlags(argc, argv, kUsage, /*quiet=*/rank != 0);
  Args a;
  a.model = RequiredFlag(FLAGS_model, "DIR");
  a.coordinator = RequiredFlag(FLAGS_coordinator, "ENDPOINT");
  a.device = FlagOneOf(FLAGS_device, {"auto", "cuda", "cpu"});
  a.kv = absl::GetFlag(FLAGS_kv_format);
  a.kv_blocks = FlagInRange(FLAGS_kv_blocks, 0, 1 << 24);
  a.gpu_memory_fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
  if (!(a.gpu_memory_fraction > 0 && a.gpu_memory_fraction <= 1)) {
    UsageError(
        absl::StrCat("--gpu-memory-fraction ", a.gpu_memory_fraction, ": must be in (0, 1]"));
  }
  a.max_step_tokens = FlagInRange(FLAGS_max_step_tokens, 1, 1 << 20);
  a.max_seqs = FlagInRange(FLAGS_max_seqs, 1, 1 << 16);
  a.moe = FlagOneOf(FLAGS_moe, {"expert", "tensor"});
  a.threads = FlagInRange(FLAGS_threads, 1, 1024);
  a.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs).on;
  a.cuda_graphs_multi_rank = absl::GetFlag(FLAGS_cuda_graphs_multi_rank).on;
  a.deterministic = absl::GetFlag(FLAGS_deterministic).on;
  a.mla_fp8_tensor_cores = absl::GetFlag(FLAGS_mla_fp8_tensor_cores).on;
  a.dcp = FlagInRange(FLAGS_dcp, 1, 1024);
  a.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  a.metrics_port = FlagInRange(FLAGS_metrics_port, 0, 65535);
  a.name = absl::GetFlag(FLAGS_name);
  a.coordinator_curve_key = absl::GetFlag(FLAGS_coordinator_curve_key);
  a.coordinator_timeout_s = FlagInRange(FLAGS_coordinator_timeout_s, 1, 86400);

  // The CUDA backend is a module loaded at run time (cuda_backend_module.h says why).
  const CudaBackendApi* cuda_api = nullptr;
  absl::Status cuda_status = absl::OkStatus();
  if (a.device != "cpu") {
    auto api = LoadCudaBackend();
    if (api.ok()) cuda_api = *api; else cuda_status = api.status();
  }
  if (a.device == "auto")
    a.device = cuda_api != nullptr && cuda_api->device_count() > 0 ? "cuda" : "cpu";
  ModelOptions options;
  options.moe = a.moe == "tensor" ? MoeParallelism::kTensor : MoeParallelism::kExpert;
  options.deterministic = a.deterministic;
  options.mla_fp8_tensor_cores = a.mla_fp8_tensor_cores;
  options.dcp = a.dcp;
  std::unique_ptr<Ops> ops;
  std::string plan_note;
  // The model's collectives: MPI on the CPU backend, NCCL between GPU ranks.
  std::unique_ptr<Communicator> device_comm;
  std::unique_ptr<TimedCommunicator> timed_device_comm;
  TimedCommunicator* model_comm = &comm;
  // Everything up to the loaded model; the first failure of any rank stops every rank.
  auto load = [&]() -> absl::StatusOr<std::unique_ptr<DeepseekV3Model>> {
    auto format = ParseKvCacheFormat(a.kv);
    if (!format.ok()) return format.status();
    options.kv_format = *format;
    if (a.device == "cpu") {
      ops = std::make_unique<CpuOps>(a.threads);
      options.num_kv_blocks = a.kv_blocks > 0 ? a.kv_blocks : 256;
    } else {
      if (cuda_api == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("--device cuda: ", cuda_status.message()));
      }
      std::string error;
      std::unique_ptr<Ops> cuda(cuda_api->create_ops(&error));
      if (cuda == nullptr) return absl::FailedPreconditionError(absl::StrCat("CUDA backend: ", error));
      auto config = LoadModelConfig(a.model);
      if (!config.ok()) return config.status();
      auto ckpt = Checkpoint::Open(a.model);
      if (!ckpt.ok()) return ckpt.status();
      MemoryPlanInput in;
      in.rank = rank;
      in.world = comm.size();
      in.expert_parallel = options.moe == MoeParallelism::kExpert;
      in.kv_format = options.kv_format;
      size_t total = 0;
      if (!cuda_api->memory_info(&in.free_bytes, &total)) {
        return absl::InternalError("cudaMemGetInfo failed on this rank's GPU");
      }
      in.memory_fraction = a.gpu_memory_fraction;
      in.kv_blocks = a.kv_blocks;
      in.max_step_tokens = a.max_step_tokens;
      in.max_seqs = a.max_seqs;
      in.deterministic = a.deterministic;
      auto plan = PlanDeviceMemory(*ckpt, *config, in);
      if (!plan.ok()) return plan.status();
      plan_note = plan->Describe();
      options.num_kv_blocks = plan->kv_blocks;
      options.graphs = a.cuda_graphs;
      options.multi_rank_graphs = a.cuda_graphs_multi_rank;
      ops = std::move(cuda);
      if (comm.size() > 1) {
        // Activations between the ranks' GPUs go over NCCL; MPI keeps the control messages.
        // (Not yet run with more than one GPU: only one-GPU machines were at hand.)
        MPI_Comm world = MPI_COMM_WORLD;
        Communicator* nccl = cuda_api->create_nccl(&world, ops.get(), &error);
        if (nccl == nullptr) return absl::FailedPreconditionError(absl::StrCat("NCCL: ", error));
        device_comm.reset(nccl);
        timed_device_comm = std::make_unique<TimedCommunicator>(*device_comm);
        model_comm = timed_device_comm.get();
      }
    }
    return DeepseekV3Model::Load(a.model, options, *ops, *model_comm);
  };
  absl::StatusOr<std::unique_ptr<DeepseekV3Model>> model = load();
  // Rank 0 needs the job's key (the file may exist on its host alone): a bad key there stops
  // every rank like a failed load. The other ranks use it for their heartbeats where their host
  // has it; without it they send none.
  CurveKeyPair link_key;
  absl::Status key_status = absl::OkStatus();
  if (!a.coordinator_curve_key.empty()) {
    auto k = LoadCurveKeyPair(a.coordinator_curve_key);
    if (k.ok()) link_key = std::move(*k);
    else if (rank == 0) key_status = absl::Status(k.status().code(), absl::StrCat("--coordinator-curve-key: ", k.status().message()));
  }
  const absl::Status agreed = mpi.AgreeOnStatus(key_status.ok() ? model.status() : key_status);
  if (agreed.ok() && rank == 0 && !plan_note.empty()) {
    std::fprintf(stderr, "mlaserve-worker: memory plan: %s\n", plan_note.c_str());
  }
  a.kv_blocks = options.num_kv_blocks;

  zmq::context_t ctx(1);
  // The coordinator serves the worker socket with the job's pair and allows only its public key.
  auto secure = [&link_key](zmq::socket_t& s) {
    if (link_key.secret_key.empty()) return;
    s.set(zmq::sockopt::curve_serverkey, link_key.public_key);
    s.set(zmq::sockopt::curve_publickey, link_key.public_key);
    s.set(zmq::sockopt::curve_secretkey, link_key.secret_key);
  };
  zmq::socket_t sock(ctx, zmq::socket_type::dealer);
  std::atomic<bool> running{true};
  std::thread heartbeat;
  if (rank == 0) {
    sock.set(zmq::sockopt::routing_id, "worker");
    sock.set(zmq::sockopt::linger, 1000);
    secure(sock);
    sock.connect(a.coordinator);
  }
  if (!agreed.ok()) {
    if (rank == 0) {
      capnp::MallocMessageBuilder msg;
      auto r = msg.initRoot<wire::StepResult>();
      r.setError(std::string(agreed.message()));
      SendResult(sock, msg);
    }
    return Fail(rank, std::string(agreed.message()));
  }
  // Which ranks beat: a loopback or ipc:// endpoint is reachable from rank 0's host only; a
  // CURVE link needs the key pair on the rank's host.
  char host[MPI_MAX_PROCESSOR_NAME] = {0}, host0[MPI_MAX_PROCESSOR_NAME] = {0};
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);
  std::memcpy(host0, host, sizeof(host));
  MPI_Bcast(host0, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0, MPI_COMM_WORLD);
  const bool reachable = IsLoopbackEndpoint(a.coordinator) ? std::strcmp(host, host0) == 0 : true;
  const int beats = rank == 0 || (reachable && (a.coordinator_curve_key.empty() || !link_key.secret_key.empty()));
  std::vector<int> beating(comm.size(), 0);
  MPI_Gather(&beats, 1, MPI_INT, beating.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (beats) {
    heartbeat = std::thread([&ctx, &running, &secure, rank, endpoint = a.coordinator] {
      zmq::socket_t hb(ctx, zmq::socket_type::dealer);
      hb.set(zmq::sockopt::routing_id, rank == 0 ? std::string("heartbeat") : absl::StrCat("heartbeat-", rank));
      hb.set(zmq::sockopt::linger, 0);
      secure(hb);
      hb.connect(endpoint);
      capnp::MallocMessageBuilder msg;
      msg.initRoot<wire::StepResult>().setPong();
      const std::string bytes = Serialize(msg);
      std::optional<std::chrono::steady_clock::time_point> stop_by;
      while (running.load()) {
        hb.send(zmq::buffer(bytes), zmq::send_flags::dontwait);
        // Only the coordinator's shutdown comes this way (to rank 0's heartbeat socket).
        zmq::pollitem_t item{hb.handle(), 0, ZMQ_POLLIN, 0};
        if (zmq::poll(&item, 1, std::chrono::milliseconds(250)) > 0) {
          zmq::message_t m;
          if (hb.recv(m, zmq::recv_flags::dontwait) && !stop_by) stop_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        }
        if (stop_by && std::chrono::steady_clock::now() > *stop_by && running.load()) {
          std::fprintf(stderr, "mlaserve-worker: rank %d: the coordinator ended this job and the rank did not stop within 5 s (stuck in a step?); exiting\n", rank);
          std::_Exit(1);
        }
      }
    });
  }
  if (rank == 0) {
    const ModelConfig& c = (*model)->config();
    nlohmann::json info = {{"model", a.model}, {"ranks", comm.size()}, {"kv_format", a.kv},
                           {"kv_blocks", a.kv_blocks * a.dcp}, {"kv_blocks_per_rank", a.kv_blocks},
                           {"dcp", a.dcp}, {"moe", a.moe}, {"vocab_size", c.vocab_size},
                           {"layers", c.num_hidden_layers}, {"hidden_size", c.hidden_size},
                           {"heads", c.num_attention_heads}, {"experts", c.n_routed_experts},
                           {"max_position_embeddings", c.max_position_embeddings},
                           {"eos_token_ids", c.eos_token_ids},
                           {"weight_bytes_rank0", (*model)->weight_bytes()},
                           {"kv_cache_bytes_rank0", (*model)->kv_cache_bytes()},
                           {"backend", a.device}};
    std::vector<int> heartbeat_ranks;
    for (int r = 0; r < comm.size(); ++r) {
      if (beating[r]) heartbeat_ranks.push_back(r);
    }
    info["heartbeat_ranks"] = heartbeat_ranks;
    capnp::MallocMessageBuilder msg;
    msg.initRoot<wire::StepResult>().setReady(info.dump());
    SendResult(sock, msg);
  }

  // Per-rank Prometheus endpoint: step phases, communication time, memory held.
  if (a.name.empty()) a.name = std::filesystem::path(a.model).filename().string();
  std::unique_ptr<WorkerMetrics> metrics;
  if (a.metrics_port > 0) {
    try {
      metrics = std::make_unique<WorkerMetrics>(a.name, rank, a.metrics_host + ":" + std::to_string(a.metrics_port + rank));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mlaserve-worker: rank %d: metrics endpoint %s:%d: %s\n", rank, a.metrics_host.c_str(),
                   a.metrics_port + rank, e.what());
    }
    if (metrics) {
      metrics->weights->Set(static_cast<double>((*model)->weight_bytes()));
      metrics->kv_cache->Set(static_cast<double>((*model)->kv_cache_bytes()));
    }
  }
  // Device memory in use (GPU backend), refreshed every step.
  auto observe_device = [&] {
    if (metrics && a.device == "cuda" && cuda_api != nullptr) {
      size_t free_b = 0, total_b = 0;
      if (cuda_api->memory_info(&free_b, &total_b)) metrics->gpu_used->Set(static_cast<double>(total_b - free_b));
      metrics->workspace->Set(static_cast<double>(cuda_api->arena_bytes(ops.get())));
    }
  };
  observe_device();
  StepExecutor executor(**model, /*sample_here=*/rank == 0);
  int exit_code = 0;
  for (;;) {
    // Rank 0 receives the plan and broadcasts its bytes; every rank parses the same message.
    std::string bytes;
    bool orphaned = false;
    if (rank == 0) {
      // The coordinator pings every second while idle; silence means it is gone.
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::seconds(a.coordinator_timeout_s)) == 0) {
        std::fprintf(stderr, "mlaserve-worker: no message from the coordinator for %d s; stopping\n",
                     a.coordinator_timeout_s);
        orphaned = true;
        capnp::MallocMessageBuilder msg;
        msg.initRoot<wire::StepPlan>().setShutdown();
        kj::Array<capnp::word> w = capnp::messageToFlatArray(msg);
        auto b = w.asBytes();
        bytes.assign(reinterpret_cast<const char*>(b.begin()), b.size());
        exit_code = 1;
      } else {
        zmq::message_t m;
        if (!sock.recv(m, zmq::recv_flags::none)) continue;
        bytes.assign(static_cast<const char*>(m.data()), m.size());
      }
    }
    (void)orphaned;
    // The length goes out as a non-blocking broadcast that the ranks wait for with sleeps
    // (worker/comm/mpi_wait.h): a blocking MPI_Bcast busy-polls a core for as long as the server
    // is idle. Every rank calls MPI_Ibcast, since a non-blocking collective matches only its own
    // kind. The bytes follow right after the length, so a blocking MPI_Bcast is fine for them.
    uint64_t len = bytes.size();
    MPI_Request len_request = MPI_REQUEST_NULL;
    absl::Status len_status = MpiCallStatus(
        MPI_Ibcast(&len, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD, &len_request), "MPI_Ibcast");
    if (len_status.ok()) len_status = WaitMpiRequest(&len_request, "step plan length broadcast");
    if (!len_status.ok()) {
      // A peer rank is gone or MPI failed: no step can run; stop this rank (mpirun then ends
      // the job, and the coordinator sees rank 0's heartbeat stop).
      std::fprintf(stderr, "mlaserve-worker: rank %d: %s; stopping\n", rank,
                   std::string(len_status.message()).c_str());
      exit_code = 1;
      break;
    }
    bytes.resize(len);
    MPI_Bcast(bytes.data(), static_cast<int>(len), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (len % sizeof(capnp::word) != 0 || len == 0) {
      if (rank == 0) {
        capnp::MallocMessageBuilder msg;
        msg.initRoot<wire::StepResult>().setError("step plan is not a whole number of 8-byte words");
        SendResult(sock, msg);
      }
      continue;
    }
    kj::Array<capnp::word> words = kj::heapArray<capnp::word>(len / sizeof(capnp::word));
    std::memcpy(words.begin(), bytes.data(), len);
    std::string error;
    bool shutdown = false;
    bool ping = false;
    ExecutedStep step;
    uint64_t step_id = 0;
    try {
      capnp::FlatArrayMessageReader reader(words);
      wire::StepPlan::Reader plan = reader.getRoot<wire::StepPlan>();
      step_id = plan.getStepId();
      shutdown = plan.isShutdown();
      ping = plan.isPing();
      if (!shutdown && !ping) {
        auto r = executor.Run(plan);
        if (r.ok()) step = std::move(*r); else error = std::string(r.status().message());
      }
    } catch (const kj::Exception& e) {
      error = absl::StrCat("malformed step plan: ", e.getDescription().cStr());
    }
    double forward = step.forward_seconds;
    if (metrics) {
      metrics->Observe(step.forward_seconds, step.sample_seconds, model_comm->seconds(), step.tokens_fed);
      observe_device();
    }
    std::vector<double> per_rank(comm.size());
    MPI_Gather(&forward, 1, MPI_DOUBLE, per_rank.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0 && !shutdown && !ping) {
      capnp::MallocMessageBuilder msg;
      auto r = msg.initRoot<wire::StepResult>();
      r.setStepId(step_id);
      if (!error.empty()) {
        r.setError(error);
      } else {
        auto list = r.initSampled(step.tokens.size());
        for (size_t i = 0; i < step.tokens.size(); ++i) {
          const auto& t = step.tokens[i];
          list[i].setSeqId(t.seq_id);
          list[i].setTokenId(t.out.token);
          if (t.want_logprobs) {
            auto lp = list[i].initLogprob();
            lp.setTokenId(t.out.token);
            lp.setLogprob(t.out.logprob);
            auto top = lp.initTop(t.out.top.size());
            for (size_t j = 0; j < t.out.top.size(); ++j) {
              top[j].setTokenId(t.out.top[j].first);
              top[j].setLogprob(t.out.top[j].second);
            }
          }
        }
      }
      auto rs = r.initRankSeconds(per_rank.size());
      for (size_t i = 0; i < per_rank.size(); ++i) rs.set(i, per_rank[i]);
      r.setSampleSeconds(step.sample_seconds);
      SendResult(sock, msg);
    }
    if (shutdown) break;
  }
  running = false;
  if (heartbeat.joinable()) heartbeat.join();
  sock.close();
  MPI_Finalize();
  return exit_code;
}
