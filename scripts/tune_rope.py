"""Sweep fused_kernels.rope's launch configuration on a GPU (the lead runs this on the H200).

    TRITON_INTERPRET=0 .venv/bin/python scripts/tune_rope.py [--batch 4 --seq 4096 --q-heads 32 --k-heads 8 --dim 128]

Inputs as scripts/bench_kernels.py makes them: q, k stored (batch, seq, heads, dim) bf16 and passed as
transpose(1, 2) views, cos/sin (1, seq, dim) bf16, output gradients contiguous (batch, heads, seq, dim).
For each (tokens per program, heads per tile, warps) it times the rope_fwd op and the rope_bwd op
(triton.testing.do_bench medians) against the floor from a copy measured in the same run (each pass reads
q, k and writes them once). Put the best into rope.launch_config.
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch
import triton

import fused_kernels

rope_module = importlib.import_module("fused_kernels.rope")  # the module; fused_kernels.rope is the function


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--k-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--interleaved", action="store_true")
    ap.add_argument("--block-t", default="1,2,4,8,16")
    ap.add_argument("--heads", default="1,2,4,8,16,32")
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args()
    b, s, hq, hk, d = args.batch, args.seq, args.q_heads, args.k_heads, args.dim
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dt).transpose(1, 2)
    cos, sin = torch.randn(1, s, d, device=dev, dtype=dt), torch.randn(1, s, d, device=dev, dtype=dt)
    dq, dk = torch.randn(b, hq, s, d, device=dev, dtype=dt), torch.randn(b, hk, s, d, device=dev, dtype=dt)
    q_order, k_order = rope_module.memory_order(q), rope_module.memory_order(k)
    il = args.interleaved
    qk_bytes = (q.numel() + k.numel()) * 2
    pass_bytes = 2 * qk_bytes + 2 * cos.numel() * 2

    src = torch.empty(qk_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    floor = pass_bytes / bw * 1e3
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy {bw / 1e9:.0f} GB/s; floor per pass {floor:.3f} ms, fwd+bwd {2 * floor:.3f} ms "
          f"(q {b}x{hq}x{s}x{d}, k {b}x{hk}x{s}x{d}, interleaved={il})")
    default = rope_module.launch_config(b * s, hq, hk, d)
    print(f"default config: {default}")

    def fwd():
        return torch.ops.fused_kernels.rope_fwd(q, k, cos, sin, 1, il)

    def bwd():
        return torch.ops.fused_kernels.rope_bwd(dq, dk, cos, sin, 1, il, q_order, k_order)

    original = rope_module.launch_config
    results = []
    seen = set()
    try:
        for bt, bh, w in itertools.product(*(map(int, a.split(",")) for a in (args.block_t, args.heads, args.warps))):
            cfg = rope_module.RopeConfig(block_t=bt, block_hq=min(bh, triton.next_power_of_2(hq)),
                                         block_hk=min(bh, triton.next_power_of_2(hk)), num_warps=w)
            if cfg in seen or bt * cfg.block_hq * triton.next_power_of_2(d) > 65536:
                continue
            seen.add(cfg)
            rope_module.launch_config = lambda *a, _cfg=cfg: _cfg
            f_ms, b_ms = triton.testing.do_bench(fwd), triton.testing.do_bench(bwd)
            results.append((f_ms + b_ms, f_ms, b_ms, cfg))
            print(f"block_t {bt:2d} heads {cfg.block_hq:2d}/{cfg.block_hk:2d} warps {w}: fwd {f_ms:.4f} ms "
                  f"({floor / f_ms:.0%} of floor)  bwd {b_ms:.4f} ms ({floor / b_ms:.0%})  sum {f_ms + b_ms:.4f}")
    finally:
        rope_module.launch_config = original
    results.sort(key=lambda r: r[0])
    print("best 5 (sum, fwd, bwd):")
    for total, f_ms, b_ms, cfg in results[:5]:
        print(f"  {total:.4f} = {f_ms:.4f} + {b_ms:.4f}  {cfg}")
    best_f = min(results, key=lambda r: r[1])
    best_b = min(results, key=lambda r: r[2])
    print(f"best fwd alone {best_f[1]:.4f} {best_f[3]}; best bwd alone {best_b[2]:.4f} {best_b[3]}")

    # End to end as the benchmark times it: forward + autograd backward into (batch, seq, heads, dim) leaves.
    q_leaf = q.transpose(1, 2).detach().requires_grad_(True)
    k_leaf = k.transpose(1, 2).detach().requires_grad_(True)

    def step():
        qo, ko = fused_kernels.rope(q_leaf.transpose(1, 2), k_leaf.transpose(1, 2), cos, sin, 1, interleaved=il)
        torch.autograd.backward((qo, ko), (dq, dk))

    ms = triton.testing.do_bench(step, grad_to_none=[q_leaf, k_leaf])
    print(f"default config, forward + autograd backward to leaves: {ms:.4f} ms ({2 * floor / ms:.0%} of floor)")


if __name__ == "__main__":
    main()
