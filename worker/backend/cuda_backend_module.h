// The CUDA backend as a module the worker loads at run time (libmlaserve_cuda_backend.so, beside
// the mlaserve-worker executable).
//
// Why a module and not a link-time dependency: cuBLASLt carries ~94 KB of static thread-local
// storage (readelf: its PT_TLS memsz is 0x17020), which glibc reserves at the top of every
// thread's stack when the library is loaded with the executable. The HTTP server behind the
// worker's Prometheus endpoint (civetweb, via prometheus-cpp) starts its threads with a fixed
// 100 KB stack, so pthread_create fails (EINVAL) and the endpoint never comes up ("null context
// when constructing CivetServer"). Loaded with dlopen after start-up, the module's TLS is
// allocated dynamically instead. A worker built with CUDA then also runs on hosts without the
// CUDA libraries, as the CPU backend.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "worker/backend/ops.h"

namespace mlaserve {

class Communicator;

struct CudaBackendApi {
  int abi_version;  // kCudaBackendAbiVersion of the module's build
  // GPUs visible to this process (0 where the driver finds none).
  int (*device_count)();
  // Free and total bytes of the current device.
  bool (*memory_info)(size_t* free_bytes, size_t* total_bytes);
  // The backend on the current device; null with *error set on failure. Never freed by the
  // module's unloading: the module stays loaded for the life of the process.
  Ops* (*create_ops)(std::string* error);
  // The step arena's size of a backend made by create_ops.
  size_t (*arena_bytes)(const Ops* ops);
  // The NCCL communicator of the ranks of *mpi_comm (an MPI_Comm), its collectives on the
  // stream of `ops` (made by create_ops); null with *error set on failure, or when the module
  // was built without NCCL.
  Communicator* (*create_nccl)(void* mpi_comm, Ops* ops, std::string* error);
};

inline constexpr int kCudaBackendAbiVersion = 3;

// The module's one export (extern "C", so dlsym finds it by this name).
extern "C" const CudaBackendApi* MlaserveCudaBackend();
inline constexpr const char* kCudaBackendSymbol = "MlaserveCudaBackend";
inline constexpr const char* kCudaBackendFile = "libmlaserve_cuda_backend.so";

// Loads the module: $MLASERVE_CUDA_BACKEND if set, else kCudaBackendFile in the directory of the
// running executable. NotFound when there is none (a build without CUDA); other errors carry
// dlopen's message (e.g. a missing libcublasLt.so).
absl::StatusOr<const CudaBackendApi*> LoadCudaBackend();

}  // namespace mlaserve
