"""Fused linear + cross entropy: loss(hidden @ weight.T + bias) without ever holding the [N, V] logits.

Math (per token i; s = logit_scale, everything else as in fused_kernels/cross_entropy.py):

    x_i = s · (h_i Wᵀ + b)        z_i = softcap · tanh(x_i / softcap)  (or x_i)
    loss_i = lse(z_i) − (1−ε) z_iy − (ε/V) Σ_j z_ij + λ lse(z_i)²,   reduced as cross_entropy reduces
    with G = ∂loss/∂(h Wᵀ + b) (N × V, computed chunk by chunk, scale and softcap derivative included):
    ∂loss/∂h = G W,   ∂loss/∂W = Gᵀ h,   ∂loss/∂b = Σ_i G_i

Tokens are processed in chunks of C rows. Per chunk: logits_c = h_c Wᵀ (+ b) into one reused
C × V buffer (cuBLAS); the cross-entropy kernel writes the chunk's row losses and, when gradients
are needed, G_c in place over logits_c; then grad_h[c] = G_c W (written straight into the gradient),
grad_W += G_cᵀ h_c (addmm into a buffer of W's dtype, fp32 accumulation inside each GEMM and one
rounding per chunk: an fp32 V × H accumulator would cost 2 GiB at 128256 × 4096), grad_b += Σ G_c
(fp32, V elements). No other temporaries: no fp32 copies, no per-chunk gradient tensors. The
normaliser (1 / #non-ignored, 1 / num_items_in_batch, or 1) is known before any chunk runs (one
count over target on the device), so for reduction "mean" / "sum" all three gradients are final when
the forward returns; the backward only multiplies them in place by the upstream gradient, and skips
even that when it is exactly 1.0. Like cross_entropy, the backward may run once.

Dispatch: eager calls run a torch.autograd.Function that keeps the gradient buffers only as a ctx
attribute, popped by the backward, so autograd adopts them as .grad (no clone: peak memory is the
gradients themselves plus the chunk buffer). Under torch.compile the custom ops below are traced
instead (the compiled graph owns the buffers; AOTAutograd may copy them into .grad).

reduction="none" has one upstream value per token, unknown in the forward: the forward computes the
losses only (one GEMM), and the backward recomputes every chunk's logits with that per-token scale
(four GEMMs in all instead of three, and a second cross-entropy pass).

Chunk rows (`plan()`, in fused_linear_cross_entropy_config): C = budget / (V · element size), rounded
down to a multiple of 8 (cuBLAS' leading-dimension granule; at least 1, at most N), then shrunk to split
N into equal chunks of that many. The budget is the `chunk_mb` argument (autopatch passes FUSED_KERNELS_FLCE_CHUNK_MB); the default,
252 MiB, keeps the whole op within 256 MiB beyond its inputs and gradients (the N + V fp32 values take
the rest). It gives C = 1024 at V = 128256 bf16 (8192 tokens → 8 chunks), 864 at 151936 and 504 at
262144. Larger chunks are faster, because grad_W's GEMM accumulates into the V × H buffer once per
chunk; a multiple of 128 rows is not needed. `_CONFIG["chunk_rows"]` forces C (tests use it to run
several chunks).

Memory beyond inputs and their gradients: the C × V logits buffer, N + V fp32 values, and cuBLAS'
workspace. Work: 3 GEMMs of 2·N·H·V FLOP plus one cross-entropy pass over N × V (read + write);
8192 × 4096 → 128256 bf16: 25.8 TFLOP.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels._gpu import OFF_GPU, device_guard
from fused_kernels._launch import launch
from fused_kernels._row_loss import capped
from fused_kernels._utils import check_float, count_launch, require_triton

# `fused_kernels.cross_entropy` the attribute is the function; the module is loaded by name.
from fused_kernels.ops import cross_entropy as _ce
# _CONFIG and DEFAULT_CHUNK_MB: the config module's own objects, so that setting _CONFIG here sets it there
from fused_kernels.ops.fused_linear_cross_entropy_config import _CONFIG, DEFAULT_CHUNK_MB, Call, check_chunk_mb, plan

__all__ = ["fused_linear_cross_entropy"]


def chunk_rows(n: int, v: int, elem_size: int, chunk_mb=None) -> int:
    """The rows per chunk: plan()'s config, which no device fact enters (the budget alone decides)."""
    return plan(Call(n, v, elem_size, chunk_mb), OFF_GPU).config


def _run_chunks(hidden, weight, bias, target, coef, row_scale, loss_rows, flag, grads, opts, chunk_mb,
                top1=None, side=None) -> None:
    """The chunk loop shared by the forward (row_scale None) and the reduction="none" backward.
    grads: (grad_hidden, grad_weight, grad_bias_fp32), each None when not wanted. top1 (N,) bool, or
    None: whether each row's target is its most likely class, read from the chunk's logits before the
    cross-entropy kernel overwrites them (one more read of the chunk). side: None, or a dict of (N,)
    fp32 buffers among SIDE_STATS, filled by _side_stats_ from the same logits (one more read)."""
    n, _ = hidden.shape
    v = weight.shape[0]
    gh, gw, gb = grads
    want_grad = gh is not None or gw is not None or gb is not None
    rows = chunk_rows(n, v, hidden.element_size(), chunk_mb)
    buf = hidden.new_empty((min(rows, n), v)) if n else None
    wt = weight.t()
    for start in range(0, n, rows):
        end = min(start + rows, n)
        h_c = hidden[start:end]
        logits = buf[: end - start]
        if bias is None:
            torch.mm(h_c, wt, out=logits)
        else:
            torch.addmm(bias, h_c, wt, out=logits)
        # top-1 rides on the statistics' sweep when that runs anyway (one read of the chunk, not two)
        fuse_top1 = top1 is not None and bool(side) and opts["logit_scale"] != 0
        if top1 is not None and not fuse_top1:
            _top1_(logits, target[start:end], opts["logit_scale"], top1[start:end])
        if side:
            _side_stats_(logits, target[start:end], opts, {k: b[start:end] for k, b in side.items()},
                         top1[start:end] if fuse_top1 else None)
        _ce.launch_ce(
            logits, target[start:end], logits if want_grad else None, loss_rows[start:end], coef,
            None if row_scale is None else row_scale[start:end], flag, **opts,
        )
        if gh is not None:
            torch.mm(logits, weight, out=gh[start:end])
        if gw is not None:
            if start == 0:
                torch.mm(logits.t(), h_c, out=gw)
            else:
                gw.addmm_(logits.t(), h_c)
        if gb is not None:
            gb += logits.sum(0, dtype=torch.float32)
    if n == 0 and gw is not None:
        gw.zero_()


def _top1_(logits, target, logit_scale, out) -> None:
    """out[i] = target[i] is the arg-max of the transformed row i. The softcap is increasing and a
    positive scale keeps the order, so the raw logits' arg-max is the transformed one's (a negative
    scale reverses it; with scale 0 every class ties and the first, as torch.argmax picks, wins)."""
    if logit_scale < 0:
        best = logits.argmin(dim=-1)
    elif logit_scale == 0:
        best = torch.zeros_like(target)
    else:
        best = logits.argmax(dim=-1)
    torch.eq(best, target, out=out)


SIDE_STATS = ("entropy", "log_sum_sq_probs", "mean_logits")  # _side_stats_kernel's outputs
SIDE_BLOCK = 4096  # classes per step of _side_stats_kernel's sweep


@triton.jit
def _side_stats_kernel(x_ptr, stride, n_cols, tgt_ptr, ent_ptr, sq_ptr, mean_ptr, top1_ptr, logit_scale, softcap,
                       HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                       HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                       NEG_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of one logits chunk, one sweep over its classes, z as the loss sees it
    (fused_kernels._row_loss.capped). Online, relative to the running max m: s = Σ e (e = exp(z − m)), se = Σ e·(z − m),
    sq = Σ e², sz = Σ z; at the end entropy = log s − se / s (−Σ p log p, without the cancellation
    of lse − Σ p·z at large logits), log Σ p² = log sq − 2 log s, mean z = sz / V. HAS_TOP1: whether
    the target is the first arg-max, from the raw logits (the softcap keeps the order, a negative
    scale reverses it: NEG_SCALE), as _top1_ decides it."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    se = tl.full((), 0.0, tl.float32)
    sq = tl.full((), 0.0, tl.float32)
    sz = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)  # max of the order key over the row
    before = tl.full((), float("-inf"), tl.float32)  # ... over the classes before the target
    y = tl.load(tgt_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_TOP1:
            key = x
            if NEG_SCALE:
                key = -x
            key = tl.where(mask, key, float("-inf"))
            best = tl.maximum(best, tl.max(key, 0))
            before = tl.maximum(before, tl.max(tl.where(cols < y, key, float("-inf")), 0))
        z = capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        if HAS_MEAN:
            sz += tl.sum(tl.where(mask, z, 0.0), 0)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, 0))  # finite: every block holds a class
        r = tl.exp(m - m_new)  # 0 on the first block (m = -inf)
        e = tl.exp(z - m_new)  # 0 on masked lanes
        if HAS_ENTROPY:
            # se relative to m_new: r·(se + (m − m_new)·s); m − m_new is -inf on the first block, where s = 0
            shift = tl.where(s > 0.0, m - m_new, 0.0) * s
            se = r * (se + shift) + tl.sum(e * tl.where(mask, z - m_new, 0.0), 0)  # no 0·(-inf) on masked lanes
        if HAS_SQ:
            sq = sq * r * r + tl.sum(e * e, 0)
        s = s * r + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    if HAS_ENTROPY:
        tl.store(ent_ptr + row, log_s - se / s)
    if HAS_SQ:
        tl.store(sq_ptr + row, tl.log(sq) - 2.0 * log_s)
    if HAS_MEAN:
        tl.store(mean_ptr + row, sz / n_cols)
    if HAS_TOP1:
        valid = (y >= 0) & (y < n_cols)  # an ignored or out-of-range target is never the arg-max
        xy = tl.load(base + tl.where(valid, y, 0)).to(tl.float32)
        ky = xy
        if NEG_SCALE:
            ky = -xy
        tl.store(top1_ptr + row, valid & (ky >= best) & (ky > before))


def _side_stats_(logits, target, opts, out, top1=None) -> None:
    """out[name][i] for the names in out (SIDE_STATS) from row i of the chunk's logits, transformed as
    the loss transforms them (logit_scale, softcap); top1 (bool, or None): the same as _top1_ gives,
    from the same sweep (logit_scale must not be 0: _top1_ handles that)."""
    n, v = logits.shape
    if n == 0:
        return
    dummy = next(iter(out.values()))  # never written where its flag is off
    softcap, scale = opts["softcap"], opts["logit_scale"]
    with device_guard(logits):
        launch(
            _side_stats_kernel, (n,),
            (logits, logits.stride(0), v, target, out.get("entropy", dummy), out.get("log_sum_sq_probs", dummy),
             out.get("mean_logits", dummy), top1 if top1 is not None else target, float(scale),
             float(softcap if softcap is not None else 1.0)),
            dict(HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY="entropy" in out,
                 HAS_SQ="log_sum_sq_probs" in out, HAS_MEAN="mean_logits" in out, HAS_TOP1=top1 is not None,
                 NEG_SCALE=scale < 0, BLOCK=min(SIDE_BLOCK, triton.next_power_of_2(v)), num_warps=8),
        )


def _opts(ignore_index, label_smoothing, z_loss, softcap, logit_scale):
    return dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap if softcap > 0 else None, logit_scale=logit_scale)


def _grad_buffers(hidden, weight, bias, need_gh, need_gw, need_gb):
    n, h = hidden.shape
    gh = _ce.new_buffer((n, h), hidden.dtype, hidden.device) if need_gh else None
    gw = _ce.new_buffer(tuple(weight.shape), weight.dtype, weight.device) if need_gw else None
    gb = torch.zeros((weight.shape[0],), dtype=torch.float32, device=weight.device) if need_gb else None
    return gh, gw, gb


def _cast_bias_grad(grads, bias):
    gh, gw, gb = grads
    return gh, gw, (gb.to(bias.dtype) if gb is not None else None)


def _budget(chunk_mb: float):
    return chunk_mb if chunk_mb > 0 else None  # the custom ops carry a float, 0.0 for the default


def _forward_impl(hidden, weight, target, bias, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
                  logit_scale, divisor_value, need_gh, need_gw, need_gb, chunk_mb=0.0, stats=None):
    """(loss, grad_hidden, grad_weight, grad_bias); a gradient is None unless asked for and the
    reduction is "mean"/"sum" (then it is final but for the upstream factor). `stats`: see
    fused_linear_cross_entropy."""
    require_triton("fused_linear_cross_entropy", hidden, weight, target)
    count_launch("fused_linear_cross_entropy_fwd")
    n = hidden.shape[0]
    coef, flag = _ce.start_loss(target, ignore_index, reduction, divisor, divisor_value, hidden.device)
    loss_rows = _ce.new_buffer((n,), torch.float32, hidden.device)
    in_forward = reduction != "none"
    grads = _grad_buffers(hidden, weight, bias, need_gh and in_forward, need_gw and in_forward, need_gb and in_forward)
    top1 = torch.empty((n,), dtype=torch.bool, device=hidden.device) if stats is not None and "is_top1" in stats else None
    # NaN-filled: a row the kernel failed to write cannot pass for a value
    side = {k: torch.full((n,), float("nan"), dtype=torch.float32, device=hidden.device)
            for k in SIDE_STATS if stats is not None and k in stats}
    _run_chunks(hidden, weight, bias, target, coef, None, loss_rows, flag, grads,
                _opts(ignore_index, label_smoothing, z_loss, softcap, logit_scale), _budget(chunk_mb), top1, side)
    loss = _ce.finish_loss(loss_rows, coef, flag, reduction, target, weight.shape[0], ignore_index)
    if stats is not None:
        if "token_loss" in stats:
            # the rows the reduction sums, before its normaliser; a copy: "none" returns loss_rows itself
            stats["token_loss"] = loss_rows.clone() if reduction == "none" else loss_rows
        if top1 is not None:
            stats["is_top1"] = top1.masked_fill_(target == ignore_index, False)
        for name, buf in side.items():
            stats[name] = buf.masked_fill_(target == ignore_index, 0.0)
    return (loss, *_cast_bias_grad(grads, bias))


def _backward_none_impl(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                        logit_scale, need_gh, need_gw, need_gb, chunk_mb=0.0):
    """Backward of reduction "none": recompute each chunk's logits, scale row i by grad_loss[i]."""
    require_triton("fused_linear_cross_entropy", hidden, weight, target)
    count_launch("fused_linear_cross_entropy_bwd")
    n = hidden.shape[0]
    coef, flag = _ce.start_loss(target, ignore_index, "none", None, -1.0, hidden.device)  # coef 1
    row_scale = grad_loss.detach().to(device=hidden.device, dtype=torch.float32).reshape(-1).contiguous()
    loss_rows = torch.empty((n,), dtype=torch.float32, device=hidden.device)  # recomputed, unused
    grads = _grad_buffers(hidden, weight, bias, need_gh, need_gw, need_gb)
    _run_chunks(hidden, weight, bias, target, coef, row_scale, loss_rows, flag, grads,
                _opts(ignore_index, label_smoothing, z_loss, softcap, logit_scale), _budget(chunk_mb))
    return _cast_bias_grad(grads, bias)


def _scale_grads_impl(grads, grad_loss) -> None:
    """Backward of reduction "mean"/"sum": the gradients from the forward, times grad_loss, in place
    (no memory traffic when grad_loss is exactly 1)."""
    require_triton("fused_linear_cross_entropy", grad_loss)
    count_launch("fused_linear_cross_entropy_bwd")
    for g in grads:
        if g is not None:
            _ce.scale_(g, grad_loss)


_SECOND_BACKWARD = (
    "fused_kernels.fused_linear_cross_entropy: backward ran a second time (retain_graph=True); "
    "its gradients are computed in the forward and scaled in place, so they are used once"
)


def _empty_if_none(grads, like):
    # Distinct empty tensors: a custom op's outputs may not alias one another.
    return tuple(g if g is not None else like.new_empty((0,)) for g in grads)


# ----------------------------------------------------------------------------------------------
# Custom ops (traced by torch.compile)


@torch.library.custom_op("fused_kernels::fused_linear_cross_entropy_fwd", mutates_args=())
def _flce_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    divisor: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    logit_scale: float,
    divisor_value: float,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    chunk_mb: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad_hidden, grad_weight, grad_bias); the gradients are computed here for
    reduction "mean"/"sum" when asked for, else they are empty tensors. softcap 0 means none; chunk_mb
    0 the default budget."""
    loss, *grads = _forward_impl(hidden, weight, target, bias, divisor, ignore_index, reduction, label_smoothing,
                                 z_loss, softcap, logit_scale, divisor_value, need_grad_hidden, need_grad_weight,
                                 need_grad_bias, chunk_mb)
    return (loss, *_empty_if_none(grads, hidden))


@_flce_fwd.register_fake
def _(hidden, weight, target, bias, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
      logit_scale, divisor_value, need_grad_hidden, need_grad_weight, need_grad_bias, chunk_mb=0.0):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    in_forward = reduction != "none"
    gh = hidden.new_empty(hidden.shape) if need_grad_hidden and in_forward else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if need_grad_weight and in_forward else hidden.new_empty((0,))
    gb = bias.new_empty(bias.shape) if need_grad_bias and in_forward else hidden.new_empty((0,))
    return loss, gh, gw, gb


@torch.library.custom_op(
    "fused_kernels::fused_linear_cross_entropy_scale_grads",
    mutates_args=("grad_hidden", "grad_weight", "grad_bias"),
)
def _flce_scale_grads(grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
                      grad_loss: torch.Tensor) -> None:
    """Backward of reduction "mean"/"sum": the gradients from the forward, times grad_loss, in place."""
    _scale_grads_impl((grad_hidden, grad_weight, grad_bias), grad_loss)


@_flce_scale_grads.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss):
    return None


@torch.library.custom_op("fused_kernels::fused_linear_cross_entropy_bwd_none", mutates_args=())
def _flce_bwd_none(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    logit_scale: float,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    chunk_mb: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of reduction "none": recompute each chunk's logits, scale row i by grad_loss[i]."""
    grads = _backward_none_impl(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss,
                                softcap, logit_scale, need_grad_hidden, need_grad_weight, need_grad_bias, chunk_mb)
    return _empty_if_none(grads, hidden)


@_flce_bwd_none.register_fake
def _(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
      need_grad_hidden, need_grad_weight, need_grad_bias, chunk_mb=0.0):
    return (hidden.new_empty(hidden.shape) if need_grad_hidden else hidden.new_empty((0,)),
            weight.new_empty(weight.shape) if need_grad_weight else hidden.new_empty((0,)),
            bias.new_empty(bias.shape) if need_grad_bias else hidden.new_empty((0,)))


def _flce_setup_context(ctx, inputs, output):
    (hidden, weight, target, bias, _divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
     logit_scale, _divisor_value, need_gh, need_gw, need_gb, *chunk_mb) = inputs
    _loss, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    ctx.n_inputs = len(inputs)
    ctx.needs = (need_gh, need_gw, need_gb)
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.options = (ignore_index, label_smoothing, z_loss, softcap, logit_scale)
        ctx.chunk_mb = chunk_mb[0] if chunk_mb else 0.0
    else:
        ctx.grads = (gh, gw, gb)


def _flce_backward(ctx, grad_loss, *_grads_of_grads):
    need_gh, need_gw, need_gb = ctx.needs
    if not (need_gh or need_gw or need_gb):  # only a num_items_in_batch tensor asked for a gradient
        return (None,) * 15 + ((None,) if ctx.n_inputs > 15 else ())
    if ctx.reduction == "none":
        hidden, weight, target, bias = ctx.saved_tensors
        gh, gw, gb = torch.ops.fused_kernels.fused_linear_cross_entropy_bwd_none(
            grad_loss, hidden, weight, target, bias, *ctx.options, need_gh, need_gw, need_gb, ctx.chunk_mb)
    else:
        grads = ctx.grads
        ctx.grads = None
        if grads is None:
            raise RuntimeError(_SECOND_BACKWARD)
        gh, gw, gb = grads
        torch.ops.fused_kernels.fused_linear_cross_entropy_scale_grads(gh, gw, gb, grad_loss)
    return (gh if need_gh else None, gw if need_gw else None, None, gb if need_gb else None) + \
        (None,) * (ctx.n_inputs - 4)


_flce_fwd.register_autograd(_flce_backward, setup_context=_flce_setup_context)


# ----------------------------------------------------------------------------------------------
# Eager autograd: the gradient buffers live only on ctx until the backward pops them, so that the
# tensors it returns have no other owner and AccumulateGrad adopts them as .grad (no clone).


class _FLCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, divisor, ignore_index, reduction, label_smoothing, z_loss,
                softcap, logit_scale, divisor_value, chunk_mb, stats=None):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        loss, *grads = _forward_impl(hidden, weight, target, bias, divisor, ignore_index, reduction,
                                     label_smoothing, z_loss, softcap, logit_scale, divisor_value, *needs, chunk_mb,
                                     stats)
        ctx.needs = needs
        ctx.reduction = reduction
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
            ctx.options = (ignore_index, label_smoothing, z_loss, softcap, logit_scale)
            ctx.chunk_mb = chunk_mb
        else:
            ctx.grads = tuple(grads)  # not saved, not outputs: popped by the backward
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if not any(ctx.needs):  # only a num_items_in_batch tensor asked for a gradient
            return (None,) * 14
        if ctx.reduction == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            gh, gw, gb = _backward_none_impl(grad_loss, hidden, weight, target, bias, *ctx.options, *ctx.needs,
                                             ctx.chunk_mb)
        else:
            grads = ctx.grads
            ctx.grads = None
            if grads is None:
                raise RuntimeError(_SECOND_BACKWARD)
            _scale_grads_impl(grads, grad_loss)
            gh, gw, gb = grads
            del grads
        return (gh, gw, None, gb) + (None,) * 10


# ----------------------------------------------------------------------------------------------
# Functional entry


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    num_items_in_batch=None,
    *,
    chunk_mb: Optional[float] = None,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """cross_entropy(logit_scale · (hidden @ weight.T + bias), target, ...) without the full logits.

    hidden (..., H); weight (V, H); bias (V,) or None, all of one float dtype; target (...) integer.
    Options as for fused_kernels.cross_entropy. chunk_mb: the MiB of logits computed at a time (None:
    DEFAULT_CHUNK_MB = 252; rows per chunk: plan()); smaller saves memory, larger runs a little faster. Under autocast the three are cast to the autocast
    dtype first, as the lm_head Linear would be. Returns float32: a scalar, or the per-token losses
    (shape of target) for reduction="none" (whose backward recomputes the logits; see the module
    docstring).

    stats: a dict naming the side outputs wanted, filled in by the same pass (eager only; no
    [N, V] tensor, no gradient): "token_loss" -> each token's loss, float32, target's shape, 0 where
    the target is ignored (free: the rows the reduction sums); "is_top1" -> whether the target is the
    most likely class, bool, target's shape, False where ignored (one more read of each logits chunk).
    E.g. stats = {"token_loss": None, "is_top1": None}; token accuracy = is_top1.sum() / (target !=
    ignore_index).sum(). The distribution statistics, each float32, target's shape, 0 where ignored, of
    p = softmax(z) with z = the transformed logits the loss sees (logit_scale, softcap): "entropy" ->
    −Σ p log p; "log_sum_sq_probs" -> log Σ p²; "mean_logits" -> Σ z / V. Asking for any of them costs
    one more read of each logits chunk (one kernel for all three, which then decides is_top1 too); the
    default path runs no extra kernel. A sampling temperature T folds in exactly: logit_scale = s / T, softcap = c / T.
    """
    check_float("hidden", hidden)
    check_float("weight", weight)
    if bias is not None:
        check_float("bias", bias)
    if hidden.dim() < 1:
        raise ValueError(f"hidden must have a last (feature) dimension, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be (V, H) with V >= 1 and H = hidden's last dimension; "
            f"hidden shape {tuple(hidden.shape)}"
        )
    v = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (v,):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be (V,) = ({v},) for weight shape {tuple(weight.shape)}")
    _ce.check_target(target, hidden.shape[:-1], f"hidden shape {tuple(hidden.shape)} without its last dimension",
                     hidden.device)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
    divisor, divisor_value = _ce.check_options(reduction, ignore_index, label_smoothing, z_loss, softcap,
                                               num_items_in_batch, hidden.device)
    check_chunk_mb(chunk_mb)
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(
            f"hidden, weight and bias must share one dtype; got hidden {hidden.dtype}, weight {weight.dtype}"
            + (f", bias {bias.dtype}" if bias is not None else "")
        )
    require_triton("fused_linear_cross_entropy", hidden, weight, target)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    t = target.reshape(-1).contiguous()
    options = (divisor, ignore_index, reduction, float(label_smoothing), float(z_loss),
               float(softcap) if softcap is not None else 0.0, float(logit_scale), divisor_value)
    mb = float(chunk_mb) if chunk_mb is not None else 0.0
    grad_on = torch.is_grad_enabled()
    if stats is not None:
        if not isinstance(stats, dict):
            raise ValueError(f"stats must be a dict naming the side outputs wanted, got {type(stats).__name__}")
        known = ("token_loss", "is_top1") + SIDE_STATS
        unknown = sorted(set(stats) - set(known))
        if unknown:
            raise ValueError(f"stats names the side outputs wanted, among {', '.join(known)}; got {unknown}")
        if torch.compiler.is_compiling():
            raise ValueError("stats is eager-only: under torch.compile use reduction='none' for per-token losses")
    if torch.compiler.is_compiling():
        loss, *_ = torch.ops.fused_kernels.fused_linear_cross_entropy_fwd(
            h2, weight, t, bias, *options, grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad, mb,
        )
    elif grad_on and any(x is not None and x.requires_grad for x in (hidden, weight, bias, divisor)):
        loss = _FLCEFunction.apply(h2, weight, t, bias, *options, mb, stats)
    else:
        loss = _forward_impl(h2, weight, t, bias, *options, False, False, False, mb, stats)[0]
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if stats is not None:
        for key in ("token_loss", "is_top1") + SIDE_STATS:
            if stats.get(key) is not None:
                stats[key] = stats[key].reshape(target.shape)
    return loss
