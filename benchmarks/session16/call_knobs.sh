#!/usr/bin/env bash
# Session 16, call 5 (carry [".whl"]; ~2 min): exp_rms_bwd_knobs.py (working tree with knobs.patch).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PYTHONPATH
timeout ${EXP_S:-300} python3 benchmarks/session16/exp_rms_bwd_knobs.py 2>&1 | grep -v Warn | tee "$OUT/exp_rms_bwd_knobs.txt"
