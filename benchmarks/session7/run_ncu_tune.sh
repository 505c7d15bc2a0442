#!/usr/bin/env bash
# Session 7, one device call: Nsight Compute counters of the CE kernel against a copy (ncu_ce.py), then
# small-block launch shapes for V = 32000 (tune_cross_entropy.py --configs). Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 200 "$NCU" --clock-control none --profile-from-start off -k regex:"_ce_kernel|_copy_kernel" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/session7/ncu_ce.py ${NCU_VOCABS:-32000 128256} > "$OUT/ncu_ce.txt" 2>&1
echo "ncu rc=$?"; grep -E "^  _|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per|Theoretical Occ|Warp Cycles Per Issued|No Eligible" "$OUT/ncu_ce.txt" | head -80
timeout ${TUNE_S:-200} python3 scripts/tune_cross_entropy.py --no-flce --vocabs 32000 --budget-s $(( ${TUNE_S:-200} - 30 )) \
  --configs "${CONFIGS}" > "$OUT/tune_ce_small_blocks.txt" 2>&1
echo "tune rc=$?"; cat "$OUT/tune_ce_small_blocks.txt" | head -60
