#!/usr/bin/env bash
# Session 11, the one-run table on the final library, in two device calls (each under the 600 s limit):
#   PART=kernels  the kernel table, fwd+bwd (the targets' mode)      ~280 s
#   PART=e2e      the training steps (Qwen3-0.6B, Llama-8B 4 layers)  ~475 s
# $OUT/bench.json comes back; scripts/bench.py --merge joins the two.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
case "${PART:?PART=kernels or PART=e2e}" in
  kernels) GPU_TESTS=0 TOTAL_BUDGET_S=400 BENCH_PARTS=kernels BENCH_MODES=fwdbwd bash scripts/gpu_check.sh > "$OUT/call_kernels.log" 2>&1 ;;
  e2e) GPU_TESTS=0 TOTAL_BUDGET_S=500 BENCH_PARTS=e2e bash scripts/gpu_check.sh > "$OUT/call_e2e.log" 2>&1 ;;
esac
tail -n 60 "$OUT/call_${PART}.log"
