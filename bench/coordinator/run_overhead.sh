#!/usr/bin/env bash
# Coordinator overhead per step with the model taken out: the real coordinator and load
# generator against mlaserve-null-worker (the step protocol answered at once, no model), at 1,
# 64 and 256 concurrent requests. Prints the loadgen report, including the coordinator's own
# per-step overhead histogram (scheduling + plan encoding + result handling + streaming).
#   bench/coordinator/run_overhead.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
port=${MLASERVE_PORT:-7955}
dir=$(mktemp -d)
"$build/coordinator/server/mlaserve-coordinator" --model "$root/tests/fixtures/models/kimi-tiny" \
  --listen "tcp://127.0.0.1:$port" --worker-listen "ipc://$dir/worker" --metrics "127.0.0.1:$((port + 2))" \
  --max-running 256 --max-step-tokens 65536 --max-waiting 4096 --prefill-chunk 0 >"$dir/coordinator.log" 2>&1 &
coord=$!
"$build/bench/coordinator/mlaserve-null-worker" --coordinator "ipc://$dir/worker" --vocab 512 --kv-blocks 8192 &
worker=$!
trap 'kill -TERM $coord 2>/dev/null || true; wait $coord 2>/dev/null || true
  kill $worker 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
  "$build/coordinator/client/mlaserve-cli" --endpoint "tcp://127.0.0.1:$port" health >/dev/null 2>&1 && break
  sleep 0.1
done
for c in ${CONCURRENCIES:-1 64 256}; do
  echo "== concurrency $c"
  "$build/bench/loadgen/mlaserve-loadgen" --endpoint "tcp://127.0.0.1:$port" --concurrency "$c" \
    --requests $((c * ${WAVES:-4})) --input-len 1000 --output-len 256 --vocab 512 \
    --metrics "127.0.0.1:$((port + 2))"
done
