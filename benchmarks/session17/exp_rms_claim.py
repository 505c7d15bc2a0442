"""Experiment (session 17, on the library after the knobs runs): the claim's atomic issued at the top of a
row (EARLY_CLAIM: _claim_issue, then _claim_publish at the exchange, so its round trip overlaps pass 1
instead of preceding thread 0's fence), in the backward (per-chunk waits and the thread-0 fence, as the
library has them) and in the forward (with and without those two). rms_norm_smem.EXPERIMENT overrides
the kernels' constexprs: it existed at commit f9f4f5b only; the library then took all three in both
kernels, so this script runs only on that commit. 1024 x 65536 bf16, queued, alternating rounds; each variant
checked against float64 after its outputs were poisoned.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session17 python3 benchmarks/session17/exp_rms_claim.py
"""

from __future__ import annotations

import time

import torch

from exp_rms_knobs import N, ROWS, case, checked_backward, checked_forward, header, library_shapes, rms, smem, timed

FORWARD = ({}, {"FINE_WAITS": True, "LEAD_FENCE": True}, {"FINE_WAITS": True, "LEAD_FENCE": True, "EARLY_CLAIM": True},
           {"EARLY_CLAIM": True})
BACKWARD = ({}, {"EARLY_CLAIM": True}, {"EARLY_CLAIM": True, "FINE_WAITS": False})


def with_overrides(direction, overrides, fn):
    smem.EXPERIMENT.clear()
    smem.EXPERIMENT[direction] = overrides
    try:
        return fn()
    finally:
        smem.EXPERIMENT.clear()


def main():
    t0 = time.time()
    sms = header()
    x, dy, w, rstd, y_ref, dx_ref, dw_ref = case()
    fshape, bshape, fgrid, bgrid = library_shapes(sms)
    y = torch.empty_like(x)
    r = torch.empty(ROWS, device="cuda")
    runs = []
    for ov in FORWARD:
        def fwd(ov=ov):
            return with_overrides("forward", ov, lambda: smem.launch_forward(
                x, w, y, r, shape=fshape, grid=fgrid, eps=1e-6, offset=0.0, casting_id=0))
        if checked_forward(f"forward {ov}", fwd, y, r, y_ref, rstd):
            runs.append((f"forward {ov}", fwd))
    timed(runs)
    dx = torch.empty_like(x)
    partial = torch.empty(bgrid, N, device="cuda")
    runs = []
    for ov in BACKWARD:
        def bwd(ov=ov):
            with_overrides("backward", ov, lambda: smem.launch_backward(
                dy, x, w, rstd, dx, partial, shape=bshape, grid=bgrid, offset=0.0, casting_id=0, compute_dw=True))
            return rms._sum_partial_rows(partial, bgrid, w)
        if checked_backward(f"backward {ov}", bwd, dx, partial, dx_ref, dw_ref):
            runs.append((f"backward + dw sum {ov}", bwd))
    timed(runs)
    counter = smem._smem.claim_counter(x.device)
    print(f"claim counter after the runs: {int(counter.item())} (0: every launch reset it)", flush=True)
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
