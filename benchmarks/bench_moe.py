"""The experts block of a mixture-of-experts layer alone: forward + backward GPU time and memory per peer,
against the grouped-GEMM floor and the dense-GEMM ceiling measured in the same run.

Peers (bf16, the same routed inputs): hf_grouped_mm (transformers' experts module, its default
grouped_mm implementation), liger (Liger-Kernel's LigerFusedMoEFunction, when its wheel is there),
ours (fused_kernels.moe_experts). Per shape:
  floor     the six grouped GEMMs of a forward + backward alone (torch's grouped GEMM on expert-sorted
            rows made beforehand): what any implementation built on them cannot beat
  ceiling   the same FLOPs (18·S·H·I for S = tokens·k rows) at the dense bf16 GEMM rate measured here
Each peer: do_bench median of forward + backward (gradients of hidden, router weights and both
weight tensors), peak memory beyond inputs and gradients, and the relative error of its output and
every gradient against transformers' eager experts in float32 on the same inputs.

    python benchmarks/bench_moe.py --out moe.json [--shapes qwen3_moe,deepseek_v3] [--tiny]
--tiny runs tiny shapes on whatever device there is (CPU: TRITON_INTERPRET=1 is set here) as a dry run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

SHAPES = {  # tokens, hidden, expert width, experts, experts per token
    "qwen3_moe": dict(tokens=16384, hidden=2048, width=768, experts=128, k=8),  # Qwen3-30B-A3B, 4 x 4096 tokens
    "deepseek_v3": dict(tokens=16384, hidden=2048, width=512, experts=256, k=8),  # the e2e DeepSeek-V3 cut
}
TINY = {"tiny": dict(tokens=64, hidden=32, width=16, experts=8, k=2)}


def _inputs(shape, device, torch, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    t, h, i, e, k = (shape[n] for n in ("tokens", "hidden", "width", "experts", "k"))
    x = torch.randn(t, h, device=device, generator=g)
    logits = torch.randn(t, e, device=device, generator=g)
    w, idx = torch.softmax(logits, -1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    gate_up = torch.randn(e, 2 * i, h, device=device, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, device=device, generator=g) / i ** 0.5
    dout = torch.randn(t, h, device=device, generator=g)
    return [v.to(dtype) for v in (x, w, gate_up, down, dout)], idx


def _hf_experts(shape, device, torch, implementation):
    """transformers' Qwen3-MoE experts module (the generic experts forward every decorated class uses)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=shape["hidden"], moe_intermediate_size=shape["width"],
                               num_experts=shape["experts"], num_experts_per_tok=shape["k"])
    cfg._experts_implementation = implementation
    return Qwen3MoeExperts(cfg).to(device)


def _peers(shape, device, torch, wanted):
    """name -> fn(x, idx, w, gate_up, down) -> out, every one computing the same block. Liger last: it
    autotunes on its first call (minutes), so a time limit cuts it, not the others."""
    import fused_kernels

    peers = {"ours": lambda x, idx, w, gate_up, down: fused_kernels.moe_experts(x, idx, w, gate_up, down)}
    module = _hf_experts(shape, device, torch, "grouped_mm")
    del module.gate_up_proj, module.down_proj  # plain attributes from here on (leaves of the benchmark)

    def hf(x, idx, w, gate_up, down):
        module.gate_up_proj, module.down_proj = gate_up, down  # the leaves themselves
        return module(x, idx, w)

    peers["hf_grouped_mm"] = hf
    try:
        from liger_kernel.transformers.swiglu import LigerFusedMoEFunction

        peers["liger"] = lambda x, idx, w, gate_up, down: LigerFusedMoEFunction.apply(
            x, gate_up, down, idx.to(torch.int32), w)
    except Exception as exc:  # noqa: BLE001 - no wheel, or an API that moved: recorded, not fatal
        peers["liger"] = exc
    return {name: fn for name, fn in peers.items() if name in wanted}


def _reference(shape, leaves, idx, device, torch):
    """Output and gradients of transformers' eager experts in float32."""
    module = _hf_experts(shape, device, torch, "eager")
    x, w, gate_up, down, dout = [t.float().detach().requires_grad_(i < 4) for i, t in enumerate(leaves)]
    del module.gate_up_proj, module.down_proj
    module.gate_up_proj, module.down_proj = gate_up, down
    out = module(x, idx, w)
    grads = torch.autograd.grad(out, (x, w, gate_up, down), dout)
    return out.detach(), grads


def _rel(a, b, torch):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grouped_floor(shape, leaves, idx, device, torch, do_bench):
    """The forward's and backward's grouped GEMMs alone, on expert-sorted rows made beforehand."""
    import importlib

    from fused_kernels.ops import moe_experts as moe

    x, w, gate_up, down, dout = leaves
    perm, inv, offsets = moe._routing(idx, shape["experts"])
    x_s = x.index_select(0, perm // shape["k"])
    g_s = dout.index_select(0, perm // shape["k"])
    gmm = moe.GROUPED_MM
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)
    gu = gmm(x_s, w1, offs=offsets)
    h = gu[:, :shape["width"]].contiguous()

    def six():
        gmm(x_s, w1, offs=offsets)  # gate_up
        gmm(h, w2, offs=offsets)  # down
        gmm(g_s, down, offs=offsets)  # dh
        gmm(g_s.t(), h, offs=offsets)  # d down_proj
        gmm(gu.t(), x_s, offs=offsets)  # d gate_up_proj
        gmm(gu, gate_up, offs=offsets)  # dx

    return do_bench(six)


def _dense_tflops(device, torch, do_bench, n=8192):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def bench_shape(name, shape, device, torch, do_bench, dtype, wanted, row=None, save=lambda: None) -> dict:
    """Fills `row` (its peers one by one; `save()` after each, so a time limit keeps what was measured)."""
    row = row if row is not None else {}
    row.update({"shape": name, **shape, "dtype": str(dtype).replace("torch.", ""), "peers": {}})
    rows = shape["tokens"] * shape["k"]
    row["flops_fwd_bwd"] = 18 * rows * shape["hidden"] * shape["width"]
    leaves, idx = _inputs(shape, device, torch, dtype)
    ref_out, ref_grads = _reference(shape, leaves, idx, device, torch)
    row["ref_norms"] = {"out": float(ref_out.norm()), **{n: float(g.norm()) for n, g in
                        zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), ref_grads)}}
    if device.type == "cuda":
        try:
            row["grouped_floor_ms"] = _grouped_floor(shape, leaves, idx, device, torch, do_bench)
        except Exception as exc:  # noqa: BLE001
            row["grouped_floor_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for peer, fn in _peers(shape, device, torch, wanted).items():
        if isinstance(fn, Exception):
            row["peers"][peer] = {"status": "unavailable", "error": f"{type(fn).__name__}: {fn}"[:300]}
            continue
        res = {}
        try:
            x, w, gate_up, down = [t.detach().clone().requires_grad_() for t in leaves[:4]]
            dout = leaves[4]

            def step():
                out = fn(x, idx, w, gate_up, down)
                return out, torch.autograd.grad(out, (x, w, gate_up, down), dout)

            out, grads = step()
            res["rel_err_out"] = _rel(out, ref_out, torch)
            res["rel_err_grads"] = {n: _rel(g, r, torch) for n, g, r in
                                    zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), grads, ref_grads)}
            res["finite"] = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
            del out, grads
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out, grads = step()
                torch.cuda.synchronize()
                # beyond the inputs and what the call returns (output and the four gradients)
                returned = out.numel() * out.element_size() + sum(g.numel() * g.element_size() for g in grads)
                res["peak_beyond_inputs_gib"] = (torch.cuda.max_memory_allocated() - base - returned) / 2 ** 30
                del out, grads
                res["fwd_bwd_ms"] = do_bench(step)
                res["fwd_ms"] = do_bench(lambda: fn(x, idx, w, gate_up, down))
            res["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one peer failing must not cost the others
            res.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400],
                       traceback=traceback.format_exc(limit=6)[-1500:])
        row["peers"][peer] = res
        save()
        print(f"[moe] {name} {peer}: {json.dumps({k: v for k, v in res.items() if k != 'traceback'})[:400]}",
              flush=True)
    if device.type == "cuda":
        ok = {p: r for p, r in row["peers"].items() if r.get("status") == "ok" and "fwd_bwd_ms" in r}
        for p, r in ok.items():
            others = [q["fwd_bwd_ms"] for n, q in ok.items() if n != p]
            if others:
                r["speed_ratio_to_best_peer"] = min(others) / r["fwd_bwd_ms"]
            if row.get("grouped_floor_ms"):
                r["fraction_of_grouped_floor"] = row["grouped_floor_ms"] / r["fwd_bwd_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--peers", default="ours,hf_grouped_mm,liger")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; on the CPU through the Triton interpreter")
    a = ap.parse_args(argv)
    if a.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from bench_common import environment

    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    if device.type == "cuda":
        from triton.testing import do_bench
    else:
        def do_bench(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    data = {"meta": environment(device), "rows": []}
    if device.type == "cuda":
        data["dense_bf16_tflops"] = _dense_tflops(device, torch, do_bench)
    shapes = TINY if a.tiny else {n: SHAPES[n] for n in a.shapes.split(",") if n}
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    def save():
        with open(a.out, "w") as f:
            json.dump(data, f, indent=1, default=str)

    for name, shape in shapes.items():
        row = {"shape": name}
        data["rows"].append(row)
        try:
            bench_shape(name, shape, device, torch, do_bench, dtype, set(a.peers.split(",")), row, save)
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400],
                       traceback=traceback.format_exc(limit=6)[-1500:])
        if data.get("dense_bf16_tflops") and "flops_fwd_bwd" in row:
            row["ceiling_ms"] = row["flops_fwd_bwd"] / (data["dense_bf16_tflops"] * 1e12) * 1e3
            for r in row["peers"].values():
                if "fwd_bwd_ms" in r:
                    r["fraction_of_dense_ceiling"] = row["ceiling_ms"] / r["fwd_bwd_ms"]
        save()
    print(json.dumps({r["shape"]: {p: {k: v for k, v in q.items() if k in ("fwd_bwd_ms", "peak_beyond_inputs_gib",
                                                                            "rel_err_out", "status")}
                                   for p, q in r.get("peers", {}).items()} for r in data["rows"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
