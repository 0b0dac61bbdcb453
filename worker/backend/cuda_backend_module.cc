// The exported entry point of libmlaserve_cuda_backend.so (see cuda_backend_module.h).
#include "worker/backend/cuda_backend_module.h"

#include <cuda_runtime_api.h>
#include <mpi.h>

#include "worker/backend/cuda_ops.h"
#ifdef MLASERVE_HAVE_NCCL
#include "worker/comm/nccl_communicator.h"
#endif

namespace mlaserve {
namespace {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool MemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  return CudaMemoryInfo(free_bytes, total_bytes).ok();
}

Ops* CreateOps(std::string* error) {
  auto ops = CudaOps::Create();
  if (!ops.ok()) {
    *error = std::string(ops.status().message());
    return nullptr;
  }
  return ops->release();
}

size_t ArenaBytes(const Ops* ops) { return static_cast<const CudaOps*>(ops)->arena_bytes(); }

const CudaBackendApi kApi = {kCudaBackendAbiVersion, DeviceCount, MemoryInfo, CreateOps,
                             ArenaBytes};

}  // namespace

extern "C" __attribute__((visibility("default"))) const CudaBackendApi* MlaserveCudaBackend() {
  return &kApi;
}

}  // namespace mlaserve
