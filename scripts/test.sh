#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs every test (GPU tests skip
# where there is no GPU), then the sanitizer and fuzz stages.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh"
(cd "${MLASERVE_BUILD_DIR:-$root/build}" && ctest --output-on-failure -j "$(nproc)" "$@")
# The sanitizer stage (scripts/sanitize.sh; MLASERVE_SANITIZE=0 skips it): a clang ASan + UBSan
# build of the CPU code and tests in build-asan/, and the CPU tests under it.
if [[ "${MLASERVE_SANITIZE:-1}" != 0 ]]; then
  "$root/scripts/sanitize.sh"
fi
# The fuzz stage (scripts/fuzz.sh; MLASERVE_FUZZ=0 skips it): a clang ASan + UBSan build of the
# parsers, each fuzzer ${MLASERVE_FUZZ_SECONDS:-60} s.
if [[ "${MLASERVE_FUZZ:-1}" != 0 ]]; then
  "$root/scripts/fuzz.sh"
fi
