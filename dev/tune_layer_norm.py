"""Which launch shape of fused_kernels.layer_norm is fastest on this GPU, forward and backward apart.

    TRITON_INTERPRET=0 python dev/tune_layer_norm.py [--shapes 16384x4096,65536x1024] [--budget-s 200]
                                                     [--out ln_sweep.json] [--cluster-only]

Per shape (bf16 x, weight and bias): every candidate LayerNormConfig (rows per tile, warps, grid size,
pipelining; chunked sweeps for long rows; the backward over a thread-block cluster, CLUSTER_CANDIDATES,
where the row is whole chunks of the shape) is forced in place of plan()'s, checked against torch's fp32
LayerNorm, and timed kernel-only (CUDA-graph replay, `tune_common.graph_ms`) against the floor from a
copy measured in the same run (forward: read x + write y; backward: read x, dy + write dx). plan()'s own
choice and torch's F.layer_norm are timed the same way. Candidates past the time budget are skipped (the
JSON says how many). The JSON keeps every timing, so a table change can cite it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import json
import os
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_common import graph_ms, header  # noqa: E402

import fused_kernels  # noqa: E402,F401  (registers the custom ops)

from fused_kernels._gpu import ClusterLaunch, ClusterShape, clusters, device_facts  # noqa: E402
from fused_kernels.ops import layer_norm as ln  # noqa: E402
from fused_kernels.ops import layer_norm_config as ln_cfg  # noqa: E402


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _whole_row_tilings(n_rows: int, n_cols: int, warp_choices, per_thread_ok):
    """(rows, block, warps, tiles) of whole-row tilings: one row of up to 16384 columns, or 2-16 rows a tile
    of 1024-8192 elements, warps whose values per thread pass `per_thread_ok(per_thread, warps)`."""
    whole = max(16, _pow2_at_least(n_cols))
    if whole > 16384:
        return
    for rows in (1, 2, 4, 8, 16):
        tile = rows * whole
        if rows > 1 and not 1024 <= tile <= 8192:
            continue
        for warps in warp_choices:
            if per_thread_ok(tile // (32 * warps), warps):
                yield rows, whole, warps, -(-n_rows // rows)


def forward_candidates(n_rows: int, n_cols: int, sms: int):
    """(fwd_rows, fwd_block, chunked, warps, programs, stages) tuples worth timing for this shape."""
    out = []
    for rows, whole, warps, n_tiles in _whole_row_tilings(n_rows, n_cols, (1, 2, 4, 8, 16, 32),
                                                          lambda per_thread, warps: per_thread in (4, 8, 16)):
        out.append((rows, whole, False, warps, n_tiles, 1))  # one program per tile
        for per_sm in (2, 4, 8):  # persistent, pipelined
            if per_sm * sms < n_tiles and warps * per_sm <= 64:
                out.append((rows, whole, False, warps, per_sm * sms, 3))
    if n_cols > 4096:
        for block, rows, warps in ((8192, 1, 16), (4096, 1, 8), (4096, 2, 16), (2048, 4, 16), (4096, 1, 16)):
            if block < n_cols:
                out.append((rows, block, True, warps, -(-n_rows // rows), 1))
    return out


def backward_candidates(n_rows: int, n_cols: int, sms: int):
    """(bwd_rows, bwd_block, chunked, warps, programs, stages) tuples worth timing for this shape."""
    out = []
    big = max(16, _pow2_at_least(n_cols)) == 16384  # 16 K held whole at 32 warps spills; timed all the same
    for rows, whole, warps, n_tiles in _whole_row_tilings(
            n_rows, n_cols, (2, 4, 8, 16, 32), lambda per_thread, warps: per_thread in (4, 8, 16) or (big and warps == 32)):
        for per_sm in (1, 2, 3, 4, 8):
            if warps * per_sm > 64 or per_sm * sms > n_tiles * 2:
                continue
            for stages in (1, 2, 3):
                out.append((rows, whole, False, warps, min(n_tiles, per_sm * sms), stages))
    if n_cols > 4096:
        for (block, rows), warps, per_sm in itertools.product(
                ((8192, 1), (4096, 1), (4096, 2), (2048, 4), (2048, 2), (1024, 8)), (8, 16, 32), (1, 2, 3)):
            if block >= n_cols or block * rows // (32 * warps) not in (4, 8, 16) or warps * per_sm > 64:
                continue
            out.append((rows, block, True, warps, min(-(-n_rows // rows), per_sm * sms), 1))
    return out


def param_candidates(n_rows: int, n_cols: int, sms: int):
    """(rows per load, columns per program, warps, row groups) of the column-parallel dw/db kernel."""
    out = []
    for m, n, warps in ((32, 256, 4), (16, 256, 4), (32, 128, 4), (16, 512, 8), (64, 128, 8), (32, 256, 8)):
        col_blocks = -(-n_cols // n)
        for per_sm in (2, 4, 8):
            out.append((m, n, warps, max(1, min(-(-n_rows // m), -(-per_sm * sms // col_blocks)))))
    return out


def with_forward(base: ln_cfg.LayerNormConfig, c, n_rows: int, sms: int) -> ln_cfg.LayerNormConfig:
    rows, block, chunked, warps, programs, stages = c
    return dataclasses.replace(base, fwd_rows=rows, fwd_block=block, fwd_chunked=chunked, fwd_warps=warps,
                               fwd_programs=programs, fwd_stages=stages)


def with_backward(base: ln_cfg.LayerNormConfig, c, n_rows: int, sms: int) -> ln_cfg.LayerNormConfig:
    if c[0] == "cluster":
        shape = ClusterShape(warps=c[1], ctas=c[2], per_sm=c[3])
        return dataclasses.replace(base, bwd_cluster=ClusterLaunch(shape, clusters(n_rows, shape, sms)))
    rows, block, chunked, warps, programs, stages, param = c
    return dataclasses.replace(base, bwd_rows=rows, bwd_block=block, bwd_chunked=chunked, bwd_warps=warps,
                               bwd_programs=programs, bwd_stages=stages, param_grid=param)


@contextlib.contextmanager
def forced(cfg: ln_cfg.LayerNormConfig):
    """plan()'s answer replaced by cfg for the forward and backward (path "cluster backward" where cfg has
    a cluster launch, which the backward then runs)."""
    with mock.patch.dict(ln_cfg._CONFIG, force=cfg):
        yield


# The cluster backward's shapes worth timing: (warps, CTAs a cluster, CTAs an SM); a row must be 2-4
# whole chunks of warps·32·8·CTAs columns (norm_smem.MIN_CHUNKS..MAX_CHUNKS).
CLUSTER_CANDIDATES = ((4, 4, 4), (4, 4, 5), (4, 4, 6), (4, 8, 4), (4, 8, 6), (8, 4, 2), (8, 4, 3), (2, 8, 8),
                      (2, 8, 6), (8, 2, 3))


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-2) -> bool:
    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and (a - b).norm().item() <= tol * b.norm().item()


def sweep_shape(n_rows: int, n_cols: int, gbps: float, deadline: float, cluster_only: bool = False) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n_rows + n_cols)
    x = (torch.randn(n_rows, n_cols, device=dev, generator=g) * 2 + 0.5).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n_cols, device=dev, generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(n_cols, device=dev, generator=g)).to(torch.bfloat16)
    dy = torch.randn(n_rows, n_cols, device=dev, generator=g).to(torch.bfloat16)
    eps = 1e-5
    # references: torch in fp32, one rounding
    xr = x.float().requires_grad_(True)
    wr = w.float().requires_grad_(True)
    br = b.float().requires_grad_(True)
    yr = torch.nn.functional.layer_norm(xr, (n_cols,), wr, br, eps)
    yr.backward(dy.float())
    xb = n_rows * n_cols * 2
    floor = {"forward": 2 * xb / (gbps * 1e6), "backward": 3 * xb / (gbps * 1e6)}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    facts = device_facts(dev)
    # the Triton paths (what candidates replace), and what a backward call gets
    base = ln_cfg.plan(ln_cfg.Call(n_rows, n_cols, torch.bfloat16, "forward"), facts)
    real = ln_cfg.plan(ln_cfg.Call(n_rows, n_cols, torch.bfloat16, "backward", weight_dtype=torch.bfloat16,
                                   dy_dtype=torch.bfloat16, aligned=True), facts)
    res = {"shape": [n_rows, n_cols], "floor_ms": floor,
           "plan": {"path": real.path, "config": dataclasses.asdict(real.config), "reason": real.reason}}

    # plan()'s own and torch's, same timing
    y, mean, rstd = ln._forward_impl(x, w, b, eps)
    res["plan_ms"] = {"forward": graph_ms(lambda: ln._forward_impl(x, w, b, eps)),
                      "backward": graph_ms(lambda: ln._backward_impl(dy, x, w, b, mean, rstd, True, True))}
    # torch's own kernels through aten (autograd's engine thread cannot be captured in a graph)
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, [n_cols], w, b, eps)
    res["torch_ms"] = {
        "forward": graph_ms(lambda: torch.ops.aten.native_layer_norm(x, [n_cols], w, b, eps)),
        "backward": graph_ms(lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [n_cols], t_mean, t_rstd, w, b, [True, True, True])),
    }

    # backward: each tiling with dw/db summed by its own programs (param None); chunked tilings also with
    # the column-parallel dw/db kernel, the dx kernel's programs then uncapped by partial rows
    tilings = backward_candidates(n_rows, n_cols, sms)
    bwd = [c + (None,) for c in tilings]
    if n_cols > 4096:
        for rows, block, _, warps, _, stages in (c for c in tilings if c[2]):
            for per_sm in (1, 2, 4):
                programs = min(-(-n_rows // rows), per_sm * sms)
                bwd.append((rows, block, True, warps, programs, stages, ln_cfg._param_grid(n_rows, n_cols, sms, False)))
        best_tiling = (2, 4096, True, 16, min(-(-n_rows // 2), 2 * sms), 1)
        bwd += [best_tiling + (p,) for p in param_candidates(n_rows, n_cols, sms)]
    from fused_kernels.ops import norm_smem as smem
    if cluster_only:
        bwd = [c + (None,) for c in tilings if c[2]][:2]  # two chunked Triton backwards to compare with
    for warps, ctas, per_sm in CLUSTER_CANDIDATES:  # the cluster backward: ("cluster", warps, ctas, per_sm)
        shape = ClusterShape(warps=warps, ctas=ctas, per_sm=per_sm)
        if smem._whole_chunks(n_cols, shape):
            bwd.append(("cluster", warps, ctas, per_sm))
    directions = (("forward", forward_candidates(n_rows, n_cols, sms), with_forward), ("backward", bwd, with_backward))
    for direction, cands, build in directions[1:] if cluster_only else directions:
        rows_out, skipped = [], 0
        for c in cands:
            if time.time() > deadline:
                skipped += 1
                continue
            cfg = build(base.config, c, n_rows, sms)
            try:
                with forced(cfg):
                    if direction == "forward":
                        fn = lambda: ln._forward_impl(x, w, b, eps)  # noqa: E731
                        yy, mm, rr = fn()
                        ok = close(yy, yr) and close(rr, 1 / (xr.float().var(1, unbiased=False) + eps).sqrt(), 1e-4)
                    else:
                        fn = lambda: ln._backward_impl(dy, x, w, b, mean, rstd, True, True)  # noqa: E731
                        dx, dw, db = fn()
                        ok = close(dx, xr.grad) and close(dw, wr.grad) and close(db, br.grad)
                    row = {"config": list(c), "ok": ok, "ms": graph_ms(fn) if ok else None}
                    if ok and direction == "backward" and c[0] != "cluster" and c[2]:  # chunked: dx alone too
                        row["dx_only_ms"] = graph_ms(lambda: ln._backward_impl(dy, x, w, b, mean, rstd, False, False))
            except Exception as exc:  # a shape Triton cannot build (too many registers / shared memory)
                rows_out.append({"config": list(c), "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            rows_out.append(row)
        timed = sorted((r for r in rows_out if r.get("ms")), key=lambda r: r["ms"])
        res[direction] = {"candidates": rows_out, "skipped": skipped,
                          "fields": ["rows", "block", "chunked", "warps", "programs", "stages"]
                          + (["param_grid (rows, block, warps, groups)"] if direction == "backward" else [])}
        print(f"\n{n_rows}x{n_cols} {direction}: floor {floor[direction]:.4f} ms  plan {res['plan_ms'][direction]:.4f}  "
              f"torch {res['torch_ms'][direction]:.4f}  ({len(timed)} timed, {skipped} skipped, "
              f"{sum(1 for r in rows_out if 'error' in r or not r.get('ok', True))} failed)")
        for r in timed[:6]:
            print(f"   {r['ms']:.4f} ms  {floor[direction] / r['ms']:6.1%}  {r['config']}"
                  + (f"  dx alone {r['dx_only_ms']:.4f}" if r.get('dx_only_ms') else ''))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16384x4096,65536x1024,4096x16384")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cluster-only", action="store_true",
                    help="the backward only: the cluster shapes (CLUSTER_CANDIDATES) and two chunked Triton ones")
    args = ap.parse_args()
    start = time.time()
    gbps = header(torch.device("cuda"))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "triton": importlib.import_module("triton").__version__, "copy_gbps": gbps, "shapes": []}
    for i, (r, c) in enumerate(shapes):
        # an equal share of what is left for each remaining shape
        deadline = time.time() + (args.budget_s - (time.time() - start)) / (len(shapes) - i)
        results["shapes"].append(sweep_shape(r, c, gbps, deadline, args.cluster_only))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
