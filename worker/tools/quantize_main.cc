// mlaserve-quantize: BF16/FP32 checkpoint folder -> ModelOpt-layout NVFP4 folder (routed experts
// in NVFP4, the rest unchanged). Streams tensor by tensor and shows progress.
//
//   mlaserve-quantize --in DIR --out DIR [--quiet]
#include <cstdio>
#include <string>

#include "worker/model/nvfp4_quantizer.h"

int main(int argc, char** argv) {
  std::string in, out;
  bool quiet = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--in" || a == "--out") && i + 1 < argc) {
      (a == "--in" ? in : out) = argv[++i];
    } else if (a == "--quiet") {
      quiet = true;
    } else {
      std::fprintf(stderr, "usage: mlaserve-quantize --in DIR --out DIR [--quiet]\n");
      return 2;
    }
  }
  if (in.empty() || out.empty()) {
    std::fprintf(stderr, "usage: mlaserve-quantize --in DIR --out DIR [--quiet]\n");
    return 2;
  }
  mlaserve::QuantizeOptions options;
  size_t quantized = 0;
  options.progress = [&](const mlaserve::QuantizeProgress& p) {
    quantized += p.quantized;
    if (!quiet && (p.index % 64 == 0 || p.index == p.total)) {
      std::fprintf(stderr, "\r[%zu/%zu tensors, %zu to NVFP4] %s\033[K", p.index, p.total, quantized, p.tensor.c_str());
    }
  };
  auto status = mlaserve::QuantizeCheckpointToNvfp4(in, out, options);
  if (!quiet) std::fprintf(stderr, "\n");
  if (!status.ok()) {
    std::fprintf(stderr, "mlaserve-quantize: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  std::printf("wrote %s: %zu weights in NVFP4\n", out.c_str(), quantized);
  return 0;
}
