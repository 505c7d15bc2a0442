#!/usr/bin/env bash
# Session 11, fourth device call: the CE kernel with a cp.async group per chunk and pass 1 waiting chunk by chunk.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh
timeout 250 python3 benchmarks/session11/probe_ce_chunk_waits.py 2>&1 | tee "$OUT/probe_ce_chunk_waits.txt"
