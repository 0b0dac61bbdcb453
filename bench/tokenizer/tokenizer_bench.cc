// Single-threaded encode throughput of our Tokenizer on a corpus file (records of uint32 LE length
// + bytes, as tests/tokenizer/make_corpus.py writes them).
//
//   tokenizer_bench MODEL_DIR CORPUS [PASSES]
// Prints MB/s (10^6 bytes of input text per second) of the best pass and the token count.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/command_line.h"
#include "coordinator/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args =
      mlaserve::ParseCommandLine(argc, argv, "tokenizer_bench MODEL_DIR CORPUS [PASSES]");
  int passes = 3;
  if (args.size() < 2 || args.size() > 3) mlaserve::UsageError("takes MODEL_DIR CORPUS [PASSES]");
  if (args.size() == 3 && !(absl::SimpleAtoi(args[2], &passes) && passes >= 1 && passes <= 1000)) {
    mlaserve::UsageError("PASSES " + args[2] + ": must be in [1, 1000]");
  }
  auto tok = mlaserve::Tokenizer::LoadFromModelDir(args[0]);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  std::ifstream in(args[1], std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  const std::string data = contents.str();
  std::vector<std::string> texts;
  size_t total = 0;
  for (size_t pos = 0; pos + 4 <= data.size();) {
    uint32_t len;
    std::memcpy(&len, data.data() + pos, 4);
    texts.push_back(data.substr(pos + 4, len));
    total += len;
    pos += 4 + len;
  }
  double best = 1e30;
  size_t tokens = 0;
  for (int p = 0; p < passes; ++p) {
    tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const std::string& text : texts) tokens += (*tok)->Encode(text, false).size();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds);
  }
  std::printf("mlaserve: %zu records, %.2f MB, %zu tokens, best of %d passes %.3f s, %.2f MB/s\n",
              texts.size(), total / 1e6, tokens, passes, best, total / 1e6 / best);
  return 0;
}
