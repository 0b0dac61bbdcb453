#!/usr/bin/env bash
# Builds bench/mla/flashmla_peer.cu, issue 15's FlashMLA peer: FlashMLA's SM90 dense BF16 decode
# (scheduling metadata, split kernel, combine) timed as mla_decode_bench times ours. FlashMLA and
# CUTLASS are not part of this repository (nothing of theirs is committed): pass a checkout of
# deepseek-ai/FlashMLA and of NVIDIA/cutlass at the commit FlashMLA pins as its csrc/cutlass
# submodule (session 28: FlashMLA 9241ae3, CUTLASS 147f567). Not built by CMake or CI; sm_90a only
# (the kernel is SM90-specific). ~2.5 minutes on 2 cores; the binary runs on the GPU machine:
#   bench/mla/flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT [HEADS [BATCHES [CONTEXTS]]]
#   OUT 8,16,64,128 1,64 32768,131072  > flashmla.csv
set -euo pipefail
fm="${1:?usage: flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT}"
cu="${2:?usage: flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT}"
out="${3:?usage: flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# FlashMLA's own nvcc flags (its setup.py), fp16 instantiations left out.
nv=(/usr/local/cuda/bin/nvcc -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16
  --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
  -gencode arch=compute_90a,code=sm_90a -I"$fm/csrc" -I"$cu/include"
  -I"$fm/csrc/kerutils/include" -I"$here/../.." -w)
"${nv[@]}" -c "$here/flashmla_peer.cu" -o "$tmp/peer.o" &
"${nv[@]}" -c "$fm/csrc/smxx/decode/combine/combine.cu" -o "$tmp/combine.o" &
"${nv[@]}" -c "$fm/csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu" \
  -o "$tmp/sched.o" &
wait
"${nv[@]}" -c "$fm/csrc/sm90/decode/dense/instantiations/bf16.cu" -o "$tmp/bf16.o"
"${nv[@]}" "$tmp"/*.o -o "$out" -lcuda
ls -l "$out"
