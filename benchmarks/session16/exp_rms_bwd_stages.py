"""Experiment (session 16; the kernel change it times is stages.patch beside it, on top of b9dc125 — it lost
(exp_rms_bwd_stages.txt) and was not kept in the library): the long-row RMSNorm backward read once (fused_kernels/rms_norm_smem.py) with two
rows in shared memory (ClusterShape.stages = 2: the next row's copies stay in flight while this row's
partial dots are exchanged) against one (the table's today: the next row's copies start only after the
exchange), at the table's lengths; the split backward for reference. Each variant is checked against
float64 first, then timed queued (GPU time) in alternating rounds.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_stages.py      (GPU)
"""

from __future__ import annotations

import argparse
import importlib
import os

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

rms = importlib.import_module("fused_kernels.rms_norm")
smem = importlib.import_module("fused_kernels.rms_norm_smem")
Shape = smem.ClusterShape

# per row length: the table's shape first, then two-stage shapes (64 KB of shared memory per CTA at 65536:
# 3 per SM; 16 warps spill under their register cap, kept to see what it costs)
VARIANTS = {
    65536: [Shape(8, 8, 4), Shape(8, 8, 3), Shape(8, 8, 3, 2), Shape(16, 8, 3, 2)],
    32768: [Shape(4, 8, 6), Shape(4, 8, 6, 2), Shape(8, 8, 3, 2), Shape(8, 8, 4, 2)],
    49152: [Shape(8, 8, 4), Shape(8, 8, 3, 2), Shape(8, 8, 4, 2)],
}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024}


def run_variant(dy, x, w, rstd, shape, sms):
    n_rows, n = x.shape
    grid = smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True)
    return dx, rms._sum_partial_rows(partial, grid, w)


def _split(dy, x, w, rstd, cfg, sms):
    dx = torch.empty_like(x)
    partial, programs = rms._split_backward(dy, x, w, rstd, dx, 0.0, "llama", True, False, cfg, sms)
    return dx, rms._sum_partial_rows(partial, programs, w)


def main(lengths, rounds):
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for n in lengths:
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, ROWS[n])
        copy = copy_ms(x, timer=queued_ms)
        print(f"N={n} rows={ROWS[n]}: copy {copy:.3f} ms; one-read floor 1.5 copies {1.5 * copy:.3f} ms", flush=True)
        split = rms.SplitBackwardConfig()
        runs = [("split backward", lambda: _split(dy, x, w, rstd, split, sms)),
                ("library _backward_impl", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for shape in VARIANTS[n]:
            runs.append((str(shape), lambda s=shape: run_variant(dy, x, w, rstd, s, sms)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="65536,32768,49152")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main([int(v) for v in a.lengths.split(",")], a.rounds)
