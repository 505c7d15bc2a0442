#!/usr/bin/env bash
# Session 16, call 8 (carry [".whl"]; ~1 min): exp_rms_bwd_fence.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PYTHONPATH
timeout ${EXP_S:-200} python3 benchmarks/session16/exp_rms_bwd_fence.py 2>&1 | grep -v Warn | tee "$OUT/exp_rms_bwd_fence.txt"
