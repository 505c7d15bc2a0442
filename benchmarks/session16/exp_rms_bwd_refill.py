"""Experiment (session 16; the knob is refill.patch beside it, on top of 15f152a): when the long-row RMSNorm
backward copies the next row into shared memory. REFILL 0 (the library): chunk by chunk as pass 2 consumes
them, one CTA barrier each (Triton's barrier pass orders the copy after every thread's read); 1: all at
the end of pass 2, one barrier; 2: right after pass 1, which keeps the row in registers for pass 2 (the
next row is claimed one row earlier, so it is known then), so the copies overlap the exchange too.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_refill.py      (GPU)
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
VARIANTS = {  # (shape, refill)
    65536: [(Shape(8, 8, 4), 0), (Shape(8, 8, 4), 1), (Shape(8, 8, 4), 2), (Shape(8, 8, 3), 2), (Shape(16, 8, 2), 2)],
    32768: [(Shape(4, 8, 6), 0), (Shape(4, 8, 6), 1), (Shape(4, 8, 6), 2)],
    49152: [(Shape(8, 8, 4), 0), (Shape(8, 8, 4), 1)],
}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024}


def run_variant(dy, x, w, rstd, shape, refill, sms):
    n_rows, n = x.shape
    grid = smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True, refill=refill)
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
        runs = [(f"{shape} refill={refill}", lambda s=shape, r=refill: run_variant(dy, x, w, rstd, s, r, sms))
                for shape, refill in variants]
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
