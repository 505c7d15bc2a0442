#!/usr/bin/env bash
# Session 16's device calls (carry [".whl"]): `bash benchmarks/session16/call.sh STEP...`, each STEP one of
#   exp_rms_bwd_NAME   benchmarks/session16/exp_rms_bwd_NAME.py (NAME: stages, probe, knobs, ahead, refill,
#                      fence; each names the kernel patch it was run on) -> $OUT/exp_rms_bwd_NAME.txt
#   exp_rms_fwd_wsmem  the long-row forward over a cluster with w in shared memory (prepared, not yet run)
#   profile    scripts/profile_ops.py, ours, at 1024x65536 and 2048x32768 -> $OUT/profile_rms_long.txt
#   tests      the rms_norm gpu tests -> $OUT/gpu_tests_rms.log
#   ncu        Nsight Compute sections of the 1024x65536 forward / backward / dw sum -> $OUT/ncu_rms_long.txt
#   stalls     warp stall reasons of the same kernels -> $OUT/ncu_rms_stalls.txt
# The calls as made (exp_ short for exp_rms_bwd_): 1 exp_stages profile tests (the profile then at
# 1024x65536 and 4096x16384); 2 exp_probe; 3 ncu; 4 stalls (the forward and backward only); 5 exp_knobs;
# 6 exp_ahead profile tests; 7 exp_refill stalls (the backward only); 8 exp_fence; 9-10 the table
# (benchmarks/session12/call_table.sh, PART=kernels with GPU_TEST_K=rms_norm, then PART=e2e).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16:$PYTHONPATH
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
KERNELS='regex:_rms_bwd_smem_kernel|_rms_norm_fwd_kernel|_dw_sum_kernel'
for step in "$@"; do
  case "$step" in
    exp_*) timeout ${EXP_S:-300} python3 "benchmarks/session16/$step.py" 2>&1 | grep -v Warn | tee "$OUT/$step.txt" ;;
    profile) timeout ${PROF_S:-90} python3 scripts/profile_ops.py --only "rms_norm 1024x65536,rms_norm 2048x32768" \
               --peers ours 2>&1 | grep -v Warn | tee "$OUT/profile_rms_long.txt" ;;
    tests) timeout ${TEST_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rms_norm.py 2>&1 \
             | tail -n 8 | tee "$OUT/gpu_tests_rms.log" ;;
    ncu) timeout ${NCU_S:-300} "$NCU" --clock-control none --profile-from-start off -k "$KERNELS" \
           --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
           --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
           python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_long.txt" | tail -n 200 ;;
    stalls) timeout ${NCU_S:-300} "$NCU" --clock-control none --profile-from-start off -k "$KERNELS" \
              --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,sm__cycles_elapsed.avg,dram__bytes.sum,gpu__time_duration.sum" \
              python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_stalls.txt" \
              | grep -v " 0$\| 0\.0[0-4]$" ;;
    *) echo "unknown step $step (exp_NAME, profile, tests, ncu, stalls)"; exit 2 ;;
  esac
done
