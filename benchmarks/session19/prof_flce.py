"""Session 19: where the fused linear CE's GPU time goes, per kernel, at the table's two FLCE shapes.

    python3 benchmarks/session19/prof_flce.py [--json PATH]      (on the H200)

For each shape: the benchmark's own inputs (scripts/bench_kernels.flce_case) and its per-kernel profile
(bench_kernels.kernel_times: a warm-up step, then torch.profiler over three forward+backward steps of
fused_kernels.fused_linear_cross_entropy, durations summed by name and divided by three). Beside it, the chunk's
cross-entropy launch alone (do_bench) and a copy of the same bytes (read + write of the chunk's logits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import bench_kernels  # noqa: E402
import fused_kernels  # noqa: E402

_flce = sys.modules["fused_kernels.fused_linear_cross_entropy"]
_ce = sys.modules["fused_kernels.cross_entropy"]

SHAPES = [(8192, 4096, 128256), (16384, 2304, 262144)]
STEPS = 3


def inputs(n, h, v):
    """(hidden, weight, target) as the benchmark's FLCE case makes them (seed 0)."""
    return bench_kernels.flce_case(n, h, v, ()).make(torch.device("cuda"), 0).args


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for n, h, v in SHAPES:
        hid, w, t = inputs(n, h, v)
        per_name = bench_kernels.kernel_times(lambda: fused_kernels.fused_linear_cross_entropy(hid, w, t).backward(),
                                              torch.device("cuda"), [hid, w], calls=STEPS)
        total = sum(us for us, _ in per_name.values()) / 1e3
        rows = _flce.chunk_rows(n, v, 2)
        print(f"\n== FLCE {n}x{h}->{v}: chunk rows {rows}, {math.ceil(n / rows)} chunks; GPU time per step "
              f"{total:.2f} ms; 3 GEMMs at 676 TFLOP/s: {6 * n * h * v / 676e12 * 1e3:.2f} ms")
        kernels = []
        for name, (us, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0]):
            print(f"  {us / 1e3:8.3f} ms  {round(count):4d}x  {name[:150]}")
            kernels.append({"name": name, "ms_per_step": us / 1e3, "launches_per_step": round(count)})
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
