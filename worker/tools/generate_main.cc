// mlaserve-generate: loads a checkpoint folder on the CPU backend and continues a prompt.
//
//   mlaserve-generate --model DIR (--ids 1,2,3 | --prompt TEXT) [--max-tokens N]
//                     [--temperature T --top-p P --top-k K --seed S] [--kv-format bf16|fp8|fp8_tiled]
//                     [--threads N] [--ignore-eos]
//
// Text prompts need the model's tokenizer files (tokenizer.json or tiktoken.model, and
// tokenizer_config.json) in DIR.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "worker/backend/cpu_ops.h"
#include "worker/model/local_session.h"

ABSL_FLAG(std::string, model, "", "The checkpoint folder; required.");
ABSL_FLAG(std::string, ids, "", "The prompt as token ids, 1,2,3 (or --prompt).");
ABSL_FLAG(std::string, prompt, "",
          "The prompt as text, encoded with the folder's tokenizer (or --ids).");
ABSL_FLAG(int32_t, max_tokens, 32, "Tokens to generate, in [1, 1048576].");
ABSL_FLAG(float, temperature, 0.0f, "Sampling temperature, in [0, 100] (0: greedy).");
ABSL_FLAG(float, top_p, 1.0f, "Nucleus sampling, in (0, 1].");
ABSL_FLAG(int32_t, top_k, 0, "Sample among the K likeliest tokens, K >= 0 (0: all).");
ABSL_FLAG(uint64_t, seed, 0, "Sampling seed.");
ABSL_FLAG(std::string, kv_format, "bf16", "KV cache format: bf16, fp8, fp8_tiled or f32.");
ABSL_FLAG(int32_t, threads, 2, "CPU threads, in [1, 1024].");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past end-of-sequence tokens.");

namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "mlaserve-generate: %s\n", msg.c_str());
  return 1;
}

constexpr char kUsage[] =
    "mlaserve-generate --model DIR (--ids 1,2,3 | --prompt TEXT) [--max-tokens N]\n"
    "  [--temperature T] [--top-p P] [--top-k K] [--seed S] [--kv-format bf16|fp8|fp8_tiled]\n"
    "  [--threads N] [--ignore-eos]";

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  ParseFlags(argc, argv, kUsage);
  const std::string model_dir = RequiredFlag(FLAGS_model, "DIR");
  const std::string ids_arg = absl::GetFlag(FLAGS_ids), prompt = absl::GetFlag(FLAGS_prompt);
  const std::string kv = absl::GetFlag(FLAGS_kv_format);
  const int max_tokens = FlagInRange(FLAGS_max_tokens, 1, 1 << 20);
  const int threads = FlagInRange(FLAGS_threads, 1, 1024);
  const bool ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  SamplingRefParams sampling;
  sampling.temperature = FlagInRange(FLAGS_temperature, 0, 100);
  sampling.top_p = absl::GetFlag(FLAGS_top_p);
  if (!(sampling.top_p > 0.0f && sampling.top_p <= 1.0f)) {
    UsageError(absl::StrCat("--top-p ", sampling.top_p, ": must be in (0, 1]"));
  }
  sampling.top_k = FlagInRange(FLAGS_top_k, 0, std::numeric_limits<int32_t>::max());
  sampling.seed = absl::GetFlag(FLAGS_seed);
  if (ids_arg.empty() == prompt.empty()) UsageError("give exactly one of --ids and --prompt");
  auto format = ParseKvCacheFormat(kv);
  if (!format.ok()) return Fail(std::string(format.status().message()));

  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t> ids;
  if (!prompt.empty()) {
    auto tok = Tokenizer::LoadFromModelDir(model_dir);
    if (!tok.ok()) return Fail(std::string(tok.status().message()));
    tokenizer = std::move(*tok);
    ids = tokenizer->Encode(prompt, /*add_special_tokens=*/true);
  } else {
    for (absl::string_view part : absl::StrSplit(ids_arg, ',', absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(part, &id)) return Fail("--ids: not a token id: " + std::string(part));
      ids.push_back(id);
    }
  }
  if (ids.empty()) return Fail("the prompt is empty");

  CpuOps ops(threads);
  SingleRankCommunicator comm;
  ModelOptions options;
  options.kv_format = *format;
  options.num_kv_blocks = (static_cast<int>(ids.size()) + max_tokens) / kKvBlockTokens + 1;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = DeepseekV3Model::Load(model_dir, options, ops, comm);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  const auto t1 = std::chrono::steady_clock::now();
  LocalSession session(**model);
  auto out = session.Generate(ids, max_tokens, sampling, ignore_eos);
  if (!out.ok()) return Fail(std::string(out.status().message()));
  const auto t2 = std::chrono::steady_clock::now();
  const double load_s = std::chrono::duration<double>(t1 - t0).count();
  const double gen_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("prompt tokens: %zu\ngenerated ids:", ids.size());
  for (int32_t id : *out) std::printf(" %d", id);
  std::printf("\n");
  if (tokenizer) {
    std::printf("prompt: %s\ncompletion: %s\n", prompt.c_str(),
                tokenizer->Decode(*out, /*skip_special_tokens=*/true).c_str());
  }
  std::printf("load %.2f s, %zu tokens in %.2f s (%.1f tok/s), weights %.1f MiB, kv cache %.1f MiB (%s)\n",
              load_s, out->size(), gen_s, out->size() / std::max(gen_s, 1e-9),
              (*model)->weight_bytes() / 1048576.0, (*model)->kv_cache_bytes() / 1048576.0, kv.c_str());
  return 0;
}
