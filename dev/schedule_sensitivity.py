"""How far two *plain* fp32 trainings of the convergence test's model drift apart when their initial
weights differ by one part in a million, under a given learning-rate schedule (CPU, a few minutes).

    .venv/bin/python dev/schedule_sensitivity.py

Rounding differences between patched and plain runs are of that size, so a schedule on which this
drift explodes (a loss spike) cannot support step-by-step equality tests at tight tolerances; the
numbers chose the warm-up + cosine + clipping schedule of tests/test_stack_gpu.py. Prints, per
schedule (lr, warm-up steps, clip norm; 0 = none): first/last loss, the largest per-step difference
and the step where it happens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_stack_gpu import STEPS, WARMUP, learnable_batch, lr_factor, small_llama  # noqa: E402

# (peak lr, warm-up steps (0: constant lr), clip norm (0: none)); the first is the test's old schedule
SCHEDULES = [(1e-3, 0, 0.0), (1e-3, WARMUP, 1.0), (5e-4, WARMUP, 1.0)]


def train(lr: float, warmup: int, clip: float, perturb: float) -> list[float]:
    model = small_llama(device="cpu")
    if perturb:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=g))
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor if warmup else (lambda step: 1.0))
    losses = []
    for _ in range(STEPS):
        ids, labels = learnable_batch(perm, data, device="cpu")
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> int:
    for lr, warmup, clip in SCHEDULES:
        a, b = train(lr, warmup, clip, 0.0), train(lr, warmup, clip, 1e-6)
        d = [abs(x - y) for x, y in zip(a, b)]
        i = max(range(len(d)), key=d.__getitem__)
        print(f"lr {lr:g} warm-up {warmup} clip {clip:g}: loss {a[0]:.3f} -> {a[-1]:.4f}; "
              f"max |difference| {d[i]:.2e} at step {i} (loss there {a[i]:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
