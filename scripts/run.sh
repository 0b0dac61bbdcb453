#!/usr/bin/env bash
# The main job: installs what is missing, builds, and generates a continuation of a prompt with
# the embedded tiny model (random weights, DeepSeek-V3's tokenizer) on the CPU.
#   scripts/run.sh ["your prompt"]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MLASERVE_BUILD_DIR:-$root/build}"
"$root/scripts/install_deps.sh"
MLASERVE_CUDA="${MLASERVE_CUDA:-OFF}" "$root/scripts/build.sh" mlaserve-generate tiny_model
"$build/worker/mlaserve-generate" --model "$build/models/tiny-deepseek-v3" \
  --prompt "${1:-The three most useful things to know about mixture-of-experts models are}" \
  --max-tokens 32 --ignore-eos
