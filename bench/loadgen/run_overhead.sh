#!/usr/bin/env bash
# Coordinator overhead per step and serving latencies at 1, 64 and 256 concurrent requests, on
# the CPU backend with the kimi-tiny fixture (2 worker ranks), through the real processes.
#   bench/loadgen/run_overhead.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
port=${MLASERVE_PORT:-7755}
"$root/deploy/mlaserve-launch" --model "$root/tests/fixtures/models/kimi-tiny" --cpu --ranks 2 --allow-no-tokenizer \
  --bin "$build" --listen "tcp://127.0.0.1:$port" --worker-port $((port + 1)) \
  --metrics "127.0.0.1:$((port + 2))" --worker-metrics-port 0 --kv-format bf16 --kv-blocks 1100 \
  -- --max-running 256 --max-step-tokens 4096 --max-waiting 4096 >/tmp/mlaserve-overhead-server.log 2>&1 &
launcher=$!
trap 'kill -TERM $launcher 2>/dev/null; wait $launcher 2>/dev/null' EXIT
for _ in $(seq 300); do
  "$build/coordinator/client/mlaserve-cli" --endpoint "tcp://127.0.0.1:$port" health >/dev/null 2>&1 && break
  sleep 0.2
done
for c in ${CONCURRENCIES:-1 64 256}; do
  echo "== concurrency $c"
  "$build/bench/loadgen/mlaserve-loadgen" --endpoint "tcp://127.0.0.1:$port" --concurrency $c \
    --requests $((c * ${WAVES:-3})) --input-len 64 --output-len 64 --vocab 512 --metrics "127.0.0.1:$((port + 2))"
done
