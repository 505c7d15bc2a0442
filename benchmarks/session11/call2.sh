#!/usr/bin/env bash
# Session 11, second device call: the tagged CE exchange (fixed for triton 3.6: its claim passes the two
# addresses as integers), and the RMSNorm dw tail as one Triton kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh
timeout 200 python3 benchmarks/session10/probe_ce_relaxed_barrier.py 2>&1 | tee "$OUT/probe_ce_tagged.txt"
timeout 200 python3 benchmarks/session11/exp_rms_dw_sum.py 2>&1 | tee "$OUT/exp_rms_dw_sum.txt"
