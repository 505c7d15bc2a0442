"""Session 19 experiment: cross-entropy launch shapes for the fused linear CE's chunks, a few hundred
long rows (prof_flce.py: at 16384×2304→262144 the chunk CE, 504 rows, runs the Triton kernel at 60 %
of a copy; the split-row shared-memory kernel is not eligible below 16 rows per cluster).

    python3 benchmarks/session19/exp_ce_few_rows.py       (on the H200)

Per chunk shape: the library's own dispatch, then forced launch shapes (`_CONFIG["force"]`), each
checked against the dispatch's losses and in-place gradient (bf16: 1e-2 relative; NaN fails), then
timed alone with CUDA events over 40 launches on a fresh copy of the logits (median, min), beside a copy
of the same bytes.
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")
L = ce.LaunchConfig

SHAPES = [(504, 262144), (1024, 128256), (864, 151936)]
CANDIDATES = {
    "smem 4w x7/SM ctas8 reg4": L(1024, 4, 7, smem=True, ctas=8, in_registers=4),
    "smem 4w x5/SM ctas8 reg4": L(1024, 4, 5, smem=True, ctas=8, in_registers=4),
    "smem 8w x4/SM ctas8 reg3": L(2048, 8, 4, smem=True, ctas=8, in_registers=3),
    "smem 8w x3/SM ctas8": L(2048, 8, 3, smem=True, ctas=8),
    "smem 8w x2/SM ctas8": L(2048, 8, 2, smem=True, ctas=8),
    "smem 8w x1/SM ctas8": L(2048, 8, 1, smem=True, ctas=8),
    "smem 8w x2/SM ctas4": L(2048, 8, 2, smem=True, ctas=4),
    "smem 8w x1/SM ctas4": L(2048, 8, 1, smem=True, ctas=4),
    "triton 16384x16 s2 hints": L(16384, 16, 0, stages=2, l2_hints=True),
    "triton 8192x8 s2 hints": L(8192, 8, 0, stages=2, l2_hints=True),
    "triton 32768x32 per_sm1 hints": L(32768, 32, 1, stages=1, l2_hints=True),
}


def run(x0, t, force, reps=40):
    """(median ms, min ms, loss_rows, grad) of launch_ce in place on copies of x0 under `force`."""
    rows = x0.shape[0]
    x = x0.clone()
    loss = torch.empty(rows, device="cuda")
    coef = torch.full((1,), 1.0 / rows, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = []
    for i in range(reps + 3):
        x.copy_(x0)
        loss.fill_(float("nan"))
        ce._CONFIG["force"] = force
        try:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            ce.launch_ce(x, t, x, loss, coef, None, flag, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                         softcap=None)
            e.record()
        finally:
            ce._CONFIG["force"] = None
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2], times[0], loss.clone(), x.clone()


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for rows, v in SHAPES:
        x0 = (torch.randn(rows, v, device="cuda") * 2).to(torch.bfloat16)
        t = torch.randint(0, v, (rows,), device="cuda")
        other = torch.empty_like(x0)
        copy = []
        for _ in range(23):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            other.copy_(x0)
            e.record()
            torch.cuda.synchronize()
            copy.append(s.elapsed_time(e))
        copy_ms = sorted(copy[3:])[10]
        med, lo, loss_ref, grad_ref = run(x0, t, None)
        smem = ce._smem_module()
        chosen = ce.launch_config(v, (lambda c: ce.smem_shape_fits(smem, x0, c)) if smem is not None else None)
        print(f"{rows}x{v}: copy of the bytes {copy_ms * 1e3:.1f} us; dispatch "
              f"({chosen}) med {med * 1e3:.1f} min {lo * 1e3:.1f} us", flush=True)
        for label, cfg in CANDIDATES.items():
            try:
                med, lo, loss, grad = run(x0, t, cfg)
            except Exception as exc:  # noqa: BLE001 - a shape that does not fit is reported
                print(f"   {label:30s} FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            el, eg = rel(loss, loss_ref), rel(grad, grad_ref)
            ok = el < 1e-2 and eg < 1e-2
            print(f"   {label:30s} med {med * 1e3:6.1f} min {lo * 1e3:6.1f} us  {copy_ms / med:4.0%} of a copy  "
                  f"{'ok' if ok else 'MISMATCH'} (loss {el:.1e}, grad {eg:.1e})", flush=True)
        del x0, other
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
