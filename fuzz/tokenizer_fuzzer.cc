// Fuzzes DeepSeek-V3's tokenizer (coordinator/tokenizer/tokenizer.h, the tokenizer.json of the
// npm assets) on arbitrary bytes, invalid UTF-8 included: Encode with and without special
// tokens, Decode and DecodeBytes of what Encode returned and of the input read as token ids
// (negative and out-of-vocabulary ids included), and the incremental detokenizer token by token.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

#include "coordinator/tokenizer/incremental_detokenizer.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace {
std::unique_ptr<mlaserve::Tokenizer> tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  auto t = mlaserve::Tokenizer::LoadFromModelDir(MLASERVE_FUZZ_TOKENIZER_DIR);
  if (!t.ok()) {
    std::fprintf(stderr, "tokenizer_fuzzer: %s (run scripts/install_npm_assets.sh)\n",
                 std::string(t.status().message()).c_str());
    std::abort();
  }
  tokenizer = std::move(*t);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool add_special = flags & 1, skip_special = flags & 2;
  const std::vector<int32_t> ids = tokenizer->Encode(text, add_special);
  for (int32_t id : ids) {
    if (id < 0 || id >= tokenizer->vocab_size()) std::abort();  // Encode made an id it can't own
  }
  (void)tokenizer->Decode(ids, skip_special);
  (void)tokenizer->DecodeBytes(ids, skip_special);

  std::vector<int32_t> raw((size - 1) / 4);
  if (!raw.empty()) std::memcpy(raw.data(), data + 1, raw.size() * 4);
  if (flags & 4) {
    for (int32_t& id : raw) id %= tokenizer->vocab_size() + 16;  // mostly valid, some not
  }
  (void)tokenizer->Decode(raw, skip_special);
  (void)tokenizer->DecodeBytes(raw, skip_special);
  mlaserve::IncrementalDetokenizer detok(*tokenizer, skip_special);
  for (int32_t id : raw) (void)detok.Add(id);
  (void)detok.Finish();
  return 0;
}
