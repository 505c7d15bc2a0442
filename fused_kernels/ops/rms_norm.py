"""RMSNorm: forward and backward in Triton, with the casting semantics of the transformers modules.

Math (per row of length N, r = rstd):
    r      = 1 / sqrt(mean(x²) + eps)            in fp32
    xhat   = x · r
    w_eff  = offset + weight                     (weight None: y = xhat, offset is not used)

    casting "llama"  (LlamaRMSNorm):  y = w_eff · round_x(xhat)
        round_x(·) rounds to x.dtype; w_eff is computed in weight.dtype (torch adds `offset + weight`
        there); y has dtype torch.promote_types(weight.dtype, x.dtype), as torch's multiply gives.
    casting "gemma"  (GemmaRMSNorm):  y = round_x(xhat · (offset + float(weight)))   all in fp32
    casting "none":                    y = round_x(xhat · (offset + float(weight)))   all in fp32
        "none" has no intermediate cast at all: the one rounding is the final cast to x.dtype
        (numerically the same formula as "gemma"; it exists so that callers can name the intent).

Backward (g = dL/dxhat, c = mean over the row of g · xhat):
    g  = dy · w_eff        ("llama": rounded to x.dtype, as autograd hands the grad of round_x(xhat)
                            back in x.dtype; otherwise fp32)
    dx = r · (g − xhat · c)
    dw = Σ_rows dy · h     (h = round_x(xhat) for "llama", xhat otherwise), accumulated in fp32

Saved for backward: x (the input itself, no copy) and r (fp32, one per row). With keep="output" (the
autopatch rule's choice) y instead of x: the backward then takes xhat = y / w_eff, which is round_x(xhat)
up to one rounding of y (2^-8 relative in bf16, 2^-23 in fp32) — the same information for dw, and for
dx an error of the order of the output's own rounding. A Linear after the norm saves y anyway, so x's
memory is freed (per decoder layer, two hidden-sized activations).

Bytes moved (rows × N elements of B bytes): forward reads x, writes y (2·rows·N·B, plus rows·4 for r);
backward reads x and dy, writes dx (3·rows·N·B), plus one fp32 partial row of dw per persistent program
(programs × N × 4 bytes, written once, then summed and cast by _dw_sum_kernel). 16384×4096 bf16: 256 MiB
forward+backward.

Which implementation runs is decided in one place, `plan(call, device)` in
fused_kernels/ops/rms_norm_config.py (with every table and threshold it uses); it returns a `fused_kernels._dispatch.Plan` whose `path` is one of:
  "cluster"  fused_kernels/norm_smem.py (Gluon, H100/H200): each row split over a thread-block
             cluster and held in shared memory, so x and dy are read from HBM once. Backward: rows of
             16384, 24576, 32768, 49152 or 65536 16-bit columns with a weight, from the input; forward:
             rows of 65536 (where the Triton forward sweeps each row twice). A first build that fails
             turns it off for the process (`_dispatch.run_path`) and the call is planned again.
  "split"    backward rows longer than SPLIT_BACKWARD_FROM (16 K), split across programs
             (SplitBackwardConfig): the row sums of g·xhat by column block, then dx and dw by row group
             and column block; x and dy are read twice from HBM (5 passes where the floor counts 3),
             but every SM works however few the rows.
  "triton"   one kernel. Rows up to the table's last entry are held whole in registers (x read once
             per kernel); longer rows are swept twice in column chunks, the second sweep reading from L2.

Launch shapes of the one-kernel path. On a GPU, triton.autotune picks among `candidate_configs`: rows
per tile, warps, single pass vs chunked, and (forward) one program per tile vs a persistent grid;
persistent grids (the backward always) get their tile loop software-pipelined by Triton (num_stages:
later tiles' loads in flight through shared memory while this one computes and stores) and as many
programs per SM as surely fit. The key is the row length, the casting mode, the dtypes and the row
count's power-of-two bucket; the first call per key times the candidates (about a second), later calls
launch the winner directly. Under the CPU interpreter the small tables _FWD_TABLE/_BWD_TABLE/_FWD_LONG/
_BWD_LONG (rms_norm_config) give one config per row length (`heuristic_config`); plan() says which applies.

Entry points: eager calls go through a torch.autograd.Function (a few µs of Python), torch.compile traces
the custom ops fused_kernels::rms_norm_fwd / rms_norm_bwd; both run `_forward_impl` / `_backward_impl`,
which execute plan()'s choice. "none" casting: see above; weight None: y = x·r in x.dtype, no dw.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from fused_kernels import _dispatch, _gpu
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts, device_facts
from fused_kernels._jit import for_store, rounded
from fused_kernels._ints import cdiv, next_pow2
from fused_kernels._launch import launch
from fused_kernels._utils import new_output as _new_output, row_stride as _row_stride, rows_view as _rows_view
from fused_kernels._utils import check_choice, check_float, count_launch, interpreter_on, launches_on_device_of
from fused_kernels.ops.rms_norm_config import (OP_NAMES, SM90, Call, LaunchConfig, SplitBackwardConfig,
                                               _MAX_PROGRAMS_PER_SM, _programs, _prune, _row_bucket, backward_programs,
                                               candidate_configs, cluster_shape, dw_sum_config, plan)

CASTING_MODES = ("llama", "gemma", "none")
_KEEP = ("input", "output")
# How triton.jit built the kernels below (it reads TRITON_INTERPRET once, when triton is imported).
_INTERPRETED = interpreter_on()
_CASTING_ID = {"llama": 0, "gemma": 1, "none": 2}


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _effective_weight(W, cols, col_mask, offset, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      EXACT_BF16: tl.constexpr):
    """offset + weight as fp32 values; "llama" rounds the sum to weight.dtype first, as torch does."""
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        if CASTING == 0:
            w = rounded(w, W.dtype.element_ty, EXACT_BF16)
    else:
        w = tl.full(cols.shape, 1.0, tl.float32)
    return w


@triton.jit
def _normalised_output(x, rstd, w_eff, X, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                       EXACT_BF16: tl.constexpr):
    """y (fp32 values, stored by the caller in y's dtype) from a [ROWS, BLOCK] tile of x."""
    xhat = x * rstd[:, None]
    if HAS_WEIGHT:
        if CASTING == 0:
            xhat = rounded(xhat, X.dtype.element_ty, EXACT_BF16)
        xhat = xhat * w_eff[None, :]
    return xhat


@triton.jit(do_not_specialize=["row_bucket"])
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    n_rows, n_cols, stride_x, stride_y,
    eps, offset,
    row_bucket,  # not read: part of the autotuning key only (see _row_bucket)
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SINGLE_PASS: tl.constexpr, EXACT_BF16: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # not read: 0 = one tile per program, else sizes a persistent grid
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the tile loop (1: none)
    L2_CAP: tl.constexpr = True,  # not read: a LaunchConfig field of the backward's grid (shared meta)
):
    # Tiles of ROWS rows; program p takes tiles p, p + P, p + 2P, ... (P programs: one per tile, or a
    # persistent grid whose loop Triton pipelines, loading later tiles while this one is stored).
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        col_mask = cols < n_cols
        # The weight is loaded before x, so that its (L2) latency overlaps x's (DRAM) latency; loaded
        # after the row's reduction, it added a second round trip to every program (sm_90a SASS).
        w_eff = _effective_weight(W, cols, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
        for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            y = _normalised_output(x, rstd, w_eff, X, CASTING, HAS_WEIGHT, EXACT_BF16)
            tl.store(Y + rows64[:, None] * stride_y + cols[None, :], for_store(y, Y.dtype.element_ty, EXACT_BF16),
                     mask=mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        # Long rows: sum of squares over column chunks, then a second sweep that re-reads x
        # (kept in L2 by the first sweep's eviction hint) to write y.
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            x_rows = X + rows.to(tl.int64)[:, None] * stride_x
            y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
            sq = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
                x = x.to(tl.float32)
                sq += x * x
            rstd = tl.rsqrt(tl.sum(sq, axis=1) / n_cols + eps)
            for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
                c = start + cols
                col_mask = c < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
                x = x.to(tl.float32)
                w_eff = _effective_weight(W, c, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
                y = _normalised_output(x, rstd, w_eff, X, CASTING, HAS_WEIGHT, EXACT_BF16)
                tl.store(y_rows + c[None, :], for_store(y, Y.dtype.element_ty, EXACT_BF16), mask=mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _grad_terms(x, dy, rstd, w_eff, X, CASTING: tl.constexpr, EXACT_BF16: tl.constexpr,
                FROM_OUTPUT: tl.constexpr = False):
    """(xhat, g = dL/dxhat, h = what dw multiplies dy by) for a tile, following the casting mode.
    FROM_OUTPUT: `x` holds the forward's output y instead, and xhat = y / w_eff (0 where w_eff is 0;
    the host saves y only for weights without zeros)."""
    if FROM_OUTPUT:
        inv_w = tl.where(w_eff != 0.0, 1.0 / tl.where(w_eff != 0.0, w_eff, 1.0), 0.0)  # once per column
        xhat = x * inv_w[None, :]
    else:
        xhat = x * rstd[:, None]
    g = dy * w_eff[None, :]
    h = xhat
    if CASTING == 0:
        # autograd hands the gradient of round_x(xhat) back in x.dtype; dw sees the rounded xhat.
        g = rounded(g, X.dtype.element_ty, EXACT_BF16)
        h = rounded(xhat, X.dtype.element_ty, EXACT_BF16)
    return xhat, g, h


@triton.jit(do_not_specialize=["row_bucket"])
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, stride_dy, stride_x, stride_dx,
    offset,
    row_bucket,  # not read: part of the autotuning key only (see _row_bucket)
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SINGLE_PASS: tl.constexpr, EXACT_BF16: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # not read: sizes the persistent grid (see _backward_impl)
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the tile loop (1: none)
    FROM_OUTPUT: tl.constexpr = False,  # X holds the forward's output y (see _grad_terms)
    L2_CAP: tl.constexpr = True,  # not read: whether the persistent grid was capped by the L2 budget
):
    # Persistent: program p takes tiles p, p + P, p + 2P, ... and sums its rows' dy·h into one
    # fp32 partial row DW_PARTIAL[p, :]; the host sums the P partial rows afterwards.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    partial_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    if SINGLE_PASS:
        col_mask = cols < n_cols
        w_eff = _effective_weight(W, cols, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        # Triton pipelines this loop (NUM_STAGES - 1 tiles of x and dy in flight through shared
        # memory, cp.async on sm_80+), which costs fewer registers than prefetching into registers.
        for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            xhat, g, h = _grad_terms(x, dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = rstd[:, None] * (g - xhat * c[:, None])
            dx = for_store(dx, DX.dtype.element_ty, EXACT_BF16)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx, mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * h
        if COMPUTE_DW:
            tl.store(partial_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # Long rows: one sweep for c = mean(g·xhat), a second (x, dy re-read from L2) for dx and dw;
        # the partial dw row lives in memory: stored on the program's first tile, added to after.
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            x_rows = X + rows64[:, None] * stride_x
            dy_rows = DY + rows64[:, None] * stride_dy
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
                c_idx = start + cols
                col_mask = c_idx < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + c_idx[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
                dy = tl.load(dy_rows + c_idx[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
                w_eff = _effective_weight(W, c_idx, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
                xhat, g, h = _grad_terms(x.to(tl.float32), dy.to(tl.float32), rstd, w_eff, DX, CASTING, EXACT_BF16,
                                         FROM_OUTPUT)
                acc += g * xhat
            c = tl.sum(acc, axis=1) / n_cols
            for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
                c_idx = start + cols
                col_mask = c_idx < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + c_idx[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
                dy = tl.load(dy_rows + c_idx[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
                dy = dy.to(tl.float32)
                w_eff = _effective_weight(W, c_idx, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
                xhat, g, h = _grad_terms(x.to(tl.float32), dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
                dx = rstd[:, None] * (g - xhat * c[:, None])
                dx = for_store(dx, DX.dtype.element_ty, EXACT_BF16)
                tl.store(DX + rows64[:, None] * stride_dx + c_idx[None, :], dx, mask=mask)
                if COMPUTE_DW:
                    not_first = (c_idx * 0 + tile) != pid  # elementwise: a scalar mask fails in the interpreter
                    earlier = tl.load(partial_row + c_idx, mask=col_mask & not_first, other=0.0)
                    tl.store(partial_row + c_idx, earlier + tl.sum(dy * h, axis=0), mask=col_mask)


@triton.jit
def _rms_norm_bwd_rowdot_kernel(
    DY, X, W, RSTD, DOT,
    n_cols, stride_dy, stride_x, offset, n_dot_blocks,
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_BF16: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
):
    # Split backward, first kernel: program (row, b) writes DOT[row, b] = Σ g·xhat over the b-th
    # block of BLOCK_N columns (see _grad_terms; X may hold y, as in _rms_norm_bwd_kernel).
    rows64 = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w_eff = _effective_weight(W, cols, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=col_mask[None, :], other=0.0)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=col_mask[None, :], other=0.0)
    xhat, g, _h = _grad_terms(x.to(tl.float32), dy.to(tl.float32), tl.load(RSTD + rows64), w_eff, X, CASTING,
                              EXACT_BF16, FROM_OUTPUT)
    tl.store(DOT + rows64 * n_dot_blocks + block, tl.sum(g * xhat, axis=1))


@triton.jit
def _rms_norm_bwd_split_kernel(
    DY, X, W, RSTD, DOT, DX, DW_PARTIAL,
    n_rows, n_cols, stride_dy, stride_x, stride_dx, offset, n_dot_blocks, rows_per_group,
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_BLOCKS: tl.constexpr, NUM_STAGES: tl.constexpr, EXACT_BF16: tl.constexpr, FROM_OUTPUT: tl.constexpr,
):
    # Split backward, second kernel: program (group, b) takes rows_per_group rows in BLOCK_N columns:
    # c = Σ_b DOT[row, b] / n_cols, dx for its columns, and Σ over its rows of dy·h into
    # DW_PARTIAL[group, its columns] (the host sums the groups' partial rows).
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dots = tl.arange(0, DOT_BLOCKS)
    w_eff = _effective_weight(W, cols, col_mask, offset, CASTING, HAS_WEIGHT, EXACT_BF16)
    dw_acc = tl.zeros([1, BLOCK_N], tl.float32)
    first = group * rows_per_group
    for r in tl.range(first, tl.minimum(first + rows_per_group, n_rows), num_stages=NUM_STAGES):
        rows64 = (r + tl.arange(0, 1)).to(tl.int64)
        dot = tl.load(DOT + rows64[:, None] * n_dot_blocks + dots[None, :], mask=(dots < n_dot_blocks)[None, :],
                      other=0.0)
        c = tl.sum(dot, axis=1) / n_cols
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=col_mask[None, :], other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows64)
        xhat, g, h = _grad_terms(x.to(tl.float32), dy, rstd, w_eff, DX, CASTING, EXACT_BF16, FROM_OUTPUT)
        dx = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], for_store(dx, DX.dtype.element_ty, EXACT_BF16),
                 mask=col_mask[None, :])
        if COMPUTE_DW:
            dw_acc += dy * h
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + group.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)




@triton.jit
def _dw_sum_kernel(PARTIAL, DW, n_parts, n_cols, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    # DW[cols] = Σ_p PARTIAL[p, cols] in fp32 (PARTS rows per load, summed across at the end), then cast.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([PARTS, BLOCK_N], tl.float32)
    for first in range(0, n_parts, PARTS):
        parts = first + tl.arange(0, PARTS)
        acc += tl.load(PARTIAL + parts.to(tl.int64)[:, None] * n_cols + cols[None, :],
                       mask=(parts[:, None] < n_parts) & col_mask[None, :], other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


def _sum_partial_rows(partial: torch.Tensor, n_parts: int, weight: torch.Tensor) -> torch.Tensor:
    """dw (weight's shape and dtype) from the first n_parts fp32 partial rows."""
    n_cols = partial.shape[1]
    dw = _new_output(weight.shape, weight.dtype, weight.device)
    block_n, parts, num_warps = dw_sum_config(n_cols)
    launch(_dw_sum_kernel, (cdiv(n_cols, block_n),), (partial, dw, n_parts, n_cols),
           dict(BLOCK_N=block_n, PARTS=parts, num_warps=num_warps))
    return dw


# ----------------------------------------------------------------------------------------------
# Autotuned launchers (GPU). The kernels write only their outputs (y, rstd; dx and the dw partial
# rows, each stored before it is read back), so the autotuner's benchmark runs cannot corrupt them:
# no reset_to_zero / restore_value needed.
# ----------------------------------------------------------------------------------------------

_BUILT_FOR: set = set()  # the DeviceFacts _tuned has built autotuners for


@functools.lru_cache(maxsize=None)
def _tuned(backward: bool, device: DeviceFacts):
    """The autotuned kernel of one direction for one GPU: its candidates and shared-memory limit from
    that GPU's facts, built on its first launch there."""
    _BUILT_FOR.add(device)
    key = ["n_cols", "row_bucket", "CASTING", "HAS_WEIGHT"] + (["COMPUTE_DW", "FROM_OUTPUT"] if backward else [])
    return triton.autotune(
        configs=[triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages)
                 for c in candidate_configs(backward, device)],
        key=key,  # the dtypes of the tensor arguments are part of every autotuning key
        prune_configs_by={"early_config_prune": functools.partial(_prune, device=device)},
    )(_rms_norm_bwd_kernel if backward else _rms_norm_fwd_kernel)


def _tuner_facts(device: DeviceFacts) -> DeviceFacts:
    """Whose candidates a launch is tuned among: its GPU's; off the GPU (the CPU interpreter, where only
    tests force this path) the reference GPU's, SM90."""
    return device if device.cuda else SM90


# The reference GPU's autotuners, built now (tests replace their benchmark); other GPUs' on first use.
_rms_norm_fwd_tuned = _tuned(False, SM90)
_rms_norm_bwd_tuned = _tuned(True, SM90)
_LATEST: dict = {}  # direction ("fwd", "bwd") -> the autotuner that tuned last (autotuned_config)


# What the autotuners chose, by a key holding everything theirs holds (the key arguments and the tensor
# dtypes): later launches with that key go straight to the kernel with the chosen meta-parameters,
# skipping triton.autotune's per-call Python (tens of µs: it rebuilds its key from every argument).
_CHOSEN: dict = {}


# Tuning runs one at a time: an Autotuner keeps per-call state on itself, and the backward runs in
# autograd's device thread while another thread may be in a forward.
_TUNING_LOCK = threading.Lock()


def _launch_tuned(backward: bool, device: DeviceFacts, kernel, key: tuple, grid, args: tuple, kwargs: dict) -> None:
    device = _tuner_facts(device)
    key = (device, *key)
    meta = _CHOSEN.get(key)
    if meta is None:
        tuned = _tuned(backward, device)
        with _TUNING_LOCK:
            tuned[grid](*args, **kwargs)
            _CHOSEN[key] = tuned.best_config.all_kwargs()
            _LATEST["bwd" if backward else "fwd"] = tuned
    else:
        merged = {**kwargs, **meta}
        launch(kernel, grid(merged), args, merged)


def reset_autotuning() -> None:
    """Forget every autotuning result: the next launch of each shape class tunes again."""
    _CHOSEN.clear()
    _LATEST.clear()
    for backward in (False, True):
        for device in _BUILT_FOR:
            _tuned(backward, device).cache.clear()


def autotuned_config(backward: bool) -> Optional[triton.Config]:
    """The config the autotuner chose in its latest tuning (None before the first one)."""
    return getattr(_LATEST.get("bwd" if backward else "fwd"), "best_config", None)


# ----------------------------------------------------------------------------------------------
# Host side: shapes, dtypes, launches (one implementation, called by the custom ops and by the
# eager autograd.Function alike)
# ----------------------------------------------------------------------------------------------

def output_dtype(x_dtype: torch.dtype, weight_dtype: Optional[torch.dtype], casting_mode: str) -> torch.dtype:
    """y's dtype: "llama" multiplies in torch, so promote(weight, x); the others cast to x.dtype."""
    if casting_mode == "llama" and weight_dtype is not None:
        return torch.promote_types(weight_dtype, x_dtype)
    return x_dtype


@launches_on_device_of(0)  # x
def _forward_impl(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y like x in the output dtype, rstd = 1/sqrt(mean(x²)+eps) in fp32, shape x.shape[:-1].
    Runs plan()'s path."""
    out_dtype = output_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    device = x.device
    y = _new_output(x.shape, out_dtype, device)
    rstd = _new_output(x.shape[:-1], torch.float32, device)
    x2 = _rows_view(x)
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return y, rstd
    count_launch("rms_norm_fwd")
    facts = device_facts(device)
    y2 = y.view(n_rows, n_cols)
    # alignment only matters (and is only looked at) for the lengths the cluster kernels take
    aligned = cluster_shape(n_cols, False) is not None and _gpu.aligned_rows(x2, y2) and _gpu.aligned_weight(weight)

    def plan_now() -> Plan:
        return plan(Call(n_rows, n_cols, x.dtype, None if weight is None else weight.dtype, "forward",
                         aligned=aligned), facts)

    p = plan_now()
    if p.path == Path.CLUSTER:
        cfg, kernels = p.config, _cluster_kernels()
        key = (n_cols, x2.dtype, y2.dtype, cfg.shape, casting_mode, offset != 0.0, weight is not None)
        if _dispatch.run_path(OP_NAMES["forward"], "cluster", key, lambda: kernels.launch_forward(
                x2, weight, y2, rstd.view(n_rows), shape=cfg.shape, grid=cfg.clusters, eps=eps, offset=offset,
                casting_id=_CASTING_ID[casting_mode]), instead="the Triton forward"):
            return y, rstd
        p = _dispatch.planned_again("rms_norm", "cluster", plan_now())
    args = (
        x2, x2 if weight is None else weight, y, rstd,
        n_rows, n_cols, _row_stride(x2), n_cols,
        eps, offset, _row_bucket(n_rows),
    )
    flags = dict(CASTING=_CASTING_ID[casting_mode], HAS_WEIGHT=weight is not None)
    cfg = p.config
    if cfg is None:
        sm_count = facts.sm_count

        def grid(meta):
            return (_programs(meta["ROWS"], meta["PROGRAMS_PER_SM"], False, n_rows, n_cols, 0, sm_count),)

        key = ("fwd", n_cols, args[-1], flags["CASTING"], flags["HAS_WEIGHT"], x.dtype, args[1].dtype, out_dtype)
        _launch_tuned(False, facts, _rms_norm_fwd_kernel, key, grid, args, dict(flags, EXACT_BF16=False))
    else:
        programs = _programs(cfg.rows, cfg.programs_per_sm, False, n_rows, n_cols, 0, facts.sm_count)
        launch(_rms_norm_fwd_kernel, (programs,), args,
               dict(flags, EXACT_BF16=_INTERPRETED, **cfg.meta(), num_warps=cfg.num_warps))
    return y, rstd


@launches_on_device_of(1)  # x
def _backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    compute_dw: bool,
    from_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw). dw has weight's shape and dtype, or is empty when weight is None or compute_dw is
    False. Runs plan()'s path: one kernel launch ("cluster", "triton") or two ("split"), plus
    _dw_sum_kernel's sum over the dw partial rows; nothing else touches full-size tensors.
    from_output: `x` is the forward's output y (of x's dtype), from which the kernels recover
    xhat = y / (offset + weight)."""
    compute_dw = compute_dw and weight is not None
    device = x.device
    dx = _new_output(x.shape, x.dtype, device)
    x2 = _rows_view(x)
    dy2 = _rows_view(dy)
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else x.new_empty(0, dtype=torch.float32)
    count_launch("rms_norm_bwd")
    facts = device_facts(device)
    # alignment only matters (and is only looked at) for the lengths the cluster kernels take
    aligned = cluster_shape(n_cols, True) is not None and _gpu.aligned_rows(x2, dy2) and _gpu.aligned_weight(weight)

    def plan_now() -> Plan:
        return plan(Call(n_rows, n_cols, x.dtype, None if weight is None else weight.dtype, "backward",
                         dy_dtype=dy2.dtype, from_output=from_output, aligned=aligned,
                         deterministic=torch.are_deterministic_algorithms_enabled()), facts)

    p = plan_now()
    if p.path == Path.CLUSTER:
        cfg, kernels = p.config, _cluster_kernels()
        partial = _new_output((cfg.clusters, n_cols) if compute_dw else (1, 1), torch.float32, device)
        key = (n_cols, x2.dtype, cfg.shape, casting_mode, offset != 0.0, compute_dw)
        if _dispatch.run_path(OP_NAMES["backward"], "cluster", key, lambda: kernels.launch_backward(
                dy2, x2, weight, rstd.contiguous().reshape(-1), dx, partial, shape=cfg.shape, grid=cfg.clusters,
                offset=offset, casting_id=_CASTING_ID[casting_mode], compute_dw=compute_dw),
                instead="the Triton backward"):
            programs = cfg.clusters
        else:
            p = _dispatch.planned_again("rms_norm", "cluster", plan_now())
    if p.path == Path.SPLIT:
        partial, programs = _split_backward(dy2, x2, weight, rstd, dx, offset, casting_mode, compute_dw, from_output,
                                            p.config, facts.sm_count)
    elif p.path == Path.TRITON:
        partial, programs = _one_kernel_backward(dy2, x2, weight, rstd, dx, offset, casting_mode, compute_dw,
                                                 from_output, p.config, facts.sm_count)
    if compute_dw:
        return dx, _sum_partial_rows(partial, programs, weight)
    return dx, partial.new_empty(0)


def _cluster_kernels():
    """fused_kernels.ops.norm_smem, the cluster launchers (a name tests replace): imported on a first cluster
    launch, since no plan picks a cluster under the CPU interpreter, which has no Gluon."""
    from fused_kernels.ops import norm_smem

    return norm_smem


def _one_kernel_backward(dy2, x2, weight, rstd, dx, offset: float, casting_mode: str, compute_dw: bool,
                         from_output: bool, cfg: Optional[LaunchConfig], sm_count: int) -> tuple[torch.Tensor, int]:
    """_rms_norm_bwd_kernel's launch with `cfg` (None: autotuned); dx is written in place. Returns the
    dw partial rows and how many of them to sum."""
    n_rows, n_cols = x2.shape
    device = x2.device
    bytes_per_col = 4 + x2.element_size() + dy2.element_size()
    if cfg is None:  # the autotuner picks rows per tile and programs per SM: room for the most
        max_programs = min(n_rows, _MAX_PROGRAMS_PER_SM * sm_count)
    else:
        max_programs = backward_programs(cfg, n_rows, n_cols, bytes_per_col, sm_count)
    partial = _new_output((max_programs, n_cols) if compute_dw else (1, 1), torch.float32, device)
    args = (
        dy2, x2, x2 if weight is None else weight, rstd.contiguous().reshape(-1), dx, partial,
        n_rows, n_cols, _row_stride(dy2), _row_stride(x2), n_cols,
        offset, _row_bucket(n_rows),
    )
    flags = dict(CASTING=_CASTING_ID[casting_mode], HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
                 FROM_OUTPUT=from_output)
    if cfg is None:
        launched = [0]

        def grid(meta):
            # Called for every config the autotuner times, then for the launch that counts: the
            # last value is the number of dw partial rows the kernel wrote.
            launched[0] = _programs(meta["ROWS"], meta["PROGRAMS_PER_SM"], not meta["SINGLE_PASS"],
                                    n_rows, n_cols, bytes_per_col, sm_count, meta["L2_CAP"])
            return (launched[0],)

        key = ("bwd", n_cols, args[-1], flags["CASTING"], flags["HAS_WEIGHT"], compute_dw, from_output, dy2.dtype,
               x2.dtype, args[2].dtype)
        _launch_tuned(True, device_facts(x2.device), _rms_norm_bwd_kernel, key, grid, args,
                      dict(flags, EXACT_BF16=False))
        return partial, launched[0]
    launch(_rms_norm_bwd_kernel, (max_programs,), args,
           dict(flags, EXACT_BF16=_INTERPRETED, **cfg.meta(), num_warps=cfg.num_warps))
    return partial, max_programs


def _split_backward(dy2, x2, weight, rstd, dx, offset: float, casting_mode: str, compute_dw: bool, from_output: bool,
                    cfg: SplitBackwardConfig, sm_count: int) -> tuple[torch.Tensor, int]:
    """The split backward's two launches (see SplitBackwardConfig); dx is written in place. Returns the
    dw partial rows and how many of them to sum."""
    n_rows, n_cols = x2.shape
    device = x2.device
    w = x2 if weight is None else weight
    rstd1 = rstd.contiguous().reshape(-1)
    flags = dict(CASTING=_CASTING_ID[casting_mode], HAS_WEIGHT=weight is not None, EXACT_BF16=_INTERPRETED,
                 FROM_OUTPUT=from_output)
    n_dot = cdiv(n_cols, cfg.dot_block)
    dot = _new_output((n_rows, n_dot), torch.float32, device)
    launch(_rms_norm_bwd_rowdot_kernel, (n_rows, n_dot),
           (dy2, x2, w, rstd1, dot, n_cols, _row_stride(dy2), _row_stride(x2), offset, n_dot),
           dict(flags, BLOCK_N=cfg.dot_block, num_warps=cfg.dot_warps))
    n_blocks = cdiv(n_cols, cfg.block_n)
    groups_wanted = max(1, cfg.programs_per_sm * sm_count // n_blocks)
    rows_per_group = cdiv(n_rows, min(n_rows, groups_wanted))
    groups = cdiv(n_rows, rows_per_group)
    partial = _new_output((groups, n_cols) if compute_dw else (1, 1), torch.float32, device)
    launch(_rms_norm_bwd_split_kernel, (groups, n_blocks),
           (dy2, x2, w, rstd1, dot, dx, partial, n_rows, n_cols, _row_stride(dy2), _row_stride(x2), n_cols, offset,
            n_dot, rows_per_group),
           dict(flags, COMPUTE_DW=compute_dw, BLOCK_N=cfg.block_n, DOT_BLOCKS=max(2, next_pow2(n_dot)),
                NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps))
    return partial, groups


# ----------------------------------------------------------------------------------------------
# Custom ops: what torch.compile traces (fake implementations give shapes without running Triton)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_kernels::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd): y like x in the output dtype, rstd = 1/sqrt(mean(x²)+eps) in fp32."""
    return _forward_impl(x, weight, eps, offset, casting_mode)


@_rms_norm_fwd.register_fake
def _rms_norm_fwd_fake(x, weight, eps, offset, casting_mode):
    out_dtype = output_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fused_kernels::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dw). dw has weight's shape and dtype, or is empty when weight is None or
    compute_dw is False."""
    return _backward_impl(dy, x, weight, rstd, offset, casting_mode, compute_dw)


@_rms_norm_bwd.register_fake
def _rms_norm_bwd_fake(dy, x, weight, rstd, offset, casting_mode, compute_dw):
    dx = x.new_empty(x.shape)
    if compute_dw and weight is not None:
        return dx, weight.new_empty(weight.shape)
    return dx, x.new_empty(0, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset, casting_mode = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if dy is None:  # only rstd was used downstream; it carries no gradient
        out_dtype = output_dtype(x.dtype, None if weight is None else weight.dtype, ctx.casting_mode)
        dy = torch.zeros(x.shape, dtype=out_dtype, device=x.device)
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = torch.ops.fused_kernels.rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode, compute_dw)
    return dx if ctx.needs_input_grad[0] else None, dw if compute_dw else None, None, None, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Eager autograd: the same launches without the custom-op dispatch (tens of µs of Python per call,
# which leaves the GPU idle between 0.1 ms kernels)
# ----------------------------------------------------------------------------------------------

def _weight_without_zeros(weight: Optional[torch.Tensor], offset: float, casting_mode: str) -> bool:
    """Whether offset + weight (as the kernels form it) has no element equal to 0, so that the input
    can be recovered from the output. Checked once per weight object (one host sync on its first use)
    and remembered on it: not per storage, since FSDP2 re-allocates an unsharded parameter's storage
    every step and a sync per norm per step would stall training. A weight None is 1 everywhere."""
    if weight is None:
        return True
    key = (weight.dtype, float(offset), casting_mode)
    if getattr(weight, "_fused_kernels_nonzero", None) == key:
        return True
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # no sync allowed: keep the input
    w_eff = weight.detach().float() + offset
    if casting_mode == "llama":
        w_eff = w_eff.to(weight.dtype)
    if bool((w_eff == 0).any()):
        return False
    try:
        weight._fused_kernels_nonzero = key
    except Exception:  # noqa: BLE001 - a tensor type without attributes: checked again next time
        pass
    return True


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, keep_output):
        y, rstd = _forward_impl(x, weight, eps, offset, casting_mode)
        ctx.from_output = (keep_output and y.dtype == x.dtype and y.shape == x.shape
                           and _weight_without_zeros(weight, offset, casting_mode))
        ctx.save_for_backward(y if ctx.from_output else x, weight, rstd)
        ctx.offset = offset
        ctx.casting_mode = casting_mode
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x_or_y, weight, rstd = ctx.saved_tensors
        compute_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _backward_impl(dy, x_or_y, weight, rstd, ctx.offset, ctx.casting_mode, compute_dw,
                                ctx.from_output)
        return dx if ctx.needs_input_grad[0] else None, dw if compute_dw else None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Functional entry
# ----------------------------------------------------------------------------------------------

def _check_scalar(name: str, value, what: str, non_negative: bool) -> None:
    if type(value) is float and math.isfinite(value) and (value >= 0 or not non_negative):
        return  # the common case, decided without the slower checks below
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (non_negative and value < 0)):
        raise ValueError(f"{name} must be {what}; got {value!r}")


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    keep: str = "input",
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x`, differentiable in `x` and `weight`.

    x: float32/bfloat16/float16, any leading shape (zero rows allowed), any strides.
    weight: shape (x.shape[-1],) float tensor, or None for a weightless norm (y = x·rstd; `offset`
        is then not used).
    casting_mode: "llama" (normalise in fp32, round to x.dtype, then multiply by offset + weight in
        torch's promoted dtype), "gemma" (all in fp32, x·rstd·(offset + weight), cast to x.dtype at the
        end), or "none" (fp32 throughout, one cast to x.dtype at the end).
    Output dtype: promote_types(weight.dtype, x.dtype) for "llama" with a weight, else x.dtype.
    keep: what the backward keeps alive. "input" (exact): x. "output": y, from which the backward
        recovers xhat = y / (offset + weight) (to within one rounding of y's dtype, ~2^-8 relative in
        bf16): the memory of x is freed whenever the next layer keeps y anyway (a Linear saves its
        input). Used only where y has x's dtype and offset + weight has no zero (checked once per
        weight object, one host sync); an element of the weight that becomes exactly 0 later (or is
        loaded as 0 into the same parameter) would get a zero gradient. Eager autograd only; under
        torch.compile the input is kept.

    Eager calls run a torch.autograd.Function; under torch.compile the registered custom op
    (fused_kernels::rms_norm_fwd) is traced instead. Both launch the same kernels.
    """
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (the hidden size); got shape {tuple(x.shape)}")
    if weight is not None:
        check_float("weight", weight)
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"weight must have shape (x.shape[-1],) = ({x.shape[-1]},); got {tuple(weight.shape)}"
            )
        if weight.device != x.device:
            raise ValueError(f"weight must be on x's device {x.device}; got {weight.device}")
    if casting_mode not in CASTING_MODES:
        check_choice("casting_mode", casting_mode, CASTING_MODES)
    _check_scalar("eps", eps, "a finite float >= 0", non_negative=True)
    _check_scalar("offset", offset, "a finite float (0.0 for Llama, 1.0 for Gemma)", non_negative=False)
    if keep not in _KEEP:
        check_choice("keep", keep, _KEEP)
    if not (x.is_cuda or (x.device.type == "cpu" and interpreter_on())):
        raise RuntimeError(
            f"rms_norm runs Triton kernels: x must be on a CUDA device, or on the CPU with "
            f"TRITON_INTERPRET=1 set before triton is imported (interpreter on: {interpreter_on()}); "
            f"got device {x.device}"
        )
    if torch.compiler.is_compiling():
        y, _rstd = torch.ops.fused_kernels.rms_norm_fwd(x, weight, float(eps), float(offset), casting_mode)
        return y
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, keep == "output")
    return _forward_impl(x, weight, float(eps), float(offset), casting_mode)[0]
