#!/usr/bin/env bash
# Session 13 device call: the cross-entropy gpu tests on the library with register rows, then the sweep
# of benchmarks/session13/exp_ce_register_rows.py. Carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PYTHONPATH
[ "${TEST_S:-240}" = 0 ] || timeout ${TEST_S:-240} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_cross_entropy.py ${TEST_K:+-k "$TEST_K"} 2>&1 \
  | tail -n 25 | tee "$OUT/gpu_tests_ce.log"
timeout ${EXP_S:-320} python3 benchmarks/session13/exp_ce_register_rows.py ${EXP_ARGS:-} 2>&1 | grep -v Warn | tee "$OUT/exp_ce_register_rows${EXP_ARGS:+_${EXP_ARGS#--}}.txt"
