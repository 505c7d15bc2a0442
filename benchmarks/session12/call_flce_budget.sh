#!/usr/bin/env bash
# Session 12: does a larger FLCE chunk budget (252 MiB: 1024-row chunks at V = 128256, still 384 at the
# Gemma-like 262144) buy time against the 192 MiB default, inside the 256 MiB target? And the spread of
# RMSNorm 4096x16384 (0.19999 ms in session 11's table against <= 0.20) over two more runs.
# Each bench.py run is its own process: the budget is read from the environment at import.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
i=0
for mb in 192 252 192 252; do
  i=$((i + 1))
  echo "== FUSED_KERNELS_FLCE_CHUNK_MB=$mb (run $i)"
  FUSED_KERNELS_FLCE_CHUNK_MB=$mb timeout 120 python3 scripts/bench.py --parts kernels --modes fwdbwd \
    --peers ours --only "flce 8192x4096->128256,flce 16384x2304" --out "$OUT/flce_${i}_$mb.json" \
    > "$OUT/flce_${i}_$mb.log" 2>&1
  tail -n 12 "$OUT/flce_${i}_$mb.log"
done
for i in 1 2; do
  timeout 100 python3 scripts/bench.py --parts kernels --modes fwdbwd --peers ours,liger,torch_compile \
    --only "rms_norm 4096x16384" --out "$OUT/rms_4096x16384_$i.json" > "$OUT/rms_$i.log" 2>&1
  tail -n 8 "$OUT/rms_$i.log"
done
