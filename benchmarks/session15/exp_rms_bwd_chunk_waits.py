"""Experiment (session 15; the kernel variant it times lived in commit 3a53f8f and was reverted after this run lost:
exp_rms_bwd_chunk_waits.txt. To run it again, check that commit out): the library's long-row RMSNorm backward read once (fused_kernels/rms_norm_smem.py)
with one cp.async group per chunk, pass 1 waiting for chunk k alone (CHUNK_WAITS), against waiting for the
whole row first (as measured in session 14's experiment: 0.155 ms at 1024 x 65536), and a few neighbouring
cluster shapes; the split backward for reference. Each variant is checked against float64 first.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session15/exp_rms_bwd_chunk_waits.py      (GPU)
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

# per row length: (shape, chunk_waits) variants; the table's shape first
VARIANTS = {
    65536: [(Shape(8, 8, 4), False), (Shape(8, 8, 4), True), (Shape(8, 8, 3), False), (Shape(8, 8, 3), True)],
    32768: [(Shape(4, 8, 6), False), (Shape(4, 8, 6), True), (Shape(4, 8, 8), True), (Shape(8, 8, 4), True)],
    49152: [(Shape(8, 8, 4), False), (Shape(8, 8, 4), True)],
}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024}


def run_variant(dy, x, w, rstd, shape, chunk_waits, sms):
    n_rows, n = x.shape
    grid = smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True, chunk_waits=chunk_waits)
    return dx, rms._sum_partial_rows(partial, grid, w)


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
                ("library _backward_impl (table shape, default waits)",
                 lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for shape, waits in VARIANTS[n]:
            runs.append((f"{shape} chunk_waits={waits}",
                         lambda s=shape, cw=waits: run_variant(dy, x, w, rstd, s, cw, sms)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


def _split(dy, x, w, rstd, cfg, sms):
    dx = torch.empty_like(x)
    partial, programs = rms._split_backward(dy, x, w, rstd, dx, 0.0, "llama", True, False, cfg, sms)
    return dx, rms._sum_partial_rows(partial, programs, w)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="65536,32768,49152")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main([int(v) for v in a.lengths.split(",")], a.rounds)
