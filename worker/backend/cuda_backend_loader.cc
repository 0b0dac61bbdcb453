#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "worker/backend/cuda_backend_module.h"

namespace mlaserve {

absl::StatusOr<const CudaBackendApi*> LoadCudaBackend() {
  static absl::StatusOr<const CudaBackendApi*> loaded =
      []() -> absl::StatusOr<const CudaBackendApi*> {
    std::string path;
    if (const char* env = std::getenv("MLASERVE_CUDA_BACKEND"); env != nullptr && *env != 0) {
      path = env;
    } else {
      std::error_code ec;
      const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
      if (ec)
        return absl::InternalError(
            absl::StrCat("cannot find the executable's folder: ", ec.message()));
      path = (exe.parent_path() / kCudaBackendFile).string();
    }
    if (!std::filesystem::exists(path)) {
      return absl::NotFoundError(
          absl::StrCat("no CUDA backend module at ", path,
                       " (a build without CUDA, or set MLASERVE_CUDA_BACKEND)"));
    }
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot load the CUDA backend ", path, ": ", dlerror()));
    }
    auto entry = reinterpret_cast<const CudaBackendApi* (*)()>(dlsym(handle, kCudaBackendSymbol));
    if (entry == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(path, " has no ", kCudaBackendSymbol));
    }
    const CudaBackendApi* api = entry();
    if (api == nullptr || api->abi_version != kCudaBackendAbiVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " was built for another mlaserve-worker (module ABI ", api ? api->abi_version : -1,
          ", worker ", kCudaBackendAbiVersion, "): rebuild both"));
    }
    return api;
  }();
  return loaded;
}

}  // namespace mlaserve
