#!/usr/bin/env bash
# Session 10, second device call: the RMSNorm cluster backward and the library CE per V, timed with
# queued launches (GPU time only: tune_cross_entropy.queued_ms) instead of event_ms's launch gaps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh
timeout 150 python3 benchmarks/session9/exp_rms_bwd_cluster.py --queued 2>&1 | tee "$OUT/exp_rms_bwd_cluster_queued.txt"
timeout 200 python3 benchmarks/session9/exp_ce_library.py --queued --vocabs ${VOCABS:-32000,128256,262144} 2>&1 | tee "$OUT/exp_ce_library_queued.txt"
