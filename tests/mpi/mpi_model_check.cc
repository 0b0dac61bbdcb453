// Runs under `mpirun -np N`: every rank loads its shard of a fixture model and the job checks
// the logits of the fixture's prompts and its greedy continuation against transformers' golden
// outputs. Prints "[mpi] ..." lines on rank 0 and exits 0 only when everything agrees.
//
//   mpi_model_check --model DIR [--moe expert|tensor] [--kv f32|bf16|fp8|fp8_tiled]
//                   [--fail-rank R] [--crash-rank R] [--dcp N]
// --dcp N (decode context parallelism, groups of N ranks): besides the golden checks (f32 cache:
// the cache is read back at every position, so only the lossless format can match transformers),
// every rank also loads the whole model alone (one rank, the same per-token attention over the
// same cache format) and the job's logits must equal that single rank's at every position of the
// three prompts, whole and in chunks of 5, and their greedy continuations of 64 tokens must be
// identical. Tolerance (max |difference| / max |logit|): f32 2e-5 (fp32 sums in another order:
// the heads' o_proj partial sums and the log-sum-exp merge of the ranks' partial attention
// outputs; measured 2-5e-6). A lossy cache turns that ~1e-6 noise into whole rounding steps
// where a cached value sits near a boundary (bf16: 2^-8 of the value; e4m3: 2^-3, and a tile
// scale of fp8_tiled may flip too), and the logits move by about as much relative to their
// scale: bound 2^-8 for bf16, 2^-3 for fp8 and fp8_tiled (measured 6e-4, 1e-4, 5.7e-2). The
// greedy identity is the check that holds every format to the same standard.
// --fail-rank makes rank R fail to load (the job must stop with "rank R: ..."); --crash-rank
// makes rank R abort before the first step (the job must end, not hang).
#include <mpi.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"
#include "worker/comm/mpi_communicator.h"
#include "worker/model/local_session.h"

ABSL_FLAG(std::string, model, "",
          "The fixture model folder (tests/fixtures/models/...); required.");
ABSL_FLAG(std::string, moe, "expert", "MoE parallelism: expert or tensor.");
ABSL_FLAG(std::string, kv, "f32", "KV cache format: f32, bf16, fp8 or fp8_tiled.");
ABSL_FLAG(int32_t, fail_rank, -1, "This rank fails to load (-1: none).");
ABSL_FLAG(int32_t, crash_rank, -1, "This rank aborts before the first step (-1: none).");
ABSL_FLAG(int32_t, dcp, 1,
          "Decode context parallelism: groups of N ranks split the cache, N in [1, 64].");

namespace {

int Finish(int code) {
  MPI_Finalize();
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  MPI_Init(&argc, &argv);
  // A usage error: every rank exits 2, rank 0 says why.
  FinalizeMpiAtExit();
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  ParseFlags(argc, argv, "mpirun -np N mpi_model_check --model DIR [flags]", world_rank != 0);
  const std::string model_dir = RequiredFlag(FLAGS_model, "DIR");
  const std::string moe = FlagOneOf(FLAGS_moe, {"expert", "tensor"});
  const std::string kv = absl::GetFlag(FLAGS_kv);
  const int fail_rank = FlagInRange(FLAGS_fail_rank, -1, 1 << 16);
  const int crash_rank = FlagInRange(FLAGS_crash_rank, -1, 1 << 16);
  const int dcp = FlagInRange(FLAGS_dcp, 1, 64);
  MpiCommunicator comm;
  const int rank = comm.rank(), world = comm.size();
  CpuOps ops(1);
  ModelOptions options;
  options.num_kv_blocks = 4;
  options.moe = moe == "tensor" ? MoeParallelism::kTensor : MoeParallelism::kExpert;
  options.dcp = dcp;
  auto format = ParseKvCacheFormat(kv);
  if (format.ok()) options.kv_format = *format;
  absl::StatusOr<std::unique_ptr<DeepseekV3Model>> model =
      rank == fail_rank ? absl::InvalidArgumentError("injected load failure (--fail-rank)")
      : !format.ok()    ? absl::StatusOr<std::unique_ptr<DeepseekV3Model>>(format.status())
                        : DeepseekV3Model::Load(model_dir, options, ops, comm);
  absl::Status agreed = comm.AgreeOnStatus(model.status());
  if (!agreed.ok()) {
    if (rank == 0) std::fprintf(stderr, "mpi_model_check: %s\n", std::string(agreed.message()).c_str());
    return Finish(3);
  }
  if (rank == crash_rank) {
    std::fprintf(stderr, "mpi_model_check: rank %d aborting (--crash-rank)\n", rank);
    std::abort();
  }
  Golden golden(model_dir);
  if (!golden.ok()) {
    if (rank == 0) std::fprintf(stderr, "mpi_model_check: no golden.safetensors in %s\n", model_dir.c_str());
    return Finish(3);
  }
  bool ok = true;
  LocalSession session(**model);
  double worst = 0;
  for (int p = 0; p < 3; ++p) {
    const auto ids = golden.Get<int32_t>("p" + std::to_string(p) + ".ids");
    const auto ref = golden.Get<float>("p" + std::to_string(p) + ".logits");
    session.Reset();
    auto logits = session.Feed(ids, true);
    if (!logits.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, std::string(logits.status().message()).c_str());
      return Finish(4);
    }
    worst = std::max(worst, CompareLogits(*logits, ref).Relative());
  }
  const auto want = golden.Get<int32_t>("p2.greedy");
  auto got = session.Generate(golden.Get<int32_t>("p2.ids"), static_cast<int>(want.size()),
                              SamplingRefParams{}, /*ignore_eos=*/true);
  if (!got.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, std::string(got.status().message()).c_str());
    return Finish(4);
  }
  // Only the paged decode in the lossless format must reproduce the oracle's tokens exactly.
  const bool greedy_ok = *got == want;
  if (options.kv_format == KvCacheFormat::kF32) ok = ok && greedy_ok;
  // DCP reads every position through the cache: against transformers only in f32.
  if (dcp == 1 || options.kv_format == KvCacheFormat::kF32) ok = ok && worst <= 1e-4;
  if (dcp > 1) {
    // The same model on one rank, with the same per-token attention over the same format.
    SingleRankCommunicator alone_comm;
    CpuOps alone_ops(1);
    ModelOptions alone_options = options;
    alone_options.dcp = 1;
    alone_options.deterministic = true;
    alone_options.num_kv_blocks = options.num_kv_blocks * dcp;
    auto alone = DeepseekV3Model::Load(model_dir, alone_options, alone_ops, alone_comm);
    if (!alone.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, std::string(alone.status().message()).c_str());
      return Finish(4);
    }
    LocalSession mine(**model), theirs(**alone);
    double dcp_worst = 0;
    for (int p = 0; p < 3; ++p) {
      const auto ids = golden.Get<int32_t>("p" + std::to_string(p) + ".ids");
      for (int chunk : {0, 5}) {
        mine.Reset();
        theirs.Reset();
        auto a = mine.Feed(ids, true, chunk);
        auto b = theirs.Feed(ids, true, chunk);
        if (!a.ok() || !b.ok()) {
          std::fprintf(stderr, "rank %d: DCP check failed to run\n", rank);
          return Finish(4);
        }
        dcp_worst = std::max(dcp_worst, CompareLogits(*a, *b).Relative());
      }
    }
    const auto prompt = golden.Get<int32_t>("p2.ids");
    auto ga = mine.Generate(prompt, 64, SamplingRefParams{}, /*ignore_eos=*/true);
    auto gb = theirs.Generate(prompt, 64, SamplingRefParams{}, /*ignore_eos=*/true);
    const bool dcp_greedy = ga.ok() && gb.ok() && *ga == *gb && ga->size() == 64;
    const double bound = options.kv_format == KvCacheFormat::kF32    ? 2e-5
                         : options.kv_format == KvCacheFormat::kBf16 ? 1.0 / 256
                                                                     : 1.0 / 8;
    ok = ok && dcp_worst <= bound && dcp_greedy;
    if (rank == 0) {
      std::printf(
          "[mpi] N=%d dcp=%d kv=%s: against one rank: max relative %.3g (bound %.3g), greedy 64 "
          "%s\n",
          world, dcp, kv.c_str(), dcp_worst, bound, dcp_greedy ? "identical" : "differs");
    }
  }
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  const double rss_mib = usage.ru_maxrss / 1024.0;  // ru_maxrss is in KiB on Linux
  const double weights_mib = (*model)->weight_bytes() / 1048576.0;
  std::vector<double> all_rss(world), all_weights(world);
  MPI_Gather(&rss_mib, 1, MPI_DOUBLE, all_rss.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(&weights_mib, 1, MPI_DOUBLE, all_weights.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  int all_ok = ok ? 1 : 0, every_ok = 0;
  MPI_Allreduce(&all_ok, &every_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("[mpi] N=%d moe=%s kv=%s: prefill max relative %.3g, greedy %s\n", world, moe.c_str(),
                kv.c_str(), worst, greedy_ok ? "identical" : "differs");
    for (int r = 0; r < world; ++r) {
      std::printf("[mpi] N=%d rank %d: peak RSS %.1f MiB, weights %.2f MiB\n", world, r, all_rss[r],
                  all_weights[r]);
    }
  }
  return Finish(every_ok ? 0 : 5);
}
