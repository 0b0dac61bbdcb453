#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts a coordinator and two `mpirun` worker
# ranks on the embedded model (models/tiny-en-nvfp4: 4.3 M parameters, DeepSeek-V3 architecture,
# NVFP4 routed experts, trained on the Brown corpus by models/train/train_tiny_en.py) on the CPU,
# streams a chat answer to the terminal, and shuts the server down.
#   scripts/run.sh ["your message"]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MLASERVE_BUILD_DIR:-$root/build-cpu}"  # CPU only: the main job needs no CUDA
"$root/scripts/install_deps.sh"
MLASERVE_BUILD_DIR="$build" MLASERVE_CUDA="${MLASERVE_CUDA:-OFF}" "$root/scripts/build.sh" mlaserve-coordinator mlaserve-worker \
  mlaserve-cli
model="${MLASERVE_MODEL:-$root/models/tiny-en-nvfp4}"
port=${MLASERVE_PORT:-5555}
endpoint="tcp://127.0.0.1:$port"
"$root/deploy/mlaserve-launch" --model "$model" --cpu --ranks 2 --bin "$build" \
  --listen "$endpoint" --worker-port $((port + 1)) --metrics "127.0.0.1:$((port + 2))" \
  --worker-metrics-port $((port + 10)) --kv-blocks 64 >"$build/run-server.log" 2>&1 &
launcher=$!
trap 'kill -TERM $launcher 2>/dev/null; wait $launcher 2>/dev/null' EXIT
for _ in $(seq 300); do
  "$build/coordinator/client/mlaserve-cli" --endpoint "$endpoint" health >/dev/null 2>&1 && break
  kill -0 $launcher 2>/dev/null || { cat "$build/run-server.log"; exit 1; }
  sleep 0.2
done
echo "== server up: $("$build/coordinator/client/mlaserve-cli" --endpoint "$endpoint" health)"
echo "== chat (a 4.3 M-parameter model that read the Brown corpus: it continues your sentence in"
echo "   the corpus' 1961 American English, streamed token by token)"
"$build/coordinator/client/mlaserve-cli" --endpoint "$endpoint" chat --max-tokens 64 \
  --temperature 0 "${1:-The house was quiet.}"
echo "== metrics sample:"
curl -s "http://127.0.0.1:$((port + 2))/metrics" 2>/dev/null | grep -E '^mlaserve_(requests_total|generation_tokens_total)' || true
