"""LayerNorm over the last dimension: forward and backward in Triton, fp32 accumulation.

`layer_norm(x, weight, bias, eps)` computes what `torch.nn.functional.layer_norm(x, (N,), weight, bias,
eps)` computes, with every intermediate in fp32 and one rounding, the final cast to x.dtype (torch's
CUDA kernel and the fp32-upcasting LayerNorm classes of transformers do the same).

Math (per row of length N, all in fp32):
    mean = Σ x / N
    var  = Σ (x − mean)² / N                  (biased, as torch; the centred sum, not E[x²] − mean²)
    rstd = 1 / sqrt(var + eps)
    xhat = (x − mean) · rstd
    y    = xhat · w + b                       (w = 1 without a weight, b = 0 without a bias)

Backward (g = dy · w, the gradient with respect to xhat):
    dx = rstd · (g − mean(g) − xhat · mean(g · xhat))
    dw = Σ_rows dy · xhat        db = Σ_rows dy        (fp32 partial rows, summed, cast to the parameter's dtype)

Saved for the backward: x (the input itself, no copy), mean and rstd (fp32, one each per row); xhat is
recomputed from them.

Rows of up to FWD_WHOLE_ROW_MAX (forward) / BWD_WHOLE_ROW_MAX (backward) columns are held whole in
registers (x read once per kernel). Longer rows are swept twice in column chunks, the second sweep
reading from L2: the forward's first sweep merges each chunk's mean and centred sum of squares into the
row's (Chan et al.'s pairwise update, as stable as the whole-row formula), the backward's first sweep
sums g and g·xhat.

Bytes moved (rows × N elements of B bytes): the forward reads x and writes y (2·rows·N·B, plus 8 bytes per
row for mean and rstd); the backward reads x and dy and writes dx (3·rows·N·B), plus, per persistent
program, one fp32 partial row each of dw and db (written once, then read by `_partial_sum_kernel`). At
16384 × 4096 in bf16 that is 640 MiB forward + backward, 0.158 ms at the H200's ~4.25 TB/s copy rate.
The chunked backward takes dw and db from `_param_grad_kernel` instead, which reads x and dy once more
(5·rows·N·B in the backward) so that the dx kernel keeps no partial rows. On an H100/H200 the backward of
the lengths of CLUSTER_BACKWARD_SHAPES (16384) splits each row over a thread-block cluster instead
(fused_kernels/norm_smem.py, Gluon): x and dy read once (3·rows·N·B), one partial row each of dw and db
per cluster.

Launch shapes: `plan(call, device)` in layer_norm_config is the one place that decides them (block, rows
per tile, warps, grid sizes, chunked or not, the cluster backward), from the tables there; it returns a
`fused_kernels._dispatch.Plan` whose `config` is a `LayerNormConfig` and whose `reason` says why. The
whole-row forward is persistent (up to 8 programs an SM), the chunked one runs a program per row; the
backward is persistent (each program owns one partial row of dw and of db, or, chunked, none). Under
the CPU interpreter the grids stay within a few programs (each costs about a millisecond there).

Dispatch: eager calls go through a torch.autograd.Function (a few µs of Python); torch.compile traces the
custom ops fused_kernels::layer_norm_fwd / layer_norm_bwd. Both run `_forward_impl` / `_backward_impl`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels import _dispatch, _gpu
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import device_facts
from fused_kernels._jit import for_store
from fused_kernels._ints import cdiv
from fused_kernels._launch import launch
from fused_kernels._utils import new_output as _new_output, row_stride as _row_stride, rows_view as _rows_view
from fused_kernels._utils import check_float, count_launch, interpreter_on, launches_on_device_of
from fused_kernels.ops.layer_norm_config import _STAGES, _SUM_SHAPE, BWD_OP, Call, cluster_shape, plan

# How triton.jit built the kernels below (it reads TRITON_INTERPRET once, when triton is imported).
_INTERPRETED = interpreter_on()


# ----------------------------------------------------------------------------------------------
# Launch plan: layer_norm_config (the tables, plan())
# ----------------------------------------------------------------------------------------------

def _cluster_kernels():
    """fused_kernels.ops.norm_smem, the cluster launchers (a name tests replace): imported on a first cluster
    launch, since no plan picks a cluster under the CPU interpreter, which has no Gluon."""
    from fused_kernels.ops import norm_smem

    return norm_smem


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    n_rows, n_cols, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr, EXACT_BF16: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Tiles of ROWS rows; program p takes tiles p, p + P, p + 2P, ...
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if not CHUNKED:
        col_mask = cols < n_cols
        # parameters first: their (L2) latency overlaps x's (DRAM) latency
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / n_cols
            d = tl.where(mask, x - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(d * d, axis=1) / n_cols + eps)
            y = d * rstd[:, None]
            if HAS_WEIGHT:
                y = y * w[None, :]
            if HAS_BIAS:
                y = y + b[None, :]
            tl.store(Y + rows64[:, None] * stride_y + cols[None, :], for_store(y, Y.dtype.element_ty, EXACT_BF16),
                     mask=mask)
            tl.store(MEAN + rows, mean, mask=row_mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            x_rows = X + rows64[:, None] * stride_x
            y_rows = Y + rows64[:, None] * stride_y
            # first sweep: each chunk's mean and centred sum of squares, merged into the row's
            mean = tl.zeros([ROWS], tl.float32)
            m2 = tl.zeros([ROWS], tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                n_a = start * 1.0
                n_b = tl.minimum(n_cols - start, BLOCK_N) * 1.0
                mean_b = tl.sum(x, axis=1) / n_b
                d = tl.where(mask, x - mean_b[:, None], 0.0)
                m2_b = tl.sum(d * d, axis=1)
                delta = mean_b - mean
                n = n_a + n_b
                mean = mean + delta * (n_b / n)
                m2 = m2 + m2_b + delta * delta * (n_a * n_b / n)
            rstd = tl.rsqrt(m2 / n_cols + eps)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                col_mask = c < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                y = (x - mean[:, None]) * rstd[:, None]
                if HAS_WEIGHT:
                    y = y * tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                if HAS_BIAS:
                    y = y + tl.load(B + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_rows + c[None, :], for_store(y, Y.dtype.element_ty, EXACT_BF16), mask=mask)
            tl.store(MEAN + rows, mean, mask=row_mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _grad_chunk(x_rows, dy_rows, W, c, mask, col_mask, mean, rstd, HAS_WEIGHT: tl.constexpr, EVICT: tl.constexpr):
    # One column chunk of the backward's terms, in fp32: dy, xhat = (x - mean)·rstd (0 off the mask) and
    # g = dy·w (dy without a weight). EVICT: "evict_last" on the first sweep keeps x and dy in L2 for the second.
    x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    dy = tl.load(dy_rows + c[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return dy, xhat, g


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols, stride_dy, stride_x, stride_dx,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr, EXACT_BF16: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Persistent: program p takes tiles p, p + P, ... and sums its rows' dy·xhat and dy into the fp32
    # partial rows DW_PARTIAL[p, :] and DB_PARTIAL[p, :]; _partial_sum_kernel adds the P rows up.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    db_row = DB_PARTIAL + pid.to(tl.int64) * n_cols
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        db_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            g = dy
            if HAS_WEIGHT:
                g = dy * w[None, :]
            mean_g = tl.sum(g, axis=1) / n_cols
            mean_gx = tl.sum(g * xhat, axis=1) / n_cols
            dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], for_store(dx, DX.dtype.element_ty, EXACT_BF16),
                     mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * xhat
            if COMPUTE_DB:
                db_acc += dy
        if COMPUTE_DW:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # first sweep: the row sums of g and g·xhat; second (x, dy from L2): dx, and dw/db added to the
        # program's partial rows in memory (stored on its first tile, read back and added to after)
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            x_rows = X + rows64[:, None] * stride_x
            dy_rows = DY + rows64[:, None] * stride_dy
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            sum_g = tl.zeros([ROWS, BLOCK_N], tl.float32)
            sum_gx = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                col_mask = c < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                dy, xhat, g = _grad_chunk(x_rows, dy_rows, W, c, mask, col_mask, mean, rstd, HAS_WEIGHT, "evict_last")
                sum_g += g
                sum_gx += g * xhat
            mean_g = tl.sum(sum_g, axis=1) / n_cols
            mean_gx = tl.sum(sum_gx, axis=1) / n_cols
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                col_mask = c < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                dy, xhat, g = _grad_chunk(x_rows, dy_rows, W, c, mask, col_mask, mean, rstd, HAS_WEIGHT, "evict_first")
                dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
                tl.store(DX + rows64[:, None] * stride_dx + c[None, :], for_store(dx, DX.dtype.element_ty, EXACT_BF16),
                         mask=mask)
                not_first = (c * 0 + tile) != pid  # elementwise: a scalar mask fails in the interpreter
                if COMPUTE_DW:
                    earlier = tl.load(dw_row + c, mask=col_mask & not_first, other=0.0)
                    tl.store(dw_row + c, earlier + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if COMPUTE_DB:
                    earlier = tl.load(db_row + c, mask=col_mask & not_first, other=0.0)
                    tl.store(db_row + c, earlier + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _param_grad_kernel(DY, X, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, stride_dy, stride_x, rows_per_group,
                       COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Program (column block j, row group g): DW_PARTIAL[g, cols] = Σ_rows of g dy·xhat, DB_PARTIAL alike,
    # accumulated in registers over BLOCK_M rows a load; _partial_sum_kernel adds the groups up.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    col_mask = cols < n_cols
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, n_rows)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in tl.range(first, last, BLOCK_M, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < last
        rows64 = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if COMPUTE_DW:
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            dw_acc += dy * tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if COMPUTE_DB:
            db_acc += dy
    out = group.to(tl.int64) * n_cols + cols
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + out, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + out, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _partial_sum_kernel(DW_PARTIAL, DB_PARTIAL, DW, DB, n_parts, n_cols,
                        COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, BLOCK_N: tl.constexpr,
                        PARTS: tl.constexpr):
    # DW[cols] = Σ_p DW_PARTIAL[p, cols] in fp32, then cast (DB alike), one column block per program.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw = tl.zeros([PARTS, BLOCK_N], tl.float32)
    db = tl.zeros([PARTS, BLOCK_N], tl.float32)
    for first in range(0, n_parts, PARTS):
        parts = first + tl.arange(0, PARTS)
        offs = parts.to(tl.int64)[:, None] * n_cols + cols[None, :]
        mask = (parts[:, None] < n_parts) & col_mask[None, :]
        if COMPUTE_DW:
            dw += tl.load(DW_PARTIAL + offs, mask=mask, other=0.0)
        if COMPUTE_DB:
            db += tl.load(DB_PARTIAL + offs, mask=mask, other=0.0)
    if COMPUTE_DW:
        tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)




# ----------------------------------------------------------------------------------------------
# Host side (one implementation, called by the custom ops and by the eager autograd.Function)
# ----------------------------------------------------------------------------------------------

@launches_on_device_of(0)  # x
def _forward_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y like x, mean and rstd fp32 of shape x.shape[:-1]."""
    device = x.device
    y = _new_output(x.shape, x.dtype, device)
    mean = _new_output(x.shape[:-1], torch.float32, device)
    rstd = _new_output(x.shape[:-1], torch.float32, device)
    x2 = _rows_view(x)
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return y, mean, rstd
    count_launch("layer_norm_fwd")
    cfg = plan(Call(n_rows, n_cols, x2.dtype, "forward"), device_facts(device)).config
    launch(_layer_norm_fwd_kernel, (cfg.fwd_programs,),
           (x2, x2 if weight is None else weight, x2 if bias is None else bias, y, mean, rstd,
            n_rows, n_cols, _row_stride(x2), n_cols, eps),
           dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_N=cfg.fwd_block, ROWS=cfg.fwd_rows,
                CHUNKED=cfg.fwd_chunked, EXACT_BF16=_INTERPRETED, NUM_STAGES=cfg.fwd_stages, num_warps=cfg.fwd_warps))
    return y, mean, rstd


@launches_on_device_of(1)  # x
def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   mean: torch.Tensor, rstd: torch.Tensor, compute_dw: bool, compute_db: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db): dw / db in the parameter's shape and dtype, or empty when not computed. One backward
    launch, plus one _partial_sum_kernel launch when dw or db is wanted."""
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    device = x.device
    dx = _new_output(x.shape, x.dtype, device)
    x2 = _rows_view(x)
    dy2 = _rows_view(dy)
    n_rows, n_cols = x2.shape
    def empty():  # one per unused output: custom-op outputs may not alias each other
        return x.new_empty(0, dtype=torch.float32)

    if n_rows == 0:
        return (dx, torch.zeros_like(weight) if compute_dw else empty(),
                torch.zeros_like(bias) if compute_db else empty())
    count_launch("layer_norm_bwd")
    mean, rstd = mean.contiguous().reshape(-1), rstd.contiguous().reshape(-1)
    facts = device_facts(device)
    # alignment only matters (and is only looked at) for the lengths the cluster backward takes
    aligned = cluster_shape(n_cols) is not None and _gpu.aligned_rows(x2, dy2) and _gpu.aligned_weight(weight)

    def plan_now() -> Plan:
        return plan(Call(n_rows, n_cols, x2.dtype, "backward", weight_dtype=None if weight is None else weight.dtype,
                         dy_dtype=dy2.dtype, aligned=aligned, deterministic=torch.are_deterministic_algorithms_enabled()),
                    facts)

    p = plan_now()
    if p.path == Path.CLUSTER_BACKWARD:
        launch_cfg = p.config.bwd_cluster
        programs = launch_cfg.clusters
        dw_partial = _new_output((programs, n_cols) if compute_dw else (1, 1), torch.float32, device)
        db_partial = _new_output((programs, n_cols) if compute_db else (1, 1), torch.float32, device)
        key = (n_cols, x2.dtype, launch_cfg.shape, weight is not None, compute_dw, compute_db)
        if _dispatch.run_path(BWD_OP, Path.CLUSTER, key, lambda: _cluster_kernels().launch_layer_norm_backward(
                dy2, x2, weight, mean, rstd, dx, dw_partial, db_partial, shape=launch_cfg.shape, grid=programs,
                compute_dw=compute_dw, compute_db=compute_db), instead="the Triton backward"):
            return (dx,) + _sum_partial_rows(dw_partial, db_partial, programs, weight, bias, compute_dw, compute_db)
        p = _dispatch.planned_again("layer_norm", Path.CLUSTER_BACKWARD, plan_now())
    cfg = p.config
    separate = cfg.param_grid is not None and (compute_dw or compute_db)
    programs = cfg.param_grid[3] if separate else cfg.bwd_programs  # partial rows of dw / db
    dw_partial = _new_output((programs, n_cols) if compute_dw else (1, 1), torch.float32, device)
    db_partial = _new_output((programs, n_cols) if compute_db else (1, 1), torch.float32, device)
    launch(_layer_norm_bwd_kernel, (cfg.bwd_programs,),
           (dy2, x2, x2 if weight is None else weight, mean, rstd,
            dx, dw_partial, db_partial, n_rows, n_cols, _row_stride(dy2), _row_stride(x2), n_cols),
           dict(HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw and not separate,
                COMPUTE_DB=compute_db and not separate, BLOCK_N=cfg.bwd_block,
                ROWS=cfg.bwd_rows, CHUNKED=cfg.bwd_chunked, EXACT_BF16=_INTERPRETED, NUM_STAGES=cfg.bwd_stages,
                num_warps=cfg.bwd_warps))
    if separate:
        rows_per_load, block_n, warps, groups = cfg.param_grid
        launch(_param_grad_kernel, (cdiv(n_cols, block_n), groups),
               (dy2, x2, mean, rstd, dw_partial, db_partial, n_rows, n_cols, _row_stride(dy2), _row_stride(x2),
                cdiv(n_rows, groups)),
               dict(COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, BLOCK_M=rows_per_load, BLOCK_N=block_n,
                    NUM_STAGES=1 if _INTERPRETED else _STAGES, num_warps=warps))
    return (dx,) + _sum_partial_rows(dw_partial, db_partial, programs, weight, bias, compute_dw, compute_db)


def _sum_partial_rows(dw_partial: torch.Tensor, db_partial: torch.Tensor, programs: int,
                      weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], compute_dw: bool,
                      compute_db: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dw, db) from the backward's fp32 partial rows (`programs` of each), one _partial_sum_kernel launch;
    an empty tensor for one not computed."""
    n_cols, device = (dw_partial if compute_dw else db_partial).shape[1], dw_partial.device
    dw = _new_output(weight.shape, weight.dtype, device) if compute_dw else dw_partial.new_empty(0)
    db = _new_output(bias.shape, bias.dtype, device) if compute_db else db_partial.new_empty(0)
    if compute_dw or compute_db:
        block_n, parts, num_warps = _SUM_SHAPE
        launch(_partial_sum_kernel, (cdiv(n_cols, block_n),),
               (dw_partial, db_partial, dw if compute_dw else dw_partial, db if compute_db else db_partial,
                programs, n_cols),
               dict(COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, BLOCK_N=block_n, PARTS=parts, num_warps=num_warps))
    return dw, db


# ----------------------------------------------------------------------------------------------
# Custom ops: what torch.compile traces (fake implementations give shapes without running Triton)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_kernels::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, mean, rstd): y like x; mean and rstd in fp32, one per row."""
    return _forward_impl(x, weight, bias, eps)


@_layer_norm_fwd.register_fake
def _layer_norm_fwd_fake(x, weight, bias, eps):
    stats = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


@torch.library.custom_op("fused_kernels::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    mean: torch.Tensor, rstd: torch.Tensor, compute_dw: bool, compute_db: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dw, db); dw / db are empty fp32 tensors when not computed. `bias` is read for its
    shape and dtype only."""
    return _backward_impl(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)


@_layer_norm_bwd.register_fake
def _layer_norm_bwd_fake(dy, x, weight, bias, mean, rstd, compute_dw, compute_db):
    dw = weight.new_empty(weight.shape) if compute_dw and weight is not None else x.new_empty(0, dtype=torch.float32)
    db = bias.new_empty(bias.shape) if compute_db and bias is not None else x.new_empty(0, dtype=torch.float32)
    return x.new_empty(x.shape), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:  # only mean / rstd were used downstream; they carry no gradient
        dy = torch.zeros_like(x)
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.fused_kernels.layer_norm_bwd(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)
    return (dx if ctx.needs_input_grad[0] else None, dw if compute_dw else None, db if compute_db else None, None)


_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _LayerNormFunction(torch.autograd.Function):
    """Eager autograd: the same launches without the custom-op dispatch (tens of µs of Python a call)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward_impl(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        compute_dw = weight is not None and ctx.needs_input_grad[1]
        compute_db = bias is not None and ctx.needs_input_grad[2]
        dx, dw, db = _backward_impl(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)
        return dx if ctx.needs_input_grad[0] else None, dw if compute_dw else None, db if compute_db else None, None


# ----------------------------------------------------------------------------------------------
# Functional entry
# ----------------------------------------------------------------------------------------------

def _check_param(name: str, p: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if p is None:
        return
    check_float(name, p)
    if p.dim() != 1 or p.shape[0] != x.shape[-1]:
        raise ValueError(f"{name} must have shape (x.shape[-1],) = ({x.shape[-1]},); got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}; got {p.device}")


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of `x`, as `torch.nn.functional.layer_norm(x, (x.shape[-1],),
    weight, bias, eps)`; differentiable in x, weight and bias.

    x: float32/bfloat16/float16, any leading shape (zero rows allowed), any strides.
    weight, bias: shape (x.shape[-1],) float tensors on x's device (their dtype may differ from x's:
        the gradients come back in it), or None.
    The output has x's dtype; mean, variance and the affine step are computed in fp32 with one final
    rounding. Eager calls run a torch.autograd.Function; under torch.compile the custom op
    fused_kernels::layer_norm_fwd is traced instead. Both launch the same kernels.
    """
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (the normalised size); got shape {tuple(x.shape)}")
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)
    if (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite float >= 0; got {eps!r}")
    if not (x.is_cuda or (x.device.type == "cpu" and interpreter_on())):
        raise RuntimeError(
            f"layer_norm runs Triton kernels: x must be on a CUDA device, or on the CPU with TRITON_INTERPRET=1 "
            f"set before triton is imported (interpreter on: {interpreter_on()}); got device {x.device}"
        )
    eps = float(eps)
    if torch.compiler.is_compiling():
        return torch.ops.fused_kernels.layer_norm_fwd(x, weight, bias, eps)[0]
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in (weight, bias))):
        return _LayerNormFunction.apply(x, weight, bias, eps)
    return _forward_impl(x, weight, bias, eps)[0]
