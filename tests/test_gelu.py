"""fused_kernels.gelu and gelu_linear against float64 torch references."""


import pytest
import torch
import torch.nn.functional as F

import fused_kernels
from tests.helpers import plan, poisoned_outputs

from fused_kernels._gpu import OFF_GPU, DeviceFacts
from fused_kernels.ops import gelu as mod

H200 = DeviceFacts(True, 132, (9, 0), 233472, True)
REFERENCE = {"tanh": lambda t: F.gelu(t, approximate="tanh"), "none": F.gelu,
             "quick": lambda t: t * torch.sigmoid(1.702 * t)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("approximate", ["tanh", "none", "quick"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_forward_backward(approximate, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 7, 33, generator=g) * 3).to(dtype).requires_grad_()
    dout = torch.randn(5, 7, 33, generator=g).to(dtype)
    with poisoned_outputs(mod):
        out = fused_kernels.gelu(x, approximate)
        (dx,) = torch.autograd.grad(out, x, dout)
    x64 = x.detach().double().requires_grad_()
    ref = REFERENCE[approximate](x64)
    (dx64,) = torch.autograd.grad(ref, x64, dout.double())
    assert out.dtype == dtype and dx.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert rel(out, ref) < TOL[dtype] and rel(dx, dx64) < TOL[dtype]


@pytest.mark.parametrize("approximate", ["tanh", "quick"])
@pytest.mark.parametrize("bias", [True, False])
def test_gelu_linear_matches_and_keeps_only_h(approximate, bias):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 6, 40, generator=g).requires_grad_()
    w = (torch.randn(24, 40, generator=g) / 6).requires_grad_()
    b = torch.randn(24, generator=g).requires_grad_() if bias else None
    dout = torch.randn(4, 6, 24, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_kernels.gelu_linear(h, w, b, approximate)
    # h and the weight, never gelu(h) (a tensor of h's size that is not h)
    assert not any(t.shape == h.shape and t.data_ptr() != h.data_ptr() for t in saved)
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(out, leaves, dout)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = F.linear(REFERENCE[approximate](l64[0]), l64[1], l64[2] if bias else None)
    ref_grads = torch.autograd.grad(ref, l64, dout.double())
    assert rel(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert want.abs().max() > 0 and rel(got, want) < 1e-5


def test_gelu_linear_bf16_and_frozen_weight():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(64, 48, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(32, 48, generator=g) / 7).bfloat16()  # frozen: no weight gradient computed
    out = fused_kernels.gelu_linear(h, w, None, "none")
    (dh,) = torch.autograd.grad(out.float().square().sum(), h)
    h64 = h.detach().double().requires_grad_()
    ref = F.linear(F.gelu(h64), w.double())
    (dh64,) = torch.autograd.grad(ref.square().sum(), h64)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 1e-2 and rel(dh, dh64) < 1e-2


def test_bad_arguments_say_what_is_expected():
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="approximate"):
        fused_kernels.gelu(h, "sigmoid")
    with pytest.raises(ValueError, match=r"weight must have shape \(out_features, 8\)"):
        fused_kernels.gelu_linear(h, torch.randn(4, 5))
    with pytest.raises(TypeError, match="dtype"):
        fused_kernels.gelu_linear(h, torch.randn(4, 8).double())


def test_opcheck_and_compile_fullgraph():
    x = torch.randn(6, 10)
    torch.library.opcheck(torch.ops.fused_kernels.gelu_fwd.default, (x, 1))
    torch.library.opcheck(torch.ops.fused_kernels.gelu_bwd.default, (torch.randn(6, 10), x, 1))
    w = torch.randn(4, 10)

    def mlp(x, w):
        return fused_kernels.gelu_linear(x, w, None, "tanh").sum()

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x, w), mlp(x, w), rtol=1e-6)


def test_plan_blocks():
    assert plan(mod, 10 ** 6, 2, device=OFF_GPU).config.block == 8192
    assert plan(mod, 10 ** 6, 4, device=H200).config.block == 4096


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["tanh", "quick"])
def test_gpu_phi2_mlp_tail(approximate):
    """Phi-2's MLP tail at 16384 tokens in bf16: gelu_linear against float32, and what it keeps for the
    backward: nothing beyond its output (h and the weight are the caller's)."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(16384, 10240, device=device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(2560, 10240, device=device, generator=g) / 100).bfloat16().requires_grad_()
    b = torch.randn(2560, device=device, generator=g).bfloat16().requires_grad_()
    dout = torch.randn(16384, 2560, device=device, generator=g).bfloat16()
    F.linear(dout[:8, :16], w[:4, :16])  # cuBLAS's workspace, made on a stream's first GEMM, is not ours
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fused_kernels.gelu_linear(h, w, b, approximate)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= out.numel() * 2 + (1 << 20)  # gelu(h) was not kept
    grads = torch.autograd.grad(out, (h, w, b), dout)
    f32 = [t.detach().float().requires_grad_() for t in (h, w, b)]
    ref = F.linear(REFERENCE[approximate](f32[0]), f32[1], f32[2])
    ref_grads = torch.autograd.grad(ref, f32, dout.float())
    assert rel(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-2
