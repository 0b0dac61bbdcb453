#!/usr/bin/env bash
# Configures and builds mlaserve into ${MLASERVE_BUILD_DIR:-build}. CUDA code is compiled where
# /usr/local/cuda exists, for ${MLASERVE_CUDA_ARCHS:-90a;120a} (set MLASERVE_CUDA=OFF to skip it).
# Arguments: targets to build (default: all).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MLASERVE_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE="${MLASERVE_BUILD_TYPE:-RelWithDebInfo}" \
  -DMLASERVE_CUDA="${MLASERVE_CUDA:-AUTO}" \
  "-DCMAKE_CUDA_ARCHITECTURES=${MLASERVE_CUDA_ARCHS:-90a;120a}" >/dev/null
if (($#)); then
  cmake --build "$build" -j "$(nproc)" --target "$@"
else
  cmake --build "$build" -j "$(nproc)"
fi
