"""A/B in one process: host µs of the cross-entropy forward (no grad, 64 x 1000, GPU) with the session-7
prologue/epilogue kernels (fused_kernels.cross_entropy as it is) against the torch ops it replaced
(count, clamp, reciprocal, a zeroed flag; sum, mul, sum; flag[0] == 0 and the assert), both around the
same launch_ce. Alternating rounds, medians.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session7/ab_ce_host_path.py     (GPU)
"""

import statistics

import torch

import fused_kernels
import importlib

ce = importlib.import_module("fused_kernels.cross_entropy")  # the module (the package exports the function)
from tune_common import host_us


def old_forward(logits, target, ignore_index=-100):
    n, v = logits.shape
    coef = (target != ignore_index).sum(dtype=torch.float32).reshape(1).clamp_(min=1.0).reciprocal_()
    loss_rows = torch.empty((n,), dtype=torch.float32, device=logits.device)
    flag = torch.zeros((1,), dtype=torch.int32, device=logits.device)
    ce.launch_ce(logits, target, None, loss_rows, coef, None, flag, ignore_index=ignore_index,
                 label_smoothing=0.0, z_loss=0.0, softcap=None)
    loss = (loss_rows.sum() * coef).sum()
    torch._assert_async(flag[0] == 0, "bad target")
    return loss


def main():
    x = torch.randn(64, 1000, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, 1000, (64,), device="cuda")
    assert torch.allclose(old_forward(x, t), fused_kernels.cross_entropy(x, t), rtol=1e-5)
    old, new = [], []
    for _ in range(5):
        old.append(host_us(lambda: old_forward(x, t)))
        new.append(host_us(lambda: fused_kernels.cross_entropy(x, t)))
    print(f"CE forward host µs, median of 5 rounds: torch ops {statistics.median(old):.1f} "
          f"({min(old):.1f}-{max(old):.1f}), prologue/epilogue kernels {statistics.median(new):.1f} "
          f"({min(new):.1f}-{max(new):.1f})")


if __name__ == "__main__":
    main()
