// Fuzzes the coordinator's handling of a client frame: the Cap'n Proto ClientRequest as
// Coordinator::HandleClientMessage reads it (the same reader limits, kj exceptions caught as it
// catches them), then PrepareRequest (coordinator/server/request_builder.h) with DeepSeek-V3's
// tokenizer and chat template, and the stop-string matcher built from the request.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "capnp/serialize.h"
#include "coordinator/scheduler/stop_strings.h"
#include "coordinator/server/request_builder.h"
#include "kj/exception.h"

namespace {
mlaserve::ModelText* model = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  auto m = mlaserve::ModelText::Load(MLASERVE_FUZZ_TOKENIZER_DIR, /*vocab_size=*/129280,
                                     /*max_model_len=*/4096, /*eos_ids=*/{});
  if (!m.ok()) {
    std::fprintf(stderr, "client_request_fuzzer: %s (run scripts/install_npm_assets.sh)\n",
                 std::string(m.status().message()).c_str());
    std::abort();
  }
  model = new mlaserve::ModelText(std::move(*m));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The coordinator refuses frames that are not whole words before reading them.
  if (size == 0 || size % sizeof(capnp::word) != 0) return 0;
  auto words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  std::memcpy(words.begin(), data, size);
  try {
    capnp::FlatArrayMessageReader reader(words, mlaserve::ClientReaderOptions());
    auto req = reader.getRoot<mlaserve::wire::ClientRequest>();
    (void)req.getRequestId();
    if (req.which() != mlaserve::wire::ClientRequest::GENERATE) return 0;
    auto prep = mlaserve::PrepareRequest(req.getGenerate(), *model);
    if (!prep.ok()) return 0;
    for (int32_t id : prep->prompt) {
      if (id < 0 || id >= model->vocab_size) std::abort();  // PrepareRequest let a bad id through
    }
    auto matcher = mlaserve::StopStringMatcher::Create(prep->stop);
    if (matcher.ok()) {
      (void)matcher->Add("some generated text");
      (void)matcher->Flush();
    }
  } catch (const kj::Exception&) {
  }
  return 0;
}
