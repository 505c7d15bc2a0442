#!/usr/bin/env bash
# Prepared for session 13's first device call (~120 s): the register-slices CE probe against the library
# at V = 128256 and 262144 (numbers against float64, then queued timing as fractions of a copy).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
timeout 300 python3 benchmarks/session12/probe_ce_register_slices.py 2>&1 | grep -v Warn | tee "$OUT/probe_ce_register_slices.txt"
