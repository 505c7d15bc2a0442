#!/usr/bin/env bash
# Session 15, call 5 (carry [".whl"]; ~3 min): the rms_norm gpu tests with CHUNK_WAITS on (the library's
# default now), then exp_rms_bwd_chunk_waits.py: per-chunk copy waits against whole-row waits.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
timeout ${TEST_S:-120} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rms_norm.py 2>&1 | tail -n 8 \
  | tee "$OUT/gpu_tests_rms_chunk_waits.log"
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PYTHONPATH
timeout ${EXP_S:-120} python3 benchmarks/session15/exp_rms_bwd_chunk_waits.py 2>&1 | grep -v Warn \
  | tee "$OUT/exp_rms_bwd_chunk_waits.txt"
