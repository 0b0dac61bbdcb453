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
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "worker/backend/cpu_ops.h"
#include "worker/model/local_session.h"

namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "mlaserve-generate: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  std::string model_dir, ids_arg, prompt, kv = "bf16";
  int max_tokens = 32, threads = 2;
  bool ignore_eos = false;
  SamplingRefParams sampling;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mlaserve-generate: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&](auto* out) {
      const std::string v = value();
      if (!absl::SimpleAtoi(v, out)) {
        std::fprintf(stderr, "mlaserve-generate: %s: not a number: %s\n", a.c_str(), v.c_str());
        std::exit(2);
      }
    };
    auto real = [&](float* out) {
      const std::string v = value();
      if (!absl::SimpleAtof(v, out)) {
        std::fprintf(stderr, "mlaserve-generate: %s: not a number: %s\n", a.c_str(), v.c_str());
        std::exit(2);
      }
    };
    if (a == "--model") model_dir = value();
    else if (a == "--ids") ids_arg = value();
    else if (a == "--prompt") prompt = value();
    else if (a == "--max-tokens") number(&max_tokens);
    else if (a == "--threads") number(&threads);
    else if (a == "--temperature") real(&sampling.temperature);
    else if (a == "--top-p") real(&sampling.top_p);
    else if (a == "--top-k") number(&sampling.top_k);
    else if (a == "--seed") number(&sampling.seed);
    else if (a == "--kv-format") kv = value();
    else if (a == "--ignore-eos") ignore_eos = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: mlaserve-generate --model DIR (--ids 1,2,3 | --prompt TEXT) [--max-tokens N]\n"
                  "  [--temperature T] [--top-p P] [--top-k K] [--seed S] [--kv-format bf16|fp8|fp8_tiled]\n"
                  "  [--threads N] [--ignore-eos]\n");
      return 0;
    } else {
      return Fail("unknown argument " + a + " (see --help)");
    }
  }
  if (model_dir.empty()) return Fail("--model DIR is required");
  if (ids_arg.empty() == prompt.empty()) return Fail("give exactly one of --ids and --prompt");
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
