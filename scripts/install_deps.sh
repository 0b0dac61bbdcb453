#!/usr/bin/env bash
# Installs what mlaserve needs to build and test on Debian 12, idempotently.
# Debian packages only (plus npm for the tokenizer assets, see scripts/install_npm_assets.sh).
# CUDA and NCCL are not installed here: they are used from /usr/local/cuda where present.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  clang  # the fuzz build (scripts/fuzz.sh): libFuzzer, ASan, UBSan
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin
  libzmq3-dev cppzmq-dev
  capnproto libcapnp-dev
  prometheus-cpp-dev prometheus
  libcivetweb-dev
  libpcre2-dev
  python3 python3-jinja2 python3-regex python3-numpy
  nodejs
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all Debian packages present"
fi

if ! command -v npm >/dev/null 2>&1; then
  # Debian's nodejs comes without npm (a separate package); a Node.js that bundles npm (as
  # NodeSource's does) needs nothing more.
  echo "install_deps: installing Debian's npm"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$here/install_npm_assets.sh" ]]; then
  "$here/install_npm_assets.sh"
fi
