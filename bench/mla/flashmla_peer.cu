// Issue 15's FlashMLA peer: FlashMLA's SM90 dense BF16 decode (its scheduling metadata, split
// kernel and combine, called through its C++ entry points as its own Python binding does in
// csrc/api/dense_decode.h) timed exactly as bench/mla/mla_decode_bench.cu times ours: cache copies
// of >= 256 MB together replayed in one CUDA graph (cold L2), shuffled page tables, every sequence
// of one length, the median replay over the copies, the same byte count (cache rows + q + out) and
// the same copy-bandwidth measurement (bench/mla/decode_timing.h, shared with it). FlashMLA and
// CUTLASS are not in this repository; build with bench/mla/flashmla_peer.sh from checkouts of both.
// Prints mla_decode_bench's CSV columns with impl "flashmla", and a sanity line a configuration on
// stderr (lse and outputs finite). FlashMLA's layout for one KV head: q [b, s_q * h_q, 1, 576] (s_q
// = 1 here: q as ours), the cache [blocks, 64, 1, 576] bf16 (ours: [blocks, 64, 576]), out [b, 1,
// h_q, 512]; page size 64.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/mla/decode_timing.h"
#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

__global__ void FillBf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 97531u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float v = (float(h & 0xffff) / 65535.0f - 0.5f) * 2.0f;
    uint32_t b;
    memcpy(&b, &v, 4);
    p[i] = uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
}

static std::vector<int> Ints(const char* s) {
  std::vector<int> v;
  std::string t(s);
  size_t a = 0;
  while (a < t.size()) {
    size_t b = t.find(',', a);
    if (b == std::string::npos) b = t.size();
    v.push_back(atoi(t.substr(a, b - a).c_str()));
    a = b + 1;
  }
  return v;
}

int main(int argc, char** argv) {
  std::vector<int> heads = Ints(argc > 1 ? argv[1] : "16,64,128"),
                   batches = Ints(argc > 2 ? argv[2] : "1,64"),
                   contexts = Ints(argc > 3 ? argv[3] : "32768,131072");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  // Copy bandwidth as our bench measures it: a 1 GiB device-to-device copy (read + write bytes).
  const double copy_bw = mlaserve::bench::MeasureCopyBandwidth();
  printf("# device %s, %d SMs; d2d copy bandwidth %.0f GB/s\n", prop.name, prop.multiProcessorCount,
         copy_bw / 1e9);
  printf("impl,format,heads,batch,context,variant,us,bytes,gbps,frac_copy,copy_gbps\n");
  for (int h : heads)
    for (int batch : batches)
      for (int context : contexts) {
        const int blocks_per_seq = (context + 63) / 64;
        const size_t num_blocks = size_t(batch) * blocks_per_seq;
        const size_t pool_bytes = num_blocks * 64 * 576 * 2;
        const int copies = mlaserve::bench::ColdL2Copies(pool_bytes);
        std::vector<uint16_t*> pools(copies);
        for (int c = 0; c < copies; ++c) {
          CK(cudaMalloc(&pools[c], pool_bytes));
          FillBf16<<<1024, 256>>>(pools[c], pool_bytes / 2, 17 + c);
        }
        std::mt19937 rng(batch * 131 + context);
        std::vector<int> table(num_blocks);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);
        std::vector<int> lens(batch, context);
        int *d_table, *d_lens;
        CK(cudaMalloc(&d_table, table.size() * 4));
        CK(cudaMalloc(&d_lens, lens.size() * 4));
        CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
        const int s_q = 1, q_seq = s_q * h;
        const int num_sm_parts = std::max(prop.multiProcessorCount / 1 / ((q_seq + 63) / 64), 1);
        const size_t q_elems = size_t(batch) * q_seq * 576, out_elems = size_t(batch) * q_seq * 512;
        uint16_t *d_q, *d_out;
        float *d_lse, *d_lse_acc, *d_o_acc;
        int *d_meta, *d_splits;
        CK(cudaMalloc(&d_q, q_elems * 2));
        CK(cudaMalloc(&d_out, out_elems * 2));
        CK(cudaMalloc(&d_lse, size_t(batch) * q_seq * 4));
        const int total_splits = batch + num_sm_parts;
        CK(cudaMalloc(&d_lse_acc, size_t(total_splits) * q_seq * 4));
        CK(cudaMalloc(&d_o_acc, size_t(total_splits) * q_seq * 512 * 4));
        CK(cudaMalloc(&d_meta, size_t(num_sm_parts) * sizeof(DecodingSchedMeta)));
        CK(cudaMalloc(&d_splits, (batch + 1) * 4));
        FillBf16<<<1024, 256>>>(d_q, q_elems, 5);
        cudaStream_t stream;
        CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const float scale = 0.1352f * 0.1352f / 0.0417f / 24.0f;
        auto run = [&](uint16_t* pool) {
          GetDecodeSchedMetaParams sp = {
              batch,    s_q,          64,      5,      -1,
              -1,       nullptr,      nullptr, d_lens, (DecodingSchedMeta*)d_meta,
              d_splits, num_sm_parts, stream};
          smxx::decode::run_get_decoding_sched_meta_kernel(sp);
          DenseAttnDecodeParams p{};
          p.b = batch;
          p.s_q = s_q;
          p.q_seq_per_hk = q_seq;
          p.seqlens_k_ptr = d_lens;
          p.h_q = h;
          p.h_k = 1;
          p.num_blocks = int(num_blocks);
          p.q_head_per_hk = h;
          p.is_causal = false;
          p.d = 576;
          p.d_v = 512;
          p.scale_softmax = scale;
          p.scale_softmax_log2 = float(scale * 1.4426950408889634);
          p.q_ptr = d_q;
          p.k_ptr = pool;
          p.o_ptr = d_out;
          p.softmax_lse_ptr = d_lse;
          p.q_batch_stride = int64_t(q_seq) * 576;
          p.k_batch_stride = 64 * 576;
          p.o_batch_stride = int64_t(q_seq) * 512;
          p.q_row_stride = 576;
          p.k_row_stride = 576;
          p.o_row_stride = 512;
          p.q_head_stride = 576;
          p.k_head_stride = 576;
          p.o_head_stride = int64_t(q_seq) * 512;
          p.block_table = d_table;
          p.block_table_batch_stride = blocks_per_seq;
          p.page_block_size = 64;
          p.tile_scheduler_metadata_ptr = (DecodingSchedMeta*)d_meta;
          p.num_sm_parts = num_sm_parts;
          p.num_splits_ptr = d_splits;
          p.total_num_splits = total_splits;
          p.softmax_lseaccum_ptr = d_lse_acc;
          p.oaccum_ptr = d_o_acc;
          p.stream = stream;
          sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);
          CombineParams cp = {batch,
                              s_q,
                              h,
                              512,
                              d_lse,
                              d_out,
                              q_seq,
                              h,
                              h * s_q * 512,
                              h * 512,
                              512,
                              d_lse_acc,
                              d_o_acc,
                              q_seq,
                              h,
                              h * s_q * 512,
                              h * 512,
                              512,
                              (DecodingSchedMeta*)d_meta,
                              d_splits,
                              num_sm_parts,
                              nullptr,
                              stream};
          smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(cp);
        };
        run(pools[0]);
        CK(cudaStreamSynchronize(stream));
        CK(cudaGetLastError());
        {
          std::vector<float> l(size_t(batch) * q_seq);
          CK(cudaMemcpy(l.data(), d_lse, l.size() * 4, cudaMemcpyDeviceToHost));
          std::vector<uint16_t> o(out_elems);
          CK(cudaMemcpy(o.data(), d_out, o.size() * 2, cudaMemcpyDeviceToHost));
          int bad = 0;
          double mx = 0;
          for (float x : l) bad += !std::isfinite(x);
          for (uint16_t b : o) {
            uint32_t u = uint32_t(b) << 16;
            float f;
            memcpy(&f, &u, 4);
            if (!std::isfinite(f))
              ++bad;
            else
              mx = std::max(mx, double(fabsf(f)));
          }
          fprintf(stderr, "flashmla h=%d b=%d ctx=%d: lse[0] %.4f, max|out| %.4f, non-finite %d\n",
                  h, batch, context, l[0], mx, bad);
        }
        cudaGraph_t graph;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int c = 0; c < copies; ++c) run(pools[c]);
        CK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        const double us = mlaserve::bench::MedianReplayUs(exec, stream, copies);
        const double bytes =
            double(batch) * context * 576 * 2 + double(q_elems) * 2 + double(out_elems) * 2;
        const double gbps = bytes / (us * 1e-6) / 1e9;
        printf("flashmla,bf16,%d,%d,%d,sm90_dense,%.2f,%.0f,%.1f,%.3f,%.1f\n", h, batch, context,
               us, bytes, gbps, gbps * 1e9 / copy_bw, copy_bw / 1e9);
        fflush(stdout);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        CK(cudaStreamDestroy(stream));
        for (auto* q : pools) CK(cudaFree(q));
        CK(cudaFree(d_table));
        CK(cudaFree(d_lens));
        CK(cudaFree(d_q));
        CK(cudaFree(d_out));
        CK(cudaFree(d_lse));
        CK(cudaFree(d_lse_acc));
        CK(cudaFree(d_o_acc));
        CK(cudaFree(d_meta));
        CK(cudaFree(d_splits));
      }
  return 0;
}
