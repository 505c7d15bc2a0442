#!/usr/bin/env bash
# Session 11, first device call: session 10's prepared CE exchange probe (relaxed-arrive bound and the
# tagged exchange), then where the RMSNorm long-row fwd+bwd time goes per kernel (ours).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 python3 benchmarks/session10/probe_ce_relaxed_barrier.py 2>&1 | tee "$OUT/probe_ce_relaxed_barrier.txt"
timeout 150 python3 scripts/profile_ops.py --only "rms_norm 4096x16384,rms_norm 1024x65536" --peers ours,torch_compile \
  --out "$OUT/profile_rms_long.json" 2>&1 | tee "$OUT/profile_rms_long.txt"
