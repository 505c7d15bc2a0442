#!/usr/bin/env bash
# Prepared in session 15 (not yet run): the RMSNorm long-row FORWARD with each row read from HBM once
# (exp_rms_fwd_cluster.py: a row split over a thread-block cluster, held in shared memory / registers,
# the partial sums of squares meeting behind one cluster barrier, rows claimed from a counter), checked
# against float64 (y, rstd; gemma / none / offset / no-weight on one shape) and timed against the
# library's forward at 1024 x 65536 (0.083 ms where a copy takes 0.066; aim ~0.070) and 2048 x 32768.
# ~1 min (compiles included); no wheels needed. A shape at <= ~0.072 ms at 65536, ahead of the library
# by more than the rounds' spread, is worth a library path beside rms_norm_smem's backward.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:${PYTHONPATH:-}
timeout ${EXP_S:-120} python3 benchmarks/session15/exp_rms_fwd_cluster.py --lengths ${LENGTHS:-65536,32768} \
  --rounds ${ROUNDS:-3} 2>&1 | grep --line-buffered -v Warn | tee "$OUT/exp_rms_fwd_cluster.txt"
