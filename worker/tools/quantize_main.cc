// mlaserve-quantize: BF16/FP32 checkpoint folder -> ModelOpt-layout NVFP4 folder (routed experts
// in NVFP4, the rest unchanged). Streams tensor by tensor and shows progress.
//
//   mlaserve-quantize --in DIR --out DIR [--quiet]
#include <cstdio>
#include <string>

#include "common/command_line.h"
#include "worker/model/nvfp4_quantizer.h"

ABSL_FLAG(std::string, in, "", "The BF16/FP32 checkpoint folder; required.");
ABSL_FLAG(std::string, out, "", "The NVFP4 folder to write; required.");
ABSL_FLAG(bool, quiet, false, "No progress on stderr.");

int main(int argc, char** argv) {
  using namespace mlaserve;
  ParseFlags(argc, argv, "mlaserve-quantize --in DIR --out DIR [--quiet]");
  const std::string in = RequiredFlag(FLAGS_in, "DIR");
  const std::string out = RequiredFlag(FLAGS_out, "DIR");
  const bool quiet = absl::GetFlag(FLAGS_quiet);
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
