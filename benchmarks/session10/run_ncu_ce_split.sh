#!/usr/bin/env bash
# Session 10, one device call: Nsight Compute counters (warp stall reasons above all) of the library's
# shared-memory CE kernel, unsplit at V = 32000 and split over a 4-CTA cluster at 128256 (plus the
# 8-CTA 4-warp shape), to see what holds the split rows at ~80 % of a copy. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout ${NCU_S:-150} "$NCU" --clock-control none -k regex:"_ce_smem_kernel" -c 3 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section LaunchStats \
  python3 benchmarks/session9/exp_ce_library.py --vocabs 32000,128256 --rounds 0 > "$OUT/ncu_ce_split.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  _|Duration|DRAM Throughput|L2 Hit Rate|Achieved Active|Warp Cycles Per Issued|No Eligible|Issue Slots Busy|Stall|stall|Cluster" "$OUT/ncu_ce_split.txt" | head -150
