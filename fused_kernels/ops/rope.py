"""Rotary position embedding (RoPE) for q and k together: one Triton launch forward, one backward.

Math: transformers' Llama `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`. With r = cos.shape[-1]
(r <= head_dim, r even) and x one head's vector of one token:

    y[:r] = x[:r] * cos + rotate(x[:r]) * sin          y[r:] = x[r:]       (partial rotary passes r.. through)

    half rotation (default, Llama):   rotate(x) = cat(-x[r/2:], x[:r/2])      pairs (a, b) = (c, c + r/2)
    interleaved=True (Cohere, GLM):   rotate(x) = stack((-x[1::2], x[::2]), -1).flatten(-2)   pairs (2i, 2i+1)

so for every pair (a, b):  y_a = x_a cos_a - x_b sin_a,   y_b = x_b cos_b + x_a sin_b.
The backward is the transpose of that linear map:  dx_a = dy_a cos_a + dy_b sin_b,  dx_b = dy_b cos_b - dy_a sin_a,
i.e. the same kernel with (sin_a, sin_b) replaced by (-sin_b, -sin_a). When the two halves of cos/sin agree
(every HF model: emb = cat(freqs, freqs), or repeat_interleave for the interleaved form) that is the rotation
by -sin; the swap keeps the gradient exact for any cos/sin. cos and sin get no gradient.

Maths in fp32; q_out/k_out in q's/k's dtype; cos/sin may have any float dtype (read as given, not first
rounded to q's dtype as HF does; the difference is below bf16/fp16 resolution).

Layouts: q, k are (batch, heads, seq, head_dim) with unsqueeze_dim=1, (batch, seq, heads, head_dim) with
unsqueeze_dim=2, read through their strides (a transpose(1, 2) view of a projection output costs no copy).
q and k may differ in head count (GQA) and head_dim. cos/sin are (batch, seq, r) or (seq, r); a batch or
seq extent of 1 broadcasts. Outputs are new dense tensors with the inputs' shapes and dim order in memory
(a transpose(1, 2) view in gives the same kind of view out, as HF's elementwise maths does), and the
gradients of q and k take q's and k's dim order, so autograd passes them to the leaves without a copy.

Grid: one program per BLOCK_T tokens of the flattened (batch, seq); it loads cos/sin for its tokens once,
then walks all q heads and all k heads of those tokens in tiles of BLOCK_H heads x the whole head_dim.
On a GPU, triton.autotune picks (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) among `candidate_configs`, keyed
on the head counts, head dims, rot, the variant, direction, dtypes and the token count's power-of-two
bucket (the first call per key times ~10 candidates; later calls reuse the winner). Under the CPU
interpreter `heuristic_config` gives one config. rope_config holds both and `plan()`, which says which
applies (tests and dev/tune_rope.py force a config through its `_CONFIG["force"]`).

Dispatch: eager calls run a torch.autograd.Function; torch.compile traces the custom ops
fused_kernels::rope_fwd / rope_bwd. Both launch through `_launch`, as `plan()` says (path "fixed" or "autotune").

Bytes moved per pass (forward, or backward):  2 * (|q| + |k|) * elem  +  2 * B_cos * seq * r * elem_cos.
Llama-3-8B shape, q 4x32x4096x128 + k 4x8x4096x128 bf16, cos/sin (4, 4096, 128) bf16: 320 MiB + 8 MiB;
forward + backward 656 MiB.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import device_facts, device_guard
from fused_kernels._ints import cdiv, next_pow2
from fused_kernels._launch import launch
from fused_kernels._utils import check_float, count_launch, triton_can_run
from fused_kernels.ops.rope_config import (_CONFIG, _TILE_SIZES, _WARPS, Call, RopeConfig, _prune, _token_bucket,
                                           plan)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr,            # input and output of one tensor (q or k), last dim contiguous in both
    x_tok, y_tok,            # [BLOCK_T] int64 offsets of each token's (batch, seq) in x and y
    tok_mask,                # [BLOCK_T] which tokens exist
    n_heads, x_sh, y_sh,     # head count and head strides
    head_dim, rot,           # channels per head; leading channels rotated (even, <= head_dim)
    cos_a, cos_b, sin_a, sin_b,  # [BLOCK_T, 1, BLOCK_R] fp32, sin already swapped/negated for backward
    BLOCK_T: tl.constexpr,   # tokens per program
    BLOCK_H: tl.constexpr,   # heads per tile
    BLOCK_R: tl.constexpr,   # power of two >= rot / 2 (pairs per head)
    BLOCK_P: tl.constexpr,   # power of two >= head_dim - rot (pass-through channels), 0 if none
    INTERLEAVED: tl.constexpr,
):
    half = rot // 2
    pair = tl.arange(0, BLOCK_R)
    pair_mask = pair < half
    head_ids = tl.arange(0, BLOCK_H)
    out_ty = y_ptr.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_H):
        heads = (h0 + head_ids).to(tl.int64)
        th_mask = tok_mask[:, None] & (heads < n_heads)[None, :]            # [T, H]
        x_row = x_tok[:, None] + heads[None, :] * x_sh                     # [T, H]
        y_row = y_tok[:, None] + heads[None, :] * y_sh
        if INTERLEAVED:
            # Load the rot channels as one contiguous (vectorisable) run, then view it as pairs and split.
            ch = tl.arange(0, 2 * BLOCK_R)
            mask = th_mask[:, :, None] & (ch < rot)[None, None, :]
            x = tl.load(x_ptr + x_row[:, :, None] + ch[None, None, :], mask=mask, other=0.0)
            x_a, x_b = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_T, BLOCK_H, BLOCK_R, 2]))
            y = tl.join(x_a * cos_a - x_b * sin_a, x_b * cos_b + x_a * sin_b)
            y = tl.reshape(y, [BLOCK_T, BLOCK_H, 2 * BLOCK_R])
            tl.store(y_ptr + y_row[:, :, None] + ch[None, None, :], y.to(out_ty), mask=mask)
        else:
            mask = th_mask[:, :, None] & pair_mask[None, None, :]
            xa_ptr = x_ptr + x_row[:, :, None] + pair[None, None, :]
            ya_ptr = y_ptr + y_row[:, :, None] + pair[None, None, :]
            x_a = tl.load(xa_ptr, mask=mask, other=0.0).to(tl.float32)
            x_b = tl.load(xa_ptr + half, mask=mask, other=0.0).to(tl.float32)
            tl.store(ya_ptr, (x_a * cos_a - x_b * sin_a).to(out_ty), mask=mask)
            tl.store(ya_ptr + half, (x_b * cos_b + x_a * sin_b).to(out_ty), mask=mask)
        if BLOCK_P > 0:
            ch_p = rot + tl.arange(0, BLOCK_P)
            mask_p = th_mask[:, :, None] & (ch_p < head_dim)[None, None, :]
            v = tl.load(x_ptr + x_row[:, :, None] + ch_p[None, None, :], mask=mask_p, other=0.0)
            tl.store(y_ptr + y_row[:, :, None] + ch_p[None, None, :], v.to(out_ty), mask=mask_p)


@triton.jit(do_not_specialize=["token_bucket"])
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    n_tokens, seq_len,
    n_q_heads, n_k_heads, q_head_dim, k_head_dim, rot,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,          # input strides: batch, seq, head (head_dim stride is 1)
    qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,    # output strides
    c_sb, c_ss, s_sb, s_ss,                      # cos / sin strides: batch, seq (0 where broadcast)
    token_bucket,                                # not read: part of the autotuning key only
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_PQ: tl.constexpr, BLOCK_PK: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    b = tok // seq_len
    s = tok % seq_len

    # cos/sin of this program's tokens, read once and shared by every q and k head.
    half = rot // 2
    pair = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        ch = tl.arange(0, 2 * BLOCK_R)
        cmask = tok_mask[:, None] & (ch < rot)[None, :]
        c = tl.load(cos_ptr + (b * c_sb + s * c_ss)[:, None] + ch[None, :], mask=cmask, other=0.0)
        sn = tl.load(sin_ptr + (b * s_sb + s * s_ss)[:, None] + ch[None, :], mask=cmask, other=0.0)
        cos_a, cos_b = tl.split(tl.reshape(c.to(tl.float32), [BLOCK_T, BLOCK_R, 2]))
        sin_a, sin_b = tl.split(tl.reshape(sn.to(tl.float32), [BLOCK_T, BLOCK_R, 2]))
    else:
        cmask = tok_mask[:, None] & (pair < half)[None, :]
        c_ptr = cos_ptr + (b * c_sb + s * c_ss)[:, None] + pair[None, :]
        s_ptr = sin_ptr + (b * s_sb + s * s_ss)[:, None] + pair[None, :]
        cos_a = tl.load(c_ptr, mask=cmask, other=0.0).to(tl.float32)
        cos_b = tl.load(c_ptr + half, mask=cmask, other=0.0).to(tl.float32)
        sin_a = tl.load(s_ptr, mask=cmask, other=0.0).to(tl.float32)
        sin_b = tl.load(s_ptr + half, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward map (see the module docstring).
        sin_a, sin_b = -sin_b, -sin_a
    cos_a = cos_a[:, None, :]
    cos_b = cos_b[:, None, :]
    sin_a = sin_a[:, None, :]
    sin_b = sin_b[:, None, :]

    _rotate_heads(q_ptr, qo_ptr, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, tok_mask,
                  n_q_heads, q_sh, qo_sh, q_head_dim, rot, cos_a, cos_b, sin_a, sin_b,
                  BLOCK_T, BLOCK_HQ, BLOCK_R, BLOCK_PQ, INTERLEAVED)
    _rotate_heads(k_ptr, ko_ptr, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, tok_mask,
                  n_k_heads, k_sh, ko_sh, k_head_dim, rot, cos_a, cos_b, sin_a, sin_b,
                  BLOCK_T, BLOCK_HK, BLOCK_R, BLOCK_PK, INTERLEAVED)


# ----------------------------------------------------------------------------------------------------------
# Autotuning (the configs, the heuristic and plan() are in rope_config)
# ----------------------------------------------------------------------------------------------------------


def _static_configs() -> list:
    configs = []
    for block_t in _TILE_SIZES:
        for block_hq in _TILE_SIZES:
            for block_hk in _TILE_SIZES:
                if block_hk <= block_hq:
                    for num_warps in _WARPS:
                        configs.append(triton.Config(RopeConfig(block_t, block_hq, block_hk, num_warps).meta(),
                                                     num_warps=num_warps))
    return configs


# The kernel writes only q_out and k_out, so the autotuner's benchmark runs cannot corrupt anything.
_rope_tuned = triton.autotune(
    configs=_static_configs(),
    key=["n_q_heads", "n_k_heads", "q_head_dim", "k_head_dim", "rot", "token_bucket", "INTERLEAVED", "BACKWARD"],
    prune_configs_by={"early_config_prune": _prune},
)(_rope_kernel)


# What the autotuner chose, by a key holding everything its key holds (the key arguments and the tensor
# dtypes): later launches with that key go straight to the kernel with the chosen meta-parameters,
# skipping triton.autotune's per-call Python (it rebuilds its key from all 32 arguments).
_CHOSEN: dict = {}
_TUNING_LOCK = threading.Lock()


def reset_autotuning() -> None:
    """Forget every autotuning result: the next launch of each shape class tunes again."""
    _CHOSEN.clear()
    _rope_tuned.cache.clear()


def autotuned_config():
    """The config the autotuner chose in its latest tuning (None before the first one)."""
    return getattr(_rope_tuned, "best_config", None)


# ----------------------------------------------------------------------------------------------------------
# Host side: strides, launch
# ----------------------------------------------------------------------------------------------------------


def _bsh_strides(x: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D q/k in the layout unsqueeze_dim names."""
    st = x.stride()
    if unsqueeze_dim == 1:  # (batch, heads, seq, head_dim)
        return st[0], st[2], st[1]
    return st[0], st[1], st[2]  # (batch, seq, heads, head_dim)


def _bs_strides(c: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of cos/sin shaped (seq, r) or (batch, seq, r); 0 where a size-1 extent broadcasts."""
    st, shape = c.stride(), c.shape
    if len(shape) == 2:
        return 0, (st[0] if shape[0] != 1 else 0)
    return (st[0] if shape[0] != 1 else 0), (st[1] if shape[1] != 1 else 0)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernel assumes unit stride along the last dim (so loads vectorise); anything else is rare
    # (an expanded gradient, a strided slice of channels) and gets one copy.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def memory_order(x: torch.Tensor) -> list[int]:
    """x's dims from outermost to innermost in memory (by stride; ties keep dim order). The identity when
    head_dim is not innermost, since the kernel writes head_dim with unit stride."""
    strides = x.stride()
    n = len(strides)
    # Decreasing stride; a reverse sort keeps equal strides in dim order (Python's sort is stable).
    order = sorted(range(n), key=strides.__getitem__, reverse=True)
    return order if order[-1] == n - 1 else list(range(n))


def _new_output(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """A dense buffer of x's shape and dtype with its dims laid out in `order` (outermost first).
    Outputs copy their input's layout, as HF's elementwise maths does: q_out of a transpose(1, 2) view is
    the same kind of view, and the gradient of q has q's strides, so autograd hands it to a
    (batch, seq, heads, head_dim) leaf without the copy it makes for a gradient of another layout.
    (Tests wrap this to poison the buffer.)"""
    return torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device)


def _launch(q, k, cos, sin, unsqueeze_dim: int, interleaved: bool, backward: bool, q_order, k_order):
    """Run the kernel over q and k (or the output gradients, when backward) into new tensors laid out in
    q_order / k_order, and return them. The one launch path of the custom ops and the eager Function."""
    if not (q.is_cuda and k.is_cuda and cos.is_cuda and sin.is_cuda) and not triton_can_run(q, k, cos, sin):
        raise RuntimeError(
            "fused_kernels.rope runs where Triton runs: CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; "
            f"got q on {q.device}, k on {k.device}, cos on {cos.device}, sin on {sin.device}"
        )
    unsqueeze_dim = 1 if unsqueeze_dim in (1, -3) else 2
    q_out, k_out = _new_output(q, q_order), _new_output(k, k_order)
    batch = q.shape[0]
    seq = q.shape[2] if unsqueeze_dim == 1 else q.shape[1]
    n_q_heads = q.shape[1] if unsqueeze_dim == 1 else q.shape[2]
    n_k_heads = k.shape[1] if unsqueeze_dim == 1 else k.shape[2]
    n_tokens = batch * seq
    if n_tokens == 0 or (q.numel() == 0 and k.numel() == 0):
        return q_out, k_out
    q, k, cos, sin = (_unit_last_stride(t) for t in (q, k, cos, sin))
    rot = cos.shape[-1]
    q_dim, k_dim = q.shape[-1], k.shape[-1]
    args = (
        q, k, q_out, k_out, cos, sin,
        n_tokens, seq,
        n_q_heads, n_k_heads, q_dim, k_dim, rot,
        *_bsh_strides(q, unsqueeze_dim), *_bsh_strides(k, unsqueeze_dim),
        *_bsh_strides(q_out, unsqueeze_dim), *_bsh_strides(k_out, unsqueeze_dim),
        *_bs_strides(cos), *_bs_strides(sin),
        _token_bucket(n_tokens),
    )
    flags = dict(
        BLOCK_R=next_pow2(max(rot // 2, 1)),
        BLOCK_PQ=next_pow2(q_dim - rot) if q_dim > rot else 0,
        BLOCK_PK=next_pow2(k_dim - rot) if k_dim > rot else 0,
        INTERLEAVED=interleaved, BACKWARD=backward,
    )
    with device_guard(q):
        p = plan(Call(n_tokens, n_q_heads, n_k_heads, max(q_dim, k_dim)), _CONFIG["device"] or device_facts(q.device))
        _run(p, args, flags, n_tokens, interleaved, backward)
    count_launch("rope_bwd" if backward else "rope_fwd")
    return q_out, k_out


def _run(p: Plan, args: tuple, flags: dict, n_tokens: int, interleaved: bool, backward: bool) -> None:
    """Launch the kernel as plan p says: a fixed config, or the autotuner's choice for this key."""
    q, k, cos, sin = args[0], args[1], args[4], args[5]
    n_q_heads, n_k_heads, q_dim, k_dim, rot = args[8:13]
    cfg = p.config
    if p.path == Path.AUTOTUNE:
        key = (n_q_heads, n_k_heads, q_dim, k_dim, rot, args[-1], interleaved, backward, q.dtype, k.dtype, cos.dtype,
               sin.dtype)
        chosen = _CHOSEN.get(key)
        grid = lambda meta: (cdiv(n_tokens, meta["BLOCK_T"]),)  # noqa: E731
        if chosen is None:
            with _TUNING_LOCK:  # the Autotuner keeps per-call state; backward runs in autograd's thread
                _rope_tuned[grid](*args, **flags)
                _CHOSEN[key] = _rope_tuned.best_config.all_kwargs()
        else:
            launch(_rope_kernel, (cdiv(n_tokens, chosen["BLOCK_T"]),), args, {**flags, **chosen})
    else:
        launch(_rope_kernel, (cdiv(n_tokens, cfg.block_t),), args, dict(flags, **cfg.meta(), num_warps=cfg.num_warps))


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fused_kernels::rope_fwd", mutates_args=())
def _rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, unsqueeze_dim, interleaved, False, memory_order(q), memory_order(k))


@torch.library.custom_op("fused_kernels::rope_bwd", mutates_args=())
def _rope_bwd(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    unsqueeze_dim: int, interleaved: bool, q_order: list[int], k_order: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of q and k, laid out like q and k were (q_order, k_order: memory_order of each)."""
    return _launch(grad_q_out, grad_k_out, cos, sin, unsqueeze_dim, interleaved, True, q_order, k_order)


@_rope_fwd.register_fake
def _rope_fwd_fake(q, k, cos, sin, unsqueeze_dim, interleaved):
    return _new_output(q, memory_order(q)), _new_output(k, memory_order(k))


@_rope_bwd.register_fake
def _rope_bwd_fake(grad_q_out, grad_k_out, cos, sin, unsqueeze_dim, interleaved, q_order, k_order):
    return _new_output(grad_q_out, q_order), _new_output(grad_k_out, k_order)


def _setup_context(ctx, inputs, output):
    x_q, x_k, cos, sin, unsqueeze_dim, interleaved = inputs[:6]
    ctx.save_for_backward(cos, sin)
    ctx.q_order, ctx.k_order = memory_order(x_q), memory_order(x_k)
    ctx.unsqueeze_dim = unsqueeze_dim
    ctx.interleaved = interleaved
    # Only needed when autograd hands us None for an unused output.
    ctx.like_q = (x_q.shape, x_q.dtype, x_q.device)
    ctx.like_k = (x_k.shape, x_k.dtype, x_k.device)


def _grad_or_zeros(g, like):
    if g is not None:
        return g
    shape, dtype, device = like
    return torch.zeros(shape, dtype=dtype, device=device)


def _rope_fwd_backward(ctx, grad_q_out, grad_k_out):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.fused_kernels.rope_bwd(
        _grad_or_zeros(grad_q_out, ctx.like_q), _grad_or_zeros(grad_k_out, ctx.like_k),
        cos, sin, ctx.unsqueeze_dim, ctx.interleaved, ctx.q_order, ctx.k_order,
    )
    return grad_q, grad_k, None, None, None, None


def _rope_bwd_backward(ctx, grad_grad_q, grad_grad_k):
    # rope_bwd applies the transpose of the rotation; its own gradient is the rotation again.
    cos, sin = ctx.saved_tensors
    gq, gk = torch.ops.fused_kernels.rope_fwd(
        _grad_or_zeros(grad_grad_q, ctx.like_q), _grad_or_zeros(grad_grad_k, ctx.like_k),
        cos, sin, ctx.unsqueeze_dim, ctx.interleaved,
    )
    return gq, gk, None, None, None, None, None, None


_rope_fwd.register_autograd(_rope_fwd_backward, setup_context=_setup_context)
_rope_bwd.register_autograd(_rope_bwd_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Eager autograd: the same launches without the custom-op dispatch (whose Python per call can leave the
# GPU idle between short kernels)
# ----------------------------------------------------------------------------------------------------------


class _RopeFunction(torch.autograd.Function):
    """One rotation of q and k (the forward map, or its transpose when `transpose`), outputs laid out in
    q_order / k_order (None: like the inputs). Its gradient is the other map, laid out like the inputs, and
    is itself differentiable (double backward) through this same Function."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved, transpose, q_order, k_order):
        in_orders = memory_order(q), memory_order(k)
        out = _launch(q, k, cos, sin, unsqueeze_dim, interleaved, transpose,
                      in_orders[0] if q_order is None else q_order, in_orders[1] if k_order is None else k_order)
        ctx.save_for_backward(cos, sin)
        ctx.rotation = (unsqueeze_dim, interleaved, transpose)
        ctx.in_orders = in_orders
        return out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        unsqueeze_dim, interleaved, transpose = ctx.rotation
        if torch.is_grad_enabled():  # create_graph=True: record this step too
            grads = _RopeFunction.apply(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved, not transpose,
                                        *ctx.in_orders)
        else:
            grads = _launch(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved, not transpose, *ctx.in_orders)
        return (*grads, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------------------------------------
# Functional entry
# ----------------------------------------------------------------------------------------------------------

_LAYOUTS = {1: "(batch, heads, seq, head_dim)", 2: "(batch, seq, heads, head_dim)"}


def _check_args(q, k, cos, sin, unsqueeze_dim, interleaved) -> int:
    """Validate the arguments; return unsqueeze_dim normalised to 1 or 2."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(
            "unsqueeze_dim must be 1 (q, k shaped (batch, heads, seq, head_dim)) or 2 (q, k shaped "
            f"(batch, seq, heads, head_dim)); -3 and -2 mean the same; got {unsqueeze_dim!r}"
        )
    ud = 1 if unsqueeze_dim in (1, -3) else 2
    layout = _LAYOUTS[ud]
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(t.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}")
    if cos.dim() not in (2, 3):
        raise ValueError(f"cos and sin must be (seq, rot) or (batch, seq, rot), got cos shape {tuple(cos.shape)}")
    rot = cos.shape[-1]
    if rot % 2:
        raise ValueError(f"cos/sin last dim (rot) must be even: channels rotate in pairs; got rot={rot}")
    for name, t in (("q", q), ("k", k)):
        if rot > t.shape[-1]:
            raise ValueError(
                f"cos/sin last dim (rot={rot}) must be <= {name}'s head_dim ({t.shape[-1]}); "
                f"a shorter cos rotates the first rot channels (partial rotary)"
            )
    seq_dim = 2 if ud == 1 else 1
    batch, seq = q.shape[0], q.shape[seq_dim]
    if k.shape[0] != batch or k.shape[seq_dim] != seq:
        raise ValueError(
            f"q and k must share batch and seq in layout {layout}: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    cos_seq = cos.shape[-2]
    if cos_seq not in (1, seq):
        raise ValueError(f"cos/sin seq extent ({cos_seq}) must be 1 or q's seq ({seq}) in layout {layout}; "
                         f"cos shape {tuple(cos.shape)}, q shape {tuple(q.shape)}")
    if cos.dim() == 3 and cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin batch extent ({cos.shape[0]}) must be 1 or q's batch ({batch}); "
                         f"cos shape {tuple(cos.shape)}, q shape {tuple(q.shape)}")
    device = q.device
    if k.device != device or cos.device != device or sin.device != device:
        raise ValueError(f"q, k, cos, sin must be on one device, got q {q.device}, k {k.device}, "
                         f"cos {cos.device}, sin {sin.device}")
    return ud


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding to q and k; returns new (q_out, k_out), differentiable in q and k (not in
    cos and sin: ValueError when they require a gradient).

    Same numbers as transformers' Llama `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` (maths in fp32,
    outputs in q's / k's dtype):
      q, k: (batch, heads, seq, head_dim) with unsqueeze_dim=1, (batch, seq, heads, head_dim) with
            unsqueeze_dim=2; any strides; q and k may have different head counts (GQA) and head_dims, and
            either may have no heads (k = q.narrow(head_axis, 0, 0) rotates q alone, for one-tensor
            functions such as Gemma 4's apply_rotary_pos_emb(x, cos, sin)).
      cos, sin: (batch, seq, rot) or (seq, rot), any float dtype; batch or seq of 1 broadcasts. When
            rot < head_dim the first rot channels are rotated and the rest passed through (partial rotary).
      interleaved: rotate channel pairs (2i, 2i+1) instead of (i, i + rot/2), i.e.
            rotate_half(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) as in Cohere and GLM models;
            cos/sin are then given at full rot size with each frequency repeated for its pair
            (freqs.repeat_interleave(2, -1)), as those models do before multiplying.

    Eager calls run a torch.autograd.Function; under torch.compile the custom op fused_kernels::rope_fwd is
    traced instead. Both launch the same kernel.
    """
    ud = _check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope: cos and sin get no gradient from this kernel, but they require one here (made from a "
                         "trainable parameter?); pass cos.detach() and sin.detach() if that gradient is not wanted, "
                         "or rotate with torch ops")
    if torch.compiler.is_compiling():
        return torch.ops.fused_kernels.rope_fwd(q, k, cos, sin, ud, interleaved)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RopeFunction.apply(q, k, cos, sin, ud, interleaved, False, None, None)
    return _launch(q, k, cos, sin, ud, interleaved, False, memory_order(q), memory_order(k))
