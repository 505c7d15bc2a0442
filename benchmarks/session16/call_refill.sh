#!/usr/bin/env bash
# Session 16, call 7 (carry [".whl"]; ~2 min): exp_rms_bwd_refill.py, then ncu stall reasons of the library's
# long-row backward with w in shared memory.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PYTHONPATH
timeout ${EXP_S:-200} python3 benchmarks/session16/exp_rms_bwd_refill.py 2>&1 | grep -v Warn | tee "$OUT/exp_rms_bwd_refill.txt"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout ${NCU_S:-120} $NCU --clock-control none --profile-from-start off -k regex:"_rms_bwd_smem_kernel" \
  --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,sm__cycles_elapsed.avg,dram__bytes.sum,gpu__time_duration.sum" \
  python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_stalls_w_in_smem.txt" | grep -v " 0$\| 0\.0[0-4]$"
