"""Session 19: where the fused linear CE's GPU time goes, per kernel, at the table's two FLCE shapes.

    python3 benchmarks/session19/prof_flce.py [--json PATH]      (on the H200)

For each shape: two warm-up steps, then torch.profiler over three forward+backward steps of
fused_kernels.fused_linear_cross_entropy on the benchmark's inputs (bf16, N(0,1) hidden, weight scaled
by 1/sqrt(H)); the kernels' durations are summed by name and divided by three. Beside it, the chunk's
cross-entropy launch alone (do_bench) and a copy of the same bytes (read + write of the chunk's logits).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fused_kernels  # noqa: E402

_flce = sys.modules["fused_kernels.fused_linear_cross_entropy"]
_ce = sys.modules["fused_kernels.cross_entropy"]

SHAPES = [(8192, 4096, 128256), (16384, 2304, 262144)]
STEPS = 3


def inputs(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn((n, h), device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn((v, h), device="cuda", generator=g) / math.sqrt(h)).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[:: max(1, min(2048, n // 4))] = -100
    return hid, w, t


def step(hid, w, t):
    hid.grad = None
    w.grad = None
    fused_kernels.fused_linear_cross_entropy(hid, w, t).backward()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for n, h, v in SHAPES:
        hid, w, t = inputs(n, h, v)
        for _ in range(2):
            step(hid, w, t)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step(hid, w, t)
            torch.cuda.synchronize()
        per_name = collections.defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per_name[ev.name][0] += ev.device_time_total / 1e3 / STEPS
                per_name[ev.name][1] += 1
        total = sum(x[0] for x in per_name.values())
        rows = _flce.chunk_rows(n, v, 2)
        print(f"\n== FLCE {n}x{h}->{v}: chunk rows {rows}, {math.ceil(n / rows)} chunks; GPU time per step "
              f"{total:.2f} ms; 3 GEMMs at 676 TFLOP/s: {6 * n * h * v / 676e12 * 1e3:.2f} ms")
        kernels = []
        for name, (ms, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0]):
            print(f"  {ms:8.3f} ms  {count // STEPS:4d}x  {name[:150]}")
            kernels.append({"name": name, "ms_per_step": ms, "launches_per_step": count // STEPS})
        # The chunk's cross entropy alone, in place, against a copy of the same bytes.
        buf = torch.randn((rows, v), device="cuda").to(torch.bfloat16)
        tgt = t[:rows].contiguous()
        loss_rows = torch.empty(rows, device="cuda")
        coef = torch.ones(1, device="cuda")
        flag = torch.zeros(1, device="cuda", dtype=torch.int32)
        opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, logit_scale=1.0)
        ce_ms = do_bench(lambda: _ce.launch_ce(buf, tgt, buf, loss_rows, coef, None, flag, **opts), warmup=20,
                         rep=200)
        other = torch.empty_like(buf)
        copy_ms = do_bench(lambda: other.copy_(buf), warmup=20, rep=200)
        print(f"  chunk CE alone {ce_ms * 1e3:.1f} us (x{math.ceil(n / rows)} = {ce_ms * math.ceil(n / rows):.2f} ms), "
              f"copy of its bytes {copy_ms * 1e3:.1f} us")
        out.append({"shape": [n, h, v], "chunk_rows": rows, "gpu_ms_per_step": total, "kernels": kernels,
                    "chunk_ce_ms": ce_ms, "chunk_copy_ms": copy_ms})
        del hid, w, t, buf, other
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "shapes": out},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
