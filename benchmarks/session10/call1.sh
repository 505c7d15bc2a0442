#!/usr/bin/env bash
# Session 10, first device call: validate session 9's last commits (CE gpu tests), run the prepared
# RMSNorm cluster-backward experiment, the host-overhead probe, and re-measure the Qwen3 e2e step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
GPU_TEST_K=cross_entropy TEST_BUDGET_S=150 BENCH_PARTS= bash scripts/gpu_check.sh > "$OUT/call1_tests.log" 2>&1
tail -n 4 "$OUT/call1_tests.log"
source scripts/device_env.sh
timeout 100 python3 benchmarks/session9/exp_rms_bwd_cluster.py 2>&1 | tee "$OUT/exp_rms_bwd_cluster.txt" | tail -n 30
timeout 60 python3 scripts/host_overhead.py --peers ours,liger 2>&1 | tee "$OUT/host_overhead.txt" | tail -n 30
mv "$OUT/bench.json" "$OUT/tests_bench.json" 2>/dev/null
GPU_TESTS=0 BENCH_PARTS=e2e BENCH_E2E_MODELS=qwen3_0.6b BENCH_E2E_PEERS=ours,liger,ours_compile TOTAL_BUDGET_S=${E2E_S:-230} \
  bash scripts/gpu_check.sh > "$OUT/call1_e2e.log" 2>&1
grep -E "qwen3|step|tok/s" "$OUT/call1_e2e.log" | tail -n 30
