// Safetensors checkpoints: one file, or many through model.safetensors.index.json.
//
// Format (huggingface/safetensors, docs "format"): 8-byte little-endian header length N, then N
// bytes of JSON {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}, then the byte buffer. Offsets are relative to the buffer; the
// tensors cover it entirely, without holes or overlap. Files are memory-mapped read-only, so a
// rank that reads one shard of a tensor touches only those pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace mlaserve {

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data buffer
  uint64_t end = 0;

  uint64_t NumElements() const;
  std::string Describe() const;  // "bfloat16-style name [7168, 128]", e.g. "BF16 [7168, 128]"
};

// The largest header the reader accepts (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100 * 1000 * 1000;

class SafetensorsFile {
 public:
  // Maps and validates the file. Every error names the file (and the tensor, where one is at
  // fault).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* Find(std::string_view name) const;
  std::span<const uint8_t> Data(const TensorInfo& info) const {
    return {data_ + info.begin, static_cast<size_t>(info.end - info.begin)};
  }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// A tensor of a checkpoint: where it lives and its bytes.
struct TensorRef {
  const TensorInfo* info = nullptr;
  const SafetensorsFile* file = nullptr;  // null for a tensor not read from a file
  std::span<const uint8_t> bytes;
};

// Where the model loader reads tensors from: a checkpoint folder (Checkpoint), or tensors made on
// demand (worker/model/synthetic_checkpoint.h) for benchmarking models whose checkpoints are not
// at hand. A TensorRef from Get stays valid while the source lives, unless the source says
// otherwise (a synthetic source keeps only its most recent tensors).
class TensorSource {
 public:
  virtual ~TensorSource();
  virtual bool Has(std::string_view name) const = 0;
  virtual absl::StatusOr<TensorRef> Get(std::string_view name) const = 0;
  // Get, and check the dtype and shape: "tensor X: expected F8_E4M3 [7168, 128], found BF16 [..]".
  absl::StatusOr<TensorRef> Get(std::string_view name, DType dtype,
                                const std::vector<int64_t>& shape) const;
  // The header of a tensor (dtype, shape, byte size end - begin) without its bytes: what a memory
  // plan reads.
  virtual absl::StatusOr<const TensorInfo*> Info(std::string_view name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
  // Where the tensors come from, for error messages (a folder, or "synthetic ...").
  virtual std::string Origin() const = 0;
};

// All tensors of a checkpoint folder (or a single .safetensors file).
class Checkpoint : public TensorSource {
 public:
  // `path`: a folder holding model.safetensors.index.json or *.safetensors, or one file.
  static absl::StatusOr<Checkpoint> Open(const std::string& path);

  using TensorSource::Get;
  bool Has(std::string_view name) const override;
  absl::StatusOr<TensorRef> Get(std::string_view name) const override;
  absl::StatusOr<const TensorInfo*> Info(std::string_view name) const override;
  std::vector<std::string> Names() const override;
  std::string Origin() const override { return folder_; }
  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>, std::less<>> tensors_;
};

// Writes a whole file at once (tests, small tools). `tensors` data must match dtype × shape.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Writes a file tensor by tensor, for converters that must not hold a checkpoint in memory:
// declare every tensor first (the header needs all offsets), then Begin(), then Append() each
// tensor's bytes in declaration order (possibly in several pieces), then Finish().
class SafetensorsStreamWriter {
 public:
  explicit SafetensorsStreamWriter(std::string path) : path_(std::move(path)) {}
  ~SafetensorsStreamWriter();
  absl::Status Declare(std::string name, DType dtype, std::vector<int64_t> shape);
  void SetMetadata(std::map<std::string, std::string> metadata) { metadata_ = std::move(metadata); }
  absl::Status Begin();
  absl::Status Append(std::span<const uint8_t> bytes);
  absl::Status Finish();
  uint64_t total_data_bytes() const { return total_; }

 private:
  std::string path_;
  std::vector<TensorInfo> declared_;
  std::map<std::string, std::string> metadata_;
  uint64_t total_ = 0;
  uint64_t written_ = 0;
  std::FILE* out_ = nullptr;
};

}  // namespace mlaserve
