"""The session-8 CE experiments' shared GPU harness: one forward-with-gradient case of 8192 rows bf16 (10 %
ignored) with its float64 reference, and the check every candidate kernel's output gets.

The reference covers the first `ref_rows` rows (all by default): softmax in float64 needs 16 bytes per
logit, 17 GB at V = 262144.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def ce_case(v: int, n: int = 8192, ref_rows=None, ignored: bool = True) -> SimpleNamespace:
    """ignored: every 10th target is ignore_index (the session-8 runs); False: none (as scripts/bench.py)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn((n, v), device="cuda", generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if ignored:
        t[::10] = -100
    rows = slice(0, ref_rows or n)
    x64 = x[rows].double()
    ref_loss = torch.nn.functional.cross_entropy(x64, t[rows], reduction="none", ignore_index=-100)
    p = torch.softmax(x64, -1)
    keep = t[rows] != -100
    p[keep, t[rows][keep]] -= 1.0
    ref_grad = p * keep[:, None] / n
    del x64, p
    return SimpleNamespace(
        n=n, v=v, x=x, t=t, rows=rows, ref_loss=ref_loss, ref_grad=ref_grad,
        coef=torch.full((1,), 1.0 / n, device="cuda"), grad=torch.empty_like(x),
        loss=torch.empty(n, device="cuda"), flag=torch.zeros(1, dtype=torch.int32, device="cuda"),
    )


def poison(case) -> None:
    case.loss.fill_(float("nan"))
    case.grad.fill_(float("nan"))


def check(case, label: str) -> None:
    """Max relative errors of the loss and the gradient over the reference rows; NaN anywhere is WRONG."""
    loss, grad = case.loss[case.rows], case.grad[case.rows]
    le = ((loss - case.ref_loss).abs().max() / case.ref_loss.abs().max()).item()
    ge = ((grad.double() - case.ref_grad).abs().max() / case.ref_grad.abs().max()).item()
    ok = le < 1e-5 and ge < 1e-2 and not (case.loss.isnan().any() or case.grad.isnan().any())
    print(f"  {label}: loss err {le:.1e}, grad err {ge:.1e} {'ok' if ok else 'WRONG'}", flush=True)


def check_and_time(case, runs, copy_ms: float, rounds: int, timer=None) -> None:
    """Each (label, fn) of runs: poisoned outputs, one run, the check against float64 (a run that raises
    is reported and dropped); then `rounds` rounds of CUDA-event medians of the survivors, in turn, as
    ms and fraction of a copy of the logits. timer: tune_cross_entropy.event_ms (default) or queued_ms."""
    from tune_cross_entropy import event_ms  # scripts/ on the path: the GPU harnesses' shared timer

    good = []
    for label, fn in runs:
        poison(case)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        check(case, label)
        good.append((label, fn))
    for rnd in range(rounds):
        for label, fn in good:
            ms = (timer or event_ms)(fn, reps=15)
            print(f"  V={case.v} round {rnd}: {ms:.3f} ms  {copy_ms / ms:5.1%} of copy  {label}", flush=True)


def copy_ms(x: torch.Tensor, reps: int = 15, timer=None) -> float:
    """CUDA-event median of a copy of x (x read once, written once): the yardstick of a one-read kernel.
    timer: tune_cross_entropy.event_ms (default) or queued_ms."""
    from tune_cross_entropy import event_ms

    dst = torch.empty_like(x)
    return (timer or event_ms)(lambda: dst.copy_(x), reps=reps)


def table_launch(case) -> None:
    """The library's cross-entropy launch on the case (plain options): its table's kernel for V."""
    from fused_kernels.cross_entropy import launch_ce

    launch_ce(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, ignore_index=-100,
              label_smoothing=0.0, z_loss=0.0, softcap=None)
