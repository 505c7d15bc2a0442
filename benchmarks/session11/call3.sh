#!/usr/bin/env bash
# Session 11, third device call: the RMSNorm gpu tests with the dw tail as one Triton kernel, where the
# RMSNorm fwd+bwd time goes now (four table shapes), and the backward autotuner's candidates at 4096×16384.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
GPU_TESTS=1 GPU_TEST_K=rms BENCH_PARTS= TEST_BUDGET_S=170 bash scripts/gpu_check.sh > "$OUT/call3_tests.log" 2>&1
tail -n 6 "$OUT/gpu_tests.log"
source scripts/device_env.sh
timeout 120 python3 scripts/profile_ops.py --peers ours,torch_compile \
  --only "rms_norm 16384x4096,rms_norm 65536x1024,rms_norm 4096x16384,rms_norm 1024x65536" \
  --out "$OUT/profile_rms.json" 2>&1 | grep -v Warn | tee "$OUT/profile_rms.txt"
timeout 120 python3 scripts/tune_rms_norm.py --shapes 4096x16384 2>&1 | tee "$OUT/tune_rms_4096x16384.txt"
