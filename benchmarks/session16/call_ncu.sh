#!/usr/bin/env bash
# Session 16, call 3 (carry [".whl"]): Nsight Compute on the library's 1024 x 65536 RMSNorm forward and
# long-row backward (speed of light, occupancy, warp states, scheduler, memory), clocks left alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout ${NCU_S:-300} $NCU --clock-control none --profile-from-start off \
  -k regex:"_rms_bwd_smem_kernel|_rms_norm_fwd_kernel|_dw_sum_kernel" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_long.txt" | tail -n 400
