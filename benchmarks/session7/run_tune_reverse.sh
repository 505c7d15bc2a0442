#!/usr/bin/env bash
# Session 7: the reversed second sweep (LaunchConfig.reverse) against the table, V = 32000 and 128256.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
for v in 32000 128256; do
  var=CONFIGS_$v
  timeout 200 python3 scripts/tune_cross_entropy.py --no-flce --vocabs $v --reps 21 --budget-s 150 \
    --configs "${!var}" > "$OUT/tune_ce_reverse_$v.txt" 2>&1
  echo "tune $v rc=$?"; grep -E "ms |best" "$OUT/tune_ce_reverse_$v.txt"
done
if [ -n "${NCU_CFG:-}" ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  CE_FORCE="$NCU_CFG" timeout 120 "$NCU" --clock-control none --profile-from-start off -k regex:"_ce_kernel|_copy_kernel" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    python3 benchmarks/session7/ncu_ce.py 32000 > "$OUT/ncu_ce_reverse.txt" 2>&1
  grep -E "^  _|Duration|DRAM Throughput|L2 Hit Rate|Achieved Occupancy" "$OUT/ncu_ce_reverse.txt"
fi
