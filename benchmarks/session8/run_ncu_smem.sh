#!/usr/bin/env bash
# Session 8, one device call: Nsight Compute counters of the shared-memory CE kernel (exp_ce_smem.py)
# against the table's two-sweep kernel at V = 32000. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:$PWD/scripts TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout ${NCU_S:-200} "$NCU" --clock-control none --profile-from-start off -k regex:"_ce_kernel|_ce_smem" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/session8/exp_ce_smem.py --ncu "${NCU_CONFIGS:-8x3x1,4x3x0}" > "$OUT/ncu_ce_smem.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  _|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per|Theoretical Occ|Warp Cycles Per Issued|No Eligible|Issue Slots Busy|Issued Warp|Stall|stall" "$OUT/ncu_ce_smem.txt" | head -120
