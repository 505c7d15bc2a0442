"""How fast fused_kernels.rms_norm is on a GPU, which path rms_norm.plan() takes, and which launch config
the autotuner picked.

    TRITON_INTERPRET=0 .venv/bin/python dev/tune_rms_norm.py [--shapes 16384x4096,1024x65536] [--sweep] [--split]

Per shape (bf16 x and weight, casting "llama"), forward and backward:
- the path and config plan() chooses on this GPU, and why;
- the autotuner's candidates and their times (its own do_bench medians), and the winner;
- the winner's kernel time (CUDA-graph replay: no Python between kernels) against the floor from a copy
  measured in the same run (forward: read x + write y; backward: read x, dy + write dx), and the heuristic
  table's config (what the interpreter runs) timed the same way;
- a plain one-row-per-program forward kernel (load the row once, rstd, y) as a yardstick;
- dispatch times of the functional entry (triton.testing.do_bench, as benchmarks/bench.py measures): forward,
  backward alone, forward + backward;
- host microseconds per call on a tiny input: the eager autograd.Function path vs the custom op path.
With --sweep every candidate is also forced (a one-kernel Plan in place of rms_norm.plan's) and timed
kernel-only. With --split (rows of >= 8192 columns) the backward is timed as one kernel and as the split
kernels. A forced plan replaces the cluster path too.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_common import autotune_timings, config_str, graph_ms, header, host_us, pct  # noqa: E402

import fused_kernels  # noqa: E402  (registers the custom ops)
from fused_kernels._dispatch import Plan  # noqa: E402

from fused_kernels.ops import rms_norm as rms
from fused_kernels.ops import rms_norm_config as rms_cfg


@triton.jit
def _plain_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    """The yardstick: one row per program, weight loaded next to x, llama casting."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0)
    w = tl.load(W + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * n_cols + cols, (xf * rstd).to(x.dtype) * w, mask=mask)


def plain_forward(x, w, y, rstd):
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    if block > 16384:  # a whole row in registers no longer fits
        return None
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _plain_fwd[(n_rows,)](x, w, y, rstd, n_cols, 1e-6, BLOCK=block, num_warps=warps)
    return y


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same numbers up to summation order (bf16 outputs may differ in the last bit)."""
    return bool(torch.isfinite(a).all()) and (a.float() - b.float()).norm().item() <= 1e-2 * b.float().norm().item()


def forced_plans(forward=None, backward=None):
    """While the returned context is active, rms_norm runs the Plan `forward` / `backward` for calls in
    that direction (None: plan()'s own)."""
    real = rms_cfg.plan

    def plan(call, device):
        wanted = forward if call.direction == "forward" else backward
        return real(call, device) if wanted is None else wanted

    return mock.patch.object(rms, "plan", plan)


def forced(cfg):
    """The one kernel with `cfg` in both directions (neither the cluster nor the split path, or a long
    row's forced config would never run)."""
    one_kernel = Plan("triton", cfg, "forced by dev/tune_rms_norm.py")
    return forced_plans(one_kernel, one_kernel)


def forced_split(cfg):
    """The backward through the split kernels with `cfg` (None: the one kernel, autotuned)."""
    if cfg is None:
        return forced_plans(backward=Plan("triton", None, "forced by dev/tune_rms_norm.py"))
    return forced_plans(backward=Plan("split", cfg, "forced by dev/tune_rms_norm.py"))


SPLIT_VARIANTS = [rms_cfg.SplitBackwardConfig()] + [
    rms_cfg.SplitBackwardConfig(**kw) for kw in (
        dict(block_n=4096, num_warps=16), dict(block_n=2048, num_warps=8), dict(block_n=8192, num_warps=16),
        dict(programs_per_sm=2), dict(programs_per_sm=8), dict(num_stages=1), dict(num_stages=2), dict(num_stages=4),
        dict(dot_block=8192, dot_warps=16), dict(dot_block=2048, dot_warps=4),
    )]


def split_section(bwd, floor_bwd: float, dx_ref) -> None:
    """The backward's kernel time: one kernel (chunked/whole, autotuned) against split configs."""
    print("  backward, one kernel vs split (kernel time incl. the dw partial sum):")
    for cfg in [None] + SPLIT_VARIANTS:
        with forced_split(cfg):
            try:
                ok = close(bwd()[0], dx_ref)
                ms = graph_ms(bwd)
            except Exception as exc:  # report, go on
                print(f"      {cfg} failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
        print(f"      {ms:.4f} ms ({pct(floor_bwd, ms)}){'' if ok else '  MISMATCH'}  "
              f"{'one kernel (autotuned)' if cfg is None else cfg}", flush=True)


def report_autotune(direction: str, tuned, floor: float) -> None:
    timings = autotune_timings(tuned)
    print(f"  {direction} autotune: {len(timings)} candidates timed; winner {config_str(rms.autotuned_config(direction == 'bwd'))}")
    for ms, cfg in timings[:8]:
        print(f"      {ms:.4f} ms ({pct(floor, ms)} of floor)  {config_str(cfg)}")
    if len(timings) > 8:
        print(f"      ... slowest {timings[-1][0]:.4f} ms  {config_str(timings[-1][1])}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,65536x1024,4096x16384,1024x65536")
    ap.add_argument("--sweep", action="store_true", help="also force and time every candidate config")
    ap.add_argument("--split", action="store_true",
                    help="time the backward as one kernel and as the split kernels (several configs), rows >= 8192")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gbps = header(dev)

    # Host cost per call (tiny input: the GPU is never the bottleneck).
    xs = torch.randn(8, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ws = torch.randn(256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dys = torch.randn(8, 256, device=dev, dtype=torch.bfloat16)
    eager_fwd = host_us(lambda: fused_kernels.rms_norm(xs, ws))
    eager_step = host_us(lambda: fused_kernels.rms_norm(xs, ws).backward(dys))
    op_fwd = host_us(lambda: torch.ops.fused_kernels.rms_norm_fwd(xs, ws, 1e-6, 0.0, "llama"))
    op_step = host_us(lambda: torch.ops.fused_kernels.rms_norm_fwd(xs, ws, 1e-6, 0.0, "llama")[0].backward(dys))
    print(f"host µs per call: eager forward {eager_fwd:.1f}, forward+backward {eager_step:.1f}; "
          f"through the custom op: {op_fwd:.1f}, {op_step:.1f}")

    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        nbytes = x.numel() * x.element_size()
        floor_fwd = 2 * nbytes / (gbps * 1e9) * 1e3
        floor_bwd = 3 * nbytes / (gbps * 1e9) * 1e3
        print(f"\n{rows}x{n} bf16: floors fwd {floor_fwd:.4f} ms, bwd {floor_bwd:.4f} ms")
        facts = rms.device_facts(x.device)
        plans = {d: rms_cfg.plan(rms_cfg.Call(rows, n, x.dtype, w.dtype, d, dy_dtype=dy.dtype), facts)
                 for d in ("forward", "backward")}
        for direction, p in plans.items():
            print(f"  plan {direction}: {p.path} {p.config if p.config is not None else ''} ({p.reason})")

        def fwd():
            return torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")

        # Autotune afresh for this shape and show what it measured.
        rms.reset_autotuning()
        y_ref, rstd = fwd()

        def bwd():
            return torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)

        dx_ref, dw_ref = bwd()
        torch.cuda.synchronize()
        report_autotune("fwd", rms._tuned(False, facts), floor_fwd)
        report_autotune("bwd", rms._tuned(True, facts), floor_bwd)

        f_ms, b_ms = graph_ms(fwd), graph_ms(bwd)
        print(f"  kernel time, autotuned: fwd {f_ms:.4f} ms ({pct(floor_fwd, f_ms)} of floor), "
              f"bwd {b_ms:.4f} ms ({pct(floor_bwd, b_ms)}; includes the dw partial sum)")
        for backward, fn, floor in ((False, fwd, floor_fwd), (True, bwd, floor_bwd)):
            cfg = rms_cfg.heuristic_config(n, backward)
            with forced(cfg):
                ms = graph_ms(fn)
            print(f"  kernel time, heuristic table {'bwd' if backward else 'fwd'}: {ms:.4f} ms ({pct(floor, ms)})  {cfg}")
        for direction, p in plans.items():
            if p.path != "triton":
                print(f"  (the {direction} above ran the {p.path} path: its autotune lines are an earlier shape's)")
        if args.split and n >= 8192:
            split_section(bwd, floor_bwd, dx_ref)
        y_plain, r_plain = torch.empty_like(x), torch.empty(rows, device=dev)
        if plain_forward(x, w, y_plain, r_plain) is not None:
            ms = graph_ms(lambda: plain_forward(x, w, y_plain, r_plain))
            print(f"  kernel time, plain 1-row-per-program forward: {ms:.4f} ms ({pct(floor_fwd, ms)})"
                  f"{'' if close(y_plain, y_ref) else '  MISMATCH'}")

        # Dispatch: the functional entry as the benchmark calls it.
        x_in = x.clone().requires_grad_(True)
        w_in = w.clone().requires_grad_(True)
        d_fwd = do_bench(lambda: fused_kernels.rms_norm(x_in, w_in))
        y_keep = fused_kernels.rms_norm(x_in, w_in)
        d_bwd = do_bench(lambda: torch.autograd.backward(y_keep, dy, retain_graph=True), grad_to_none=[x_in, w_in])
        d_step = do_bench(lambda: fused_kernels.rms_norm(x_in, w_in).backward(dy), grad_to_none=[x_in, w_in])
        print(f"  dispatch (do_bench of rms_norm): fwd {d_fwd:.4f} ms, bwd {d_bwd:.4f} ms, fwd+bwd {d_step:.4f} ms "
              f"(floor {floor_fwd + floor_bwd:.4f}, {pct(floor_fwd + floor_bwd, d_step)})")
        del y_keep, x_in, w_in

        if args.sweep:
            for backward, fn, floor, ref in ((False, fwd, floor_fwd, y_ref), (True, bwd, floor_bwd, dx_ref)):
                results = []
                for cfg in rms_cfg.candidate_configs(backward, facts):
                    meta = cfg.meta()
                    if not rms_cfg._fits(meta, n):
                        continue
                    with forced(cfg):
                        try:
                            out = fn()[0]
                            ok = close(out, ref)
                            ms = graph_ms(fn)
                        except Exception as exc:  # a config that does not compile or launch: report, go on
                            print(f"  {'bwd' if backward else 'fwd'} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                            continue
                    results.append((ms, cfg, ok))
                results.sort(key=lambda r: r[0])
                print(f"  sweep {'bwd' if backward else 'fwd'} (kernel time, forced configs), best 6 of {len(results)}:")
                for ms, cfg, ok in results[:6]:
                    print(f"      {ms:.4f} ms ({pct(floor, ms)}){'' if ok else '  MISMATCH'}  {cfg}")
        del x, w, dy, y_ref, rstd, dx_ref, dw_ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
