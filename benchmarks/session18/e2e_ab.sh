#!/usr/bin/env bash
# Session 18: is Qwen3-0.6B's eager step (78.2k tok/s in this session's e2e call, 107.1k in session 16's)
# slower because of the code or because of the host? The same step timed with session 16's library
# (e64590b's fused_kernels + autopatch, extracted into old_s16/ and carried: carry [".whl", "old_s16"]) and
# with this tree's, back to back in one call, old first.
#   git archive e64590b fused_kernels autopatch | tar -x -C old_s16
# As run in session 18's call 5, the script put old_s16 on PYTHONPATH; scripts/bench.py puts its own
# repository root first, so both runs imported this tree (its "library from" lines said so): two reruns
# of c4fce48. Now the old run gets a tree of its own (old_s16 + a copy of scripts/), whose root bench.py
# puts first; each run prints the library it imported.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
OLD=$(mktemp -d)
cp -r old_s16/fused_kernels old_s16/autopatch "$OLD"/ && cp -r scripts "$OLD"/scripts
for which in old new; do
  if [ "$which" = old ]; then ROOT=$OLD; else ROOT=$PWD; fi
  (cd "$ROOT" && timeout ${RUN_S:-90} python3 scripts/bench.py --parts e2e --e2e-models qwen3_0.6b --e2e-peers ours \
     --e2e-budget-s 85 --out "$OUT/e2e_$which.json" 2>&1 | grep -E "tok/s|steps|e2e\]" | head -4
   python3 -c "import sys; sys.path.insert(0, '.'); import fused_kernels, os; print('  library from', os.path.dirname(fused_kernels.__file__))")
done
rm -rf "$OLD"
