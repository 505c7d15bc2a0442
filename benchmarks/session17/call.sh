#!/usr/bin/env bash
# Session 17's device calls (carry [".whl"]): `bash benchmarks/session17/call.sh STEP...`, each STEP one of
#   tests      the rms_norm gpu tests and cross_entropy's smem ones (the claim counter changed) -> $OUT/gpu_tests.log
#   profile    scripts/profile_ops.py, ours and torch.compile, at rms_norm 1024x65536 -> $OUT/profile_rms_long.txt
#   stalls     Nsight Compute warp stall reasons of this session's forward, backward and dw sum at 1024x65536
#              (session 16's method; not run this session) -> $OUT/ncu_rms_stalls.txt
#   exp_NAME   benchmarks/session17/exp_NAME.py -> $OUT/exp_NAME.txt (rms_knobs, rms_claim: run on the commits their
#              docstrings name; rms_dsmem, rms_16k: run in session 18, see benchmarks/session18/README.md)
# The calls as made: 1 (on session 16's call.sh) tests + exp_rms_fwd_wsmem; 2 tests profile (the tests timed out
# after 48 of 60, all passed); 3-5 exp_rms_knobs (runs 1-3); 6 the rms gpu tests + profile; 7 exp_rms_claim;
# 8 the table (benchmarks/session12/call_table.sh PART=kernels, GPU_TEST_K=rms_norm); 9-10 the remaining
# cross_entropy smem gpu tests and the fused linear CE / loss-rule ones.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16:$PWD/benchmarks/session17:$PYTHONPATH
for step in "$@"; do
  case "$step" in
    tests) timeout ${TEST_S:-240} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rms_norm.py \
             "tests/test_cross_entropy.py::test_gpu_smem_path_matches_reference" 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.log" ;;
    profile) timeout ${PROF_S:-120} python3 scripts/profile_ops.py --only "rms_norm 1024x65536" \
               --peers ${PEERS:-ours} 2>&1 | grep -v Warn | tee "$OUT/profile_rms_long.txt" ;;
    stalls) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            timeout ${NCU_S:-300} "$NCU" --clock-control none --profile-from-start off \
              -k 'regex:_rms_bwd_smem_kernel|_rms_fwd_smem_kernel|_dw_sum_kernel' \
              --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,sm__cycles_elapsed.avg,dram__bytes.sum,gpu__time_duration.sum" \
              python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_stalls.txt" \
              | grep -v " 0$\| 0\.0[0-4]$" ;;
    exp_*) timeout ${EXP_S:-300} python3 "benchmarks/session17/$step.py" 2>&1 | grep -v Warn | tee "$OUT/$step.txt" ;;
    *) echo "unknown step $step (tests, profile, stalls, exp_NAME)"; exit 2 ;;
  esac
done
