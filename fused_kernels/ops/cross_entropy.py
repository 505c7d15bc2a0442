"""Cross entropy over a large vocabulary: the loss and the gradient of the logits in one kernel.

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
has the row at hand; that buffer *is* the gradient. The backward multiplies it in place by the
upstream gradient (a kernel that returns at once when that is exactly 1.0, the usual case) and hands
the buffer itself to autograd: the eager autograd.Function keeps it only as a ctx attribute that the
backward pops, so no other reference is alive and AccumulateGrad adopts it as `.grad` (no clone, no
second logits-sized buffer). The backward may therefore run once (retain_graph=True and a second
backward raise). Under torch.compile the custom ops below are traced instead; there the compiled
graph owns the buffers, and whether .grad is the buffer or a copy is up to AOTAutograd.

Kernel: one program per row, or (`per_sm` > 0) a persistent grid of per_sm·#SMs programs each taking
rows pid, pid + P, ... A row of at most BLOCK classes is held whole in registers (read once, written
once). A longer row is swept twice in BLOCK-wide blocks: first the online max / sum-exp in fp32 (plus
z_y, Σz for label smoothing, the softcap tanh), then the gradient (softmax − onehot)·scale. The second
read of a ≤ 512 KB row comes from L2 when rows in flight × row bytes stay well under the 50 MB L2,
which is what the one-program-per-SM-at-a-time shapes and the L2 eviction hints are for. Bytes moved,
8192 × 128256 bf16 with the gradient: read 2.10 GB + write 2.10 GB from HBM (+ the second read, from
L2 or HBM). Without the gradient: one read, half that.

Paths (`plan()` in cross_entropy_config decides, from the tables there; `Plan.path`):
  - "smem", "smem-split", "smem-registers": the Gluon kernel of fused_kernels/cross_entropy_smem.py,
    which holds each row in shared memory (read from HBM once): unsplit, split over a thread-block
    cluster of 2-8 CTAs (Hopper and later), or with the first chunks of each CTA's share in registers.
    They run on a CUDA GPU with Gluon for 16-bit logits and gradient with 16-byte aligned rows, the
    gradient wanted, SMEM_FROM <= V <= 262144, when an SMEM_TABLE shape fits the SM (and, split, the
    rows give each cluster >= SPLIT_MIN_ROWS_PER_CLUSTER of them).
  - "triton": this module's kernel with LAUNCH_TABLE's shape: everywhere else, and on the CPU.
A smem path whose first build fails with the installed Triton is turned off for the process
(fused_kernels._dispatch, one warning) and the call planned again: the next shape computes the same
numbers. `_CONFIG["force"]` forces one LaunchConfig (tests, dev/tune_cross_entropy.py);
`_CONFIG["sm_count"]` stands in for the SM count (the CPU interpreter has none: there the grid is one
program per row unless it is set); `_CONFIG["device"]` stands in for the device's facts (tests).

The kernel takes the gradient buffer separately from the logits; fused_linear_cross_entropy passes
the same tensor for both (gradient written in place over its logits chunk): a row belongs to one
program, which reads z_y before it writes anything and reads every block before it overwrites it.

Around the kernel, two one-program kernels keep the host path short (each small torch op costs
CPU time the loss's GPU work does not hide): a prologue writes the gradient coefficient (counting the
non-ignored rows for "mean") and clears the flag; an epilogue sums the rows' losses times the
coefficient into the 0-d loss and turns the flag into the value the check reads. Out-of-range targets
are flagged by the kernel (and treated as ignored there); the forward checks the flag at its end: a
device-side assert on a GPU (no host sync, like torch's own cross entropy), a ValueError naming them
on the CPU. Pass the logits in the model's dtype: an upcast copy (HF's `logits.float()`) doubles the
bytes for nothing, the kernel computes in fp32.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels import _dispatch
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts, device_facts, device_guard
from fused_kernels._jit import for_store
from fused_kernels._launch import launch
from fused_kernels._row_loss import capped, dlogits, row_loss
from fused_kernels._utils import check_choice, check_float, count_launch, interpreter_on, require_triton
# _CONFIG: the config module's own dict (its plan() reads "force", "sm_count", "device"; the buffers here
# "poison", "on_buffer")
from fused_kernels.ops.cross_entropy_config import (_CONFIG, OP, SMEM_FROM, SPLIT_MIN_ROWS_PER_CLUSTER, Call,
                                                    LaunchConfig, _grid_sms, _programs, plan)

__all__ = ["cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")
# How triton.jit built the kernels (it reads TRITON_INTERPRET once, when triton is imported): under the
# interpreter, bf16 stores are rounded to nearest even first, as the GPU's casts do (fused_kernels._jit).
_INTERPRETED = interpreter_on()


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _stats_block(x_blk, offs, lim, m, s, sumz, logit_scale, softcap, EVICT: tl.constexpr, MASKED: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LS: tl.constexpr):
    """One block of the first sweep (x_blk: the block's first logit, lim: classes left in the row):
    the running max m, Σ exp(z − m) and Σ z, updated. Addresses are one scalar base plus the constant
    offsets, which keeps them out of registers."""
    if MASKED:
        mask = offs < lim
        x = tl.load(x_blk + offs, mask=mask, other=0.0, eviction_policy=EVICT)
        z = tl.where(mask, capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP), float("-inf"))
    else:
        z = capped(tl.load(x_blk + offs, eviction_policy=EVICT), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
    m_new = tl.maximum(m, tl.max(z, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # only -inf so far: Σ stays 0
    s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
    if HAS_LS:
        if MASKED:
            sumz += tl.sum(tl.where(offs < lim, z, 0.0), 0)
        else:
            sumz += tl.sum(z, 0)
    return m_new, s, sumz


@triton.jit
def _grad_block(x_blk, g_blk, offs, lim, y_rel, lse, coef_p, coef_u, coef_y, logit_scale, softcap,
                LOAD_EVICT: tl.constexpr, STORE_EVICT: tl.constexpr, MASKED: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EXACT_BF16: tl.constexpr):
    """One block of the second sweep: re-read the logits, write the gradient (y_rel: the target's
    position within the block, outside [0, BLOCK) when it lies elsewhere)."""
    if MASKED:
        mask = offs < lim
        x = tl.load(x_blk + offs, mask=mask, other=0.0, eviction_policy=LOAD_EVICT)
    else:
        x = tl.load(x_blk + offs, eviction_policy=LOAD_EVICT)
    z = capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
    d = dlogits(tl.exp(z - lse), z, offs, y_rel, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP)
    d = for_store(d, g_blk.dtype.element_ty, EXACT_BF16).to(g_blk.dtype.element_ty)
    if MASKED:
        tl.store(g_blk + offs, d, mask=mask, eviction_policy=STORE_EVICT)
    else:
        tl.store(g_blk + offs, d, eviction_policy=STORE_EVICT)


@triton.jit
def _ce_kernel(
    x_ptr, x_stride, tgt_ptr, grad_ptr, grad_stride, loss_ptr, coef_ptr, row_scale_ptr, flag_ptr,
    n_rows, V, ignore_index, logit_scale, softcap, label_smoothing, z_loss,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    WRITE_GRAD: tl.constexpr, SINGLE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
    KEEP: tl.constexpr, DROP: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    """Rows pid, pid + P, ... (P programs): loss_i into loss_ptr[row]; coef·row_scale_i·∂loss_i/∂x
    into the gradient row. KEEP / DROP: eviction policies ("" for none) of the first sweep's loads and
    of the second sweep's loads and stores."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    inv_v = 1.0 / V
    coef_all = tl.load(coef_ptr)
    if HAS_SCALE:
        coef_all = coef_all * logit_scale  # ∂z/∂x = s (times the softcap factor)
    v_full = V // BLOCK * BLOCK  # unmasked blocks below, one masked tail block
    for r in range(pid, n_rows, n_prog):
        row = tl.cast(r, tl.int64)
        x_row = x_ptr + row * x_stride
        g_row = grad_ptr + row * grad_stride
        y = tl.load(tgt_ptr + row).to(tl.int64)
        kept = y != ignore_index
        in_range = (y >= 0) & (y < V)
        tl.store(flag_ptr, 1, mask=kept & (~in_range))  # out-of-range target: flagged, row ignored
        if kept & in_range:
            yc = y.to(tl.int32)  # in [0, V): 32-bit compares against the class offsets
            coef = coef_all
            if HAS_ROW_SCALE:
                coef = coef * tl.load(row_scale_ptr + row)
            if SINGLE_BLOCK:
                # The whole row in registers: one read, one write, one exp per class.
                mask = offs < V
                x = tl.load(x_row + offs, mask=mask, other=0.0, eviction_policy=DROP)
                z = tl.where(mask, capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP), float("-inf"))
                m = tl.max(z, 0)
                e = tl.exp(z - m)
                s = tl.sum(e, 0)
                lse = m + tl.log(s)
                zy = tl.sum(tl.where(offs == yc, z, 0.0), 0)
                sumz = 0.0
                if HAS_LS:
                    sumz = tl.sum(tl.where(mask, z, 0.0), 0)
                tl.store(loss_ptr + row, row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS))
                if WRITE_GRAD:
                    d = dlogits(e * (1.0 / s), z, offs, yc, coef * (1.0 + 2.0 * z_loss * lse),
                                 coef * label_smoothing * inv_v, coef * (1.0 - label_smoothing), softcap, HAS_SOFTCAP)
                    d = for_store(d, grad_ptr.dtype.element_ty, EXACT_BF16).to(grad_ptr.dtype.element_ty)
                    tl.store(g_row + offs, d, mask=mask, eviction_policy=DROP)
            else:
                # z_y first: with the gradient written in place over the logits it would be gone.
                zy = capped(tl.load(x_row + yc), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m = tl.full((), float("-inf"), tl.float32)
                s = tl.full((), 0.0, tl.float32)
                sumz = tl.full((), 0.0, tl.float32)
                for start in tl.range(0, v_full, BLOCK, num_stages=NUM_STAGES):
                    m, s, sumz = _stats_block(x_row + start, offs, V - start, m, s, sumz, logit_scale, softcap,
                                              KEEP, False, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
                if v_full < V:
                    m, s, sumz = _stats_block(x_row + v_full, offs, V - v_full, m, s, sumz, logit_scale, softcap,
                                              KEEP, True, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
                lse = m + tl.log(s)
                tl.store(loss_ptr + row, row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS))
                if WRITE_GRAD:
                    coef_p = coef * (1.0 + 2.0 * z_loss * lse)
                    coef_u = coef * label_smoothing * inv_v
                    coef_y = coef * (1.0 - label_smoothing)
                    for start in tl.range(0, v_full, BLOCK, num_stages=NUM_STAGES):
                        _grad_block(x_row + start, g_row + start, offs, V - start, yc - start, lse, coef_p, coef_u,
                                    coef_y, logit_scale, softcap, DROP, DROP, False, HAS_SCALE, HAS_SOFTCAP,
                                    EXACT_BF16)
                    if v_full < V:
                        _grad_block(x_row + v_full, g_row + v_full, offs, V - v_full, yc - v_full, lse, coef_p,
                                    coef_u, coef_y, logit_scale, softcap, DROP, DROP, True, HAS_SCALE, HAS_SOFTCAP,
                                    EXACT_BF16)
        else:
            tl.store(loss_ptr + row, 0.0)
            if WRITE_GRAD:
                zero = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    tl.store(g_row + cols, zero, mask=cols < V)


@triton.jit
def _scale_kernel(t_ptr, g_ptr, row_len, n_blocks_per_row, n_blocks,
                  PER_ROW: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
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
                tl.store(ptr, for_store(v, t_ptr.dtype.element_ty, EXACT_BF16).to(t_ptr.dtype.element_ty), mask=mask)
    else:
        g = tl.load(g_ptr)
        if g != 1.0:
            for blk in range(pid, n_blocks, n_prog):
                idx = tl.cast(blk, tl.int64) * BLOCK + offs
                mask = idx < row_len
                v = tl.load(t_ptr + idx, mask=mask, other=0.0).to(tl.float32) * g
                tl.store(t_ptr + idx, for_store(v, t_ptr.dtype.element_ty, EXACT_BF16).to(t_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _loss_prologue_kernel(tgt_ptr, n_rows, ignore_index, divisor_ptr, coef_value, coef_ptr, flag_ptr,
                          MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program: coef_ptr[0] = what each row's gradient and the loss sum are multiplied by, and
    flag_ptr[0] = 0 (no bad target seen yet). MODE 0: coef_value; 1: 1 / #rows whose target is not
    ignore_index (1 when there are none); 2: 1 / divisor_ptr[0] (0 when that is 0)."""
    if MODE == 1:
        offs = tl.arange(0, BLOCK)
        count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n_rows, BLOCK):
            rows = start + offs
            t = tl.load(tgt_ptr + rows, mask=rows < n_rows, other=ignore_index)
            count += (t != ignore_index).to(tl.int32)
        coef = 1.0 / tl.maximum(tl.sum(count, 0).to(tl.float32), 1.0)
    elif MODE == 2:
        d = tl.load(divisor_ptr).to(tl.float32)
        coef = tl.where(d != 0.0, 1.0 / tl.where(d != 0.0, d, 1.0), 0.0)
    else:
        coef = coef_value
    tl.store(coef_ptr, coef)
    tl.store(flag_ptr, 0)


@triton.jit
def _loss_epilogue_kernel(loss_rows_ptr, n_rows, coef_ptr, flag_ptr, loss_ptr, ok_ptr,
                          REDUCE: tl.constexpr, BLOCK: tl.constexpr):
    """One program: loss_ptr[0] = coef · Σ loss_rows (REDUCE), and ok_ptr[0] = 1 unless a kernel
    flagged an out-of-range target (what the device-side assert checks)."""
    if REDUCE:
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK):
            rows = start + offs
            acc += tl.load(loss_rows_ptr + rows, mask=rows < n_rows, other=0.0)
        tl.store(loss_ptr, tl.sum(acc, 0) * tl.load(coef_ptr))
    tl.store(ok_ptr, (tl.load(flag_ptr) == 0).to(tl.int32))


# ----------------------------------------------------------------------------------------------
# Host side: buffers, launch shapes


def new_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every output buffer comes from here; tests poison it so an element never written shows up,
    and follow it (on_buffer) to check that autograd adopts it as .grad without a copy."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _CONFIG["poison"]:
        t.fill_(float("nan") if dtype.is_floating_point else -(2**31) + 7)
    if _CONFIG["on_buffer"] is not None:
        _CONFIG["on_buffer"](t)
    return t


# What runs instead once a path is turned off (the warning says it): each smem path needs "smem" on,
# and a split row (registers or not) needs "smem-split" on.
_INSTEAD = {
    "smem": "the Triton kernel for every vocabulary size",
    "smem-split": "not splitting rows",
    "smem-registers": "shapes not holding chunks in registers",
}


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def _facts(x: torch.Tensor) -> DeviceFacts:
    return _CONFIG["device"] or device_facts(x.device)


def _call(x: torch.Tensor, grad: Optional[torch.Tensor]) -> Call:
    return Call(x.shape[0], x.shape[1], x.dtype, None if grad is None else grad.dtype,
                _aligned(x) and (grad is None or _aligned(grad)))


def plan_for(x: torch.Tensor, grad: Optional[torch.Tensor], facts: Optional[DeviceFacts] = None) -> Plan:
    """plan() for logits x (N, V) and the gradient buffer grad (None: no gradient) on x's device (facts:
    its DeviceFacts; default that of x's device, or _CONFIG["device"] standing in for it: tests)."""
    return plan(_call(x, grad), facts or _facts(x))


_PLANS: dict = {}  # plan_for's answers by everything plan() reads, so that a training step plans once per shape
_SMEM_PATHS = (Path.SMEM, Path.SMEM_SPLIT, Path.SMEM_REGISTERS)


def _planned(x: torch.Tensor, grad: Optional[torch.Tensor], facts: DeviceFacts) -> Plan:
    """plan_for(x, grad, facts), remembered: the key holds the inputs, the knobs and the paths' state."""
    key = (_call(x, grad), facts, _CONFIG["force"], _CONFIG["sm_count"], SMEM_FROM, SPLIT_MIN_ROWS_PER_CLUSTER,
           tuple(_dispatch.path_on(OP, p) for p in _SMEM_PATHS))
    got = _PLANS.get(key)
    if got is None:
        if len(_PLANS) > 1024:
            _PLANS.clear()
        got = _PLANS[key] = plan_for(x, grad, facts)
    return got


def _smem_module():
    """fused_kernels.cross_entropy_smem, imported on first use (it imports this module's Triton helpers)."""
    from fused_kernels.ops import cross_entropy_smem

    return cross_entropy_smem


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
    """Run the cross-entropy kernel over the rows of x (N, V; unit column stride) that plan_for(x, grad)
    names. A smem path whose first build fails is turned off (_dispatch.run_path) and the call planned
    again; a shape that has run before and then fails, or a forced one, raises.

    loss_rows (N,) fp32 gets loss_i (0 for ignored rows). When grad (N, V; may be x itself) is given
    it gets coef[0] · row_scale[i] · ∂loss_i/∂x_i. flag (int32) is set to 1 when a target lies outside
    [0, V) and is not ignore_index (that row is treated as ignored).
    """
    n, v = x.shape
    if n == 0:
        return
    assert v == 1 or (x.stride(1) == 1 and (grad is None or grad.stride(1) == 1)), "unit class stride"
    options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                   logit_scale=logit_scale)
    facts = _facts(x)
    while True:
        p = _planned(x, grad, facts)
        if p.path == Path.TRITON:
            break
        cfg = p.config
        key = (v, x.dtype, cfg, row_scale is not None, softcap is not None, logit_scale != 1.0, label_smoothing > 0)
        smem = _smem_module()

        def run(cfg=cfg):
            with device_guard(x):
                smem.launch_ce_smem(x, target, grad, loss_rows, coef, row_scale, flag, warps=cfg.warps,
                                    ctas=cfg.ctas, grid=_programs(cfg, n, _grid_sms(facts)),
                                    in_registers=cfg.in_registers, per_sm=cfg.per_sm, **options)

        if _dispatch.run_path(OP, p.path, key, run, instead=_INSTEAD[p.path], forced=_CONFIG["force"] is not None):
            return
    cfg = p.config
    g = grad if grad is not None else x  # never written when WRITE_GRAD is False
    rs = row_scale if row_scale is not None else coef  # never read when HAS_ROW_SCALE is False
    scalars = (n, v, ignore_index, float(logit_scale), float(softcap if softcap is not None else 1.0),
               float(label_smoothing), float(z_loss))
    flags = dict(has_scale=logit_scale != 1.0, has_softcap=softcap is not None, has_ls=label_smoothing > 0.0,
                 has_row_scale=row_scale is not None)
    with device_guard(x):
        launch(
            _ce_kernel, (_programs(cfg, n, _grid_sms(facts)),),
            (x, x.stride(0), target, g, g.stride(0), loss_rows, coef, rs, flag) + scalars,
            dict(kernel_constexprs(cfg, v, **flags, write_grad=grad is not None), num_warps=cfg.warps),
        )


def kernel_constexprs(cfg: LaunchConfig, v: int, *, has_scale: bool, has_softcap: bool, has_ls: bool,
                      has_row_scale: bool, write_grad: bool, exact_bf16: bool = _INTERPRETED) -> dict:
    """_ce_kernel's constexpr arguments for rows of v classes under launch shape cfg (launch_ce, and
    dev/check_sm90.py, which compiles the same kernels for sm_90a)."""
    block = min(cfg.block, triton.next_power_of_2(v))
    hints = cfg.l2_hints and v > block  # a row held whole is read once: nothing to keep in L2
    return dict(
        HAS_SCALE=has_scale, HAS_SOFTCAP=has_softcap, HAS_LS=has_ls, HAS_ROW_SCALE=has_row_scale,
        WRITE_GRAD=write_grad, SINGLE_BLOCK=v <= block, BLOCK=block, NUM_STAGES=cfg.stages,
        KEEP="evict_last" if hints else "", DROP="evict_first" if hints else "", EXACT_BF16=exact_bf16,
    )


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
    block = 4096 if t.is_cuda else 1024
    per = triton.cdiv(row_len, block)
    n_blocks = rows * per
    cap = 8 * _grid_sms(device_facts(t.device)) if t.is_cuda else 16
    with device_guard(t):
        launch(_scale_kernel, (min(n_blocks, cap),), (t, g, row_len, per, n_blocks),
               dict(PER_ROW=per_row, BLOCK=block, EXACT_BF16=_INTERPRETED, num_warps=8))


_LOSS_BLOCK = 4096  # rows per step of the prologue's count and the epilogue's sum (one program each)


def start_loss(target: torch.Tensor, ignore_index: int, reduction: str, divisor: Optional[torch.Tensor],
               divisor_value: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(coef, flag), one launch, no host sync. coef (1,) fp32: what each row's ∂loss/∂logits, and the
    loss sum, are multiplied by: 1 / #non-ignored rows for "mean" (1 when none), 1 / num_items_in_batch
    (0 when it is 0), else 1. flag (1,) int32 = 0: the cross-entropy kernel sets it on a bad target.
    Replaces ~7 small torch ops (count, clamp, reciprocal, a zeroed flag), whose host time outlasted
    the loss's GPU work."""
    coef = torch.empty((1,), dtype=torch.float32, device=device)
    flag = torch.empty((1,), dtype=torch.int32, device=device)
    div = coef  # never read unless MODE 2
    if divisor is not None:
        mode, value = 2, 0.0
        div = divisor.detach()
        if div.device != coef.device or div.dtype == torch.bool:
            div = div.to(device=device, dtype=torch.float32)
        div = div.reshape(1)
    elif divisor_value >= 0:  # num_items_in_batch given as a number
        mode, value = 0, (1.0 / divisor_value if divisor_value else 0.0)
    elif reduction == "mean":
        mode, value = 1, 0.0
    else:
        mode, value = 0, 1.0
    with device_guard(coef):
        launch(_loss_prologue_kernel, (1,), (target, target.numel(), ignore_index, div, value, coef, flag),
               dict(MODE=mode, BLOCK=_LOSS_BLOCK, num_warps=4))
    return coef, flag


def finish_loss(loss_rows: torch.Tensor, coef: torch.Tensor, flag: torch.Tensor, reduction: str,
                target: torch.Tensor, v: int, ignore_index: int) -> torch.Tensor:
    """The loss: coef · Σ loss_rows as a fresh 0-d tensor (one launch), or loss_rows itself for "none";
    then the out-of-range target check. On a GPU that is a device-side assert, as in torch's own cross
    entropy: no host sync (a sync per call leaves the GPU idle while the CPU catches up to launch the
    backward), but the CUDA context is lost when it fires. On the CPU
    (the interpreter) a ValueError names the bad targets. The 0-d loss is not a view: a custom op must
    not return one (an in-place `loss += aux_loss`, as MoE models do, would be refused by autograd)."""
    reduce = reduction != "none"
    loss = torch.empty((), dtype=torch.float32, device=loss_rows.device) if reduce else loss_rows
    ok = torch.empty((1,), dtype=torch.int32, device=loss_rows.device)
    with device_guard(loss_rows):
        launch(_loss_epilogue_kernel, (1,), (loss_rows, loss_rows.numel(), coef, flag, loss, ok),
               dict(REDUCE=reduce, BLOCK=_LOSS_BLOCK, num_warps=4))
    if ok.is_cuda:
        torch._assert_async(
            ok,
            f"fused_kernels cross entropy: a target lies outside [0, {v}) (the number of classes) and is not "
            f"ignore_index={ignore_index}",
        )
    elif not int(ok.item()):
        bad = target[(target != ignore_index) & ((target < 0) | (target >= v))]
        raise ValueError(
            f"target values must lie in [0, {v}) (the number of classes) or equal ignore_index={ignore_index}; "
            f"got {bad.numel()} outside, e.g. {bad[:5].tolist()}"
        )
    return loss


def _forward_impl(logits, target, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
                  divisor_value, compute_grad) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(loss, grad): loss () or (N,) fp32; grad (N, V) of the logits' dtype holding ∂loss/∂logits
    (per-row losses unscaled for "none") when compute_grad, else None. softcap 0 means none."""
    require_triton("cross_entropy", logits, target)
    count_launch("cross_entropy_fwd")
    n, v = logits.shape
    coef, flag = start_loss(target, ignore_index, reduction, divisor, divisor_value, logits.device)
    loss_rows = new_buffer((n,), torch.float32, logits.device)
    grad = new_buffer((n, v), logits.dtype, logits.device) if compute_grad else None
    launch_ce(logits, target, grad, loss_rows, coef, None, flag,
              ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
              softcap=softcap if softcap > 0 else None)
    return finish_loss(loss_rows, coef, flag, reduction, target, v, ignore_index), grad


def _backward_impl(grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """grad *= grad_loss in place (per row when grad_loss has one value per row)."""
    require_triton("cross_entropy", grad)
    count_launch("cross_entropy_bwd")
    scale_(grad, grad_loss, per_row=grad_loss.dim() > 0)


_SECOND_BACKWARD = (
    "fused_kernels.cross_entropy: backward ran a second time (retain_graph=True); the gradient is "
    "computed in the forward and scaled in place by the backward, so it can be used once"
)


# ----------------------------------------------------------------------------------------------
# Custom ops (traced by torch.compile). `reduction` is the user's; `divisor` / `divisor_value` carry
# num_items_in_batch (a tensor, or a number >= 0; -1 when absent).


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
    loss, grad = _forward_impl(logits, target, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
                               divisor_value, compute_grad)
    return loss, grad if grad is not None else logits.new_empty((0,))


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
    _backward_impl(grad_logits, grad_loss)


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
        raise RuntimeError(_SECOND_BACKWARD)
    ctx.used = True
    (grad,) = ctx.saved_tensors
    torch.ops.fused_kernels.cross_entropy_bwd(grad, grad_loss)
    return grad, None, None, None, None, None, None, None, None, None


_cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup_context)


# ----------------------------------------------------------------------------------------------
# Eager autograd: the gradient buffer lives only on ctx until the backward pops it, so that the
# tensor the backward returns has no other owner and AccumulateGrad adopts it as .grad (no clone).


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, divisor, ignore_index, reduction, label_smoothing, z_loss, softcap,
                divisor_value):
        compute_grad = ctx.needs_input_grad[0]
        loss, grad = _forward_impl(logits, target, divisor, ignore_index, reduction, label_smoothing, z_loss,
                                   softcap, divisor_value, compute_grad)
        ctx.compute_grad = compute_grad
        ctx.grad_logits = grad  # not saved, not an output: popped by the backward
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if not ctx.compute_grad:  # only a num_items_in_batch tensor that requires grad gets here
            return (None,) * 9
        grad = ctx.grad_logits
        ctx.grad_logits = None
        if grad is None:
            raise RuntimeError(_SECOND_BACKWARD)
        _backward_impl(grad, grad_loss)
        return grad, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Functional entry


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_options(reduction, ignore_index, label_smoothing, z_loss, softcap, num_items_in_batch, device=None):
    """Validate the options shared with fused_linear_cross_entropy; return (divisor, divisor_value).
    Under torch.compile an int num_items_in_batch becomes a 0-d float32 tensor on `device` (the divisor)."""
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
    if (torch.compiler.is_compiling() and isinstance(num_items_in_batch, int)
            and not isinstance(num_items_in_batch, bool)):
        # A count that changes between calls (the tokens of each batch) is a symbolic int in the trace:
        # math.isfinite stopped the trace on it and float() would guard on its value. As a tensor it is
        # a graph input of any value, divided by in the kernel as a tensor divisor is.
        if num_items_in_batch < 0:
            raise ValueError(f"num_items_in_batch must be None, a number >= 0 or a tensor, got {num_items_in_batch!r}")
        return torch.full((), num_items_in_batch, dtype=torch.float32, device=device), -1.0
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
    Eager calls run a torch.autograd.Function; under torch.compile the custom op
    fused_kernels::cross_entropy_fwd is traced instead. Both launch the same kernels.
    """
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a last (class) dimension of size >= 1, got shape {tuple(logits.shape)}")
    check_target(target, logits.shape[:-1], f"logits shape {tuple(logits.shape)} without its last (class) dimension",
                 logits.device)
    divisor, divisor_value = check_options(reduction, ignore_index, label_smoothing, z_loss, softcap,
                                           num_items_in_batch, logits.device)
    require_triton("cross_entropy", logits, target)
    v = logits.shape[-1]
    x = _rows(logits, v)
    t = target.reshape(-1).contiguous()
    options = (ignore_index, reduction, float(label_smoothing), float(z_loss),
               float(softcap) if softcap is not None else 0.0, divisor_value)
    if torch.compiler.is_compiling():
        compute_grad = torch.is_grad_enabled() and logits.requires_grad
        loss, _ = torch.ops.fused_kernels.cross_entropy_fwd(x, t, divisor, *options, compute_grad)
    elif torch.is_grad_enabled() and (logits.requires_grad or (divisor is not None and divisor.requires_grad)):
        loss = _CrossEntropyFunction.apply(x, t, divisor, *options)
    else:
        loss, _ = _forward_impl(x, t, divisor, *options, False)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss
