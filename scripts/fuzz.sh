#!/usr/bin/env bash
# The fuzz stage (fuzz/CMakeLists.txt): builds the libFuzzer targets with clang, ASan and UBSan
# into ${MLASERVE_FUZZ_BUILD_DIR:-build-fuzz} and runs each for ${MLASERVE_FUZZ_SECONDS:-60} s from
# its seed corpus (CTest label `fuzz`, one target at a time). Arguments go to ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MLASERVE_FUZZ_BUILD_DIR:-$root/build-fuzz}"
cmake -S "$root" -B "$build" -G Ninja -DMLASERVE_FUZZ=ON -DMLASERVE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  "-DMLASERVE_FUZZ_SECONDS=${MLASERVE_FUZZ_SECONDS:-60}" >/dev/null
cmake --build "$build" -j "$(nproc)" --target mlaserve_fuzzers
cd "$build"
ctest -L fuzz --output-on-failure "$@"
