"""Gated linear units, SwiGLU and GeGLU: forward and backward in Triton.

Math (g = gate, u = up, dout = upstream gradient; every step in fp32, rounded once to the input dtype):

    swiglu:          out = silu(g) · u = g σ(g) · u
                     silu'(g) = σ(g) (1 + g (1 − σ(g)))
    geglu "tanh":    gelu(g) = ½ g (1 + tanh z),  z = √(2/π) (g + 0.044715 g³)
                     Because ½ (1 + tanh z) = σ(2z):  gelu(g) = g σ(2z), and
                     gelu'(g) = σ(2z) + g · 2 σ(2z) (1 − σ(2z)) · √(2/π) (1 + 3 · 0.044715 g²)
    geglu "none":    gelu(g) = g Φ(g),  Φ(g) = ½ (1 + erf(g / √2))
                     gelu'(g) = Φ(g) + g φ(g),  φ(g) = exp(−g²/2) / √(2π)
    backward:        dup = dout · act(g),   dgate = dout · u · act'(g)

HF computes `act_fn(gate) * up` as two rounded steps (act rounded to the input dtype, then the product
rounded again); we round once, which is closer to the exact value.

The backward recomputes act(g) from g, so autograd saves only gate and up (which the caller holds
anyway, as the projections' outputs), never the output; dgate and dup come from one kernel.

Bytes moved, for N elements of b bytes: forward 3·N·b (read g, u; write out), backward 5·N·b (read
dout, g, u; write dgate, dup). SwiGLU 16384×14336 bf16: 8 × 448 MiB = 3.76 GB.

glu_linear(gate, up, weight, bias, activation) is the gated MLP's tail, `linear(act(g) · u, weight, bias)`
(the down projection), as one autograd node that saves gate, up and the weight but not the product
h = act(g) · u: the backward recomputes h (one more forward kernel, 3·N·b bytes) for the weight
gradient, dweight = doutᵀ h, then runs the usual GLU backward on dh = dout · weight, writing dgate and
dup over gate and up (saved for this node only, dead after it; their version counters are bumped so
that a retain_graph second backward fails loudly). A plain
`down_proj(swiglu(gate, up))` keeps h alive from the forward to the backward (the Linear saves its
input): tokens × intermediate × b bytes per layer, 96 MiB per Qwen3-0.6B layer at 16384 tokens bf16.

Layout: contiguous inputs are processed as one flat row. Otherwise each tensor is viewed as
rows × cols with a row stride and unit column stride — this covers the two halves of a fused
gate_up_proj output (`gate, up = x.chunk(2, dim=-1)`, row stride 2·cols) without a copy; a tensor that
cannot be viewed that way (transposed, or leading dims that do not collapse) is copied first.
Programs tile rows × cols with a (BLOCK_M, BLOCK_N) block: `plan()` (in glu_config, with the tables)
says which (path "flat" for contiguous operands, "rows" for row views), from `_block_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kernels._activations import GELU_APPROXIMATE, GELU_ERF, GELU_TANH, SILU, gate_act, gate_act_and_grad
from fused_kernels._gpu import device_facts, device_guard
from fused_kernels._launch import launch
from fused_kernels._utils import check_choice, check_float, check_projection, count_launch, require_triton
from fused_kernels.ops.glu_config import Call, plan

__all__ = ["swiglu", "geglu", "glu_linear"]

@triton.jit
def _tile(n_rows, n_cols, n_col_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          WIDE_INDEX: tl.constexpr):
    """This program's row indices, column indices and bounds mask."""
    pid = tl.program_id(0)
    if WIDE_INDEX:  # some offset passes 2**31: do the index arithmetic in int64
        pid = pid.to(tl.int64)
    pid_m = pid // n_col_blocks
    pid_n = pid - pid_m * n_col_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows, cols, mask


@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_rows, n_cols, n_col_blocks,
    stride_gate, stride_up, stride_out,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, BLOCK_M, BLOCK_N, WIDE_INDEX)
    gate_offs = rows[:, None] * stride_gate + cols[None, :]
    up_offs = rows[:, None] * stride_up + cols[None, :]
    out_offs = rows[:, None] * stride_out + cols[None, :]
    if EVEN:  # the tile lies inside the tensor: no mask, so loads and stores vectorise freely
        g = tl.load(gate_ptr + gate_offs).to(tl.float32)
        u = tl.load(up_ptr + up_offs).to(tl.float32)
    else:
        g = tl.load(gate_ptr + gate_offs, mask=mask).to(tl.float32)
        u = tl.load(up_ptr + up_offs, mask=mask).to(tl.float32)
    out = (gate_act(g, ACT) * u).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + out_offs, out)
    else:
        tl.store(out_ptr + out_offs, out, mask=mask)


@triton.jit
def _glu_bwd_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    n_rows, n_cols, n_col_blocks,
    stride_dout, stride_gate, stride_up, stride_grad,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, BLOCK_M, BLOCK_N, WIDE_INDEX)
    dout_offs = rows[:, None] * stride_dout + cols[None, :]
    gate_offs = rows[:, None] * stride_gate + cols[None, :]
    up_offs = rows[:, None] * stride_up + cols[None, :]
    grad_offs = rows[:, None] * stride_grad + cols[None, :]
    if EVEN:
        do = tl.load(dout_ptr + dout_offs).to(tl.float32)
        g = tl.load(gate_ptr + gate_offs).to(tl.float32)
        u = tl.load(up_ptr + up_offs).to(tl.float32)
    else:
        do = tl.load(dout_ptr + dout_offs, mask=mask).to(tl.float32)
        g = tl.load(gate_ptr + gate_offs, mask=mask).to(tl.float32)
        u = tl.load(up_ptr + up_offs, mask=mask).to(tl.float32)
    a, da = gate_act_and_grad(g, ACT)
    dup = (do * a).to(dup_ptr.dtype.element_ty)
    dgate = (do * u * da).to(dgate_ptr.dtype.element_ty)
    if EVEN:
        tl.store(dgate_ptr + grad_offs, dgate)
        tl.store(dup_ptr + grad_offs, dup)
    else:
        tl.store(dgate_ptr + grad_offs, dgate, mask=mask)
        tl.store(dup_ptr + grad_offs, dup, mask=mask)


# ----------------------------------------------------------------------------------------------
# Host side


def _empty_output(shape, like: torch.Tensor) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it to prove each element is written)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a rows × cols tensor with unit column stride: a view when the strides allow (e.g. a
    chunk of a wider last dimension), a contiguous copy when they do not (transposed views)."""
    n_cols = t.shape[-1] if t.dim() > 0 else 1
    try:
        t2 = t.view(-1, n_cols)
    except RuntimeError:  # leading dims that do not collapse into one row stride
        return t.reshape(-1, n_cols).contiguous()
    if n_cols > 1 and t2.stride(1) != 1:
        return t2.contiguous()
    return t2


def _launch(kernel, direction: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], act: int):
    """Run `kernel` over same-shaped `inputs` (read) and `outputs` (written): fresh contiguous tensors,
    or (the in-place backward) views that `_writable_rows` accepted, all with one row stride."""
    elem = inputs[0].element_size()
    if all(t.is_contiguous() for t in (*inputs, *outputs)):
        # One flat row: the longest contiguous run there is, and no row arithmetic.
        n_rows, n_cols = 1, outputs[0].numel()
        ins, in_strides = inputs, [0] * len(inputs)
        out_stride = 0
        p = plan(Call(1, n_cols, elem, direction), device_facts(outputs[0].device))
    else:
        ins = [_as_rows(t) for t in inputs]
        outputs = [t.view(-1, t.shape[-1]) for t in outputs]
        n_rows, n_cols = ins[0].shape
        in_strides = [t.stride(0) for t in ins]
        out_stride = outputs[0].stride(0) if n_rows > 1 else n_cols
        p = plan(Call(n_rows, n_cols, elem, direction, row_strides=(*in_strides, out_stride)),
                 device_facts(outputs[0].device))
    cfg = p.config
    n_col_blocks = -(-n_cols // cfg.block_n)
    with device_guard(outputs[0]):
        launch(kernel, (cfg.programs,),
               (*ins, *outputs, n_rows, n_cols, n_col_blocks, *in_strides, out_stride),
               dict(ACT=act, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, EVEN=cfg.even, WIDE_INDEX=cfg.wide_index,
                    num_warps=cfg.num_warps))


def _forward(op: str, gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    require_triton(op, gate, up)
    count_launch(op)
    out = _empty_output(gate.shape, gate)
    if out.numel():
        _launch(_glu_fwd_kernel, "fwd", [gate, up], [out], act)
    return out


def _backward(op: str, dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int,
              in_place: bool = False):
    """(dgate, dup) in fresh buffers; with in_place, written over gate and up instead (whose values
    the caller needs no more) where one launch can do that (`_writable_rows`). In place, the version
    counters of gate and up are bumped, so a second backward through a graph that saved them
    (retain_graph=True) fails loudly instead of reading gradients as activations."""
    require_triton(op, dout, gate, up)
    count_launch(op)
    if dout.dtype != gate.dtype:
        dout = dout.to(gate.dtype)
    in_place = in_place and gate.numel() > 0 and _writable_rows(gate, up)
    if in_place:
        dgate, dup = gate, up
    else:
        dgate = _empty_output(gate.shape, gate)
        dup = _empty_output(gate.shape, gate)
    if dgate.numel():
        _launch(_glu_bwd_kernel, "bwd", [dout, gate, up], [dgate, dup], act)
    if in_place:
        torch.autograd.graph.increment_version((gate, up))
    return dgate, dup


def _writable_rows(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether dgate and dup may be written over gate and up by one launch: both viewable as rows with
    unit column stride and one common row stride, and not overlapping each other."""
    n_cols = gate.shape[-1] if gate.dim() else 1
    try:
        g2, u2 = gate.view(-1, n_cols), up.view(-1, n_cols)
    except RuntimeError:
        return False
    if n_cols > 1 and (g2.stride(1) != 1 or u2.stride(1) != 1):
        return False
    if g2.shape[0] > 1 and g2.stride(0) != u2.stride(0):
        return False
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return True
    gap = abs(gate.storage_offset() - up.storage_offset())  # same storage: the halves of gate_up_proj
    return gap >= n_cols and (g2.shape[0] <= 1 or gap + n_cols <= g2.stride(0))


# ----------------------------------------------------------------------------------------------
# Custom ops. Forward outputs and gradients are always contiguous, in the real and fake versions.


@torch.library.custom_op("fused_kernels::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward("swiglu_fwd", gate, up, SILU)


@_swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fused_kernels::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward("swiglu_bwd", dout, gate, up, SILU)


@_swiglu_bwd.register_fake
def _(dout, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _swiglu_setup_context(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)  # not the output: the backward recomputes silu(gate)


def _swiglu_autograd(ctx, dout):
    gate, up = ctx.saved_tensors
    return torch.ops.fused_kernels.swiglu_bwd(dout, gate, up)


_swiglu_fwd.register_autograd(_swiglu_autograd, setup_context=_swiglu_setup_context)


@torch.library.custom_op("fused_kernels::geglu_fwd", mutates_args=())
def _geglu_fwd(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    check_choice("approximate", approximate, tuple(GELU_APPROXIMATE))
    return _forward("geglu_fwd", gate, up, GELU_APPROXIMATE[approximate])


@_geglu_fwd.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fused_kernels::geglu_bwd", mutates_args=())
def _geglu_bwd(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    check_choice("approximate", approximate, tuple(GELU_APPROXIMATE))
    return _backward("geglu_bwd", dout, gate, up, GELU_APPROXIMATE[approximate])


@_geglu_bwd.register_fake
def _(dout, gate, up, approximate):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _geglu_setup_context(ctx, inputs, output):
    gate, up, approximate = inputs
    ctx.save_for_backward(gate, up)  # not the output: the backward recomputes gelu(gate)
    ctx.approximate = approximate


def _geglu_autograd(ctx, dout):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.fused_kernels.geglu_bwd(dout, gate, up, ctx.approximate)
    return dgate, dup, None


_geglu_fwd.register_autograd(_geglu_autograd, setup_context=_geglu_setup_context)


# ----------------------------------------------------------------------------------------------
# Eager autograd: the same launches as the custom ops without their dispatch (Python per call).
# torch.compile traces the custom ops instead.


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act: int, op: str):
        out = _forward(f"{op}_fwd", gate, up, act)
        ctx.save_for_backward(gate, up)  # not the output: the backward recomputes act(gate)
        ctx.act = act
        ctx.op = op
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = _backward(f"{ctx.op}_bwd", dout, gate, up, ctx.act)
        return dgate, dup, None, None


def _dispatch(op: str, gate: torch.Tensor, up: torch.Tensor, act: int, compiled_op):
    if torch.compiler.is_compiling():
        return compiled_op()
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _GLUFunction.apply(gate, up, act, op)
    return _forward(f"{op}_fwd", gate, up, act)


# ----------------------------------------------------------------------------------------------
# The gate followed by the down projection, without keeping the product (eager only: under
# torch.compile glu_linear traces the GLU custom op and F.linear, and the compiler decides what to keep).


class _GLULinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, bias, act: int, op: str, temporaries: bool):
        hidden = _forward(f"{op}_fwd", gate, up, act)
        out = torch.nn.functional.linear(hidden, weight, bias)
        ctx.save_for_backward(gate, up, weight)  # not hidden: the backward recomputes it
        ctx.act, ctx.op, ctx.has_bias, ctx.temporaries = act, op, bias is not None, temporaries
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        dweight = dbias = None
        if ctx.needs_input_grad[2]:
            hidden = _forward(f"{ctx.op}_recompute", gate, up, ctx.act)
            dweight = d2.t().mm(hidden.reshape(-1, hidden.shape[-1]))
            del hidden
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = d2.sum(0)
        dgate = dup = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dhidden = dout.matmul(weight)
            # temporaries: gate and up die with this node, so their buffers take the gradients (two
            # fewer tokens × intermediate buffers at the backward's peak)
            dgate, dup = _backward(f"{ctx.op}_bwd", dhidden, gate, up, ctx.act, in_place=ctx.temporaries)
        return dgate, dup, dweight, dbias, None, None, None


GLU_ACTIVATIONS = {"silu": ("swiglu", SILU), "gelu_tanh": ("geglu", GELU_TANH), "gelu": ("geglu", GELU_ERF)}


def glu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias=None,
               activation: str = "silu", temporaries: bool = False) -> torch.Tensor:
    """linear(act(gate) * up, weight, bias): a gated MLP's down projection after its gate, where the
    backward recomputes act(gate) * up instead of keeping it (see the module docstring).

    activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU with the exact erf). gate and up as for
    `swiglu`; weight (out_features, gate.shape[-1]) and bias (out_features,) or None, of gate's dtype.
    temporaries: gate and up are intermediate results nobody else reads or keeps (a module's own
    projection outputs); the backward then writes their gradients over them. Never pass True for
    tensors you hold (leaves, views of leaves, anything read after the backward): they are overwritten.
    Under torch.compile this is `F.linear(swiglu(gate, up), weight, bias)` (or geglu).
    """
    check_choice("activation", activation, tuple(GLU_ACTIVATIONS))
    _check_pair(gate, up)
    check_float("weight", weight)
    check_projection("gate", gate, weight, bias)
    op, act = GLU_ACTIVATIONS[activation]
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not (
            gate.requires_grad or up.requires_grad or weight.requires_grad
            or (bias is not None and bias.requires_grad)):
        hidden = swiglu(gate, up) if act == SILU else geglu(gate, up, "tanh" if act == GELU_TANH else "none")
        return torch.nn.functional.linear(hidden, weight, bias)
    temporaries = bool(temporaries) and gate.grad_fn is not None and up.grad_fn is not None
    return _GLULinearFunction.apply(gate, up, weight, bias, act, op, temporaries)


# ----------------------------------------------------------------------------------------------
# Functional entries


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float("gate", gate)
    check_float("up", up)
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype {gate.dtype}, got {up.dtype}")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.device != gate.device:
        raise ValueError(f"up must be on gate's device {gate.device}, got {up.device}")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and rounded once to the inputs' dtype.

    gate and up: same shape and dtype (float32, bfloat16, float16), any layout; strided views such as
    the halves of `gate_up_proj(x).chunk(2, dim=-1)` are read in place. Returns a contiguous tensor.
    The backward saves only gate and up. Eager calls run a torch.autograd.Function; under
    torch.compile the custom op fused_kernels::swiglu_fwd is traced instead (same kernels).
    """
    _check_pair(gate, up)
    return _dispatch("swiglu", gate, up, SILU, lambda: torch.ops.fused_kernels.swiglu_fwd(gate, up))


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up, computed in fp32 and rounded once to the inputs' dtype.

    approximate: "tanh" (GELU-tanh, HF's gelu_pytorch_tanh, Gemma) or "none" (exact erf GELU).
    Inputs as for `swiglu`.
    """
    check_choice("approximate", approximate, tuple(GELU_APPROXIMATE))
    _check_pair(gate, up)
    return _dispatch("geglu", gate, up, GELU_APPROXIMATE[approximate],
                     lambda: torch.ops.fused_kernels.geglu_fwd(gate, up, approximate))
