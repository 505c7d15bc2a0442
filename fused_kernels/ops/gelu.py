"""GELU, and a plain MLP's tail `linear(gelu(h), weight, bias)` that recomputes gelu(h) in its backward.

Math (fp32 inside, one rounding to the input dtype; approximate "tanh", "none" (erf) or "quick", CLIP's
g σ(1.702 g); the formulas and derivatives are in fused_kernels/_activations.py):

    forward   a = gelu(h)                       backward   dh = dout · gelu'(h)
    gelu_linear(h, W, b) = a Wᵀ + b             backward   dW = doutᵀ a (a recomputed from h), db = Σ dout,
                                                           da = dout W, dh = da · gelu'(h) (written over da)

Why: a plain MLP `fc2(gelu(fc1(x)))` in eager torch keeps fc1's output h (for gelu's backward) and a (for
fc2's weight gradient): two tokens × intermediate tensors per layer. gelu_linear keeps h only and pays one
more elementwise pass (read h, write a: 2·N·b bytes) in the backward. At 16384 tokens, intermediate 10240
(Phi-2), bf16: 320 MiB less per layer.

Bytes moved, N elements of b bytes: gelu forward 2·N·b; backward 3·N·b (read h, dout; write dh).
Contiguous tensors are processed as one flat row in blocks of `plan().config` elements.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fused_kernels._activations import GELU_APPROXIMATE, GELU_QUICK, gate_act, gate_act_and_grad
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts, device_facts, device_guard
from fused_kernels._jit import for_store
from fused_kernels._launch import launch
from fused_kernels._utils import (check_choice, check_float, check_projection, count_launch, interpreter_on, new_output,
                                  require_triton)

__all__ = ["gelu", "gelu_linear", "plan", "APPROXIMATE"]

APPROXIMATE = {**GELU_APPROXIMATE, "quick": GELU_QUICK}
_INTERPRETED = interpreter_on()
_new_output = new_output  # every buffer the kernels write (tests poison it)


@triton.jit
def _gelu_fwd_kernel(X, OUT, n, ACT: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, for_store(gate_act(x, ACT), OUT.dtype.element_ty, EXACT_BF16), mask=mask)


@triton.jit
def _gelu_bwd_kernel(X, DOUT, DX, n, ACT: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    _, da = gate_act_and_grad(x, ACT)
    tl.store(DX + offs, for_store(dout * da, DX.dtype.element_ty, EXACT_BF16), mask=mask)


class GeluConfig(NamedTuple):
    block: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one call: n contiguous elements of elem_bytes bytes."""
    n: int
    elem_bytes: int


def plan(call: Call, device: DeviceFacts) -> Plan:
    """One flat row of `n` elements: 16 KiB of input per program (4096 elements of 4 bytes, 8192 of 2),
    on every device (a table too small for a module of its own)."""
    block = 16384 // call.elem_bytes
    return Plan(Path.FLAT, GeluConfig(block, 8), f"{call.n} contiguous elements in blocks of {block}")


def _launch(kernel, ins, out, act: int) -> None:
    n = out.numel()
    if not n:
        return
    cfg = plan(Call(n, ins[0].element_size()), device_facts(out.device)).config
    with device_guard(out):
        launch(kernel, (triton.cdiv(n, cfg.block),), (*ins, out, n),
               dict(ACT=act, BLOCK=cfg.block, EXACT_BF16=_INTERPRETED, num_warps=cfg.num_warps))


def _forward(x: torch.Tensor, act: int, op: str = "gelu_fwd") -> torch.Tensor:
    require_triton("gelu", x)
    count_launch(op)  # "gelu_recompute" for the backward's recomputation: not a call of the op
    x = x.contiguous()
    out = _new_output(x.shape, x.dtype, x.device)
    _launch(_gelu_fwd_kernel, (x,), out, act)
    return out


def _backward(dout: torch.Tensor, x: torch.Tensor, act: int, into: torch.Tensor = None) -> torch.Tensor:
    """dx = dout · gelu'(x); `into`: a contiguous buffer of x's shape to write it in (may be dout itself)."""
    require_triton("gelu", dout, x)
    count_launch("gelu_bwd")
    x = x.contiguous()
    dout = dout.to(x.dtype).contiguous()
    dx = into if into is not None else _new_output(x.shape, x.dtype, x.device)
    _launch(_gelu_bwd_kernel, (x, dout), dx, act)
    return dx


@torch.library.custom_op("fused_kernels::gelu_fwd", mutates_args=())
def _gelu_fwd(x: torch.Tensor, act: int) -> torch.Tensor:
    return _forward(x, act)


@_gelu_fwd.register_fake
def _(x, act):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fused_kernels::gelu_bwd", mutates_args=())
def _gelu_bwd(dout: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    return _backward(dout, x, act)


@_gelu_bwd.register_fake
def _(dout, x, act):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup_context(ctx, inputs, output):
    x, act = inputs
    ctx.save_for_backward(x)  # not the output: the backward recomputes gelu'(x) from x
    ctx.act = act


def _autograd(ctx, dout):
    (x,) = ctx.saved_tensors
    return torch.ops.fused_kernels.gelu_bwd(dout, x, ctx.act), None


_gelu_fwd.register_autograd(_autograd, setup_context=_setup_context)


class _GeluLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, act: int):
        out = torch.nn.functional.linear(_forward(h, act), weight, bias)
        ctx.save_for_backward(h, weight)  # not gelu(h): the backward recomputes it
        ctx.act, ctx.has_bias = act, bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        h, weight = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        dweight = dbias = dh = None
        if ctx.needs_input_grad[1]:
            a = _forward(h, ctx.act, "gelu_recompute")
            dweight = d2.t().mm(a.reshape(-1, a.shape[-1]))
            del a
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = d2.sum(0)
        if ctx.needs_input_grad[0]:
            da = dout.matmul(weight).contiguous()
            dh = _backward(da, h, ctx.act, into=da if da.dtype == h.dtype else None)  # da is ours alone
        return dh, dweight, dbias, None


def _act_id(approximate: str) -> int:
    check_choice("approximate", approximate, tuple(APPROXIMATE))
    return APPROXIMATE[approximate]


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x) in fp32, rounded once to x's dtype: approximate "tanh" (gelu_pytorch_tanh, gelu_new), "none"
    (the erf GELU) or "quick" (x·σ(1.702x), CLIP's quick_gelu). The backward saves x only. A custom op
    (fused_kernels::gelu_fwd), traced whole by torch.compile."""
    check_float("x", x)
    return torch.ops.fused_kernels.gelu_fwd(x, _act_id(approximate))


def gelu_linear(h: torch.Tensor, weight: torch.Tensor, bias=None, approximate: str = "tanh") -> torch.Tensor:
    """linear(gelu(h), weight, bias): a plain MLP's activation and second projection, keeping h but not
    gelu(h) for the backward (see the module docstring). weight (out, h.shape[-1]) and bias (out,) or None,
    of h's dtype and device. Under torch.compile: F.linear of the gelu custom op."""
    act = _act_id(approximate)
    check_float("h", h)
    check_projection("h", h, weight, bias)
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not (
            h.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return torch.nn.functional.linear(torch.ops.fused_kernels.gelu_fwd(h, act), weight, bias)
    return _GeluLinearFunction.apply(h, weight, bias, act)
