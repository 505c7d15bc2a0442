"""Mixture-of-experts experts block: routing, grouped GEMMs, gated activation and weighted combine.

Math (T tokens, k experts per token, S = T·k rows, E experts, H hidden, I expert width; w = top-k
weights, e(t, j) = top-k index; W1[e] = gate_up_proj[e] (2I × H: gate rows, then up rows), W2[e] =
down_proj[e] (H × I); with transposed=True the stored matrices are their transposes):

    routing   perm = stable argsort of the S expert ids; row r of the expert-sorted order is the pair
              perm[r] = t·k + j, token(r) = perm[r] // k; inv = perm⁻¹; offsets[e] = #rows of experts ≤ e
    forward   x_s = hidden[token]                               S × H   (gather)
              gu  = x_s · W1[e(r)]ᵀ                              S × 2I  (grouped GEMM)
              h   = act(gu[:, :I]) · gu[:, I:]                   S × I   (fp32, one rounding)
              y   = h · W2[e(r)]ᵀ                                S × H   (grouped GEMM)
              out[t] = Σ_j w[t, j] · y[inv[t·k + j]]             T × H   (fp32 sum in j order, one rounding)
    backward  (dout: T × H)
              g_s    = dout[token]                               S × H   (gather)
              dh_raw = g_s · W2[e(r)]                            S × I   (grouped GEMM)
              dw[r]  = ⟨dh_raw[r], h[r]⟩   (= ⟨dout[t], y[r]⟩: the router weights' gradient without y)
              dh = w[r] · dh_raw;  dgate = dh · up · act'(gate);  dup = dh · act(gate);  wh = w[r] · h
              dW2[e] = Σ_{r∈e} g_s[r]ᵀ wh[r];  dW1[e] = Σ_{r∈e} dgu[r]ᵀ x_s[r]   (grouped GEMMs over rows)
              dx_s = dgu · W1[e(r)];  dhidden[t] = Σ_j dx_s[inv[t·k + j]]

Saved for the backward: gu (S·2I·b bytes), the routing (perm, inv: S int64; offsets: E int32) and the
inputs. x_s is gathered again from hidden, h is recomputed from gu inside the backward's elementwise
kernel (together with dw, dh, dgu and wh: one pass), and y (S·H) is never kept. transformers'
grouped_mm path keeps x_s, gu, h and y (S·(2H + 3I)·b bytes per layer: 1.5 GiB for Qwen3-30B-A3B's
shape at 16384 tokens in bf16, against 0.4 GiB here).

The backward's memory, beyond gu and its inputs: its gradients (dW1, dW2, dhidden, dw) and one S × H
buffer at a time (g_s with dh_raw and wh, then x_s, then dx_s), nothing S × 2I: dgu is written over gu
when the backward frees the graph after it (no retain_graph / create_graph, not under torch.compile:
moe_experts_bwd_into_gu), and the outputs nobody differentiates (gu and the routing) get None, not
zeros, as their gradients. At Qwen3-30B-A3B's shape and 16384 tokens each is an S × 2I bf16 buffer
(0.375 GiB) not made; the backward's high-water mark drops by 0.69 GiB (docs/kernels/moe_experts.md).

Bytes moved outside the GEMMs, b bytes per element: forward gather S·H·b read + write, activation
3·S·I·b, combine S·H·b + T·H·b; backward two gathers 2·(2·S·H·b), the elementwise pass 6·S·I·b,
combine S·H·b + T·H·b.

Everything is deterministic: a stable sort, gathers, and per-token sums in a fixed order (no atomics).

Paths (`plan()`, in moe_experts_config): "grouped_mm" runs the GEMMs as torch's grouped GEMM (one launch per projection,
offsets read on the GPU, no host sync); "loop" runs one torch.mm per expert after one host read of the
offsets (dtypes or layouts the grouped GEMM does not take, GPUs before sm_80, torch without it).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels._activations import GELU_ERF, GELU_TANH, SILU, gate_act_and_grad
from fused_kernels._dispatch import Plan
from fused_kernels._gpu import device_facts, device_guard
from fused_kernels._jit import for_store, rounded
from fused_kernels._launch import launch
from fused_kernels._utils import check_choice, check_float, count_launch, interpreter_on, new_output, require_triton
from fused_kernels.ops.glu import geglu, swiglu
from fused_kernels.ops.moe_experts_config import GROUPED_MM, Call, ExpertsConfig, plan

__all__ = ["moe_experts", "plan", "ACTIVATIONS"]

ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU_ERF}
_INTERPRETED = interpreter_on()
_new_output = new_output  # every buffer the Triton kernels write (tests poison it)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _combine_kernel(Y, INV, W, OUT, n_cols, stride_y, stride_out,
                    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_BF16: tl.constexpr):
    # out[t, cols] = Σ_j w[t, j] · Y[inv[t·K + j], cols] (w = 1 without HAS_W), fp32, j in order.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        r = tl.load(INV + t * K + j).to(tl.int64)
        y = tl.load(Y + r * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(W + t * K + j).to(tl.float32)
        acc += y
    tl.store(OUT + t * stride_out + cols, for_store(acc, OUT.dtype.element_ty, EXACT_BF16), mask=mask)


@triton.jit
def _act_bwd_kernel(GU, DH, WS, DGU, WH, DW, n_rows, n_cols, stride_gu, stride_dh, stride_dgu, stride_wh,
                    ACT: tl.constexpr, NEED_WH: tl.constexpr, NEED_DW: tl.constexpr, IN_PLACE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_BF16: tl.constexpr):
    # Rows of gu = [gate | up] (n_cols each) and dh_raw: h = act(gate)·up (rounded as the forward stored
    # it), dw = Σ dh_raw·h, dh = w·dh_raw, dgate = dh·up·act'(gate), dup = dh·act(gate), wh = w·h.
    # IN_PLACE: DGU is GU. Every element is read once and written once by the same program, after the
    # chunk's loads (the barrier orders them across the program's threads, whatever the layouts).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    w = tl.load(WS + rows, mask=row_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        gu_rows = GU + rows64[:, None] * stride_gu + cols[None, :]
        g = tl.load(gu_rows, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_rows + n_cols, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IN_PLACE:
            tl.debug_barrier()
        a, da = gate_act_and_grad(g, ACT)
        h = rounded(a * u, GU.dtype.element_ty, EXACT_BF16)
        if NEED_DW:
            dw += tl.sum(dh * h, axis=1)
        dh = dh * w[:, None]
        dgu_rows = DGU + rows64[:, None] * stride_dgu + cols[None, :]
        tl.store(dgu_rows, for_store(dh * u * da, DGU.dtype.element_ty, EXACT_BF16), mask=mask)
        tl.store(dgu_rows + n_cols, for_store(dh * a, DGU.dtype.element_ty, EXACT_BF16), mask=mask)
        if NEED_WH:
            tl.store(WH + rows64[:, None] * stride_wh + cols[None, :],
                     for_store(h * w[:, None], WH.dtype.element_ty, EXACT_BF16), mask=mask)
    if NEED_DW:
        tl.store(DW + rows, dw, mask=row_mask)


# ----------------------------------------------------------------------------------------------
# Dispatch (the tables and plan() are in moe_experts_config)


def _aligned(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        b = t.element_size()
        if t.data_ptr() % 16 or any((s * b) % 16 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1):
            return False
    return True


def _plan_for(x: torch.Tensor, n_rows: int, width: int, w1: torch.Tensor, w2: torch.Tensor) -> Plan:
    """plan() of a call on these tensors, on x's device."""
    dims_ok = (x.shape[-1] * x.element_size()) % 16 == 0 and (width * x.element_size()) % 16 == 0
    return plan(Call(n_rows, x.shape[-1], width, x.dtype, aligned=dims_ok and _aligned(x, w1, w2)),
                device_facts(x.device))


def _gmm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, path: str, bounds=None) -> torch.Tensor:
    """Rows of a (S × K, sorted by expert) times their expert's b[e] (E × K × N, any inner layout)."""
    if path == "grouped_mm":
        return GROUPED_MM(a, b, offs=offsets)
    out = a.new_empty((a.shape[0], b.shape[2]))
    for e, (lo, hi) in enumerate(bounds):
        if hi > lo:
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
    return out


def _gmm_rows(a_t: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, path: str, bounds=None) -> torch.Tensor:
    """Per expert e, a_t[:, rows of e] · b[rows of e]: (M × S) and (S × N) -> E × M × N; experts with no
    rows get zeros. The weight gradients."""
    if path == "grouped_mm":
        return GROUPED_MM(a_t, b, offs=offsets)
    out = a_t.new_zeros((len(bounds), a_t.shape[0], b.shape[1]))
    for e, (lo, hi) in enumerate(bounds):
        if hi > lo:
            torch.mm(a_t[:, lo:hi], b[lo:hi], out=out[e])
    return out


def _bounds(offsets: torch.Tensor, path: str):
    if path == "grouped_mm":
        return None
    ends = offsets.tolist()  # the loop path's one host read
    return list(zip([0] + ends[:-1], ends))


def _routing(top_k_index: torch.Tensor, n_experts: int):
    """(perm, inv, offsets) of the flattened expert ids: the expert-sorted order (stable), its inverse
    and the cumulative row counts per expert (int32), all computed on the ids' device."""
    ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(ids, stable=True)
    inv = torch.argsort(perm)  # perm is a permutation: its sort is its inverse, deterministically
    experts = torch.arange(n_experts, device=ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    return perm, inv, offsets


def _combine(y: torch.Tensor, inv: torch.Tensor, weights: Optional[torch.Tensor], n_tokens: int, k: int,
             cfg: ExpertsConfig, out_dtype: torch.dtype) -> torch.Tensor:
    out = _new_output((n_tokens, y.shape[1]), out_dtype, y.device)
    if n_tokens:
        w = weights if weights is not None else inv
        grid = (n_tokens, triton.cdiv(y.shape[1], cfg.combine_block))
        with device_guard(y):
            launch(_combine_kernel, grid, (y, inv, w, out, y.shape[1], y.stride(0), out.stride(0)),
                   dict(K=k, HAS_W=weights is not None, BLOCK_N=cfg.combine_block, EXACT_BF16=_INTERPRETED,
                        num_warps=cfg.combine_warps))
    return out


def _views(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, transposed: bool):
    """(W1 as E × H × 2I, W2 as E × I × H): the forward GEMMs' right operands, as views."""
    if transposed:
        return gate_up_proj, down_proj
    return gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)


def _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed: bool) -> None:
    check_float("hidden", hidden)
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dim() != 3 or t.dtype != hidden.dtype or t.device != hidden.device:
            raise ValueError(f"{name} must be a 3-D (experts, ., .) tensor of hidden's dtype {hidden.dtype} on "
                             f"{hidden.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    n_experts, h = gate_up_proj.shape[0], hidden.shape[-1]
    two_i = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    w1_in = gate_up_proj.shape[1] if transposed else gate_up_proj.shape[2]
    want_w2 = (n_experts, two_i // 2, h) if transposed else (n_experts, h, two_i // 2)
    if w1_in != h or two_i % 2 or tuple(down_proj.shape) != want_w2:
        layout = "(E, H, 2I) and (E, I, H)" if transposed else "(E, 2I, H) and (E, H, I)"
        raise ValueError(f"gate_up_proj and down_proj must be {layout} for hidden size H={h} "
                         f"(transposed={transposed}); got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"top_k_index and top_k_weights must both be hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} + (k,), got {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    check_float("top_k_weights", top_k_weights)


# ----------------------------------------------------------------------------------------------
# Forward and backward (what the custom ops run)


def _forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act: int, transposed: bool):
    require_triton("moe_experts", hidden, gate_up_proj, down_proj)
    count_launch("moe_experts_fwd")
    n_tokens, k = top_k_index.shape
    n_experts = gate_up_proj.shape[0]
    w1, w2 = _views(gate_up_proj, down_proj, transposed)
    width = w2.shape[1]
    perm, inv, offsets = _routing(top_k_index, n_experts)
    p = _plan_for(hidden, perm.numel(), width, w1, w2)
    bounds = _bounds(offsets, p.path)
    x_s = hidden.index_select(0, perm // k)
    gu = _gmm(x_s, w1, offsets, p.path, bounds)
    del x_s
    gate, up = gu[:, :width], gu[:, width:]
    h = swiglu(gate, up) if act == SILU else geglu(gate, up, "tanh" if act == GELU_TANH else "none")
    y = _gmm(h, w2, offsets, p.path, bounds)
    del h
    out = _combine(y, inv, top_k_weights.reshape(-1), n_tokens, k, p.config, hidden.dtype)
    return out, gu, perm, inv, offsets


def _backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets, act: int,
              transposed: bool, need_hidden: bool, need_weights: bool, need_routing: bool, gu_scratch: bool):
    count_launch("moe_experts_bwd")
    n_tokens, k = top_k_weights.shape
    w1, w2 = _views(gate_up_proj, down_proj, transposed)
    width = w2.shape[1]
    n_rows = perm.numel()
    p = _plan_for(hidden, n_rows, width, w1, w2)
    cfg = p.config
    bounds = _bounds(offsets, p.path)
    dout = dout.to(hidden.dtype).contiguous()
    token = perm // k
    g_s = dout.index_select(0, token)
    dh_raw = _gmm(g_s, w2.transpose(1, 2), offsets, p.path, bounds)
    w_s = top_k_weights.reshape(-1).index_select(0, perm)
    # gu_scratch: nothing reads gu after this backward (the graph is freed), so dgu takes its place
    dgu = gu if gu_scratch else _new_output(gu.shape, gu.dtype, gu.device)
    wh = _new_output((n_rows, width), gu.dtype, gu.device) if need_weights else dgu
    dw = _new_output((n_rows,), torch.float32, gu.device) if need_routing else w_s
    if n_rows:
        grid = (triton.cdiv(n_rows, cfg.bwd_block_m),)
        with device_guard(gu):
            launch(_act_bwd_kernel, grid,
                   (gu, dh_raw, w_s, dgu, wh, dw, n_rows, width, gu.stride(0), dh_raw.stride(0), dgu.stride(0),
                    wh.stride(0)),
                   dict(ACT=act, NEED_WH=need_weights, NEED_DW=need_routing, IN_PLACE=dgu is gu,
                        BLOCK_M=cfg.bwd_block_m, BLOCK_N=cfg.bwd_block_n, EXACT_BF16=_INTERPRETED,
                        num_warps=cfg.bwd_warps))
    del dh_raw
    # Order for memory: each S-row temporary is freed before the next one is made (g_s before x_s,
    # x_s before dx_s), so beyond gu (dgu in its place) and the weight gradients the backward holds
    # one S × H tensor at a time (g_s with wh, then x_s, then dx_s).
    d_w1 = d_w2 = None
    if need_weights:
        d_w2 = (_gmm_rows(wh.t(), g_s, offsets, p.path, bounds) if transposed  # stored (E, I, H)
                else _gmm_rows(g_s.t(), wh, offsets, p.path, bounds))  # stored (E, H, I)
    del g_s, wh
    if need_weights:
        x_s = hidden.index_select(0, token)
        d_w1 = (_gmm_rows(x_s.t(), dgu, offsets, p.path, bounds) if transposed  # stored (E, H, 2I)
                else _gmm_rows(dgu.t(), x_s, offsets, p.path, bounds))  # stored (E, 2I, H)
        del x_s
    d_hidden = None
    if need_hidden:
        dx_s = _gmm(dgu, w1.transpose(1, 2), offsets, p.path, bounds)
        del dgu
        d_hidden = _combine(dx_s, inv, None, n_tokens, k, cfg, hidden.dtype)
    d_routing = dw.index_select(0, inv).view(n_tokens, k).to(top_k_weights.dtype) if need_routing else None
    # a custom op returns tensors: each gradient not asked for is a fresh empty one (never shared)
    return tuple(t if t is not None else hidden.new_empty((0,)) for t in (d_hidden, d_routing, d_w1, d_w2))


# ----------------------------------------------------------------------------------------------
# Custom ops (eager calls go through them too: one dispatch per layer is noise next to the GEMMs)


@torch.library.custom_op("fused_kernels::moe_experts_fwd", mutates_args=())
def _moe_experts_fwd(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: int, transposed: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, transposed)


@_moe_experts_fwd.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, transposed):
    n_rows = top_k_index.numel()
    two_i = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    index = dict(dtype=torch.int64, device=hidden.device)
    return (hidden.new_empty(hidden.shape), hidden.new_empty((n_rows, two_i)), torch.empty((n_rows,), **index),
            torch.empty((n_rows,), **index),
            torch.empty((gate_up_proj.shape[0],), dtype=torch.int32, device=hidden.device))


@torch.library.custom_op("fused_kernels::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gu: torch.Tensor, perm: torch.Tensor,
                     inv: torch.Tensor, offsets: torch.Tensor, act: int, transposed: bool, need_hidden: bool,
                     need_weights: bool, need_routing: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets, act, transposed,
                     need_hidden, need_weights, need_routing, gu_scratch=False)


@torch.library.custom_op("fused_kernels::moe_experts_bwd_into_gu", mutates_args=("gu",))
def _moe_experts_bwd_into_gu(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                             gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gu: torch.Tensor,
                             perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor, act: int, transposed: bool,
                             need_hidden: bool, need_weights: bool, need_routing: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_experts_bwd that writes gu's gradient over gu: for a backward that frees the graph after it."""
    return _backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets, act, transposed,
                     need_hidden, need_weights, need_routing, gu_scratch=True)


@_moe_experts_bwd.register_fake
@_moe_experts_bwd_into_gu.register_fake
def _(dout, hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets, act, transposed, need_hidden,
      need_weights, need_routing):
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            top_k_weights.new_empty(top_k_weights.shape) if need_routing else hidden.new_empty((0,)),
            gate_up_proj.new_empty(gate_up_proj.shape) if need_weights else hidden.new_empty((0,)),
            down_proj.new_empty(down_proj.shape) if need_weights else hidden.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, transposed = inputs
    _, gu, perm, inv, offsets = output
    ctx.save_for_backward(hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets)
    ctx.act, ctx.transposed = act, transposed
    ctx.mark_non_differentiable(gu, perm, inv, offsets)
    # The backward gets None, not zeros, for the outputs nobody differentiates: materialised, gu's
    # zeros alone would be S × 2I elements allocated for the whole backward.
    ctx.set_materialize_grads(False)


def _graph_freed() -> bool:
    """Whether the running backward frees the graph after it (no retain_graph / create_graph), so a saved
    tensor is read once and the backward may overwrite it. False where that is not known: outside an
    eager backward, under torch.compile (its graphs own their buffers), or a torch without the query."""
    if torch.compiler.is_compiling():
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    try:
        return keep_graph is not None and not keep_graph()
    except RuntimeError:
        return False


def _autograd(ctx, dout, *_unused):
    need = ctx.needs_input_grad
    if dout is None:  # the output took no part in what is differentiated
        return (None,) * 7
    hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets = ctx.saved_tensors
    need_weights = bool(need[3] or need[4])
    # gu is read once when the graph is freed after this backward: its gradient then goes in its place
    # (S × 2I elements fewer at the backward's peak); else (retain_graph, create_graph, torch.compile) not.
    bwd = torch.ops.fused_kernels.moe_experts_bwd_into_gu if _graph_freed() else torch.ops.fused_kernels.moe_experts_bwd
    d_hidden, d_routing, d_w1, d_w2 = bwd(
        dout, hidden, top_k_weights, gate_up_proj, down_proj, gu, perm, inv, offsets, ctx.act, ctx.transposed,
        bool(need[0]), need_weights, bool(need[2]))
    return (d_hidden if need[0] else None, None, d_routing if need[2] else None,
            d_w1 if need[3] else None, d_w2 if need[4] else None, None, None)


_moe_experts_fwd.register_autograd(_autograd, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional entry


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str = "silu",
                transposed: bool = False) -> torch.Tensor:
    """The experts of a mixture-of-experts layer: Σ_j w[t, j] · down_e(act(gate_e(x_t)) · up_e(x_t)) over the
    k experts e = top_k_index[t, j] of each token (see the module docstring).

    hidden (T, H) or (..., H); top_k_index and top_k_weights (..., k) with hidden's leading shape (ids in
    [0, E): ids outside that range are not checked, which would need a host sync); gate_up_proj
    (E, 2I, H) holding the gate rows then the up rows, down_proj (E, H, I), both of hidden's dtype;
    transposed=True for weights stored as (E, H, 2I) and (E, I, H). activation: "silu" (SwiGLU experts),
    "gelu_tanh" or "gelu". Returns hidden's shape and dtype. Gradients flow to hidden, top_k_weights
    and both weights. Registered as the custom op fused_kernels::moe_experts_fwd (torch.compile traces it
    whole).
    """
    check_choice("activation", activation, tuple(ACTIVATIONS))
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed)
    shape = hidden.shape
    x = hidden.reshape(-1, shape[-1])
    if not x.is_contiguous():
        x = x.contiguous()
    k = top_k_index.shape[-1]
    out = torch.ops.fused_kernels.moe_experts_fwd(x, top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k),
                                                  gate_up_proj, down_proj, ACTIVATIONS[activation],
                                                  bool(transposed))[0]
    return out.view(shape)
