"""Cross entropy over a large vocabulary: the loss and the gradient of the logits in one pass.

Math, per row i with target y (the row is ignored when y == ignore_index), V classes, all in fp32:

    z_j    = softcap · tanh(s·x_j / softcap)          (z_j = s·x_j without softcap; s = logit_scale,
                                                        1 here, set by fused_linear_cross_entropy)
    lse    = log Σ_j exp(z_j)
    loss_i = lse − (1−ε)·z_y − (ε/V)·Σ_j z_j + λ·lse²  (ε = label_smoothing as torch defines it,
                                                        λ = z_loss; 0 for an ignored row)
    ∂loss_i/∂z_j = (1 + 2λ·lse)·p_j − (1−ε)·[j = y] − ε/V,    p_j = exp(z_j − lse)
    ∂z_j/∂x_j    = s·(1 − (z_j/softcap)²)                       (s without softcap)

reduction "mean": Σ_i loss_i / #non-ignored rows (0 when every row is ignored); "sum": Σ_i loss_i;
"none": loss_i per row. With num_items_in_batch (HF's fixed_cross_entropy) the sum is divided by it,
for reduction "mean" or "sum" alike ("none" is refused); a divisor of 0 gives loss 0 and zero grads.
That is F.cross_entropy(z.float(), y, ignore_index, reduction, label_smoothing) plus the z-loss term,
except that an all-ignored "mean" gives 0 where torch gives NaN.

Gradient in the forward. When the logits need a gradient, the forward kernel writes
∂loss/∂logits (already divided by the normaliser) into a fresh buffer of the logits' dtype while it
has the row at hand; that buffer *is* the gradient. The backward only multiplies it in place by the
upstream gradient, in a kernel that returns at once when that is exactly 1.0 (the usual case), so
forward + backward read the logits once and write the gradient once:
    8192 × 128256 bf16: 2 · 2.10 GB = 4.2 GB, 0.99 ms at 4.25 TB/s.   (No grad: half that.)
The backward keeps a reference to the buffer and scales it in place, so backward may run once
(retain_graph=True and a second backward raise).

Kernels (one file, three launch plans, chosen by `_plan`; FUSED_KERNELS_CE_PATH overrides):
  "row"      one program per row. A row of <= `row_max` classes is loaded once into registers
             (read once, write once). Longer rows loop over vocab blocks twice (online max/sum-exp,
             then the gradient), the second read coming from L2 or HBM.
  "coop"     (CUDA, long rows) the row is split into S chunks of `chunk` classes; one program per
             (row, chunk) keeps its chunk in registers, publishes its partial max / sum-exp, waits
             at a per-row counter until the row's S partials are in, then writes its gradient
             from registers: each logit is read from HBM exactly once. Deadlock-free: programs
             take their (row, chunk) from an atomic ticket when they start, so the claimed tasks
             are always a prefix; every row wholly inside it finishes and frees its slots, and
             only the last row's (< S) programs can be waiting, so S resident programs suffice
             (checked against the SM count, else "twophase").
  "twophase" the same chunk kernel run as two launches (partials, then gradient): no in-kernel
             waiting, the logits are read twice. The CPU interpreter runs programs one after
             another, so the CPU tests check the chunk kernel's math through this plan.
Auto: "row" for V <= row_max (8192) and on the CPU, else "coop". Environment (read at import):
FUSED_KERNELS_CE_PATH=auto|row|coop|twophase, FUSED_KERNELS_CE_ROW_MAX, FUSED_KERNELS_CE_BLOCK
(row loop block, 8192), FUSED_KERNELS_CE_CHUNK (4096), FUSED_KERNELS_CE_CHUNK_WARPS (0: chunk/1024).
The kernels take the gradient buffer separately from the logits; fused_linear_cross_entropy passes
the same tensor for both (gradient written in place over its logits chunk): every program reads
what it needs (including z_y) before any program writes over it.

Out-of-range targets are flagged by the kernels (and treated as ignored there); the forward checks
the flag once at its end, the one host sync it makes. Pass the logits in the model's dtype: an
upcast copy (HF's `logits.float()`) doubles the bytes for nothing, the kernels compute in fp32.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels._utils import check_choice, check_float, count_launch, interpreter_on, triton_can_run

__all__ = ["cross_entropy"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


# Launch tuning. Read once from the environment; tests patch the dict.
_CONFIG = {
    "path": os.environ.get("FUSED_KERNELS_CE_PATH", "auto"),  # auto | row | coop | twophase
    "row_max": _env_int("FUSED_KERNELS_CE_ROW_MAX", 8192),  # longest row held whole in registers
    "block": _env_int("FUSED_KERNELS_CE_BLOCK", 8192),  # vocab block of the looping row kernel
    "chunk": _env_int("FUSED_KERNELS_CE_CHUNK", 4096),  # classes per program in coop / twophase
    "chunk_warps": _env_int("FUSED_KERNELS_CE_CHUNK_WARPS", 0),  # 0: chosen from the chunk
    "poison": False,  # tests: fill every fresh output buffer with NaN before the kernels run
}
_PATHS = ("auto", "row", "coop", "twophase")
REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _capped(x, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """z = softcap · tanh(s·x / softcap) (or s·x) in fp32. tanh(a) = sign(a)·(1 − e)/(1 + e) with
    e = exp(−2|a|): no overflow, and no libdevice call (the interpreter and every Triton have exp)."""
    z = x.to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        a = z / softcap
        e = tl.exp(-2.0 * tl.abs(a))
        t = (1.0 - e) / (1.0 + e)
        z = softcap * tl.where(a < 0, -t, t)
    return z


@triton.jit
def _dlogits(z, cols, y, lse, coef_p, coef_u, coef_y, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """coef · ∂loss/∂x for a block of one row (see the module docstring); coef_p = coef·(1 + 2λ·lse),
    coef_u = coef·ε/V, coef_y = coef·(1 − ε)."""
    d = coef_p * tl.exp(z - lse) - coef_u
    d = tl.where(cols == y, d - coef_y, d)
    if HAS_SOFTCAP:
        c = tl.minimum(tl.abs(z) / softcap, 1.0)  # |z| <= softcap; masked lanes (z = -inf) give 0, not NaN
        d = d * (logit_scale * (1.0 - c * c))
    else:
        d = d * logit_scale
    return d


@triton.jit
def _row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS: tl.constexpr):
    loss = lse + z_loss * lse * lse
    if HAS_LS:
        loss = loss - (1.0 - label_smoothing) * zy - label_smoothing * inv_v * sumz
    else:
        loss = loss - zy
    return loss


@triton.jit
def _ce_row_kernel(
    x_ptr, x_stride, tgt_ptr, grad_ptr, grad_stride, loss_ptr, coef_ptr, row_scale_ptr, flag_ptr,
    V, ignore_index, logit_scale, softcap, label_smoothing, z_loss,
    HAS_SOFTCAP: tl.constexpr, HAS_LS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    WRITE_GRAD: tl.constexpr, SINGLE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: loss_i into loss_ptr[row]; coef·∂loss_i/∂x into the grad row."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    g_row = grad_ptr + row * grad_stride
    y = tl.load(tgt_ptr + row).to(tl.int64)
    kept = y != ignore_index
    in_range = (y >= 0) & (y < V)
    tl.store(flag_ptr, 1, mask=kept & (~in_range))  # out-of-range target: flagged, row ignored
    valid = kept & in_range
    offs = tl.arange(0, BLOCK)
    inv_v = 1.0 / V
    if valid:
        coef = tl.load(coef_ptr)
        if HAS_ROW_SCALE:
            coef = coef * tl.load(row_scale_ptr + row)
        if SINGLE_BLOCK:
            # The whole row in registers: one read, one write.
            mask = offs < V
            z = _capped(tl.load(x_row + offs, mask=mask, other=0.0), logit_scale, softcap, HAS_SOFTCAP)
            z = tl.where(mask, z, float("-inf"))
            m = tl.max(z, 0)
            e = tl.exp(z - m)
            s = tl.sum(e, 0)
            lse = m + tl.log(s)
            zy = tl.sum(tl.where(offs == y, z, 0.0), 0)
            sumz = 0.0
            if HAS_LS:
                sumz = tl.sum(tl.where(mask, z, 0.0), 0)
            tl.store(loss_ptr + row, _row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS))
            if WRITE_GRAD:
                coef_p = coef * (1.0 + 2.0 * z_loss * lse)
                d = _dlogits(z, offs, y, lse, coef_p, coef * label_smoothing * inv_v,
                             coef * (1.0 - label_smoothing), logit_scale, softcap, HAS_SOFTCAP)
                tl.store(g_row + offs, d.to(grad_ptr.dtype.element_ty), mask=mask)
        else:
            # z_y first: with the gradient written in place over the logits it would be gone.
            zy = _capped(tl.load(x_row + y), logit_scale, softcap, HAS_SOFTCAP)
            m = float("-inf")
            s = 0.0
            sumz = 0.0
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = _capped(tl.load(x_row + cols, mask=mask, other=0.0), logit_scale, softcap, HAS_SOFTCAP)
                z = tl.where(mask, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, 0))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of -inf logits
                s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
                m = m_new
                if HAS_LS:
                    sumz += tl.sum(tl.where(mask, z, 0.0), 0)
            lse = m + tl.log(s)
            tl.store(loss_ptr + row, _row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS))
            if WRITE_GRAD:
                coef_p = coef * (1.0 + 2.0 * z_loss * lse)
                coef_u = coef * label_smoothing * inv_v
                coef_y = coef * (1.0 - label_smoothing)
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    mask = cols < V
                    z = _capped(tl.load(x_row + cols, mask=mask, other=0.0), logit_scale, softcap, HAS_SOFTCAP)
                    d = _dlogits(z, cols, y, lse, coef_p, coef_u, coef_y, logit_scale, softcap, HAS_SOFTCAP)
                    tl.store(g_row + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            zero = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK):
                cols = start + offs
                tl.store(g_row + cols, zero, mask=cols < V)


@triton.jit
def _ce_chunk_kernel(
    x_ptr, x_stride, tgt_ptr, grad_ptr, grad_stride, loss_ptr, coef_ptr, row_scale_ptr, flag_ptr,
    sync_ptr, part_ptr, zy_ptr,
    N, V, S, ignore_index, logit_scale, softcap, label_smoothing, z_loss,
    PHASE: tl.constexpr,  # 0: partials, wait, gradient in one program ("coop"); 1: partials; 2: gradient
    HAS_SOFTCAP: tl.constexpr, HAS_LS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    WRITE_GRAD: tl.constexpr, S_POW2: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (row, chunk of CHUNK classes). Partials per row in part_ptr[row, 3, S]:
    chunk max, Σ exp(z − chunk max), Σ z; z_y in zy_ptr[row]. sync_ptr[0:N] counts the partials a
    row has published, sync_ptr[N] hands out tickets (PHASE 0 only; zeroed before the launch)."""
    if PHASE == 0:
        task = tl.atomic_add(sync_ptr + N, 1)  # in start order: whoever we wait for has started
    else:
        task = tl.program_id(0)
    row = (task // S).to(tl.int64)
    chunk = task % S
    x_row = x_ptr + row * x_stride
    g_row = grad_ptr + row * grad_stride
    part_row = part_ptr + row * 3 * S
    y = tl.load(tgt_ptr + row).to(tl.int64)
    kept = y != ignore_index
    in_range = (y >= 0) & (y < V)
    valid = kept & in_range
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    inv_v = 1.0 / V
    if PHASE != 2:
        tl.store(flag_ptr, 1, mask=kept & (~in_range) & (chunk == 0))
    if valid:
        if PHASE != 2:
            # Held across the wait in the logits' own dtype (fewer registers, more programs per SM).
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            z = tl.where(mask, _capped(x, logit_scale, softcap, HAS_SOFTCAP), float("-inf"))
            m_c = tl.max(z, 0)
            m_ref = tl.where(m_c == float("-inf"), 0.0, m_c)  # a chunk of -inf logits adds 0
            tl.store(part_row + chunk, m_c)
            tl.store(part_row + S + chunk, tl.sum(tl.exp(z - m_ref), 0))
            if HAS_LS:
                tl.store(part_row + 2 * S + chunk, tl.sum(tl.where(mask, z, 0.0), 0))
            if (y >= chunk * CHUNK) & (y < chunk * CHUNK + CHUNK):
                tl.store(zy_ptr + row, tl.sum(tl.where(cols == y, z, 0.0), 0))
            if PHASE == 0:
                tl.debug_barrier()  # every thread's stores before the release below
                tl.atomic_add(sync_ptr + row, 1, sem="release")
        if PHASE != 1:
            if PHASE == 0:
                seen = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
                while seen < S:
                    seen = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0)
            z = tl.where(mask, _capped(x, logit_scale, softcap, HAS_SOFTCAP), float("-inf"))
            # Other programs' partials: volatile loads skip L1, which may hold this line from before.
            k = tl.arange(0, S_POW2)
            k_mask = k < S
            ms = tl.load(part_row + k, mask=k_mask, other=float("-inf"), volatile=True)
            ss = tl.load(part_row + S + k, mask=k_mask, other=0.0, volatile=True)
            m = tl.max(ms, 0)
            lse = m + tl.log(tl.sum(ss * tl.exp(ms - m), 0))
            if WRITE_GRAD:
                coef = tl.load(coef_ptr)
                if HAS_ROW_SCALE:
                    coef = coef * tl.load(row_scale_ptr + row)
                d = _dlogits(z, cols, y, lse, coef * (1.0 + 2.0 * z_loss * lse), coef * label_smoothing * inv_v,
                             coef * (1.0 - label_smoothing), logit_scale, softcap, HAS_SOFTCAP)
                tl.store(g_row + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)
            if chunk == 0:
                sumz = 0.0
                if HAS_LS:
                    sumz = tl.sum(tl.load(part_row + 2 * S + k, mask=k_mask, other=0.0, volatile=True), 0)
                zy = tl.load(zy_ptr + row, volatile=True)
                tl.store(loss_ptr + row, _row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS))
    else:
        if PHASE != 1:
            if WRITE_GRAD:
                tl.store(g_row + cols, tl.zeros([CHUNK], dtype=grad_ptr.dtype.element_ty), mask=mask)
            if chunk == 0:
                tl.store(loss_ptr + row, 0.0)


@triton.jit
def _scale_kernel(t_ptr, g_ptr, row_len, n_blocks_per_row, n_blocks,
                  PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """t *= g in place over a contiguous tensor, g a scalar or one value per row of row_len elements.
    Blocks where g is exactly 1.0 are not touched (no memory traffic when the upstream grad is 1)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    if PER_ROW:
        for blk in range(pid, n_blocks, n_prog):
            row = blk // n_blocks_per_row
            g = tl.load(g_ptr + row)
            if g != 1.0:
                cols = (blk - row * n_blocks_per_row) * BLOCK + offs
                mask = cols < row_len
                ptr = t_ptr + tl.cast(row, tl.int64) * row_len + cols
                v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * g
                tl.store(ptr, v.to(t_ptr.dtype.element_ty), mask=mask)
    else:
        g = tl.load(g_ptr)
        if g != 1.0:
            for blk in range(pid, n_blocks, n_prog):
                idx = tl.cast(blk, tl.int64) * BLOCK + offs
                mask = idx < row_len
                v = tl.load(t_ptr + idx, mask=mask, other=0.0).to(tl.float32) * g
                tl.store(t_ptr + idx, v.to(t_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host side: buffers, launch plans


def _device_guard(t: torch.Tensor):
    """Launch on the tensor's GPU (Triton launches on the current device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def new_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every output buffer comes from here; tests poison it so an element never written shows up."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _CONFIG["poison"]:
        t.fill_(float("nan") if dtype.is_floating_point else -(2**31) + 7)
    return t


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _plan(x: torch.Tensor, v: int) -> str:
    path = _CONFIG["path"]
    check_choice("FUSED_KERNELS_CE_PATH", path, _PATHS)
    if path == "auto":
        if v <= _CONFIG["row_max"] or not x.is_cuda:
            path = "row"  # the CPU interpreter runs programs one at a time: no in-kernel waiting
        else:
            path = "coop"
    if path == "coop":
        if not x.is_cuda:
            raise RuntimeError("the 'coop' cross-entropy plan waits inside the kernel; it needs a GPU")
        # A waiting program needs its row's other S − 1 programs resident (one per SM is certain).
        if triton.cdiv(v, _CONFIG["chunk"]) > _sm_count(x.device):
            path = "twophase"
    return path


def launch_ce(
    x: torch.Tensor,
    target: torch.Tensor,
    grad: Optional[torch.Tensor],
    loss_rows: torch.Tensor,
    coef: torch.Tensor,
    row_scale: Optional[torch.Tensor],
    flag: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    logit_scale: float = 1.0,
) -> None:
    """Run the cross-entropy kernels over the rows of x (N, V; unit column stride).

    loss_rows (N,) fp32 gets loss_i (0 for ignored rows). When grad (N, V; may be x itself) is given
    it gets coef[0] · row_scale[i] · ∂loss_i/∂x_i. flag (int32) is set to 1 when a target lies outside
    [0, V) and is not ignore_index (that row is treated as ignored).
    """
    n, v = x.shape
    if n == 0:
        return
    assert v == 1 or (x.stride(1) == 1 and (grad is None or grad.stride(1) == 1)), "unit class stride"
    flags = dict(
        HAS_SOFTCAP=softcap is not None,
        HAS_LS=label_smoothing > 0.0,
        HAS_ROW_SCALE=row_scale is not None,
        WRITE_GRAD=grad is not None,
    )
    g = grad if grad is not None else x  # never written when WRITE_GRAD is False
    rs = row_scale if row_scale is not None else coef  # never read when HAS_ROW_SCALE is False
    scalars = (float(logit_scale), float(softcap if softcap is not None else 1.0),
               float(label_smoothing), float(z_loss))
    path = _plan(x, v)
    with _device_guard(x):
        if path == "row":
            single = v <= _CONFIG["row_max"]
            block = triton.next_power_of_2(v) if single else _CONFIG["block"]
            _ce_row_kernel[(n,)](
                x, x.stride(0), target, g, g.stride(0), loss_rows, coef, rs, flag,
                v, ignore_index, *scalars,
                SINGLE_BLOCK=single, BLOCK=block, num_warps=max(4, min(16, block // 512)), **flags,
            )
            return
        chunk = _CONFIG["chunk"]
        s = triton.cdiv(v, chunk)
        warps = _CONFIG["chunk_warps"] or max(4, min(16, chunk // 1024))
        part = torch.empty((n, 3, s), dtype=torch.float32, device=x.device)
        zy = torch.empty((n,), dtype=torch.float32, device=x.device)
        sync = torch.zeros((n + 1,) if path == "coop" else (1,), dtype=torch.int32, device=x.device)
        args = (x, x.stride(0), target, g, g.stride(0), loss_rows, coef, rs, flag, sync, part, zy,
                n, v, s, ignore_index, *scalars)
        consts = dict(S_POW2=max(2, triton.next_power_of_2(s)), CHUNK=chunk, num_warps=warps, **flags)
        if path == "coop":
            _ce_chunk_kernel[(n * s,)](*args, PHASE=0, **consts)
        else:
            _ce_chunk_kernel[(n * s,)](*args, PHASE=1, **consts)
            _ce_chunk_kernel[(n * s,)](*args, PHASE=2, **consts)


def scale_(t: torch.Tensor, g: torch.Tensor, per_row: bool = False) -> None:
    """t *= g in place (t contiguous). g: a 1-element tensor, or with per_row one value per row of t.
    Costs no memory traffic where g == 1.0 exactly."""
    if t.numel() == 0:
        return
    assert t.is_contiguous()
    g = g.detach().to(device=t.device, dtype=torch.float32).reshape(-1).contiguous()
    if per_row:
        rows = t.shape[0]
        row_len = t.numel() // rows
    else:
        rows, row_len = 1, t.numel()
    block = 1024 if interpreter_on() else 4096
    per = triton.cdiv(row_len, block)
    n_blocks = rows * per
    cap = 16 if not t.is_cuda else 8 * _sm_count(t.device)
    with _device_guard(t):
        _scale_kernel[(min(n_blocks, cap),)](t, g, row_len, per, n_blocks, PER_ROW=per_row, BLOCK=block,
                                             num_warps=8)


def grad_coef(target: torch.Tensor, ignore_index: int, reduction: str, divisor: Optional[torch.Tensor],
              divisor_value: float, device) -> torch.Tensor:
    """1-element fp32 tensor on `device`: what each row's ∂loss/∂logits is multiplied by, and the
    loss sum too (1 / #non-ignored for "mean", 1 / num_items_in_batch, else 1). No host sync."""
    if divisor is not None:
        d = divisor.detach().to(device=device, dtype=torch.float32).reshape(1)
        return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    if divisor_value >= 0:  # num_items_in_batch given as a number
        return torch.full((1,), 1.0 / divisor_value if divisor_value else 0.0, dtype=torch.float32, device=device)
    if reduction == "mean":
        count = (target != ignore_index).sum(dtype=torch.float32).reshape(1)
        return count.clamp_(min=1.0).reciprocal_()
    return torch.ones((1,), dtype=torch.float32, device=device)


def raise_if_flagged(flag: torch.Tensor, target: torch.Tensor, v: int, ignore_index: int) -> None:
    """The one host sync of the forward: did any kernel see a target outside [0, V)? Skipped while a
    CUDA graph is being captured (no sync allowed there; such rows count as ignored)."""
    if flag.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if int(flag.item()):
        bad = target[(target != ignore_index) & ((target < 0) | (target >= v))]
        raise ValueError(
            f"target values must lie in [0, {v}) (the number of classes) or equal ignore_index={ignore_index}; "
            f"got {bad.numel()} outside, e.g. {bad[:5].tolist()}"
        )


def require_triton(op: str, *tensors: torch.Tensor) -> None:
    if not triton_can_run(*tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"{op}: the Triton kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; "
            f"got tensors on {', '.join(devices)}"
        )


def reduce_loss(loss_rows: torch.Tensor, coef: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    # .sum() of the 1-element product, not .reshape(()): a custom op must not return a view (an
    # in-place `loss += aux_loss`, as MoE models do, would be refused by autograd).
    return (loss_rows.sum() * coef).sum()


# ----------------------------------------------------------------------------------------------
# Custom ops. `reduction` is the user's; `divisor` / `divisor_value` carry num_items_in_batch
# (a tensor, or a number >= 0; -1 when absent).


@torch.library.custom_op("fused_kernels::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    divisor: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    divisor_value: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, grad): loss () or (N,) fp32; grad (N, V) of logits' dtype holding
    ∂loss/∂logits when compute_grad, else an empty tensor. softcap 0 means none."""
    require_triton("cross_entropy", logits, target)
    count_launch("cross_entropy_fwd")
    n, v = logits.shape
    coef = grad_coef(target, ignore_index, reduction, divisor, divisor_value, logits.device)
    loss_rows = new_buffer((n,), torch.float32, logits.device)
    grad = new_buffer((n, v), logits.dtype, logits.device) if compute_grad else logits.new_empty((0,))
    flag = torch.zeros((1,), dtype=torch.int32, device=logits.device)
    launch_ce(logits, target, grad if compute_grad else None, loss_rows, coef, None, flag,
              ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
              softcap=softcap if softcap > 0 else None)
    loss = reduce_loss(loss_rows, coef, reduction)
    raise_if_flagged(flag, target, v, ignore_index)
    return loss, grad


@_cross_entropy_fwd.register_fake
def _(logits, target, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap, divisor_value,
      compute_grad):
    n, v = logits.shape
    loss = logits.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    grad = logits.new_empty((n, v)) if compute_grad else logits.new_empty((0,))
    return loss, grad


@torch.library.custom_op("fused_kernels::cross_entropy_bwd", mutates_args=("grad_logits",))
def _cross_entropy_bwd(grad_logits: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """grad_logits *= grad_loss in place (per row when grad_loss has one value per row)."""
    require_triton("cross_entropy", grad_logits)
    count_launch("cross_entropy_bwd")
    scale_(grad_logits, grad_loss, per_row=grad_loss.dim() > 0)


@_cross_entropy_bwd.register_fake
def _(grad_logits, grad_loss):
    return None


def _ce_setup_context(ctx, inputs, output):
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.compute_grad = inputs[-1]
    ctx.used = False
    ctx.save_for_backward(grad)


def _ce_backward(ctx, grad_loss, _grad_of_grad):
    if not ctx.compute_grad:  # only a num_items_in_batch tensor that requires grad gets here
        return (None,) * 10
    if ctx.used:
        raise RuntimeError(
            "fused_kernels.cross_entropy: backward ran a second time (retain_graph=True); the gradient is "
            "computed in the forward and scaled in place by the backward, so it can be used once"
        )
    ctx.used = True
    (grad,) = ctx.saved_tensors
    torch.ops.fused_kernels.cross_entropy_bwd(grad, grad_loss)
    return grad, None, None, None, None, None, None, None, None, None


_cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional entry


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_options(reduction, ignore_index, label_smoothing, z_loss, softcap, num_items_in_batch):
    """Validate the options shared with fused_linear_cross_entropy; return (divisor, divisor_value)."""
    check_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not _is_number(label_smoothing) or not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    if not _is_number(z_loss) or not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if softcap is not None and (not _is_number(softcap) or not (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if num_items_in_batch is None:
        return None, -1.0
    if reduction == "none":
        raise ValueError(
            "num_items_in_batch divides the summed loss (HF's fixed_cross_entropy); it needs reduction "
            "'mean' or 'sum', got 'none'"
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex():
            raise ValueError(
                f"num_items_in_batch must be a number or a one-element real tensor, got a tensor of shape "
                f"{tuple(num_items_in_batch.shape)} and dtype {num_items_in_batch.dtype}"
            )
        return num_items_in_batch, -1.0
    if not _is_number(num_items_in_batch) or not (math.isfinite(num_items_in_batch) and num_items_in_batch >= 0):
        raise ValueError(f"num_items_in_batch must be None, a number >= 0 or a tensor, got {num_items_in_batch!r}")
    return None, float(num_items_in_batch)


def check_target(target, leading_shape, leading_name: str, device) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices (e.g. torch.int64), got {target.dtype}")
    if tuple(target.shape) != tuple(leading_shape):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal {leading_name} {tuple(leading_shape)}"
        )
    if target.device != device:
        raise ValueError(f"target must be on {device}, got {target.device}")


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as (rows, width) with unit column stride: a view when possible, else a copy."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(1) == 1 or width == 1 else t2.contiguous()


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    num_items_in_batch=None,
) -> torch.Tensor:
    """Cross entropy of logits (..., V) against integer target (...), as transformers computes it
    (F.cross_entropy on the float32 logits, after `softcap · tanh(logits / softcap)` when softcap is
    set) plus z_loss · lse² averaged like the loss. See the module docstring for the exact formulas.

    reduction: "mean" over non-ignored rows (0 when all are ignored), "sum", or "none" (per-row
    losses of target's shape, 0 where ignored). num_items_in_batch (number or 0-d tensor): the loss
    is sum / num_items_in_batch for reduction "mean" or "sum" (0 when it is 0); not with "none".
    Returns float32. The gradient of the logits has their dtype and is computed in the forward.
    """
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a last (class) dimension of size >= 1, got shape {tuple(logits.shape)}")
    check_target(target, logits.shape[:-1], f"logits shape {tuple(logits.shape)} without its last (class) dimension",
                 logits.device)
    divisor, divisor_value = check_options(reduction, ignore_index, label_smoothing, z_loss, softcap,
                                           num_items_in_batch)
    require_triton("cross_entropy", logits, target)
    v = logits.shape[-1]
    x = _rows(logits, v)
    t = target.reshape(-1).contiguous()
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _ = torch.ops.fused_kernels.cross_entropy_fwd(
        x, t, divisor, ignore_index, reduction, float(label_smoothing), float(z_loss),
        float(softcap) if softcap is not None else 0.0, divisor_value, compute_grad,
    )
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss
