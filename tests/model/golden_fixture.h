// Reads a fixture folder's golden.safetensors (tests/oracle/make_tiny_models.py).
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"

namespace mlaserve {

// A fixture by name (tests/fixtures/models/NAME), or by a path from the source root when the
// name has a '/' (the shipped models: models/tiny-en).
inline std::string FixtureDir(const std::string& name) {
  const char* root = std::getenv("MLASERVE_SOURCE_DIR");
  const std::string base = root != nullptr ? root : ".";
  if (name.find('/') != std::string::npos) return base + "/" + name;
  return base + "/tests/fixtures/models/" + name;
}

class Golden {
 public:
  explicit Golden(const std::string& dir) {
    auto f = SafetensorsFile::Open(dir + "/golden.safetensors");
    if (f.ok()) file_ = std::move(*f);
  }
  bool ok() const { return file_ != nullptr; }
  template <class T>
  std::vector<T> Get(const std::string& name) const {
    const TensorInfo* t = file_->Find(name);
    if (t == nullptr) return {};
    auto bytes = file_->Data(*t);
    std::vector<T> v(bytes.size() / sizeof(T));
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
  double Meta(const std::string& key) const { return std::stod(file_->metadata().at(key)); }

 private:
  std::unique_ptr<SafetensorsFile> file_;
};

struct LogitError {
  double max_abs = 0;   // max |ours - ref|
  double ref_scale = 0; // max |ref|
  double Relative() const { return max_abs / ref_scale; }
};

inline LogitError CompareLogits(const std::vector<float>& ours, const std::vector<float>& ref) {
  LogitError e;
  for (size_t i = 0; i < ref.size() && i < ours.size(); ++i) {
    e.max_abs = std::max(e.max_abs, static_cast<double>(std::abs(ours[i] - ref[i])));
    e.ref_scale = std::max(e.ref_scale, static_cast<double>(std::abs(ref[i])));
  }
  if (ours.size() != ref.size()) e.max_abs = 1e30;
  return e;
}

}  // namespace mlaserve
