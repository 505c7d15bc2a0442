"""Experiment (session 16, after ncu_rms_stalls.txt: barrier, membar and L2-latency stalls dominate the long-row
backward): the library's rms_norm_smem kernel with two knobs (knobs.patch beside it, on top of probe.patch):
W_IN_SMEM, the CTA's slice of w copied into shared memory once (it was read from global memory twice per
row, an L1 hit only 30 % of the time); CHUNK_BUFFERS, one shared allocation per chunk, so that Triton's
barrier pass does not put a CTA barrier after every chunk's copy. Checked against float64, then timed
queued in alternating rounds.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_knobs.py      (GPU)
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
KNOBS = [dict(), dict(w_in_smem=True), dict(chunk_buffers=True), dict(w_in_smem=True, chunk_buffers=True)]
VARIANTS = {
    65536: [(Shape(8, 8, 4), k) for k in KNOBS] + [(Shape(8, 8, 3), dict(w_in_smem=True, chunk_buffers=True))],
    32768: [(Shape(4, 8, 6), k) for k in KNOBS] + [(Shape(8, 8, 4), dict(w_in_smem=True, chunk_buffers=True))],
    49152: [(Shape(8, 8, 4), k) for k in (KNOBS[0], KNOBS[3])],
    24576: [(Shape(4, 8, 6), k) for k in (KNOBS[0], KNOBS[3])],
}
ROWS = {65536: 1024, 32768: 2048, 49152: 1024, 24576: 2048}


def run_variant(dy, x, w, rstd, shape, knobs, sms, casting="llama", offset=0.0):
    n_rows, n = x.shape
    grid = smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=offset,
                         casting_id=rms._CASTING_ID[casting], compute_dw=True, **knobs)
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
        runs = [("library _backward_impl", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for shape, knobs in VARIANTS[n]:
            runs.append((f"{shape} {knobs}", lambda s=shape, k=knobs: run_variant(dy, x, w, rstd, s, k, sms)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="65536,32768,49152,24576")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main([int(v) for v in a.lengths.split(",")], a.rounds)
