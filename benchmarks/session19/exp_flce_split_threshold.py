"""Session 19 experiment: the fused linear CE with the chunk cross entropy's split rows allowed from
7 rows per cluster instead of 16 (cross_entropy.SPLIT_MIN_ROWS_PER_CLUSTER, read at each dispatch, so
it is set here at run time; the library is unchanged).

    python3 benchmarks/session19/exp_flce_split_threshold.py      (on the H200)

exp_ce_few_rows.txt timed the chunk launches alone; this times the whole FLCE forward+backward
(do_bench medians, bf16, the benchmark's inputs) at the table's two shapes and Qwen3-0.6B's lm_head
(16384×1024→151936, 864-row chunks), threshold 16 and 7 alternating over three rounds in one process,
and checks that both give the same loss and gradients (relative 1e-2; NaN fails).
"""

from __future__ import annotations

import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import bench_kernels  # noqa: E402
import fused_kernels  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prof_flce import inputs  # noqa: E402

SHAPES = [(8192, 4096, 128256), (16384, 2304, 262144), (16384, 1024, 151936)]
THRESHOLDS = (16, 7)


def kernels_used(hid, w, t):
    names = bench_kernels.kernel_times(lambda: fused_kernels.fused_linear_cross_entropy(hid, w, t).backward(),
                                       torch.device("cuda"), [hid, w], calls=1)
    return sorted(name for name in names if "ce" in name and "kernel" in name)


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for n, h, v in SHAPES:
        hid, w, t = inputs(n, h, v)
        results = {}
        for k in THRESHOLDS:
            ce.SPLIT_MIN_ROWS_PER_CLUSTER = k
            hid.grad = w.grad = None
            loss = fused_kernels.fused_linear_cross_entropy(hid, w, t)
            loss.backward()
            results[k] = (loss.detach().clone(), hid.grad.clone(), w.grad.clone())
            print(f"{n}x{h}->{v} threshold {k}: CE kernels {kernels_used(hid, w, t)}", flush=True)
        ref = results[16]
        for a, b, name in zip(results[7], ref, ("loss", "grad_hidden", "grad_weight")):
            err = ((a.double() - b.double()).norm() / b.double().norm()).item()
            ok = torch.isfinite(a).all().item() and err < 1e-2
            print(f"   {name}: threshold 7 against 16, relative {err:.1e} {'ok' if ok else 'MISMATCH'}", flush=True)
        del results, ref

        def step():
            hid.grad = None
            w.grad = None
            fused_kernels.fused_linear_cross_entropy(hid, w, t).backward()

        times = {k: [] for k in THRESHOLDS}
        for _ in range(3):
            for k in THRESHOLDS:
                ce.SPLIT_MIN_ROWS_PER_CLUSTER = k
                times[k].append(do_bench(step, warmup=3, rep=400 if v < 200000 else 900))
        line = "  ".join(f"threshold {k}: " + " ".join(f"{x:.2f}" for x in times[k]) + " ms" for k in THRESHOLDS)
        print(f"   {line}", flush=True)
        del hid, w, t
        torch.cuda.empty_cache()
    ce.SPLIT_MIN_ROWS_PER_CLUSTER = 16
    return 0


if __name__ == "__main__":
    sys.exit(main())
