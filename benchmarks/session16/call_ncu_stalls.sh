#!/usr/bin/env bash
# Session 16, call 4 (carry [".whl"]): warp stall reasons (per issued instruction) of the library's 1024 x 65536
# RMSNorm forward and long-row backward, and the forward autotuner's pick.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
source scripts/device_env.sh >/dev/null 2>&1
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout ${NCU_S:-300} $NCU --clock-control none --profile-from-start off \
  -k regex:"_rms_bwd_smem_kernel|_rms_norm_fwd_kernel" \
  --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,sm__cycles_elapsed.avg,dram__bytes.sum" \
  python3 benchmarks/session16/ncu_rms_long.py 2>&1 | grep -v "Warn\|^==PROF==" | tee "$OUT/ncu_rms_stalls.txt" | grep -v " 0$\| 0\.0[0-4]$"
python3 - <<'PY' 2>&1 | grep -v Warn | tee "$OUT/fwd_pick.txt"
import os; os.environ["TRITON_INTERPRET"] = "0"
import torch, fused_kernels as fk
from fused_kernels import rms_norm as r
x = torch.randn(1024, 65536, device="cuda", dtype=torch.bfloat16); w = torch.ones(65536, device="cuda", dtype=torch.bfloat16)
fk.rms_norm(x, w, eps=1e-6)
print("forward autotuned:", r.autotuned_config(False))
PY
