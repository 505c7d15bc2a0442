#!/usr/bin/env bash
# Session 15, second device call (carry [".whl"]; <= ~8 min): every gpu test on the library as it now is
# (ring exchange, FLCE chunk granule 8, the long-row RMSNorm backward read once: rms_norm_smem), then the
# RMSNorm long-row forward experiment (exp_rms_fwd_cluster.py) if it is here.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; export OUT
GPU_TESTS=1 BENCH_PARTS="" TEST_BUDGET_S=${TEST_BUDGET_S:-330} TOTAL_BUDGET_S=400 bash scripts/gpu_check.sh \
  > "$OUT/call_check.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -n 15
if [ -f benchmarks/session15/call_rms_fwd.sh ]; then
  EXP_S=${EXP_S:-100} bash benchmarks/session15/call_rms_fwd.sh
fi
