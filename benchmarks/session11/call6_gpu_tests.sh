#!/usr/bin/env bash
# Session 11, last device call: the whole gpu test suite on the final library.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export OUT
GPU_TESTS=1 BENCH_PARTS= TEST_BUDGET_S=${TEST_S:-340} bash scripts/gpu_check.sh > "$OUT/call6.log" 2>&1
tail -n 8 "$OUT/gpu_tests.log"
