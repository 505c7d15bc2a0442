"""Probe (session 11, prepared, not run): is the split CE rows' ~80 % of a copy the cluster occupancy?

Only 92 clusters of 4 CTAs fit on the H200 at once (368 CTAs), where the unsplit kernel runs 396 (3 per
SM). The unsplit kernel reaches 88 % of a copy at V = 32000, and 0.93 × 88 % ≈ 82 %, close to the split
rows' 80 % at 128256. This probe runs the library's kernel with fewer programs than it launches:
- unsplit, V = 32000, 36432 rows (a multiple of both 396 and 368, so neither grid is unevenly loaded:
  the unsplit kernel assigns rows statically), with grids 396, 368 and 330;
- split, V = 128256, 8192 rows (clusters claim rows from a counter), with grids of 99 clusters (the
  library's), 92 (what fits) and 80.

If the unsplit kernel at 368 CTAs falls to ~82 %, occupancy is the split rows' cost, and a design whose
row slices are claimed by ordinary CTAs (no cluster launch; progress needs only CTAS resident CTAs) is
the lead. If it stays at ~88 %, the cost is in the exchange.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/probe_ce_occupancy.py
"""

from __future__ import annotations

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")
smem = importlib.import_module("fused_kernels.cross_entropy_smem")


def main():
    from ce_case import ce_case, check_and_time, copy_ms
    from tune_cross_entropy import queued_ms
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for v, n, grids in ((32000, 36432, (396, 368, 330)), (128256, 8192, (99, 92, 80))):
        case = ce_case(v, n=n, ref_rows=256, ignored=False)
        copy = copy_ms(case.x, timer=queued_ms)
        cfg = ce.launch_config(v, lambda c: True)
        library_grid = ce.grid_programs(cfg, case.n, case.x.device)
        print(f"V={v}, {n} rows: copy {copy:.3f} ms; {cfg}, library grid {library_grid}", flush=True)

        def run(grid, case=case, cfg=cfg):
            smem.launch_ce_smem(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, warps=cfg.warps,
                                ctas=cfg.ctas, grid=grid, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                softcap=None, logit_scale=1.0)

        check_and_time(case, [(f"grid {g} ({g * cfg.ctas} CTAs)", lambda g=g: run(g)) for g in grids],
                       copy, rounds=3, timer=queued_ms)
        del case


if __name__ == "__main__":
    main()
