"""Hardware counters of the cross-entropy kernel (forward writing the gradient, bf16) against a plain
Triton copy of the same bytes, on the H200 under Nsight Compute: why V = 32000 runs at 67 % of the
copy ceiling (DRAM throughput, L2 hit rate of the second sweep, occupancy, stall reasons).

    ncu --clock-control none --profile-from-start off --set full -k regex:"_ce_kernel|_copy_kernel" \
        python3 benchmarks/session7/ncu_ce.py [V ...]

CE_FORCE=8192x8x0x2x1 (block x warps x per_sm x stages x l2_hints) replaces the table's shape.
Everything between cudaProfilerStart / Stop is profiled: one copy of 8192×V bf16 (read + write, the
CE's HBM floor traffic) and one CE forward per V, each after a warm-up launch outside the window.
"""

import os
import sys

import torch
import triton
import triton.language as tl

from fused_kernels import cross_entropy as ce_module
from fused_kernels.cross_entropy import launch_ce


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def main() -> None:
    vocabs = [int(v) for v in sys.argv[1:]] or [32000, 128256]
    if os.environ.get("CE_FORCE"):  # BLOCKxWARPSxPER_SMxSTAGESxHINTS instead of the table
        b, w, p, st, h = os.environ["CE_FORCE"].split("x")
        ce_module._CONFIG["force"] = ce_module.LaunchConfig(int(b), int(w), float(p), int(st), h == "1")
    rows = 8192
    runs = []
    for v in vocabs:
        g = torch.Generator(device="cuda").manual_seed(v)
        x = (torch.randn((rows, v), device="cuda", generator=g) * 2).to(torch.bfloat16)
        t = torch.randint(0, v, (rows,), device="cuda", generator=g)
        grad = torch.empty_like(x)
        loss = torch.empty(rows, device="cuda")
        coef = torch.full((1,), 1.0 / rows, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        dst = torch.empty_like(x)

        def ce(x=x, t=t, grad=grad, loss=loss, coef=coef, flag=flag):
            launch_ce(x, t, grad, loss, coef, None, flag, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                      softcap=None)

        def copy(x=x, dst=dst):
            n = x.numel()
            _copy_kernel[(triton.cdiv(n, 8192),)](x, dst, n, BLOCK=8192, num_warps=8)

        ce(), copy()  # compile and warm outside the profiled window
        runs.append((copy, ce))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for copy, ce in runs:
        copy()
        ce()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
