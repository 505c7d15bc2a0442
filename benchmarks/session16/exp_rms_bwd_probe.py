"""Experiment (session 16; the kernel knob it uses, PROBE, is probe.patch beside it, on top of 2bb2b14, not
kept in the library): where the time of the long-row RMSNorm backward read once goes at 1024 x 65536,
by leaving parts of the kernel out (timing only: the results of the variants with parts left out are
wrong by design) -- PROBE bits: 1 no dx stores; 4 no pass 1 (the dot exchanged is 0); 6 no pass 1 and no
exchange (claims and the cluster barrier stay); with compute_dw off, no dw sums. References in the same
process: a copy of x, and torch.mul(x, dy, out=dx) (the same bytes as the backward: two reads, one write).

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9 python3 \
        benchmarks/session16/exp_rms_bwd_probe.py      (GPU)
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

rms = importlib.import_module("fused_kernels.rms_norm")
smem = importlib.import_module("fused_kernels.rms_norm_smem")


def main(n=65536, rows=1024, rounds=3):
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import rms_case
    from tune_cross_entropy import queued_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, rows)
    dx = torch.empty_like(x)
    shape = smem.shape_for(n)
    grid = smem.clusters(rows, shape, sms)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)

    def variant(probe, dw):
        return lambda: smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0,
                                            casting_id=0, compute_dw=dw, probe=probe)

    runs = [("copy of x (1 read, 1 write)", lambda: copy_ms),  # placeholder, timed below
            ("torch.mul(x, dy, out=dx) (2 reads, 1 write)", lambda: torch.mul(x, dy, out=dx)),
            ("kernel as in the library", variant(0, True)),
            ("no dx stores", variant(1, True)),
            ("no pass 1", variant(4, True)),
            ("no pass 1, no exchange", variant(6, True)),
            ("no pass 1, no exchange, no stores", variant(7, True)),
            ("no dw", variant(0, False)),
            ("no pass 1, no exchange, no dw", variant(6, False)),
            ("loads, claims and barriers only", variant(7, False)),
            ("forward: library _forward_impl", lambda: rms._forward_impl(x, w, 1e-6, 0.0, "llama")),
            ("forward's bytes: torch.mul(x, w, out=y) (1 read, 1 write)", lambda: torch.mul(x, w, out=dx))]
    variant(0, True)()
    dw = rms._sum_partial_rows(partial, grid, w)
    ex = ((dx.double() - dx_ref).abs().max() / dx_ref.abs().max()).item()
    print(f"library variant check: dx err {ex:.1e}", flush=True)
    for rnd in range(rounds):
        print(f"round {rnd}: copy {copy_ms(x, timer=queued_ms):.4f} ms", flush=True)
        for label, fn in runs[1:]:
            print(f"  {queued_ms(fn, reps=15):.4f} ms  {label}", flush=True)


if __name__ == "__main__":
    main()
