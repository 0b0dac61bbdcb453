// Fuzzes the safetensors reader (common/safetensors.h): the 8-byte length, the JSON header and
// its offsets (first input byte even), or a model.safetensors.index.json next to one valid shard
// (first byte odd). The reader maps files, so the input is written to a scratch folder first.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "common/safetensors.h"

namespace {

std::string& ScratchDir() {
  static std::string dir;
  return dir;
}

void WriteFile(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// Reads every byte the reader hands out, so that ASan sees an out-of-map span.
void Touch(const mlaserve::SafetensorsFile& file) {
  volatile uint8_t sink = 0;
  for (const auto& t : file.tensors()) {
    for (uint8_t b : file.Data(t)) sink = sink ^ b;
    (void)t.NumElements();
    (void)t.Describe();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/mlaserve-safetensors-fuzz-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::abort();
  ScratchDir() = tmpl;
  // The shard an index may name: one BF16 [2] tensor "a".
  const std::string header = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  std::string shard(8, '\0');
  for (int i = 0; i < 8; ++i) shard[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  shard += header + std::string(4, '\x01');
  WriteFile(ScratchDir() + "/model-00001-of-00001.safetensors",
            reinterpret_cast<const uint8_t*>(shard.data()), shard.size());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool index = data[0] & 1;
  ++data;
  --size;
  if (!index) {
    const std::string path = ScratchDir() + "/input.safetensors";
    WriteFile(path, data, size);
    auto file = mlaserve::SafetensorsFile::Open(path);
    if (file.ok()) {
      Touch(**file);
      for (const auto& t : (*file)->tensors()) (void)(*file)->Find(t.name);
    }
    return 0;
  }
  WriteFile(ScratchDir() + "/model.safetensors.index.json", data, size);
  auto ckpt = mlaserve::Checkpoint::Open(ScratchDir());
  if (ckpt.ok()) {
    for (const std::string& name : ckpt->Names()) {
      auto ref = ckpt->Get(name);
      if (ref.ok()) {
        volatile uint8_t sink = 0;
        for (uint8_t b : ref->bytes) sink = sink ^ b;
      }
    }
  }
  return 0;
}
