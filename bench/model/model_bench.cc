// The whole model on one GPU (CUDA backend): prefill tokens/s and decode tokens/s against their
// ceilings measured in the same run, and (optionally) greedy agreement with a transformers
// oracle file (bench/model/hf_midsize.py oracle).
//
//   mlaserve-model-bench --model DIR [--kv bf16,fp8_tiled] [--batches 1,8,64] [--context 1024]
//       [--prefill 2048,8192] [--steps 16] [--oracle FILE] [--graphs on,off]
//       [--deterministic off,on] [--phases on] [--programmatic off] [--fused-mla-input off]
//       [--moe-few-expert off] [--moe-few-expert-layer on] [--fused-prologues on]
//       [--programmatic-small off]
//       [--mla-q-fusion off] [--programmatic-dispatch off] [--shared-expert-overlap off]
//       [--programmatic-mla-combine off] [--mla-min-share N] [--mla-absorb-fusion off]
//       [--moe expert|tensor]
//   mlaserve-model-bench --synthetic-weights CONFIG_DIR [--seed S] [--rank R --ranks N] ...
//
// --synthetic-weights: the weights of a checkpoint of CONFIG_DIR's config.json (+
// hf_quant_config.json), generated while loading (worker/model/synthetic_checkpoint.h), e.g.
// bench/model/configs/kimi-k2.5 -- full-size models without their checkpoints. --rank R --ranks N
// (also with --model): this GPU loads rank R's shard of an N-rank deployment (heads, vocabulary,
// MLP slices and experts as N ranks split them) and runs it alone: the all-reduces and the logits
// gather are skipped, so the times are one rank's compute without its communication, and the
// logits are the rank's vocabulary slice (prompt tokens are drawn from that slice).
//
// --mpi on: one rank of an `mpirun -np N` job (issue 22; needs NCCL): rank R loads rank R's shard
// of the N-rank deployment on GPU local_rank % device count, the ranks run every step in lockstep
// and exchange activations through NcclCommunicator (and the one-shot all-reduce where
// MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES enables it), rank 0 prints, and every time is the slowest
// rank's. Prompt tokens span the whole vocabulary and the logits are the gathered whole rows.
// --dcp G: decode context parallelism in groups of G ranks (ModelOptions::dcp; each rank holds
// 1/G of the KV blocks). --multi-rank-graphs on (the default here; the worker's is off): decode
// steps captured into CUDA graphs with the collectives inside (ModelOptions::multi_rank_graphs);
// the decode lines say whether graphs were captured. --compare-single on: before the job loads,
// rank 0 loads the whole model alone (the same weights: synthetic weights depend only on the seed
// and the tensor's name) and decodes 3 prompts of 48 tokens plus 32 greedy tokens; the job then
// decodes the same, and the line "compare" gives the largest |logit difference| / max |logit| over
// every position where the two greedy sequences still agree, and how many greedy tokens agree
// (issue 22: logits against N = 1, greedy identical in bf16 KV). The whole model must fit on one
// GPU for it (cut the layers of a full-size config, e.g. 4 of Kimi-K2.5's).
//
// Decode roofline: the bytes a step must read (every non-expert weight once, but of the embedding
// table only the step's B rows; the routed experts the batch is expected to touch: E * (1 - (1 -
// k/E)^B) per MoE layer for uniform routing; the KV cache of every sequence in its format) over
// the device-to-device copy bandwidth measured here (bytes read + written per second: HBM's total
// rate, which a read-only stream does not exceed). Prefill ceiling: its GEMM FLOPs (2 x active
// parameters per token, plus attention's 2 x heads x (qk + v) x keys per query) over the bf16 GEMM
// rate measured here (an 8192^3 LinearGemm). Each figure is the median of the timed repetitions.
//
// --deterministic off,on runs every figure in each mode (ModelOptions::deterministic: batch-
// invariant kernels, every token's attention through the decode kernel), on the same loaded
// weights, so the mode's cost is a same-run ratio.
//
// --phases on: after each decode batch's timed steps, 3 more steps run eagerly with CUDA events
// at the model's phase boundaries (Ops::Phase: attention projections, MLA cache write + attention,
// o_proj, dense/shared MLP, router, routed experts, norms, lm_head, sampling) and the device time
// of each phase is printed (the mean of the 3 steps; eager, so launch gaps are inside them).
// Phase timing also brackets a profiler range: `ncu --profile-from-start off` sees those steps.
//
// CudaOps' decode-step optimisations can be switched for A/B runs, with CudaOps' defaults:
// --programmatic off: the skinny projections of batches of up to 4 rows launched
// without the programmatic dependency on the previous kernel (CudaOps::SetProgrammaticLaunch).
// --fused-mla-input off: MLA's latent norm, k RoPE and cache write as five ops, not one kernel
// (CudaOps::SetFusedMlaInput). --mla-fp8-tensor-cores off: the fp8 caches' MLA decode in the exact
// form, not on e4m3 tensor cores from 64 query rows (CudaOps::SetMlaFp8TensorCores).
// --moe-few-expert off: the routed experts' decode GEMMs always on the tile kernel, not the
// few-expert kernel where few experts are active (CudaOps::SetMoeFewExpert). --moe-few-expert-layer
// on: at 1-4 tokens the routed experts' layer as one fused launch where the few-expert kernel runs
// (CudaOps::SetMoeFewExpertLayer; off by default until measured). --fused-prologues on: the q_a
// norm with q_b and the shared expert's SiLU with its down projection as one skinny kernel each at
// batches of up to 4 (CudaOps::SetFusedPrologues; off by default).
// --programmatic-small off: the norms, RoPE, the fused MLA input, SiLU and the route kernel
// launched plainly, not programmatically dependent on the previous kernel (CudaOps::
// SetProgrammaticSmallKernels; on by default). --mla-q-fusion off: q's RoPE as its own kernel
// and copied into the absorbed q (a memcpy node) instead of rotated inside the fused MLA input
// kernel and read in place by the decode kernel (CudaOps::SetMlaQFusion; on by default).
// --programmatic-dispatch off: the routed experts' dispatch launched plainly (CudaOps::
// SetProgrammaticDispatch; on by default). --shared-expert-overlap off: the shared expert in
// line before the router instead of on a side stream beside the routed experts (CudaOps::
// SetSharedExpertOverlap; on by default, and off whenever --phases on times the phases).
// --programmatic-mla-combine off: the MLA decode's combine launched plainly (CudaOps::
// SetProgrammaticMlaCombine; on by default). --mla-absorb-fusion off: q's absorption by a cuBLASLt
// launch in the MLA decode instead of inside the fused MLA input kernel at decode steps of up
// to 4 rows (CudaOps::SetMlaAbsorbFusion; on by default). --moe-route-split off: the
// router's one-warp-a-token kernel at decode sizes instead of a block a token (CudaOps::
// SetMoeRouteSplit; on by default). --moe-route-dispatch-fusion off: the split router's kernel
// no longer does the routed experts' dispatch in one-token steps (CudaOps::
// SetMoeRouteDispatchFusion; on by default).
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "common/safetensors.h"
#include "kernels/linear/linear.h"
#include "worker/backend/cuda_ops.h"
#include "worker/comm/communicator.h"
#include "worker/comm/mpi_communicator.h"
#if MLASERVE_HAVE_NCCL
#include "worker/comm/nccl_communicator.h"
#endif
#include "worker/model/deepseek_v3.h"
#include "worker/model/synthetic_checkpoint.h"

ABSL_FLAG(std::string, model, "", "The checkpoint folder (or --synthetic-weights).");
ABSL_FLAG(
    std::string, synthetic_weights, "",
    "A folder with config.json (+ hf_quant_config.json): its weights are generated while loading.");
ABSL_FLAG(std::vector<std::string>, kv, std::vector<std::string>({"bf16", "fp8_tiled"}),
          "KV cache formats to run, comma-separated.");
ABSL_FLAG(mlaserve::IntList, batches, (mlaserve::IntList{{1, 8, 64}}),
          "Decode batch sizes, each in [1, 65536].");
ABSL_FLAG(mlaserve::IntList, prefill, (mlaserve::IntList{{2048, 8192}}),
          "Prefill lengths, each in [1, 16777216] (empty: none).");
ABSL_FLAG(int32_t, context, 1024, "Context of every decoding sequence, in [0, 16777216].");
ABSL_FLAG(int32_t, steps, 16, "Timed decode steps per batch, in [1, 1048576].");
ABSL_FLAG(std::string, oracle, "",
          "A transformers oracle file (bench/model/hf_midsize.py oracle): greedy agreement (needs "
          "--model).");
ABSL_FLAG(std::vector<std::string>, graphs, std::vector<std::string>({"on", "off"}),
          "CUDA graph modes to run: on, off or both.");
ABSL_FLAG(std::vector<std::string>, deterministic, std::vector<std::string>({"off"}),
          "Deterministic modes to run: off, on or both.");
ABSL_FLAG(mlaserve::OnOff, phases, mlaserve::OnOff{false},
          "Also time the model's phases with CUDA events.");
ABSL_FLAG(mlaserve::OnOff, programmatic, mlaserve::OnOff{true},
          "Launch the decode steps' skinny projections programmatically dependent on the previous "
          "kernel (CudaOps::SetProgrammaticLaunch).");
ABSL_FLAG(mlaserve::OnOff, fused_mla_input, mlaserve::OnOff{true},
          "Run MLA's input (latent norm, k RoPE, cache write) as one kernel "
          "(CudaOps::SetFusedMlaInput).");
ABSL_FLAG(mlaserve::OnOff, mla_fp8_tensor_cores, mlaserve::OnOff{true},
          "Run the fp8 caches' MLA decode on e4m3 tensor cores where the plan has such a kernel "
          "(from 64 query rows on SM90; CudaOps::SetMlaFp8TensorCores); off: the exact form.");
ABSL_FLAG(mlaserve::OnOff, fused_prologues, mlaserve::OnOff{false},
          "Run the q_a norm with q_b and the shared expert's SiLU with its down projection as one "
          "skinny kernel each at batches of up to 4 (CudaOps::SetFusedPrologues).");
ABSL_FLAG(mlaserve::OnOff, programmatic_small, mlaserve::OnOff{true},
          "Launch the norms, RoPE, the fused MLA input, SiLU and the route kernel programmatically "
          "dependent on the previous kernel (CudaOps::SetProgrammaticSmallKernels).");
ABSL_FLAG(mlaserve::OnOff, mla_q_fusion, mlaserve::OnOff{true},
          "Rotate q inside the fused MLA input kernel and let the decode kernel read its RoPE dims "
          "in place (CudaOps::SetMlaQFusion); off: a RoPE kernel and a copy.");
ABSL_FLAG(mlaserve::OnOff, mla_absorb_fusion, mlaserve::OnOff{true},
          "Absorb q (q_nope W_kb) inside the fused MLA input kernel at decode steps of up to 4 "
          "rows (CudaOps::SetMlaAbsorbFusion, the default); off: a cuBLASLt launch in the MLA "
          "decode.");
ABSL_FLAG(mlaserve::OnOff, moe_route_split, mlaserve::OnOff{true},
          "Route decode-size batches with a block of 4 warps a token (sigmoid routers with one "
          "expert group; CudaOps::SetMoeRouteSplit); off: one warp a token.");
ABSL_FLAG(mlaserve::OnOff, moe_route_dispatch_fusion, mlaserve::OnOff{true},
          "The router and the routed experts' dispatch as one kernel in one-token steps (needs "
          "--moe-route-split on; CudaOps::SetMoeRouteDispatchFusion); off: two launches.");
ABSL_FLAG(mlaserve::OnOff, programmatic_dispatch, mlaserve::OnOff{true},
          "Launch the routed experts' dispatch programmatically dependent on the router in decode "
          "batches (CudaOps::SetProgrammaticDispatch).");
ABSL_FLAG(mlaserve::OnOff, shared_expert_overlap, mlaserve::OnOff{true},
          "Run the shared expert on a side stream beside the router, the dispatch and the routed "
          "experts (CudaOps::SetSharedExpertOverlap; off with --phases on).");
ABSL_FLAG(mlaserve::OnOff, programmatic_mla_combine, mlaserve::OnOff{true},
          "Launch the MLA decode's combine programmatically dependent on its split kernel "
          "(CudaOps::SetProgrammaticMlaCombine).");
ABSL_FLAG(int32_t, mla_min_share, 0,
          "The MLA decode split's smallest share in 16-token units, 0..1024 (0: the kernels' "
          "rule, MlaBalancedShare; 4 forces the rule before session 13; "
          "CudaOps::SetMlaMinShare).");
ABSL_FLAG(int32_t, skinny_mma_rows, 0,
          "Projections of 5..N rows (N <= 16) on the skinny kernels' tensor-core variant; 0: "
          "cuBLASLt (CudaOps::SetSkinnyTensorCoreRows).");
ABSL_FLAG(int32_t, decode_gemm_rows, mlaserve::CudaOps::kDefaultDecodeGemmRows,
          "Projections of 5..N rows (N <= 64) on the split-K tensor-core decode GEMM; 0: cuBLASLt "
          "(CudaOps::SetDecodeGemmRows; the default is CudaOps').");
ABSL_FLAG(int32_t, merged_projection_rows, mlaserve::CudaOps::kDefaultMergedProjectionRows,
          "q_a with kv_a and the shared expert's gate with up as one product (and a split) at "
          "5..N rows (N <= 256); 0: one product each (CudaOps::SetMergedProjectionRows).");
ABSL_FLAG(int32_t, gemm_no_split_rows, 0,
          "cuBLASLt projections of at least N rows take an algorithm without split-K where the "
          "heuristic offers one; 0: the heuristic's first (CudaOps::SetGemmHeuristicChoice).");
ABSL_FLAG(int32_t, gemm_heuristic_rank, 0,
          "cuBLASLt projections take the heuristic's N-th usable algorithm, 0..15 "
          "(CudaOps::SetGemmHeuristicChoice).");
ABSL_FLAG(mlaserve::OnOff, moe_few_expert, mlaserve::OnOff{true},
          "The routed experts' decode GEMMs on the few-expert kernel where few experts are active "
          "(CudaOps::SetMoeFewExpert).");
ABSL_FLAG(mlaserve::OnOff, moe_few_expert_layer, mlaserve::OnOff{false},
          "Where the few-expert kernel runs a 1-4 token step: the routed experts' whole layer as "
          "one fused launch (CudaOps::SetMoeFewExpertLayer).");
ABSL_FLAG(mlaserve::OnOff, moe_wave_tail, mlaserve::OnOff{true},
          "Decode steps on the routed experts' tile kernel: the tiles of a last, mostly empty wave "
          "on the few-expert kernel (CudaOps::SetMoeWaveTail).");
ABSL_FLAG(mlaserve::OnOff, moe_prefill_wgmma, mlaserve::OnOff{true},
          "The NVFP4 / INT4 routed experts' prefill tiles on the SM90 wgmma kernel "
          "(CudaOps::SetMoePrefillWgmma).");
ABSL_FLAG(std::string, moe, "expert",
          "How the routed experts are split over --ranks: expert (whole experts a rank) or tensor "
          "(every expert's intermediate slice).");
ABSL_FLAG(int32_t, rank, 0, "Load this rank's shard of a --ranks N deployment, in [0, N).");
ABSL_FLAG(int32_t, ranks, 0, "The deployment's rank count, in [0, 65536] (0: the whole model).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the synthetic weights.");
ABSL_FLAG(mlaserve::OnOff, mpi, mlaserve::OnOff{false},
          "Run as one rank of an mpirun job: rank R loads shard R of N and the ranks exchange "
          "activations over NCCL (needs NCCL).");
ABSL_FLAG(int32_t, dcp, 1,
          "With --mpi on: decode context parallelism in groups of this many ranks.");
ABSL_FLAG(mlaserve::OnOff, multi_rank_graphs, mlaserve::OnOff{true},
          "With --mpi on: capture decode steps with their collectives into CUDA graphs "
          "(ModelOptions::multi_rank_graphs).");
ABSL_FLAG(mlaserve::OnOff, compare_single, mlaserve::OnOff{false},
          "With --mpi on: compare the job's logits and greedy tokens with the whole model on rank "
          "0 alone.");

namespace mlaserve {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Device-to-device copy bandwidth, bytes read + written per second.
double CopyBandwidth() {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  cudaMalloc(&a, bytes);
  cudaMalloc(&b, bytes);
  cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 2) t.push_back(ms * 1e-3);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / Median(t);
}

// bf16 GEMM rate through the backend's own GEMM path, on random-ish data (not zeros).
double GemmRate() {
  auto gemm = LinearGemm::Create();
  if (!gemm.ok()) return 0;
  const int64_t n = 8192;
  void *x = nullptr, *w = nullptr, *o = nullptr;
  cudaMalloc(&x, n * n * 2);
  cudaMalloc(&w, n * n * 2);
  cudaMalloc(&o, n * n * 2);
  std::vector<uint16_t> h(n * n);
  std::mt19937 rng(1);
  for (auto& v : h) v = static_cast<uint16_t>(0x3c00 + (rng() & 0x3ff)) ^ ((rng() & 1) << 15);
  cudaMemcpy(x, h.data(), n * n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(w, h.data(), n * n * 2, cudaMemcpyHostToDevice);
  LinearGemm::Args a;
  a.m = a.n = a.k = n;
  a.x = x;
  a.x_stride = n;
  a.w = w;
  a.alpha = 1e-4f;
  a.out = o;
  a.out_dtype = DType::kBF16;
  a.out_stride = n;
  std::vector<double> t;
  for (int i = 0; i < 8; ++i) {
    cudaDeviceSynchronize();
    const double t0 = Now();
    (void)(*gemm)->Run(a, nullptr);
    cudaDeviceSynchronize();
    if (i >= 2) t.push_back(Now() - t0);
  }
  cudaFree(x);
  cudaFree(w);
  cudaFree(o);
  return 2.0 * n * n * n / Median(t);
}

// Sequences [first, first + n) of a step batch, each with its own contiguous run of blocks.
struct Sequences {
  std::vector<std::vector<int32_t>> tables;
  std::vector<int> lengths;
};

StepBatch Step(Sequences& s, const std::vector<int>& which,
               const std::vector<std::vector<int32_t>>& tokens) {
  StepBatch b;
  for (size_t i = 0; i < which.size(); ++i) {
    const int q = which[i];
    SequenceSlice sl;
    sl.token_begin = static_cast<int>(b.tokens.size());
    sl.num_tokens = static_cast<int>(tokens[i].size());
    sl.context_len = s.lengths[q];
    sl.block_table = s.tables[q];
    for (size_t t = 0; t < tokens[i].size(); ++t) {
      const int pos = s.lengths[q] + static_cast<int>(t);
      b.tokens.push_back(tokens[i][t]);
      b.positions.push_back(pos);
      b.slots.push_back(int64_t{sl.block_table[pos / kKvBlockTokens]} * kKvBlockTokens +
                        pos % kKvBlockTokens);
    }
    b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
    b.seqs.push_back(std::move(sl));
    s.lengths[q] += static_cast<int>(tokens[i].size());
  }
  return b;
}

// The slowest rank's value in an MPI job (the value itself otherwise).
double MaxOverRanks(double v, bool mpi) {
  if (!mpi) return v;
  double m = v;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

// What --compare-single decodes: 3 prompts of kComparePrompt tokens (a fixed draw over the whole
// vocabulary), then kCompareSteps greedy tokens each, one sequence at a time; every position's
// logits row is kept.
constexpr int kComparePrompts = 3, kComparePrompt = 48, kCompareSteps = 32;
struct GreedyRun {
  std::vector<std::vector<int32_t>> tokens;             // [prompt][step]
  std::vector<std::vector<std::vector<float>>> logits;  // [prompt][step][vocab]
};

absl::StatusOr<GreedyRun> DecodeForCompare(DeepseekV3Model& m, int vocab) {
  GreedyRun run;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  for (int p = 0; p < kComparePrompts; ++p) {
    Sequences s;
    s.tables.emplace_back();
    for (int b = 0; b < (kComparePrompt + kCompareSteps + kKvBlockTokens) / kKvBlockTokens; ++b)
      s.tables[0].push_back(b);
    s.lengths.push_back(0);
    std::vector<int32_t> prompt(kComparePrompt);
    for (auto& x : prompt) x = tok(rng);
    run.tokens.emplace_back();
    run.logits.emplace_back();
    std::vector<int32_t> feed = prompt;
    for (int step = 0; step < kCompareSteps; ++step) {
      std::vector<float> logits;
      if (auto st = m.Forward(Step(s, {0}, {feed}), &logits); !st.ok()) return st;
      if (logits.size() != static_cast<size_t>(vocab)) {
        return absl::InternalError("compare: the logits row is not the whole vocabulary");
      }
      const int32_t g =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      run.tokens.back().push_back(g);
      run.logits.back().push_back(std::move(logits));
      feed = {g};
    }
  }
  return run;
}

// Each value of a list of on/off modes (--graphs on,off), checked.
std::vector<std::string> Modes(const absl::Flag<std::vector<std::string>>& flag) {
  std::vector<std::string> modes = absl::GetFlag(flag);
  for (const std::string& m : modes) {
    if (m != "on" && m != "off")
      UsageError(FlagName(flag) + " " + m + ": each mode must be on or off");
  }
  return modes;
}

int Run(int argc, char** argv) {
  ParseFlags(argc, argv,
             "mlaserve-model-bench (--model DIR | --synthetic-weights CONFIG_DIR) [flags]");
  const std::string model_dir = absl::GetFlag(FLAGS_model), oracle = absl::GetFlag(FLAGS_oracle);
  const std::string synthetic_dir = absl::GetFlag(FLAGS_synthetic_weights);
  const int shard_world = FlagInRange(FLAGS_ranks, 0, 1 << 16);
  const int shard_rank = FlagInRange(FLAGS_rank, 0, 1 << 16);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const std::vector<std::string> kvs = absl::GetFlag(FLAGS_kv);
  const std::vector<int> batches = FlagIntsInRange(FLAGS_batches, 1, 1 << 16);
  const std::vector<int> prefills =
      FlagIntsInRange(FLAGS_prefill, 1, 1 << 24, /*allow_empty=*/true);
  const int context = FlagInRange(FLAGS_context, 0, 1 << 24);
  const int steps = FlagInRange(FLAGS_steps, 1, 1 << 20);
  const std::vector<std::string> graph_modes = Modes(FLAGS_graphs);
  const std::vector<std::string> det_modes = Modes(FLAGS_deterministic);
  const bool phases = absl::GetFlag(FLAGS_phases).on;
  const std::string moe = absl::GetFlag(FLAGS_moe);
  if (moe != "expert" && moe != "tensor") UsageError("--moe " + moe + ": expert or tensor");
  const bool moe_tensor = moe == "tensor";
  if (model_dir.empty() == synthetic_dir.empty()) {
    UsageError("one of --model DIR and --synthetic-weights CONFIG_DIR is required");
  }
  if (!synthetic_dir.empty() && !oracle.empty())
    UsageError("--oracle needs the real weights (--model)");
  if (shard_world > 0 && shard_rank >= shard_world) UsageError("--rank must be in [0, --ranks)");
  const bool mpi = absl::GetFlag(FLAGS_mpi).on;
  const int dcp = FlagInRange(FLAGS_dcp, 1, 1 << 16);
  const bool compare_single = absl::GetFlag(FLAGS_compare_single).on;
  if (!mpi && (dcp > 1 || compare_single)) UsageError("--dcp and --compare-single need --mpi on");
  if (mpi && shard_world > 0) UsageError("--rank / --ranks and --mpi on exclude each other");
  int world_rank = 0, world_size = 1;
  if (mpi) {
#if !MLASERVE_HAVE_NCCL
    UsageError("--mpi on needs NCCL, which this build has not found");
#endif
    MPI_Init(&argc, &argv);
    FinalizeMpiAtExit();
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (world_size % dcp != 0) UsageError("--dcp must divide the number of ranks");
    const int local_rank = RanksOnHost(MPI_COMM_WORLD).rank;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
        cudaSetDevice(local_rank % devices) != cudaSuccess) {
      std::fprintf(stderr, "rank %d: no usable CUDA device\n", world_rank);
      return 1;
    }
    // Rank 0 speaks for the job; the others' errors still reach stderr.
    if (world_rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  }
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  const double bw = CopyBandwidth();
  const double rate = GemmRate();
  std::printf("device %s: copy bandwidth %.0f GB/s, bf16 GEMM %.0f TFLOP/s (measured here)\n",
              prop.name, bw / 1e9, rate / 1e12);
  if (mpi) {
    std::printf(
        "mpi: %d ranks, one GPU each, NCCL between them; decode context parallelism in "
        "groups of %d; multi-rank graphs %s; times are the slowest rank's\n",
        world_size, dcp, absl::GetFlag(FLAGS_multi_rank_graphs).on ? "on" : "off");
  }
  auto config = LoadModelConfig(synthetic_dir.empty() ? model_dir : synthetic_dir);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = *config;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_prefill =
      prefills.empty() ? 0 : *std::max_element(prefills.begin(), prefills.end());
  const int per_seq_blocks =
      (std::max(context + steps + 64, 0) + kKvBlockTokens - 1) / kKvBlockTokens;
  const int blocks =
      max_batch * per_seq_blocks + (max_prefill + kKvBlockTokens) / kKvBlockTokens + 2;
  // With decode context parallelism a rank holds 1/dcp of the blocks (block g on rank g % dcp).
  const int rank_blocks = (blocks + dcp - 1) / dcp;
  for (const std::string& kv : kvs) {
    auto fmt = ParseKvCacheFormat(kv);
    if (!fmt.ok()) return 2;
    auto ops = CudaOps::Create();
    if (!ops.ok()) {
      std::fprintf(stderr, "%s\n", std::string(ops.status().message()).c_str());
      return 1;
    }
    (*ops)->SetProgrammaticLaunch(absl::GetFlag(FLAGS_programmatic).on);
    (*ops)->SetFusedMlaInput(absl::GetFlag(FLAGS_fused_mla_input).on);
    (*ops)->SetMlaFp8TensorCores(absl::GetFlag(FLAGS_mla_fp8_tensor_cores).on);
    (*ops)->SetMoeFewExpert(absl::GetFlag(FLAGS_moe_few_expert).on);
    (*ops)->SetMoeFewExpertLayer(absl::GetFlag(FLAGS_moe_few_expert_layer).on);
    (*ops)->SetMoeWaveTail(absl::GetFlag(FLAGS_moe_wave_tail).on);
    (*ops)->SetSkinnyTensorCoreRows(FlagInRange(FLAGS_skinny_mma_rows, 0, 16));
    (*ops)->SetDecodeGemmRows(FlagInRange(FLAGS_decode_gemm_rows, 0, 64));
    (*ops)->SetMergedProjectionRows(FlagInRange(FLAGS_merged_projection_rows, 0, 256));
    (*ops)->SetGemmHeuristicChoice(FlagInRange(FLAGS_gemm_heuristic_rank, 0, 15),
                                   FlagInRange(FLAGS_gemm_no_split_rows, 0, 1 << 20));
    (*ops)->SetMoePrefillWgmma(absl::GetFlag(FLAGS_moe_prefill_wgmma).on);
    (*ops)->SetFusedPrologues(absl::GetFlag(FLAGS_fused_prologues).on);
    (*ops)->SetProgrammaticSmallKernels(absl::GetFlag(FLAGS_programmatic_small).on);
    (*ops)->SetMlaQFusion(absl::GetFlag(FLAGS_mla_q_fusion).on);
    (*ops)->SetMlaAbsorbFusion(absl::GetFlag(FLAGS_mla_absorb_fusion).on);
    (*ops)->SetMoeRouteSplit(absl::GetFlag(FLAGS_moe_route_split).on);
    (*ops)->SetMoeRouteDispatchFusion(absl::GetFlag(FLAGS_moe_route_dispatch_fusion).on);
    (*ops)->SetProgrammaticDispatch(absl::GetFlag(FLAGS_programmatic_dispatch).on);
    (*ops)->SetSharedExpertOverlap(absl::GetFlag(FLAGS_shared_expert_overlap).on);
    (*ops)->SetProgrammaticMlaCombine(absl::GetFlag(FLAGS_programmatic_mla_combine).on);
    (*ops)->SetMlaMinShare(FlagInRange(FLAGS_mla_min_share, 0, 1024));
    SingleRankCommunicator single;
    ModelOptions o;
    o.kv_format = *fmt;
    o.num_kv_blocks = mpi ? rank_blocks : blocks;
    o.shard_rank = shard_rank;
    o.shard_world = shard_world;
    o.moe = moe_tensor ? MoeParallelism::kTensor : MoeParallelism::kExpert;
    // Loads the model of options `opts` over `comm` (synthetic weights, a checkpoint's shard or
    // the whole checkpoint).
    std::unique_ptr<SyntheticCheckpoint> synthetic;
    auto load = [&](const ModelOptions& opts, Ops& ops_ref,
                    Communicator& with) -> absl::StatusOr<std::unique_ptr<DeepseekV3Model>> {
      if (!synthetic_dir.empty()) {
        SyntheticCheckpointOptions so;
        so.seed = seed;
        synthetic = std::make_unique<SyntheticCheckpoint>(c, so);
        return DeepseekV3Model::Load(*synthetic, c, opts, ops_ref, with);
      }
      if (opts.shard_world > 0) {
        auto ckpt = Checkpoint::Open(model_dir);
        if (!ckpt.ok()) return ckpt.status();
        return DeepseekV3Model::Load(*ckpt, c, opts, ops_ref, with);
      }
      return DeepseekV3Model::Load(model_dir, opts, ops_ref, with);
    };
    // --compare-single: rank 0 decodes with the whole model alone first (then frees it).
    absl::StatusOr<GreedyRun> single_run = absl::UnknownError("not run");
    if (compare_single) {
      if (world_rank == 0) {
        auto whole_ops = CudaOps::Create();
        if (!whole_ops.ok()) return 1;
        ModelOptions whole = o;
        whole.num_kv_blocks = (kComparePrompt + kCompareSteps) / kKvBlockTokens + 2;
        auto whole_model = load(whole, **whole_ops, single);
        if (!whole_model.ok()) {
          std::fprintf(stderr, "compare: loading the whole model on one GPU: %s\n",
                       std::string(whole_model.status().message()).c_str());
          return 1;
        }
        synthetic.reset();
        single_run = DecodeForCompare(**whole_model, c.vocab_size);
        if (!single_run.ok()) {
          std::fprintf(stderr, "compare: %s\n", std::string(single_run.status().message()).c_str());
          return 1;
        }
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
    std::unique_ptr<Communicator> job_comm;
    Communicator* comm = &single;
#if MLASERVE_HAVE_NCCL
    if (mpi) {
      o.dcp = dcp;
      o.multi_rank_graphs = absl::GetFlag(FLAGS_multi_rank_graphs).on;
      auto nccl = NcclCommunicator::Create(MPI_COMM_WORLD, (*ops)->stream());
      if (!nccl.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", world_rank,
                     std::string(nccl.status().message()).c_str());
        return 1;
      }
      std::printf("kv %s: NCCL communicator of %d ranks; one-shot all-reduce %s\n", kv.c_str(),
                  (*nccl)->size(),
                  (*nccl)->one_shot_max_bytes() > 0
                      ? ("up to " + std::to_string((*nccl)->one_shot_max_bytes()) + " B").c_str()
                      : "off");
      job_comm = *std::move(nccl);
      comm = job_comm.get();
    }
#endif
    const double t_load = Now();
    absl::StatusOr<std::unique_ptr<DeepseekV3Model>> model = load(o, **ops, *comm);
    if (!model.ok()) {
      std::fprintf(stderr, "load: %s\n", std::string(model.status().message()).c_str());
      return 1;
    }
    const double load_s = Now() - t_load;
    if (synthetic != nullptr) {
      std::printf("synthetic weights of %s (seed %llu, %.1f GB for the whole model): generated "
                  "%.1f GB for this shard, %.1f GB/s including the upload\n",
                  synthetic_dir.c_str(), static_cast<unsigned long long>(seed),
                  synthetic->total_bytes() / 1e9, synthetic->generated_bytes() / 1e9,
                  synthetic->generated_bytes() / 1e9 / load_s);
      synthetic.reset();  // the generator's last tensors (up to a few GB of host memory)
    }
    DeepseekV3Model& m = **model;
    const double weights = static_cast<double>(m.weight_bytes());
    const double experts = static_cast<double>(m.expert_bytes());
    // The embedding table is gathered, not multiplied: a step reads its tokens' rows only (before
    // session 38 the decode roofline counted the rank's whole slice, 2.35 GB / ranks for Kimi-K2.5,
    // and the prefill ceiling its parameters' FLOPs).
    const double embedding = static_cast<double>(m.embedding_bytes());
    int moe_layers = 0;
    for (int l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.IsMoeLayer(l);
    const ShardRange vocab = m.vocab_shard();
    std::printf(
        "kv %s: rank %d of %d loaded in %.1f s, weights %.2f GB (routed experts %.2f GB), "
        "%d heads, %d experts, KV %d blocks\n",
        kv.c_str(), mpi ? world_rank : shard_rank, mpi ? world_size : std::max(shard_world, 1),
        load_s, weights / 1e9, experts / 1e9, m.heads_shard().count, m.experts_shard().count,
        o.num_kv_blocks);
    if (compare_single) {
      auto job_run = DecodeForCompare(m, c.vocab_size);
      if (!job_run.ok()) {
        std::fprintf(stderr, "rank %d: compare: %s\n", world_rank,
                     std::string(job_run.status().message()).c_str());
        return 1;
      }
      if (world_rank == 0) {
        // Over the positions where both greedy sequences still agree (after a difference the two
        // decode different text).
        double worst = 0;
        int agree = 0, total = 0;
        for (int p = 0; p < kComparePrompts; ++p) {
          bool same = true;
          for (int step = 0; step < kCompareSteps; ++step) {
            ++total;
            if (!same) continue;
            const auto& a = single_run->logits[p][step];
            const auto& b = job_run->logits[p][step];
            double max_abs = 0, diff = 0;
            for (size_t j = 0; j < a.size(); ++j) {
              max_abs = std::max(max_abs, std::fabs(double(a[j])));
              diff = std::max(diff, std::fabs(double(a[j]) - b[j]));
            }
            worst = std::max(worst, diff / std::max(max_abs, 1e-30));
            same = single_run->tokens[p][step] == job_run->tokens[p][step];
            agree += same;
          }
        }
        std::printf(
            "compare kv=%s: %d ranks against the whole model on one GPU: greedy %d of %d "
            "tokens identical; max |logit difference| / max |logit| %.3g (positions up to "
            "each prompt's first greedy difference)\n",
            kv.c_str(), world_size, agree, total, worst);
      }
    }
    std::mt19937 rng(7);
    // Prompt tokens: the rank's vocabulary slice when it runs alone (other tokens embed to zeros
    // there), the whole vocabulary in an MPI job (the embedding's partial rows are all-reduced).
    const int token_base = mpi ? 0 : vocab.begin;
    std::uniform_int_distribution<int> tok(token_base,
                                           mpi ? c.vocab_size - 1 : vocab.begin + vocab.count - 1);
    for (const std::string& det : det_modes) {
    if (auto st = m.set_deterministic(det == "on"); !st.ok()) {
      std::fprintf(stderr, "deterministic %s: %s\n", det.c_str(), std::string(st.message()).c_str());
      return 1;
    }
    // Prefill: one sequence of P tokens in one step.
    for (int P : prefills) {
      std::vector<double> t;
      for (int rep = 0; rep < 3; ++rep) {
        Sequences s;
        s.tables.push_back({});
        for (int b = 0; b < (P + kKvBlockTokens - 1) / kKvBlockTokens; ++b)
          s.tables[0].push_back(b);
        s.lengths.push_back(0);
        std::vector<int32_t> ids(P);
        for (auto& x : ids) x = tok(rng);
        StepBatch b = Step(s, {0}, {ids});
        const double t0 = Now();
        auto logits = m.Forward(b);
        if (!logits.ok() || !(*ops)->Synchronize().ok()) {
          std::fprintf(
              stderr, "prefill %d failed: %s\n", P,
              std::string(logits.ok() ? (*ops)->Synchronize().message() : logits.status().message())
                  .c_str());
          return 1;
        }
        if (rep > 0) t.push_back(Now() - t0);
      }
      const double sec = MaxOverRanks(Median(t), mpi);
      const double active = (weights - experts - embedding) / 2 +
                            experts / 2 * c.num_experts_per_tok / std::max(c.n_routed_experts, 1);
      const double attn = 2.0 * m.heads_shard().count * (c.qk_head_dim() + c.v_head_dim) * P / 2.0 *
                          c.num_hidden_layers;
      const double flops = (2.0 * active + attn) * P;
      std::printf(
          "prefill kv=%s det=%s tokens=%d: %.1f ms, %.0f tok/s, %.0f TFLOP/s = %.2f of the GEMM "
          "rate\n",
          kv.c_str(), det.c_str(), P, sec * 1e3, P / sec, flops / sec / 1e12, flops / sec / rate);
    }
    // Decode: B sequences of `context` tokens (filled first), then `steps` greedy steps, with
    // the steps replayed as CUDA graphs and run eagerly (the launch time graphs save).
    for (const std::string& graphs : graph_modes)
      for (int B : batches) {
        m.set_graphs(graphs == "on");
        Sequences s;
        for (int q = 0; q < B; ++q) {
          s.tables.emplace_back();
          for (int b = 0; b < per_seq_blocks; ++b)
            s.tables.back().push_back(q * per_seq_blocks + b);
          s.lengths.push_back(0);
        }
        // Fill the caches in chunks of up to 8 sequences and 32k tokens (a prefill's scratch
        // grows with its tokens: 8 x 32k at once did not fit beside a 24-layer Kimi slice's
        // 58 GB cache, and the MoE takes at most 65,535 tokens a call).
        const int fill_seqs = std::clamp(32768 / std::max(context, 1), 1, 8);
        for (int q0 = 0; q0 < B; q0 += fill_seqs) {
          std::vector<int> which;
          std::vector<std::vector<int32_t>> toks;
          for (int q = q0; q < std::min(B, q0 + fill_seqs); ++q) {
            which.push_back(q);
            toks.emplace_back(context);
            for (auto& x : toks.back()) x = tok(rng);
          }
          auto l = m.Forward(Step(s, which, toks));
          const absl::Status st = l.ok() ? (*ops)->Synchronize() : l.status();
          if (!st.ok()) {
            std::fprintf(stderr, "fill failed: %s\n", std::string(st.message()).c_str());
            return 1;
          }
        }
        std::vector<int> all(B);
        for (int q = 0; q < B; ++q) all[q] = q;
        std::vector<std::vector<int32_t>> next(B, std::vector<int32_t>(1, token_base));
        SequenceSampling greedy;
        std::vector<int32_t> hist;
        SamplingBatch sb;
        for (int q = 0; q < B; ++q) sb.rows.push_back({&greedy, &hist, 0, 0});
        std::vector<double> t;
        for (int step = 0; step < steps + 2; ++step) {
          const double t0 = Now();
          StepBatch b = Step(s, all, next);
          auto logits = m.Forward(b);
          std::vector<SampledOutput> out;
          absl::Status st = logits.ok() ? (*ops)->Sample(*logits, sb, &out) : logits.status();
          if (!st.ok()) {
            std::fprintf(stderr, "decode failed: %s\n", std::string(st.message()).c_str());
            return 1;
          }
          for (int q = 0; q < B; ++q) next[q][0] = token_base + out[q].token;
          if (step >= 2) t.push_back(Now() - t0);
        }
        const double sec = MaxOverRanks(Median(t), mpi);
        const int captured = m.captured_graphs();
        if (phases) {
          m.set_graphs(false);
          (*ops)->SetPhaseTiming(true);
          std::vector<std::pair<std::string, double>> sum;
          for (int rep = 0; rep < 3; ++rep) {
            auto logits = m.Forward(Step(s, all, next));
            (*ops)->Phase("sample");
            std::vector<SampledOutput> out;
            absl::Status st = logits.ok() ? (*ops)->Sample(*logits, sb, &out) : logits.status();
            if (!st.ok()) return 1;
            for (int q = 0; q < B; ++q) next[q][0] = token_base + out[q].token;
            for (const auto& [name, ms] : (*ops)->PhaseTimes()) {
              auto it = std::find_if(sum.begin(), sum.end(), [&](const auto& p) { return p.first == name; });
              if (it == sum.end()) sum.push_back({name, ms / 3});
              else it->second += ms / 3;
            }
          }
          (*ops)->SetPhaseTiming(false);
          double total = 0;
          std::string line;
          for (const auto& [name, ms] : sum) {
            total += ms;
            line += " " + name + " " + std::to_string(ms).substr(0, 6);
          }
          std::printf("phases kv=%s det=%s batch=%d (eager, ms):%s | total %.2f\n", kv.c_str(),
                      det.c_str(), B, line.c_str(), total);
          m.set_graphs(graphs == "on");
        }
        const double E = std::max(c.n_routed_experts, 1), k = c.num_experts_per_tok;
        const double touched = moe_layers > 0 ? E * (1 - std::pow(1 - k / E, B)) / E : 0;
        // Each rank reads the whole cache of its heads' latent, or 1/dcp of it under decode
        // context parallelism.
        const double kv_bytes = double(B) * (context + steps / 2) * c.num_hidden_layers *
                                KvCacheBytesPerToken(*fmt) / dcp;
        const double dense = weights - experts - embedding + double(B) * c.hidden_size * 2;
        const double bytes = dense + experts * touched + kv_bytes;
        // HBM moves about the same bytes per second whichever way they go: the copy's read +
        // write rate is also the ceiling of a read-only step.
        const double floor = bytes / bw;
        std::printf(
            "decode kv=%s det=%s graphs=%s%s batch=%d context=%d: step %.2f ms, %.0f tok/s "
            "(%.1f a user); reads %.2f GB (weights %.2f, experts %.2f, KV %.3f) -> roofline %.2f "
            "ms, ratio %.2f\n",
            kv.c_str(), det.c_str(), graphs.c_str(),
            graphs == "on" && captured == 0 ? " (none captured: ran eagerly)" : "", B, context,
            sec * 1e3, B / sec, 1 / sec, bytes / 1e9, dense / 1e9, experts * touched / 1e9,
            kv_bytes / 1e9, floor * 1e3, sec / floor);
      }
    }  // det_modes
    if (auto st = m.set_deterministic(false); !st.ok()) return 1;
    // Greedy agreement with transformers (bf16 weights, bf16 KV cache on both sides).
    if (!oracle.empty()) {
      auto file = SafetensorsFile::Open(oracle);
      if (!file.ok()) {
        std::fprintf(stderr, "oracle: %s\n", std::string(file.status().message()).c_str());
        return 1;
      }
      auto read = [&](const char* name) {
        const TensorInfo* ti = (*file)->Find(name);
        std::vector<uint8_t> bytes;
        if (ti != nullptr) {
          auto d = (*file)->Data(*ti);
          bytes.assign(d.begin(), d.end());
        }
        return bytes;
      };
      auto as_i32 = [](const std::vector<uint8_t>& b) {
        std::vector<int32_t> v(b.size() / 4);
        std::memcpy(v.data(), b.data(), b.size());
        return v;
      };
      const std::vector<int32_t> prompt = as_i32(read("prompt")), want = as_i32(read("greedy"));
      const std::vector<uint8_t> lb = read("greedy_logits");
      std::vector<float> ref(lb.size() / 4);
      std::memcpy(ref.data(), lb.data(), lb.size());
      Sequences s;
      s.tables.emplace_back();
      const int need =
          (static_cast<int>(prompt.size() + want.size()) + kKvBlockTokens) / kKvBlockTokens;
      for (int b = 0; b < need; ++b) s.tables[0].push_back(b);
      s.lengths.push_back(0);
      std::vector<float> logits;
      if (!m.Forward(Step(s, {0}, {prompt}), &logits).ok()) return 1;
      int first_diff = -1, top1 = 0;
      double dot = 0, n1 = 0, n2 = 0;
      const int V = c.vocab_size;
      for (size_t i = 0; i < want.size(); ++i) {
        const int32_t g =
            static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        if (g == want[i])
          ++top1;
        else if (first_diff < 0)
          first_diff = static_cast<int>(i);
        if (ref.size() >= (i + 1) * V) {
          for (int j = 0; j < V; ++j) {
            dot += double(logits[j]) * ref[i * V + j];
            n1 += double(logits[j]) * logits[j];
            n2 += double(ref[i * V + j]) * ref[i * V + j];
          }
        }
        // Teacher-forced with transformers' token.
        if (!m.Forward(Step(s, {0}, {{want[i]}}), &logits).ok()) return 1;
      }
      std::printf(
          "oracle kv=%s: greedy %d of %zu tokens equal to transformers' (first difference at "
          "%d), logit cosine %.5f\n",
          kv.c_str(), top1, want.size(), first_diff, dot / std::sqrt(n1 * n2));
    }
  }
  return 0;
}

}  // namespace
}  // namespace mlaserve

int main(int argc, char** argv) {
  // Line by line, so that a run cut short by a time limit still shows what it measured.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  return mlaserve::Run(argc, argv);
}
