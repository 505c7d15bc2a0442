#!/usr/bin/env bash
# Session 10, third device call: the kernel table (fwdbwd, the targets' mode) on the final library, then
# the Qwen3 step with the default caching allocator and with expandable segments (A/B, ours only).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
GPU_TESTS=0 TOTAL_BUDGET_S=${K_S:-400} BENCH_PARTS=kernels BENCH_MODES=fwdbwd bash scripts/gpu_check.sh > "$OUT/call3_kernels.log" 2>&1
mv "$OUT/bench.json" "$OUT/k.json"; mv "$OUT/bench.log" "$OUT/k_bench.log"
tail -n 45 "$OUT/call3_kernels.log"
for conf in "" "expandable_segments:True"; do
  PYTORCH_CUDA_ALLOC_CONF=$conf GPU_TESTS=0 BENCH_PARTS=e2e BENCH_E2E_MODELS=qwen3_0.6b BENCH_E2E_PEERS=ours \
    TOTAL_BUDGET_S=140 bash scripts/gpu_check.sh > "$OUT/call3_e2e_${conf%%:*}.log" 2>&1
  mv "$OUT/bench.json" "$OUT/e2e_ab_${conf%%:*}.json"
  echo "== PYTORCH_CUDA_ALLOC_CONF=$conf"; grep -A2 "qwen3_0.6b / ours " "$OUT/call3_e2e_${conf%%:*}.log" | head -4
done
