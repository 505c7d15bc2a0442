#!/usr/bin/env bash
# Prepared in session 14 (no device time left to run it): does FLCE's 128-row chunk granule cost the
# Gemma-like shape? At V = 262144 the default 252 MiB budget fits 504 rows, which chunk_rows rounds down
# to 384 (43 chunks instead of 33); each chunk's grad_weight addmm reads and writes the whole 1.2 GB
# weight gradient, and session 5 measured 113.9 ms at 384 rows against 108.7 at 512
# (../session5/flce_gemma_gemm_decomposition.txt). The table's Gemma-like row has stayed at 111-113 ms
# wall since. This times the chunk loop's GEMMs and FLCE fwd+bwd (peak memory too) at 384 / 448 / 504 /
# 512 rows, and at the Qwen3 step's lm_head shape (768 now, 864 with an 8-row granule). If 504 wins by more
# than the spread, chunk_rows' granule becomes 8 (cuBLAS needs leading dimensions in multiples of 8 elements)
# and test_chunk_rule's expected rows change with it. ~2-3 min; carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
timeout ${GEMMA_S:-150} python3 scripts/tune_cross_entropy.py --flce-only --flce-shape 16384,2304,262144 \
  --flce-chunks 384,448,504 2>&1 | grep -v Warn | tee "$OUT/flce_granule_gemma.txt"
timeout ${QWEN_S:-90} python3 scripts/tune_cross_entropy.py --flce-only --flce-shape 16384,1024,151936 \
  --flce-chunks 768,864 2>&1 | grep -v Warn | tee "$OUT/flce_granule_qwen3.txt"
