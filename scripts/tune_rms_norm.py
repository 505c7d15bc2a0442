"""Sweep fused_kernels.rms_norm's launch configuration on a GPU (the lead runs this on the H200).

    TRITON_INTERPRET=0 .venv/bin/python scripts/tune_rms_norm.py [--shapes 16384x4096,1024x65536] [--quick]

For each shape (bf16 x and weight, casting "llama") it times the rms_norm_fwd op and the rms_norm_bwd op
(triton.testing.do_bench medians) for every candidate LaunchConfig, checks each candidate's outputs
against the shipped config's, and prints them against the floors from a copy measured in the same run
(forward: read x + write y; backward: read x, dy + write dx). Put the best rows into rms_norm's
_FWD_TABLE / _BWD_TABLE / _FWD_LONG / _BWD_LONG / L2_BUDGET_BYTES.
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch
import triton
from triton.testing import do_bench

import fused_kernels  # noqa: F401  (registers the custom ops)

rms = importlib.import_module("fused_kernels.rms_norm")  # the module; fused_kernels.rms_norm is the function
LaunchConfig = rms.LaunchConfig


def candidates(n_cols: int, backward: bool, quick: bool):
    block = max(16, triton.next_power_of_2(n_cols))
    out = []
    if block <= 16384:  # whole row in registers (the backward at 16384 spills; measured anyway)
        for rows, warps in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16, 32)):
            per_thread = block * rows // (32 * warps)
            if not 4 <= per_thread <= 32 or block * rows > 32768:
                continue
            for per_sm in ((1, 2, 4) if backward else (0,)):
                out.append(LaunchConfig(block, rows, warps, per_sm))
    if n_cols > 4096:
        for chunk, warps in itertools.product((4096, 8192, 16384), (8, 16, 32)):
            if chunk // (32 * warps) > 32 or chunk // (32 * warps) < 4:
                continue
            for per_sm in ((1, 2) if backward else (0,)):
                out.append(LaunchConfig(chunk, 1, warps, per_sm, chunked=True))
    if quick:
        out = out[:: max(1, len(out) // 8)]
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same numbers up to summation order (bf16 outputs may differ in the last bit)."""
    return bool(torch.isfinite(a).all()) and (a.float() - b.float()).norm().item() <= 1e-2 * b.float().norm().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,65536x1024,4096x16384,1024x65536")
    ap.add_argument("--quick", action="store_true", help="every few candidates only")
    ap.add_argument("--l2-budgets-mib", default="16,32,48", help="tried for chunked backward configs")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)

    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    copy_gbps = 2 * big.numel() / (do_bench(lambda: dst.copy_(big)) * 1e-3) / 1e9
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy {copy_gbps:.0f} GB/s")

    shipped_launch_config = rms.launch_config
    shipped_budget = rms.L2_BUDGET_BYTES
    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        nbytes = x.numel() * x.element_size()
        floor_fwd = 2 * nbytes / (copy_gbps * 1e9) * 1e3
        floor_bwd = 3 * nbytes / (copy_gbps * 1e9) * 1e3
        y_ref, rstd = torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
        dx_ref, dw_ref = torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)
        print(f"\n{rows}x{n} bf16: floors fwd {floor_fwd:.4f} ms, bwd {floor_bwd:.4f} ms;"
              f" shipped fwd {shipped_launch_config(n, False)}, bwd {shipped_launch_config(n, True)}")
        for backward in (False, True):
            shipped = (lambda: torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)) if backward \
                else (lambda: torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama"))
            floor = floor_bwd if backward else floor_fwd
            ms = do_bench(shipped)
            print(f"  {'bwd' if backward else 'fwd'} shipped {ms:.4f} ms ({floor / ms:5.1%} of floor)")
            results = []
            for cfg in candidates(n, backward, args.quick):
                budgets = [int(b) * 2**20 for b in args.l2_budgets_mib.split(",")] if (backward and cfg.chunked) else [shipped_budget]
                for budget in budgets:
                    rms.launch_config = lambda n_cols, bw, cfg=cfg: cfg
                    rms.L2_BUDGET_BYTES = budget
                    try:
                        if backward:
                            fn = lambda: torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)
                            dx, dw = fn()
                            ok = close(dx, dx_ref) and close(dw, dw_ref)
                        else:
                            fn = lambda: torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
                            ok = close(fn()[0], y_ref)
                        ms = do_bench(fn)
                    except Exception as exc:  # a config that does not compile or launch: report, go on
                        print(f"  {'bwd' if backward else 'fwd'} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    finally:
                        rms.launch_config = shipped_launch_config
                        rms.L2_BUDGET_BYTES = shipped_budget
                    results.append((ms, cfg, budget, ok))
            results.sort(key=lambda r: r[0])
            for ms, cfg, budget, ok in results[:6]:
                extra = f" L2 budget {budget >> 20} MiB" if (backward and cfg.chunked) else ""
                print(f"  {'bwd' if backward else 'fwd'} {ms:.4f} ms ({floor / ms:5.1%} of floor)"
                      f"{'' if ok else '  MISMATCH'}  {cfg}{extra}")


if __name__ == "__main__":
    main()
