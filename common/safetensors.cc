#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace mlaserve {
namespace {

using json = nlohmann::json;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status FileError(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

}  // namespace

uint64_t TensorInfo::NumElements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string TensorInfo::Describe() const {
  return absl::StrCat(std::string(DTypeName(dtype)), " ", ShapeString(shape));
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(const_cast<uint8_t*>(map_), map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return FileError(path, absl::StrCat("cannot stat: ", std::strerror(err)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return FileError(path, absl::StrCat("truncated: ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return FileError(path, absl::StrCat("mmap failed: ", std::strerror(errno)));

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = static_cast<const uint8_t*>(map);
  file->map_size_ = size;

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file->map_[i];
  if (header_len > kSafetensorsMaxHeaderBytes) {
    return FileError(path, absl::StrCat("header length ", header_len, " exceeds the ",
                                        kSafetensorsMaxHeaderBytes, "-byte limit (corrupt file?)"));
  }
  if (8 + header_len > size) {
    return FileError(path, absl::StrCat("truncated: header says ", header_len,
                                        " bytes of JSON but the file has ", size - 8));
  }
  const char* header = reinterpret_cast<const char*>(file->map_ + 8);
  json doc = json::parse(header, header + header_len, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return FileError(path, "header is not valid JSON");
  if (!doc.is_object()) return FileError(path, "header is not a JSON object");

  file->data_ = file->map_ + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return FileError(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return FileError(path, absl::StrCat("__metadata__ value of \"", m.key(), "\" is not a string"));
        }
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return FileError(path, absl::StrCat("tensor ", name, ": ", what));
    };
    if (!v.is_object()) return bad("entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) return bad("missing string \"dtype\"");
    if (!v.contains("shape") || !v["shape"].is_array()) return bad("missing array \"shape\"");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      return bad("missing \"data_offsets\" [begin, end]");
    }
    TensorInfo info;
    info.name = name;
    auto dtype = ParseDType(v["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    info.dtype = *dtype;
    uint64_t elements = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape has a non-integer or negative dimension");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && elements > std::numeric_limits<uint64_t>::max() / 64 / dim)) {
        return bad("shape is too large");
      }
      elements *= dim;
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const json& o : v["data_offsets"]) {
      if (!o.is_number_unsigned()) return bad("data_offsets are not non-negative integers");
    }
    info.begin = v["data_offsets"][0].get<uint64_t>();
    info.end = v["data_offsets"][1].get<uint64_t>();
    if (info.begin > info.end) return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] are reversed"));
    if (info.end > data_size) {
      return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                              "] run past the end of the data (", data_size, " bytes): truncated file?"));
    }
    auto bytes = DTypeByteSize(info.dtype, elements);
    if (!bytes.ok()) return bad(std::string(bytes.status().message()));
    if (*bytes != info.end - info.begin) {
      return bad(absl::StrCat(info.Describe(), " needs ", *bytes, " bytes but data_offsets span ",
                              info.end - info.begin));
    }
    file->tensors_.push_back(std::move(info));
  }
  // The tensors must tile the buffer: sorted by offset, each starts where the previous ended.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : file->tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->begin < expected) {
      return FileError(path, absl::StrCat("tensor ", t->name, ": data_offsets [", t->begin, ", ",
                                          t->end, "] overlap another tensor"));
    }
    if (t->begin > expected) {
      return FileError(path, absl::StrCat("tensor ", t->name, ": data_offsets start at ", t->begin,
                                          ", leaving a hole after byte ", expected));
    }
    expected = t->end;
  }
  if (expected != data_size) {
    return FileError(path, absl::StrCat("the tensors cover ", expected, " bytes but the data has ",
                                        data_size, " (trailing bytes or truncated header)"));
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& path) {
  namespace fs = std::filesystem;
  Checkpoint ckpt;
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    ckpt.folder_ = fs::path(path).parent_path().string();
    files.push_back(path);
  } else if (fs::is_directory(path, ec)) {
    ckpt.folder_ = path;
    const fs::path index = fs::path(path) / "model.safetensors.index.json";
    if (fs::exists(index)) {
      std::ifstream in(index);
      json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (doc.is_discarded() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": not a safetensors index (no \"weight_map\" object)"));
      }
      std::set<std::string> names;
      for (auto it = doc["weight_map"].begin(); it != doc["weight_map"].end(); ++it) {
        if (!it.value().is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map entry ", it.key(), " is not a file name"));
        }
        const std::string f = it.value().get<std::string>();
        if (f.find('/') != std::string::npos || f == ".." ) {
          return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map names a file outside the folder: ", f));
        }
        names.insert(f);
      }
      for (const auto& f : names) files.push_back((fs::path(path) / f).string());
    } else {
      for (const auto& entry : fs::directory_iterator(path, ec)) {
        const std::string name = entry.path().filename().string();
        if (entry.path().extension() == ".safetensors" && name.rfind("model", 0) == 0) {
          files.push_back(entry.path().string());
        }
      }
      std::sort(files.begin(), files.end());
    }
    if (files.empty()) {
      return absl::NotFoundError(absl::StrCat(path, ": no model*.safetensors files and no model.safetensors.index.json"));
    }
  } else {
    return absl::NotFoundError(absl::StrCat(path, ": no such file or folder"));
  }
  for (const auto& f : files) {
    auto file = SafetensorsFile::Open(f);
    if (!file.ok()) return file.status();
    std::shared_ptr<SafetensorsFile> shared(std::move(*file));
    for (const auto& t : shared->tensors()) {
      auto [it, inserted] = ckpt.tensors_.emplace(t.name, std::make_pair(shared.get(), &t));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " is in both ", it->second.first->path(), " and ", f));
      }
    }
    ckpt.files_.push_back(std::move(shared));
  }
  return ckpt;
}

bool Checkpoint::Has(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

absl::StatusOr<TensorRef> Checkpoint::Get(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", std::string(name), " not found in checkpoint ", folder_));
  }
  TensorRef ref;
  ref.file = it->second.first;
  ref.info = it->second.second;
  ref.bytes = ref.file->Data(*ref.info);
  return ref;
}

TensorSource::~TensorSource() = default;

absl::StatusOr<TensorRef> TensorSource::Get(std::string_view name, DType dtype,
                                            const std::vector<int64_t>& shape) const {
  auto ref = Get(name);
  if (!ref.ok()) return ref.status();
  if (ref->info->dtype != dtype || ref->info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", std::string(name), ": expected ", std::string(DTypeName(dtype)), " ", ShapeString(shape),
        ", found ", ref->info->Describe(), " (", ref->file != nullptr ? ref->file->path() : Origin(), ")"));
  }
  return ref;
}

absl::StatusOr<const TensorInfo*> Checkpoint::Info(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", std::string(name), " not found in checkpoint ", folder_));
  }
  return it->second.second;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, _] : tensors_) names.push_back(name);
  return names;
}

namespace {
std::string HeaderJson(const std::vector<TensorInfo>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json doc = json::object();
  if (!metadata.empty()) doc["__metadata__"] = metadata;
  for (const auto& t : tensors) {
    doc[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                   {"shape", t.shape},
                   {"data_offsets", {t.begin, t.end}}};
  }
  std::string header = doc.dump();
  // Pad with spaces to a multiple of 8 so that the data buffer is 8-byte aligned.
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}
}  // namespace

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (out_ != nullptr) std::fclose(out_);
}

absl::Status SafetensorsStreamWriter::Declare(std::string name, DType dtype, std::vector<int64_t> shape) {
  if (out_ != nullptr) return absl::FailedPreconditionError("Declare after Begin");
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  auto bytes = DTypeByteSize(dtype, t.NumElements());
  if (!bytes.ok()) return bytes.status();
  t.begin = total_;
  t.end = total_ + *bytes;
  total_ = t.end;
  declared_.push_back(std::move(t));
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Begin() {
  out_ = std::fopen(path_.c_str(), "wb");
  if (out_ == nullptr) return absl::PermissionDeniedError(absl::StrCat(path_, ": cannot create: ", std::strerror(errno)));
  const std::string header = HeaderJson(declared_, metadata_);
  uint8_t len[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  if (std::fwrite(len, 1, 8, out_) != 8 || std::fwrite(header.data(), 1, header.size(), out_) != header.size()) {
    return absl::DataLossError(absl::StrCat(path_, ": write failed"));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Append(std::span<const uint8_t> bytes) {
  if (out_ == nullptr) return absl::FailedPreconditionError("Append before Begin");
  if (written_ + bytes.size() > total_) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": more data appended than declared"));
  }
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), out_) != bytes.size()) {
    return absl::DataLossError(absl::StrCat(path_, ": write failed: ", std::strerror(errno)));
  }
  written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Finish() {
  if (out_ == nullptr) return absl::FailedPreconditionError("Finish before Begin");
  if (written_ != total_) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", written_, " bytes written of ", total_, " declared"));
  }
  const int rc = std::fclose(out_);
  out_ = nullptr;
  if (rc != 0) return absl::DataLossError(absl::StrCat(path_, ": close failed"));
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  SafetensorsStreamWriter writer(path);
  for (const auto& t : tensors) {
    if (auto s = writer.Declare(t.name, t.dtype, t.shape); !s.ok()) return s;
  }
  writer.SetMetadata(metadata);
  if (auto s = writer.Begin(); !s.ok()) return s;
  for (const auto& t : tensors) {
    auto bytes = DTypeByteSize(t.dtype, TensorInfo{t.name, t.dtype, t.shape}.NumElements());
    if (!bytes.ok()) return bytes.status();
    if (*bytes != t.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": ", t.bytes.size(),
                                                     " bytes given for ", *bytes, " declared"));
    }
    if (auto s = writer.Append(t.bytes); !s.ok()) return s;
  }
  return writer.Finish();
}

}  // namespace mlaserve
