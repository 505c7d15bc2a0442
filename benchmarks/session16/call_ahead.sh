#!/usr/bin/env bash
# Session 16, call 6 (carry [".whl"]; ~4 min): exp_rms_bwd_ahead.py, the per-kernel profile of the library's
# long rows, the rms_norm gpu tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PYTHONPATH
timeout ${EXP_S:-200} python3 benchmarks/session16/exp_rms_bwd_ahead.py 2>&1 | grep -v Warn | tee "$OUT/exp_rms_bwd_ahead.txt"
timeout ${PROF_S:-60} python3 scripts/profile_ops.py --only "rms_norm 1024x65536,rms_norm 2048x32768" --peers ours \
  2>&1 | grep -v Warn | tee "$OUT/profile_rms_long.txt"
timeout ${TEST_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rms_norm.py 2>&1 | tail -n 8 \
  | tee "$OUT/gpu_tests_rms.log"
