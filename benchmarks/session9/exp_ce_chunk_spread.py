"""Experiment (session 9): the spread of single launches of the CE kernel on FLCE-sized chunks (the
Qwen3 e2e step was bimodal, 157 or 195 ms, after V = 151936 moved to 8-CTA clusters). Times each launch
alone (CUDA events, in-place gradient as fused_linear_cross_entropy does) and prints min / median / p90 /
max per launch shape.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session9/exp_ce_chunk_spread.py
"""

from __future__ import annotations

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")


def spread(rows, v, force, reps=60):
    x0 = (torch.randn(rows, v, device="cuda") * 2).to(torch.bfloat16)
    x = x0.clone()
    t = torch.randint(0, v, (rows,), device="cuda")
    loss = torch.empty(rows, device="cuda")
    coef = torch.full((1,), 1.0 / rows, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = []
    for i in range(reps + 3):
        x.copy_(x0)
        ce._CONFIG["force"] = force
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        ce.launch_ce(x, t, x, loss, coef, None, flag, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                     softcap=None)
        e.record()
        ce._CONFIG["force"] = None
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    times.sort()
    n = len(times)
    return times[0], times[n // 2], times[int(n * 0.9)], times[-1]


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    L = ce.LaunchConfig
    shapes = {
        "table (Triton)": None,
        "smem 8w x4/SM ctas8": L(2048, 8, 4, smem=True, ctas=8),
        "smem 8w x3/SM ctas8": L(2048, 8, 3, smem=True, ctas=8),
        "smem 8w x2/SM ctas4": L(2048, 8, 2, smem=True, ctas=4),
    }
    for rows, v in ((640, 151936), (8192, 151936), (768, 128256)):
        for label, force in shapes.items():
            if force is None:
                force = ce.launch_config(v)
            if v == 128256 and force.smem and force.ctas == 8 and force.per_sm == 4:
                continue
            try:
                lo, med, p90, hi = spread(rows, v, force)
            except Exception as exc:  # noqa: BLE001
                print(f"{rows}x{v} {label}: FAILED {type(exc).__name__} {str(exc)[:200]}")
                continue
            print(f"{rows}x{v} {label:22s} min {lo:.3f} med {med:.3f} p90 {p90:.3f} max {hi:.3f} ms", flush=True)
        if v == 128256:
            lo, med, p90, hi = spread(rows, v, L(2048, 8, 3, smem=True, ctas=4))
            print(f"{rows}x{v} {'smem 8w x3/SM ctas4':22s} min {lo:.3f} med {med:.3f} p90 {p90:.3f} max {hi:.3f} ms")


if __name__ == "__main__":
    main()
