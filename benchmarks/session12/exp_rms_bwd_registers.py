"""Experiment (session 12): the RMSNorm backward at 16384 columns without register spills.

Why: the library's backward for 16 K rows (whole row per program, 32 warps, one program per SM, Triton
pipelining 2 stages) is at ~73 % of its floor (130.7 µs of the 199.9 µs fwd+bwd at 4096×16384, target
200). At 32 warps a thread may hold 64 registers; its 16 columns of dw (fp32), w, x and dy are all live
across the row's reduction, and ptxas spills 48 bytes per thread (scripts/check_sm90.py: "SPILLS").

Variants, generated from the library's kernel source by checked replacements (the CE probes' helpers):
- reload: after the row dot c, x and dy are loaded again (evict_first: a different load, not merged with
  the first) and xhat, g, h recomputed, so neither needs to stay live across the reduction. The second
  read comes from L2 (the row was just read), not HBM. Triton pipelines the second loads too (twice
  the shared memory).
- reload_x, reload_dy: only one of the two loaded again.

The case, its float64 reference and the check-and-time loop are session 9's (exp_rms_bwd_cluster.py);
each run is the backward kernel plus the library's dw tail (_sum_partial_rows). The committed
exp_rms_bwd_registers.txt came from this file's first revision (f5b4348), which had its own case and
timed the kernel alone (µs against a 3-pass floor at 4.2 TB/s); the variants' verdict (equal within
noise) does not depend on that.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session12/exp_rms_bwd_registers.py [--compile-only]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session10"),
                os.path.join(ROOT, "benchmarks", "session9")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

import importlib  # noqa: E402
rms = importlib.import_module("fused_kernels.rms_norm")
from probe_ce_relaxed_barrier import _module_from, _replace_once  # noqa: E402

DOT = """            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = rstd[:, None] * (g - xhat * c[:, None])"""
RELOAD = """            c = tl.sum(g * xhat, axis=1) / n_cols
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            xhat, g, h = _grad_terms(x, dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
            dx = rstd[:, None] * (g - xhat * c[:, None])"""


RELOAD_X = """            c = tl.sum(g * xhat, axis=1) / n_cols
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            xhat, g, h = _grad_terms(x, dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
            dx = rstd[:, None] * (g - xhat * c[:, None])"""
RELOAD_DY = """            c = tl.sum(g * xhat, axis=1) / n_cols
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            xhat, g, h = _grad_terms(x, dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
            dx = rstd[:, None] * (g - xhat * c[:, None])"""


def variants():
    src = open(rms.__file__).read()
    return {"library": rms, "reload": _module_from("rms_bwd_reload", _replace_once(src, DOT, RELOAD)),
            "reload_x": _module_from("rms_bwd_reload_x", _replace_once(src, DOT, RELOAD_X)),
            "reload_dy": _module_from("rms_bwd_reload_dy", _replace_once(src, DOT, RELOAD_DY))}


# (n_cols, warps, stages): the library's whole-row backward at 16 K; 8 K as a check that nothing breaks
SHAPES = ((16384, 32, 2), (16384, 32, 3), (8192, 16, 2))


def meta(n_cols, warps, stages):
    return dict(CASTING=0, HAS_WEIGHT=True, COMPUTE_DW=True, BLOCK_N=n_cols, ROWS=1, SINGLE_PASS=True,
                EXACT_BF16=False, PROGRAMS_PER_SM=1, NUM_STAGES=stages, FROM_OUTPUT=False, L2_CAP=True)


def compile_only():
    import check_sm90
    sig = check_sm90.rms_norm_signature("bf16", backward=True)
    for name, mod in variants().items():
        for n_cols, warps, stages in SHAPES:
            r = check_sm90.compile_sm90(mod._rms_norm_bwd_kernel, sig, meta(n_cols, warps, stages),
                                        check_sm90._aligned(sig, n_cols), warps, stages)
            print(f"{name:8s} n_cols={n_cols} warps={warps} stages={stages}: {r}", flush=True)


def main():
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    mods = variants()
    for rows, (n_cols, warps, stages) in zip((4096, 4096, 8192), SHAPES):
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n_cols, rows)
        copy = copy_ms(x, timer=queued_ms)  # read + write of one tensor
        print(f"{rows}x{n_cols} warps={warps} stages={stages}: copy {copy:.4f} ms", flush=True)
        runs = []
        for name, mod in mods.items():
            dx = torch.full_like(x, float("nan"))
            partial = torch.full((sm, n_cols), float("nan"), device=x.device)
            args = (dy, x, w, rstd, dx, partial, rows, n_cols, dy.stride(0), x.stride(0), dx.stride(0), 0.0, 0)

            def run(mod=mod, args=args, dx=dx, partial=partial):
                mod._rms_norm_bwd_kernel[(sm,)](*args, **meta(n_cols, warps, stages), num_warps=warps,
                                                num_stages=stages)
                return dx, rms._sum_partial_rows(partial, sm, w)
            runs.append((name, run))
        check_and_time(n_cols, runs, dx_ref, dw_ref, 1.5 * copy, 3, queued_ms)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
