#!/usr/bin/env bash
# The decode-step A/B of issue 14 on a GPU machine, in one call: the GPU tests of CudaOps'
# switchable decode optimisations (few-expert MoE kernel, programmatic launches, fused MLA input, fused
# prologues), moe_bench --decode, then mlaserve-model-bench on Kimi-K2.5's rank-0-of-8 shard
# shapes with the defaults (the prologues off, the others on), each switched, and
# all off (the same binary, one process per setting), then the full 61-layer shard.
#   bench/model/run_decode_ab.sh BIN_DIR [LAYERS]
# BIN_DIR holds mlaserve-model-bench, libmlaserve_cuda_backend.so, the test binaries and
# optionally moe_bench (flat), lib/ beside it the libraries the machine lacks; logs go to $OUT
# (or /tmp). LAYERS: the short
# model's layer count (default 4). FULL=0 skips the 61-layer runs (each loads ~95 GB of synthetic
# weights in ~100 s per KV format; KV_FULL=bf16,fp8_tiled for both formats); TESTS=0 skips the
# tests, SAN=1 adds compute-sanitizer on the fused few-expert layer, SHORT=0 the short model's
# rows; EXTRA=1 adds the tensor-parallel MoE row, context 32k and DeepSeek-R1 (on the short model; R1 at full size). Issue 14's full-size rows, each alone:
# FULL_TP=1 the 61-layer shard with tensor-parallel experts; FULL_R1=1 DeepSeek-R1 NVFP4 at 8-way,
# bf16 KV (KV_R1 to change); SLICE32K=N the first N layers of the Kimi shard at context 32k, batches
# 1, 8, 64, bf16 and fp8_tiled KV (the whole shard's latent cache of 64 x 32k does not fit one
# H200 beside its weights: 147 GB bf16; a slice gives the per-layer ratio, labelled as a slice).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="$(cd "$1" && pwd)"
layers="${2:-4}"
out="${OUT:-/tmp}"
export LD_LIBRARY_PATH="$bin/../lib:$bin:${LD_LIBRARY_PATH:-}"
export MLASERVE_SOURCE_DIR="$root"
cd "$root" || exit 1

if [[ "${TESTS:-1}" == 1 ]]; then
  OUT="$out" MLASERVE_TEST_TIMEOUT=300 scripts/gpu_check.sh "$bin" moe_experts_gpu_test \
    elementwise_gpu_test gpu_model_test moe_gpu_test
  (cd "$root" && timeout 300 "$bin/cuda_ops_test" --gtest_filter='*MlaKvPrep*' \
    >"$out/cuda_ops_kvprep.log" 2>&1)
  echo "cuda_ops_test MlaKvPrep rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda_ops_kvprep.log" | tr '\n' ' ')"
fi
# SAN=1: compute-sanitizer memcheck and racecheck on the fused few-expert layer's graph test (its
# persistent kernel waits on a global counter; kernels/moe/moe_few_expert_layer.cuh).
if [[ "${SAN:-0}" == 1 ]] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    (cd "$root" && timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$bin/moe_experts_gpu_test" --gtest_filter='*FewExpertLayerReplays*' \
      >"$out/sanitizer_${tool}_few_expert_layer.log" 2>&1)
    echo "compute-sanitizer $tool few-expert layer rc=$? $(tail -1 "$out/sanitizer_${tool}_few_expert_layer.log")"
  done
fi
# The expert kernels alone (layer time, its few-expert column), where BIN_DIR has moe_bench.
if [[ -x "$bin/moe_bench" ]]; then
  timeout 120 "$bin/moe_bench" --decode >"$out/moe_bench_decode.log" 2>&1
  echo "moe_bench --decode rc=$?"
  grep -E '^(ep8|all)' "$out/moe_bench_decode.log" | cut -c1-20,60-
fi

short="$(mktemp -d)"
trap 'rm -rf "$short"' EXIT
cp -r bench/model/configs/kimi-k2.5/. "$short/"
set_layers() {  # config.json, layers
  python3 - "$1" "$2" <<'PY'
import json, sys
path, layers = sys.argv[1], int(sys.argv[2])
c = json.load(open(path))
t = c.get("text_config", c)
t["num_hidden_layers"] = layers
json.dump(c, open(path, "w"))
PY
}
set_layers "$short/config.json" "$layers"

bench() {  # name, model dir, extra flags... (BENCH_TIMEOUT seconds, default 590)
  local name="$1" dir="$2"
  shift 2
  timeout "${BENCH_TIMEOUT:-590}" "$bin/mlaserve-model-bench" --synthetic-weights "$dir" --rank 0 --ranks 8 \
    --context 1024 --prefill "" --graphs on "$@" >"$out/bench_$name.log" 2>&1
  echo "$name rc=$?"
  grep -E '^decode' "$out/bench_$name.log" | sed 's/reads.*ratio/ratio/'
}

common=(--kv bf16 --batches 1,2,4,8,64)
none=(--moe-few-expert off --programmatic off --fused-mla-input off --programmatic-small off
  --mla-q-fusion off --programmatic-dispatch off --shared-expert-overlap off
  --programmatic-mla-combine off --mla-absorb-fusion off --mla-min-share 4 --moe-route-split off
  --moe-route-dispatch-fusion off --moe-few-expert-layer off)
if [[ "${SHORT:-1}" == 1 ]]; then
  bench short_default "$short" "${common[@]}"
  bench short_tile "$short" "${common[@]}" --moe-few-expert off
  bench short_nopdl "$short" "${common[@]}" --programmatic off
  bench short_nofused "$short" "${common[@]}" --fused-mla-input off
  bench short_prologues "$short" "${common[@]}" --fused-prologues on
  bench short_plain_small "$short" "${common[@]}" --programmatic-small off
  bench short_no_q_fusion "$short" "${common[@]}" --mla-q-fusion off
  bench short_plain_dispatch "$short" "${common[@]}" --programmatic-dispatch off
  bench short_no_overlap "$short" "${common[@]}" --shared-expert-overlap off
  bench short_plain_mla_combine "$short" "${common[@]}" --programmatic-mla-combine off
  bench short_no_absorb_fusion "$short" "${common[@]}" --mla-absorb-fusion off
  bench short_min_share4 "$short" "${common[@]}" --mla-min-share 4
  bench short_route_one_warp "$short" "${common[@]}" --moe-route-split off
  bench short_route_no_dispatch_fusion "$short" "${common[@]}" --moe-route-dispatch-fusion off
  bench short_few_expert_layer "$short" "${common[@]}" --moe-few-expert-layer on
  bench short_new "$short" "${common[@]}" --fused-prologues on
  bench short_none "$short" "${common[@]}" "${none[@]}"
  bench short_default2 "$short" "${common[@]}"
fi

# Issue 14's rows not measured yet (EXTRA=1): Kimi-K2.5 with tensor-parallel experts, context
# 32k at batch 1 and 8, and DeepSeek-R1 NVFP4 at 8-way (16 of 128 heads, 32 of 256 experts).
if [[ "${EXTRA:-0}" == 1 ]]; then
  bench short_tp "$short" "${common[@]}" --moe tensor
  bench short_32k "$short" --kv bf16,fp8_tiled --batches 1,8 --context 32768
  bench r1_full bench/model/configs/deepseek-r1-nvfp4 --kv bf16 --batches 1,8,64,256 --phases on
fi

if [[ "${FULL:-1}" == 1 ]]; then
  full=(--kv "${KV_FULL:-bf16}" --batches 1,8,64,256 --phases on)
  bench full_default bench/model/configs/kimi-k2.5 "${full[@]}"
  bench full_none bench/model/configs/kimi-k2.5 "${full[@]}" "${none[@]}"
fi
if [[ "${FULL_TP:-0}" == 1 ]]; then
  bench full_tp bench/model/configs/kimi-k2.5 --kv bf16 --batches 1,8,64,256 --phases on --moe tensor
fi
if [[ "${FULL_R1:-0}" == 1 ]]; then
  bench r1_full bench/model/configs/deepseek-r1-nvfp4 --kv "${KV_R1:-bf16}" --batches 1,8,64,256 \
    --phases on
fi
if [[ -n "${SLICE32K:-}" ]]; then
  slice="$(mktemp -d)"
  cp -r bench/model/configs/kimi-k2.5/. "$slice/"
  set_layers "$slice/config.json" "$SLICE32K"
  bench "slice${SLICE32K}_32k" "$slice" --kv bf16,fp8_tiled --batches 1,8,64 --context 32768
  rm -rf "$slice"
fi
