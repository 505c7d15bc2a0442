"""Experiment (session 16; the knob is lead_fence.patch beside it, on top of 15f152a): the exchange's cluster
barrier with one fence per CTA (thread 0, which stored the CTA's partial dot and the claimed row, runs
fence.acq_rel.gpu; every thread arrives relaxed) against barrier.cluster.arrive.release in every thread
(a MEMBAR.ALL.GPU per warp, 11 % of the warps' stall cycles in ncu_rms_stalls_w_in_smem.txt).

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_fence.py      (GPU)
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

rms = importlib.import_module("fused_kernels.rms_norm")
smem = importlib.import_module("fused_kernels.rms_norm_smem")
Shape = smem.ClusterShape
VARIANTS = {n: [(smem.shape_for(n), False), (smem.shape_for(n), True)] for n in (65536, 32768, 49152, 24576)}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024, 24576: 2048}


def run_variant(dy, x, w, rstd, shape, lead_fence, sms):
    n_rows, n = x.shape
    grid = smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True, lead_fence=lead_fence)
    return dx, rms._sum_partial_rows(partial, grid, w)


def main(rounds=3):
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for n, variants in VARIANTS.items():
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, ROWS[n])
        copy = copy_ms(x, timer=queued_ms)
        print(f"N={n} rows={ROWS[n]}: copy {copy:.3f} ms; one-read floor 1.5 copies {1.5 * copy:.3f} ms", flush=True)
        runs = [(f"{shape} lead_fence={lead_fence}", lambda s=shape, r=lead_fence: run_variant(dy, x, w, rstd, s, r, sms))
                for shape, lead_fence in variants]
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
