#!/usr/bin/env bash
# The lean variant of ../session13/call_next_ring.sh, for a session with little device time (~150 s of
# command; session 14 had 228 s and could not start a machine): the cluster exchange in two slots per
# cluster (session 13's ring_exchange.patch, applied on the device's copy only) and _row_loss's new order. The
# shared-memory gpu tests of the split rows (2 and 8 CTAs; their assertion: <= 64 KiB of scratch) and one
# unsplit case, then CE 8192 x 128256 / 262144 timed with the table's shapes (session 13: 1.115 / 2.321 ms,
# exp_ce_register_rows_part3.txt). Carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/../.."
git apply benchmarks/session13/ring_exchange.patch || { echo "the patch does not apply"; exit 1; }
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PYTHONPATH
timeout ${TEST_S:-95} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_cross_entropy.py \
  -k "smem_path and (128256 or 262144 or 4300 or (32000 and smoothing))" 2>&1 | tail -n 15 | tee "$OUT/gpu_tests_smem.log"
timeout ${EXP_S:-70} python3 - <<'PY' 2>&1 | grep -v Warn | tee "$OUT/ce_ring_times.txt"
import sys
sys.path.insert(0, "benchmarks/session13")
import exp_ce_register_rows as e
import torch, triton
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
e.plain((128256, 262144), ("8 CTAs x 4 warps, 3 in regs, 8/SM", "8 CTAs x 8 warps, 3 in regs, 4/SM"))
PY
