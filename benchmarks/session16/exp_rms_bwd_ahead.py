"""Experiment (session 16): the long-row RMSNorm backward read once with w in shared memory and one buffer
per chunk (the library now; exp_rms_bwd_knobs.txt) and CLAIM_AHEAD (the row after next claimed right
after a row's barrier and published at the next one, so the atomic's round trip is off the path to the
barrier), per table shape and a few more; the grid sized to the clusters that fit at once (62 at 65536,
ncu) rather than per_sm x SMs / 8 (66); then _dw_sum_kernel's shapes at 62-66 partial rows of 65536
(6.3 us in the table's profile, a quarter of a wave).

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_ahead.py      (GPU)
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
VARIANTS = {  # (shape, claim_ahead, grid or None)
    65536: [(Shape(8, 8, 4), False, None), (Shape(8, 8, 4), True, None), (Shape(8, 8, 4), False, 62),
            (Shape(16, 8, 2), False, None), (Shape(16, 8, 2), True, None), (Shape(16, 8, 3), False, None)],
    32768: [(Shape(4, 8, 6), False, None), (Shape(4, 8, 6), True, None), (Shape(8, 8, 4), False, None)],
    49152: [(Shape(8, 8, 4), False, None), (Shape(8, 8, 4), True, None)],
    24576: [(Shape(4, 8, 6), False, None), (Shape(4, 8, 6), True, None)],
}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024, 24576: 2048}
DW_SUM_SHAPES = [(128, 16, 2), (64, 16, 2), (64, 16, 4), (128, 16, 4), (256, 16, 4), (128, 32, 4), (64, 32, 4),
                 (32, 64, 8), (64, 64, 8), (256, 8, 2), (512, 8, 4), (128, 8, 1), (32, 32, 4), (32, 16, 2)]


def run_variant(dy, x, w, rstd, shape, ahead, grid, sms):
    n_rows, n = x.shape
    grid = grid or smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True, claim_ahead=ahead)
    return dx, rms._sum_partial_rows(partial, grid, w)


def dw_sum(rounds):
    from tune_cross_entropy import queued_ms
    w = torch.ones(65536, device="cuda", dtype=torch.bfloat16)
    for parts in (62, 66):
        partial = torch.randn(parts, 65536, device="cuda")
        ref = partial.double().sum(0)
        for block_n, rows, warps in DW_SUM_SHAPES:
            dw = torch.empty_like(w)

            def fn():
                rms.launch(rms._dw_sum_kernel, (triton.cdiv(65536, block_n),), (partial, dw, parts, 65536),
                           dict(BLOCK_N=block_n, PARTS=rows, num_warps=warps))
            fn()
            err = ((dw.double() - ref).abs().max() / ref.abs().max()).item()
            times = [queued_ms(fn, reps=15) for _ in range(rounds)]
            print(f"dw_sum parts={parts} (BLOCK_N, PARTS, warps)=({block_n}, {rows}, {warps}): err {err:.1e} "
                  f"{' '.join(f'{t * 1e3:.2f}' for t in times)} us", flush=True)


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
        runs = [("library _backward_impl", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for shape, ahead, grid in VARIANTS[n]:
            runs.append((f"{shape} claim_ahead={ahead} grid={grid or 'default'}",
                         lambda s=shape, a=ahead, g=grid: run_variant(dy, x, w, rstd, s, a, g, sms)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()
    dw_sum(rounds)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="65536,32768,49152,24576")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main([int(v) for v in a.lengths.split(",")], a.rounds)
