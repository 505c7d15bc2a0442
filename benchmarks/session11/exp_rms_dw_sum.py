"""Experiment (session 11): the RMSNorm backward's dw tail. The library sums the fp32 dw partial rows with
torch (`partial[:P].sum(0)`, a reduce kernel) and casts to the weight's dtype (a second kernel): 5.2 + 1.0 µs
of the 203 µs fwd+bwd at 4096×16384 (profile_rms_long.txt), where the target is 200. Is one Triton kernel
(sum over the P rows of a column block, cast, store) faster?

The run in exp_rms_dw_sum.txt timed this file's own copy of the kernel; the library adopted it unchanged
as rms_norm._dw_sum_kernel, which the sweep below now forces through each (block, rows, warps).

Times (queued, GPU only) the library's tail against the Triton kernel over block sizes, on the partial rows
the library's own backward wrote (still in L2, as in the real call), and checks the sums.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/exp_rms_dw_sum.py
"""

from __future__ import annotations

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

rms = importlib.import_module("fused_kernels.rms_norm")


def main():
    from tune_cross_entropy import queued_ms
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for rows, cols in ((4096, 16384), (16384, 4096), (1024, 65536), (65536, 1024)):
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
        w = (torch.rand(cols, device=dev) + 0.5).to(torch.bfloat16)
        dy = torch.randn_like(x)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        dx = torch.empty_like(x)
        sm = rms._sm_count(dev)
        split = rms.split_backward_config(rows, cols)
        if split is not None:
            partial, n_parts = rms._split_backward(dy, x, w, rstd, dx, 0.0, "llama", True, False, split, sm)
        else:
            partial, n_parts = rms._one_kernel_backward(dy, x, w, rstd, dx, 0.0, "llama", True, False, sm)
        torch.cuda.synchronize()
        ref = partial[:n_parts].double().sum(0)
        lib = lambda: partial[:n_parts].sum(dim=0).to(torch.bfloat16)  # noqa: E731
        lib_ms = min(queued_ms(lib, reps=21) for _ in range(3))
        print(f"{rows}x{cols}: {n_parts} partial rows ({n_parts * cols * 4 / 2**20:.1f} MiB); "
              f"library sum+cast {lib_ms * 1e3:.1f} us", flush=True)
        out = torch.empty(cols, device=dev, dtype=torch.bfloat16)
        for block in (32, 64, 128, 256, 512):
            for parts in (4, 8, 16):
                for warps in (2, 4, 8):
                    if block * parts // (32 * warps) < 1 or block * parts // (32 * warps) > 32:
                        continue
                    grid = (triton.cdiv(cols, block),)

                    def fn(block=block, parts=parts, warps=warps, grid=grid):
                        rms._dw_sum_kernel[grid](partial, out, n_parts, cols, BLOCK_N=block, PARTS=parts, num_warps=warps)
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
                    ok = err < 1e-2 and not torch.isnan(out).any().item()
                    t = min(queued_ms(fn, reps=21) for _ in range(3))
                    print(f"   block {block:4d} parts {parts:3d} warps {warps}: {t * 1e3:6.1f} us "
                          f"({t / lib_ms:.2f} of library) {'ok' if ok else f'WRONG {err:.1e}'}", flush=True)
        del x, dy, dx  # partial: rebound by the next shape (the closures above hold it)


if __name__ == "__main__":
    main()
