#!/usr/bin/env bash
# Session 12, the one-run table on the library with the 252 MiB FLCE chunk default, in two device calls:
#   PART=kernels  the FLCE / loss / stack gpu tests (the default changed), then the kernel table (fwdbwd)
#   PART=e2e      the training steps (Qwen3-0.6B, Llama-8B 4 layers)
# $OUT/bench.json comes back; scripts/bench.py --merge joins the two. Session 13 ran the kernels part as
#   GPU_TEST_K="cross_entropy or rules_loss" TEST_BUDGET_S=270 TOTAL_BUDGET_S=590 PART=kernels bash benchmarks/session12/call_table.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
case "${PART:?PART=kernels or PART=e2e}" in
  kernels) GPU_TEST_K=${GPU_TEST_K-"fused_linear_cross_entropy or rules_loss or stack_gpu"} \
           TEST_BUDGET_S=${TEST_BUDGET_S:-150} TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-540} BENCH_PARTS=kernels \
           BENCH_MODES=fwdbwd bash scripts/gpu_check.sh > "$OUT/call_kernels.log" 2>&1 ;;
  e2e) GPU_TESTS=0 TOTAL_BUDGET_S=500 BENCH_PARTS=e2e bash scripts/gpu_check.sh > "$OUT/call_e2e.log" 2>&1 ;;
esac
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -3
tail -n 50 "$OUT/call_${PART}.log"
