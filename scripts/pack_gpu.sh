#!/usr/bin/env bash
# Packs binaries built here for the GPU machine, which has CUDA, NCCL and MPI but lacks ZeroMQ,
# Cap'n Proto, abseil, prometheus-cpp and civetweb (the developers' shared notes): one xz archive holding
# dist/bin (the binaries, and libmlaserve_cuda_backend.so where given: the worker and the model
# tests load it from their own directory) and dist/lib (those libraries, found with ldd).
#   scripts/pack_gpu.sh OUT.tar.xz BINARY...
# On the GPU machine: tar -xJf OUT.tar.xz -C /tmp && export LD_LIBRARY_PATH=/tmp/dist/lib, then
# run /tmp/dist/bin/... from the repository root (scripts/gpu_check.sh /tmp/dist/bin runs the
# GPU test binaries). Carry the archive in a git-ignored folder (e.g. .dev/, excluded in
# .git/info/exclude) and name it in the call's `carry`: one xz -9 archive shares the static
# kernel libraries between the binaries (a dozen test binaries: ~5 MB).
set -euo pipefail
out="${1:?usage: scripts/pack_gpu.sh OUT.tar.xz BINARY...}"
shift
(($#)) || { echo "pack_gpu: no binaries" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/dist/bin" "$tmp/dist/lib"
for b in "$@"; do cp "$b" "$tmp/dist/bin/"; done
for b in "$tmp"/dist/bin/*; do
  ldd "$b" | awk '/=>/ {print $3}' |
    grep -E 'lib(absl_|capnp|kj|prometheus|zmq|sodium|pgm|norm|civetweb|benchmark)' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$tmp/dist/lib/"; done
tar -C "$tmp" -cf - dist | xz -9 -T"$(nproc)" >"$out"
ls -l "$out"
