// A backend-owned buffer with a dtype and a shape: activations, weights and caches alike.
// The model code never reads the bytes of a tensor; only its backend does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "common/dtype.h"

namespace mlaserve {

enum class Device { kCpu, kCuda };

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape, std::shared_ptr<void> storage, void* data,
         Device device)
      : dtype_(dtype), shape_(std::move(shape)), storage_(std::move(storage)), data_(data),
        device_(device) {}

  // Zero-filled host memory.
  static Tensor Host(DType dtype, std::vector<int64_t> shape) {
    Tensor t;
    t.dtype_ = dtype;
    t.shape_ = std::move(shape);
    const size_t bytes = t.nbytes();
    auto storage = std::shared_ptr<uint8_t[]>(new uint8_t[bytes == 0 ? 1 : bytes]());
    t.data_ = storage.get();
    t.storage_ = std::shared_ptr<void>(storage, storage.get());
    t.device_ = Device::kCpu;
    return t;
  }

  // The same storage seen with another shape of the same element count.
  Tensor Reshaped(std::vector<int64_t> shape) const {
    Tensor t = *this;
    t.shape_ = std::move(shape);
    return t;
  }

  // Rows [begin, begin + count) of a tensor whose first dimension is rows: the same storage.
  Tensor Rows(int64_t begin, int64_t count) const {
    Tensor t = *this;
    const int64_t row = shape_.empty() || shape_[0] == 0 ? 0 : numel() / shape_[0];
    t.shape_[0] = count;
    t.data_ = static_cast<uint8_t*>(data_) + static_cast<size_t>(begin * row) * DTypeBits(dtype_) / 8;
    return t;
  }

  bool empty() const { return data_ == nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int64_t numel() const {
    return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeBits(dtype_) / 8; }

  template <class T>
  T* data() {
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(data_);
  }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Device device_ = Device::kCpu;
};

}  // namespace mlaserve
