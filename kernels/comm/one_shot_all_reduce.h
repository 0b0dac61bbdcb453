// A one-shot all-reduce of bf16 vectors between the GPUs of one node through peer memory: every
// rank writes its vector straight into every peer's workspace and sums what the peers wrote into
// its own, in one kernel with no flag round trip. For the decode step's small all-reduces (Kimi
// and DeepSeek: 7,168 bf16 a token, 122 calls a step), where NCCL's ring or tree pays its
// protocol's latency on a few KB. The issue that asks for it: "Multi-GPU run" (issue 22), which
// measures it against NCCL (bench/comm/all_reduce_bench.cc).
//
// The protocol (Lamport-style, as TensorRT-LLM's "lamport" all-reduce and vLLM's custom
// all-reduce do it; the code here is our own): a workspace element holds a sentinel bit pattern
// (bf16 -0.0, 0x8000) until a peer's value lands in it, so the reader polls the data itself and
// needs no separate flag, and the writer needs no release fence before a flag (a fence at system
// scope waits for the writes' acknowledgements over NVLink: one round trip saved). Inputs equal to
// -0.0 are sent as +0.0, which changes no sum's value (only the sign of an all-zero sum). Each
// workspace has three generations of slots; a call uses generation g, and after reading restores
// the sentinel in generation g - 1 (mod 3), which no peer can be writing: a peer writes generation
// g - 1 only during the previous call, and this rank finished reading all of it before this call.
// The next write to it comes two calls later, after this kernel has ended.
//
// Work is cut into fixed chunks of kOneShotChunkElems elements; each chunk has its own generation
// counter in the workspace (a block takes chunks c, c + grid, ...), so the calls need no host-side
// state and are captured into CUDA graphs as they are, and message sizes may vary between calls
// (every rank makes the same calls with the same sizes, so every chunk's counter agrees across
// ranks). The sum is fp32 in rank order 0..N-1, rounded once to bf16: bit-identical on every
// rank (NCCL adds in bf16 at each hop of its ring or tree).
//
// Failure: a rank that waits longer than timeout_ns for a peer writes that peer's rank (+ 1) to
// `error` (host-mapped memory, readable after the context is lost) and traps: the stream reports
// an error instead of hanging (the NCCL communicator's WaitForStream then names the peer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

inline constexpr int kOneShotMaxRanks = 8;
// bf16 elements a chunk: one block of 256 threads x one 16-byte vector (8 bf16) a thread.
inline constexpr int kOneShotChunkElems = 2048;
inline constexpr int kOneShotThreads = kOneShotChunkElems / 8;
inline constexpr int kOneShotGenerations = 3;

// Bytes of one rank's workspace for vectors of up to max_elems bf16 among `ranks` ranks: the
// chunks' generation counters (uint32, padded to 256 B), then the slots: [3 generations][ranks]
// [chunks * kOneShotChunkElems] bf16. 0 for invalid arguments.
size_t OneShotWorkspaceBytes(int ranks, int64_t max_elems);

// Prepares a fresh workspace (cudaMalloc'd, OneShotWorkspaceBytes): every slot element the
// sentinel, every counter 0. Asynchronous on `stream`.
absl::Status InitOneShotWorkspace(void* workspace, int ranks, int64_t max_elems,
                                  cudaStream_t stream);

struct OneShotAllReduceParams {
  int rank = 0;
  int ranks = 1;          // 1..kOneShotMaxRanks
  int64_t max_elems = 0;  // the workspaces' capacity (the same on every rank)
  // Every rank's workspace as this rank's device addresses it (peers[rank] is its own; the others
  // mapped through CUDA IPC, or plain device pointers when the "ranks" share one process).
  void* peers[kOneShotMaxRanks] = {};
  void* data = nullptr;  // bf16 [count], 16-byte aligned; summed over ranks in place
  int64_t count = 0;     // <= max_elems; the same on every rank
  // Blocks of the kernel (0: one a chunk up to the device's SM count, queried at each call; callers
  // that call often pass the SM count). Ranks that share one GPU (tests) bound it so that every
  // rank's blocks are resident at once.
  int max_blocks = 0;
  uint64_t timeout_ns = 60ull * 1000 * 1000 * 1000;
  uint32_t* error =
      nullptr;  // host-mapped; set to (waited-for rank + 1) before a trap; may be null
};

// count = 0 is a no-op. Asynchronous on `stream`; no host sync, no allocation (graph-capturable).
// Every rank must make the same sequence of calls with the same counts.
absl::Status InvokeOneShotAllReduce(const OneShotAllReduceParams& p, cudaStream_t stream);

}  // namespace mlaserve
