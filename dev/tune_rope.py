"""How fast fused_kernels.rope is on a GPU, and which tile the autotuner picked (run on the target GPU).

    TRITON_INTERPRET=0 .venv/bin/python dev/tune_rope.py [--batch 4 --seq 4096 --q-heads 32 --k-heads 8 --dim 128]
                                                             [--interleaved] [--sweep]

Inputs as benchmarks/bench_kernels.py makes them: q, k stored (batch, seq, heads, dim) bf16 and passed as
transpose(1, 2) views, cos/sin (1, seq, dim) bf16, output gradients contiguous (batch, heads, seq, dim).
Reported, forward (rope_fwd op) and backward (rope_bwd op):
- the autotuner's candidates with its own do_bench medians, and the winner;
- the winner's kernel time (CUDA-graph replay: no Python between kernels) against the floor from a copy
  measured in the same run (each pass reads q, k, cos, sin and writes q, k once), and the heuristic config's;
- dispatch times of the functional entry (triton.testing.do_bench): forward, forward + autograd backward
  into (batch, seq, heads, dim) leaves, as benchmarks/bench.py measures them;
- host microseconds per call on a tiny input: the eager autograd.Function path vs the custom op path.
With --sweep every (tokens, heads per tile, warps) in --block-t x --heads x --warps is also forced (through
rope_config._CONFIG["force"]) and timed kernel-only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_common import autotune_timings, config_str, graph_ms, header, host_us, pct  # noqa: E402

import fused_kernels  # noqa: E402

from fused_kernels.ops import rope as rope_module
from fused_kernels.ops import rope_config


class forced:
    """Force one RopeConfig while active."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        self.saved = rope_config._CONFIG["force"]
        rope_config._CONFIG["force"] = self.cfg

    def __exit__(self, *exc):
        rope_config._CONFIG["force"] = self.saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--k-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--interleaved", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also force and time every config of the grid below")
    ap.add_argument("--block-t", default="1,2,4")
    ap.add_argument("--heads", default="2,4,8,16,32")
    ap.add_argument("--warps", default="1,2,4,8")
    args = ap.parse_args()
    b, s, hq, hk, d = args.batch, args.seq, args.q_heads, args.k_heads, args.dim
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    gbps = header(dev)

    # Host cost per call (tiny input: the GPU is never the bottleneck).
    qs = torch.randn(1, 16, hq, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    ks = torch.randn(1, 16, hk, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    cs, ss = torch.randn(1, 16, d, device=dev, dtype=dt), torch.randn(1, 16, d, device=dev, dtype=dt)

    def step_eager():
        qo, ko = fused_kernels.rope(qs, ks, cs, ss, 1)
        torch.autograd.backward((qo, ko), (torch.ones_like(qo), torch.ones_like(ko)))

    def step_op():
        qo, ko = torch.ops.fused_kernels.rope_fwd(qs, ks, cs, ss, 1, False)
        torch.autograd.backward((qo, ko), (torch.ones_like(qo), torch.ones_like(ko)))

    print(f"host µs per call: eager forward {host_us(lambda: fused_kernels.rope(qs, ks, cs, ss, 1)):.1f}, "
          f"forward+backward {host_us(step_eager):.1f}; through the custom op: "
          f"{host_us(lambda: torch.ops.fused_kernels.rope_fwd(qs, ks, cs, ss, 1, False)):.1f}, {host_us(step_op):.1f}")

    q = torch.randn(b, s, hq, d, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dt).transpose(1, 2)
    cos, sin = torch.randn(1, s, d, device=dev, dtype=dt), torch.randn(1, s, d, device=dev, dtype=dt)
    dq, dk = torch.randn(b, hq, s, d, device=dev, dtype=dt), torch.randn(b, hk, s, d, device=dev, dtype=dt)
    q_order, k_order = rope_module.memory_order(q), rope_module.memory_order(k)
    il = args.interleaved
    pass_bytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
    floor = pass_bytes / (gbps * 1e9) * 1e3
    print(f"floor per pass {floor:.4f} ms, fwd+bwd {2 * floor:.4f} ms "
          f"(q {b}x{hq}x{s}x{d}, k {b}x{hk}x{s}x{d}, interleaved={il})")

    def fwd():
        return torch.ops.fused_kernels.rope_fwd(q, k, cos, sin, 1, il)

    def bwd():
        return torch.ops.fused_kernels.rope_bwd(dq, dk, cos, sin, 1, il, q_order, k_order)

    rope_module.reset_autotuning()
    ref_f = fwd()
    f_timings = autotune_timings(rope_module._rope_tuned)
    f_best = rope_module.autotuned_config()
    ref_b = bwd()
    b_timings = autotune_timings(rope_module._rope_tuned)
    b_best = rope_module.autotuned_config()
    for name, timings, best in (("fwd", f_timings, f_best), ("bwd", b_timings, b_best)):
        print(f"{name} autotune: {len(timings)} candidates timed; winner {config_str(best)}")
        for ms, cfg in timings:
            print(f"    {ms:.4f} ms ({pct(floor, ms)} of floor)  {config_str(cfg)}")

    f_ms, b_ms = graph_ms(fwd), graph_ms(bwd)
    print(f"kernel time, autotuned: fwd {f_ms:.4f} ms ({pct(floor, f_ms)} of floor), bwd {b_ms:.4f} ms ({pct(floor, b_ms)})")
    heuristic = rope_config.heuristic_config(b * s, hq, hk, d)
    with forced(heuristic):
        hf, hb = graph_ms(fwd), graph_ms(bwd)
    print(f"kernel time, heuristic {heuristic}: fwd {hf:.4f} ms ({pct(floor, hf)}), bwd {hb:.4f} ms ({pct(floor, hb)})")

    # Dispatch: the functional entry as the benchmark calls it.
    q_leaf = q.transpose(1, 2).detach().requires_grad_(True)
    k_leaf = k.transpose(1, 2).detach().requires_grad_(True)

    def call():
        return fused_kernels.rope(q_leaf.transpose(1, 2), k_leaf.transpose(1, 2), cos, sin, 1, interleaved=il)

    def step():
        torch.autograd.backward(call(), (dq, dk))

    d_fwd = do_bench(call)
    d_step = do_bench(step, grad_to_none=[q_leaf, k_leaf])
    print(f"dispatch (do_bench of rope): fwd {d_fwd:.4f} ms ({pct(floor, d_fwd)}), fwd + autograd backward to leaves "
          f"{d_step:.4f} ms ({pct(2 * floor, d_step)} of floor)")

    if args.sweep:
        results = []
        seen = set()
        for bt, bh, w in itertools.product(*(map(int, a.split(",")) for a in (args.block_t, args.heads, args.warps))):
            cfg = rope_config.RopeConfig(block_t=bt, block_hq=min(bh, triton.next_power_of_2(hq)),
                                         block_hk=min(bh, triton.next_power_of_2(hk)), num_warps=w)
            if cfg in seen or bt * cfg.block_hq * triton.next_power_of_2(d) > 65536:
                continue
            seen.add(cfg)
            with forced(cfg):
                try:
                    ok = all(torch.equal(a, r) for a, r in zip(fwd(), ref_f))
                    fm, bm = graph_ms(fwd), graph_ms(bwd)
                except Exception as exc:  # a config that does not compile or launch: report, go on
                    print(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
            results.append((fm + bm, fm, bm, cfg, ok))
            print(f"  block_t {bt:2d} heads {cfg.block_hq:2d}/{cfg.block_hk:2d} warps {w}: fwd {fm:.4f} ms "
                  f"({pct(floor, fm)})  bwd {bm:.4f} ms ({pct(floor, bm)}){'' if ok else '  MISMATCH'}")
        results.sort(key=lambda r: r[0])
        print("sweep, best 5 (kernel time fwd + bwd):")
        for total, fm, bm, cfg, ok in results[:5]:
            print(f"  {total:.4f} = {fm:.4f} + {bm:.4f}  {cfg}")


if __name__ == "__main__":
    main()
