#!/usr/bin/env bash
# Session 18: is Qwen3-0.6B's eager step (78.2k tok/s in this session's e2e call, 107.1k in session 16's)
# slower because of the code or because of the host? The same step timed with session 16's library
# (e64590b's fused_kernels + autopatch, extracted into old_s16/, carried) and with this tree's, back to
# back in one call, old first. (carry [".whl", "old_s16"])
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
for which in old new; do
  if [ "$which" = old ]; then PP=$PWD/old_s16:$PYTHONPATH; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout ${RUN_S:-90} python3 scripts/bench.py --parts e2e --e2e-models qwen3_0.6b --e2e-peers ours \
    --e2e-budget-s 85 --out "$OUT/e2e_$which.json" 2>&1 | grep -E "tok/s|steps|e2e\]" | head -4
  PYTHONPATH=$PP python3 -c "import fused_kernels, os; print('  library from', os.path.dirname(fused_kernels.__file__))"
done
