"""What session 16's rms_norm_smem experiments share: build a case, run one variant of the long-row
backward (a cluster shape, an optional grid, and the keyword knobs of the kernel patch the experiment
timed), check each against float64, then time them queued in alternating rounds.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16
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
ROWS = {65536: 1024, 49152: 1024, 32768: 2048, 24576: 2048}  # 2^26 elements each


def run_variant(dy, x, w, rstd, shape, sms, grid=None, **knobs):
    """(dx, dw) of the long-row backward with this shape, grid (default: the library's) and knobs."""
    n_rows, n = x.shape
    grid = grid or smem.clusters(n_rows, shape, sms)
    dx = torch.empty_like(x)
    partial = torch.empty(grid, n, dtype=torch.float32, device=x.device)
    smem.launch_backward(dy, x, w, rstd, dx, partial, shape=shape, grid=grid, offset=0.0, casting_id=0,
                         compute_dw=True, **knobs)
    return dx, rms._sum_partial_rows(partial, grid, w)


def main(variants: dict, rounds: int = 3, library: bool = False) -> None:
    """variants: row length -> [(shape, grid or None, knobs dict)]; library: time _backward_impl first."""
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for n, cases in variants.items():
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, ROWS[n])
        copy = copy_ms(x, timer=queued_ms)
        print(f"N={n} rows={ROWS[n]}: copy {copy:.3f} ms; one-read floor 1.5 copies {1.5 * copy:.3f} ms", flush=True)
        runs = [("library _backward_impl", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))] \
            if library else []
        for shape, grid, knobs in cases:
            label = f"{shape} {knobs}" + (f" grid={grid}" if grid else "")
            runs.append((label, lambda s=shape, g=grid, k=knobs: run_variant(dy, x, w, rstd, s, sms, g, **k)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()
