#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs every test (GPU tests skip
# where there is no GPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh"
cd "${MLASERVE_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)" "$@"
