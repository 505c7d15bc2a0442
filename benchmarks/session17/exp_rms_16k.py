"""Experiment (session 17, prepared on the CPU, compiled for sm_90a on triton 3.6 and 3.9; run in session 18
on df9b16d, before the library's exchange moved into shared memory: benchmarks/session18/exp_rms_16k.txt;
updated to the library's launch arguments since, so later runs time the shared-memory exchange):
RMSNorm 4096 x 16384, the table row at its 0.20 ms line (0.199-0.202 over sessions 11-17), with
rms_norm_smem's kernels as session 17 left them (per-chunk waits, thread-0 fence, early claim,
self-resetting counter) against the library's Triton kernels that serve 16384 today:
  - forward: the cluster forward at 16384 in 2 or 4 chunks (rms_norm_smem takes only 8 chunks of 8192:
    it lost at 32768 in 4 chunks before session 17's exchange changes) against the Triton forward;
  - backward + dw sum: the smem backward at 16384 (session 15 found it level with the one-kernel
    backward, before w in shared memory, the per-chunk waits and the thread-0 fence) against the
    one-kernel backward.
If a variant wins by more than two rounds' spread, widen SMEM_FORWARD_TABLE / FORWARD_CHUNKS or let
rms_norm's dispatch send 16384 to the smem backward.

    .venv/bin/python benchmarks/session17/exp_rms_16k.py --compile-only       (CPU)
    bash benchmarks/session17/call.sh exp_rms_16k                            (GPU, ~40 s)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"), HERE]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from fused_kernels import cross_entropy_smem as _smem  # noqa: E402
from fused_kernels import rms_norm_smem as lib  # noqa: E402
from fused_kernels._launch import launch  # noqa: E402

Shape = lib.ClusterShape
ROWS, N = 4096, 16384
FORWARD_SHAPES = (Shape(4, 8, 6), Shape(2, 8, 12), Shape(4, 4, 6), Shape(8, 4, 4))  # 2, 4, 4, 2 chunks
BACKWARD_SHAPES = (Shape(4, 8, 6), Shape(2, 8, 12), Shape(4, 4, 6))  # 2, 4, 4 chunks


def forward_meta(n: int, shape: lib.ClusterShape) -> dict:
    """_rms_fwd_smem_kernel's constexprs for any 1-8 chunk count (rms_norm_smem.forward_constexprs holds
    the library to FORWARD_CHUNKS)."""
    if n % shape.chunk or not 1 <= n // shape.chunk <= 8:
        raise ValueError(f"N={n}: 1-8 chunks of {shape.chunk} for {shape}")
    reg, smem = _smem.layouts(shape.warps, shape.ctas)
    return dict(N=n, WARPS=shape.warps, CTAS=shape.ctas, REG=reg, SMEM=smem, num_warps=shape.warps,
                num_ctas=shape.ctas, maxnreg=_smem.register_cap(shape.warps, shape.per_sm), OFFSET=0.0, CASTING=0,
                HAS_WEIGHT=True, PTX=lib.exchange_ptx(shape.ctas))


def launch_forward(x2, w, y2, rstd, shape, grid):
    next_rows, counter = lib._claim_scratch(grid, x2.device)
    launch(lib._rms_fwd_smem_kernel, (grid,),
           (x2, w, y2, rstd, next_rows, counter, x2.shape[0], x2.stride(0), y2.stride(0), 1e-6),
           forward_meta(x2.shape[1], shape))


def compile_only() -> None:
    from check_sm90 import compile_sm90, rms_norm_smem_cases
    fwd_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32",
               "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32", "stride_x": "i32", "stride_y": "i32",
               "eps": "fp32"}
    aligned = [a for a in fwd_sig if a.endswith("_ptr") or a.startswith("stride")]
    print(f"triton {triton.__version__}, sm_90a", flush=True)
    for shape in FORWARD_SHAPES:
        flags = forward_meta(N, shape)
        flags.pop("num_warps")
        res = compile_sm90(lib._rms_fwd_smem_kernel, fwd_sig, flags, aligned, shape.warps, 1)
        fit = min(233472 // (res["shared"] + 1024), 64 // shape.warps)
        print(f"forward {shape}: {res} fit {fit}{'' if fit >= shape.per_sm else ' TOO FEW'}", flush=True)
    saved = lib.SMEM_BACKWARD_TABLE
    for shape in BACKWARD_SHAPES:
        lib.SMEM_BACKWARD_TABLE = (shape,)
        try:
            for label, kernel, sig, flags, al, warps, stages, _ in rms_norm_smem_cases([N], "bf16"):
                if "casting 0 offset 0.0 dw True" in label and "forward" not in label:
                    res = compile_sm90(kernel, sig, flags, al, warps, stages)
                    fit = min(233472 // (res["shared"] + 1024), 64 // shape.warps)
                    print(f"backward {shape}: {res} fit {fit}{'' if fit >= shape.per_sm else ' TOO FEW'}", flush=True)
        finally:
            lib.SMEM_BACKWARD_TABLE = saved


def gpu_main(rounds: int) -> None:
    from exp_rms_knobs import case, checked_backward, checked_forward, header, rms, timed
    t0 = time.time()
    sms = header()
    x, dy, w, rstd, y_ref, dx_ref, dw_ref = case(ROWS, N)
    y = torch.empty_like(x)
    r = torch.empty(ROWS, device="cuda")
    runs = [("library forward (Triton)", lambda: rms._forward_impl(x, w, 1e-6, 0.0, "llama"))]
    for shape in FORWARD_SHAPES:
        grid = lib.clusters(ROWS, shape, sms)
        label = f"smem forward {shape} grid {grid}"
        fn = lambda s=shape, g=grid: launch_forward(x, w, y, r, s, g)  # noqa: E731
        if checked_forward(label, fn, y, r, y_ref, rstd):
            runs.append((label, fn))
    timed(runs, rounds)

    runs = [("library backward (one kernel) + dw sum", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
    dx = torch.empty_like(x)
    for shape in BACKWARD_SHAPES:
        grid = lib.clusters(ROWS, shape, sms)
        partial = torch.empty(grid, N, device="cuda")

        def bwd(s=shape, g=grid, p=partial):
            lib.launch_backward(dy, x, w, rstd, dx, p, shape=s, grid=g, offset=0.0, casting_id=0, compute_dw=True)
            return rms._sum_partial_rows(p, g, w)
        label = f"smem backward {shape} grid {grid} + dw sum"
        if checked_backward(label, bwd, dx, partial, dx_ref, dw_ref):
            runs.append((label, bwd))
    timed(runs, rounds)
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    compile_only() if a.compile_only else gpu_main(a.rounds)
