"""The scalar losses our ops return can be updated in place, as MoE models do with
`loss += router_aux_loss_coef * aux_loss` (a custom op returning a view would be refused)."""

import torch

import fused_kernels
from helpers import randn


def test_cross_entropy_loss_accepts_inplace_add():
    logits = randn(6, 11, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    loss = fused_kernels.cross_entropy(logits, target)
    loss += 0.5 * logits.sum()
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_logits, target) + 0.5 * ref_logits.sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert torch.allclose(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-7)


def test_fused_linear_cross_entropy_loss_accepts_inplace_add():
    hidden = randn(5, 8, requires_grad=True)
    weight = randn(13, 8, requires_grad=True)
    target = torch.randint(0, 13, (5,))
    loss = fused_kernels.fused_linear_cross_entropy(hidden, weight, target)
    aux = (hidden * hidden).mean()
    loss += 0.01 * aux
    loss.backward()
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(h @ w.T, target) + 0.01 * (h * h).mean()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert torch.allclose(hidden.grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)
