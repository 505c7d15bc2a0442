"""LayerNorm's launch tables and heuristics, and its one `plan(call, device)`: which path runs a call
("whole-row", "chunked backward", "chunked" or "cluster backward", fused_kernels/ops/layer_norm.py's
docstring says what each is), with which launch shapes, and why. Plain Python, no kernels."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from fused_kernels import _dispatch, _gpu
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import ClusterLaunch, ClusterShape, DeviceFacts
from fused_kernels._ints import cdiv, next_pow2

_CONFIG = {
    "force": None,  # a LayerNormConfig every call uses (tests, dev/tune_layer_norm.py)
}


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
    """Launch shape of one call's kernels."""

    fwd_rows: int  # forward rows per tile (power of two): several for short rows, so each load is large enough
    fwd_block: int  # forward: columns per load (power of two), >= n_cols unless fwd_chunked
    fwd_chunked: bool  # forward: rows swept twice in chunks of fwd_block columns
    fwd_warps: int
    fwd_programs: int  # forward grid: one program per tile, or fewer looping over tiles (persistent)
    fwd_stages: int  # software pipelining of the whole-row forward's tile loop (1: none)
    bwd_rows: int  # backward rows per tile
    bwd_block: int
    bwd_chunked: bool
    bwd_warps: int
    bwd_programs: int  # persistent backward programs; whole-row: each writes one dw and one db partial row
    bwd_stages: int  # software pipelining of the whole-row backward's tile loop (1: none)
    # dw / db from their own column-parallel kernel (_param_grad_kernel) instead of the backward's
    # programs: (rows per load, columns per program, warps, row groups); None: the backward sums them
    param_grid: Optional[tuple[int, int, int, int]] = None
    # the backward on a thread-block cluster (norm_smem, path "cluster backward"), each row read once;
    # the Triton fields above stay the fallback should its first build fail
    bwd_cluster: Optional[ClusterLaunch] = None


# Sizes measured on an H200 (dev/tune_layer_norm.py: every candidate forced and timed kernel-only; the
# numbers are in docs/kernels/layer_norm.md). One rule fits the widths it measured (1024 and 4096 columns):
# 16 fp32 values per thread per held array, small programs, several resident per SM, and the tile loop
# software-pipelined (3 stages) so one tile's loads are in flight while the previous one is reduced.
#   forward:  one row per tile (at least 1024 columns a tile), warps = tile / 512, up to 8 programs per SM
#             (64 warps an SM at most), persistent;
#   backward: at least 2048 columns a tile (2 rows of 1024), warps = tile / 512, 16 warps an SM.
FWD_WHOLE_ROW_MAX = 16384  # the forward holds one row in registers up to here: 32 warps, 2 programs an SM
BWD_WHOLE_ROW_MAX = 8192  # the backward holds x, dy and the weight: beyond this its chunked form is faster
_PER_THREAD = 16
_FWD_MIN_TILE, _FWD_WARPS_PER_SM, _FWD_MAX_PER_SM = 1024, 64, 8
_BWD_MIN_TILE, _BWD_WARPS_PER_SM = 2048, 16
_STAGES = 3
# Longer rows are swept twice in column chunks of _CHUNK, the second sweep from L2. Forward (beyond
# 16384 columns): one row a tile, 16 warps, a program per tile. Backward: one row a tile, warps = chunk /
# 512 (the whole-row rule), 4 programs an SM, fastest of the chunkings timed at 16384 columns.
_CHUNK, _FWD_CHUNK_WARPS = 4096, 16
_BWD_CHUNK_WARPS, _BWD_CHUNK_PER_SM = _CHUNK // (32 * _PER_THREAD), 4
# Chunked backward: the second sweep re-reads x and dy of the program's tile; persistent programs are
# capped so that those tiles stay within this much of the L2 (H200: 50 MiB).
L2_BUDGET_BYTES = 32 * 2**20
# Chunked backward: dw / db from a separate column-parallel kernel. It reads x and dy once more
# (2·rows·N·B), but the dx kernel then keeps no partial rows: their read-modify-write once a tile, through
# L2, and the reduction across the tile's rows held the fused chunked backward at 0.264 ms at 4096 x 16384
# (split: 0.125 ms dx + 0.072 ms dw/db). (rows per load, columns per program, warps, programs an SM);
# row groups fill the GPU.
_PARAM_ROWS, _PARAM_BLOCK, _PARAM_WARPS, _PARAM_PROGRAMS_PER_SM = 32, 128, 4, 2
# Under the interpreter every program runs one after another in Python.
_INTERPRETER_PROGRAMS = 4
# The backward of these row lengths on an H100/H200: a row split over a thread-block cluster, x and dy
# read from HBM once into shared memory (norm_smem._norm_bwd_smem_kernel, Gluon; the chunked backward
# reads them three times). Every length is 2-4 whole chunks of its shape (norm_smem.MIN_CHUNKS..MAX_CHUNKS).
CLUSTER_BACKWARD_SHAPES = {
    16384: ClusterShape(warps=4, ctas=4, per_sm=4),  # 4 chunks of 4096; dw and db sums in 64 registers
}
# Fewer rows per cluster and the partial rows of dw and db (one each per cluster) and the per-CTA copies
# of w cost as much as the rows: the Triton backward takes those calls.
MIN_ROWS_PER_CLUSTER = 4
BWD_OP = "layer_norm_bwd"  # the op name _dispatch knows the backward's paths by


def _whole_row_tiling(whole: int, min_tile: int) -> tuple[int, int]:
    """(rows per tile, warps): tiles of at least min_tile elements, _PER_THREAD values per thread."""
    rows = max(1, min_tile // whole)
    return rows, max(1, rows * whole // (32 * _PER_THREAD))


def cluster_shape(n_cols: int) -> Optional[ClusterShape]:
    """The cluster backward's shape for rows of n_cols (CLUSTER_BACKWARD_SHAPES), or None."""
    return CLUSTER_BACKWARD_SHAPES.get(n_cols)


def backward_cluster(n_rows: int, n_cols: int, x_dtype: torch.dtype, weight_dtype: Optional[torch.dtype], *,
                     device: DeviceFacts, dy_dtype: Optional[torch.dtype], aligned: bool,
                     deterministic: bool) -> tuple[Optional[ClusterLaunch], str]:
    """(the cluster backward's launch, why) for a call, or (None, why not): a length of
    CLUSTER_BACKWARD_SHAPES, Gluon on a GPU with thread-block clusters, x, dy and the weight (None: none)
    of one 16-bit dtype, 16-byte aligned rows, not deterministic mode (which rows a cluster's dw and db
    partial rows sum varies between runs), MIN_ROWS_PER_CLUSTER rows per cluster; and its path not
    turned off by a failed first build (`_dispatch.run_path`)."""
    shape = cluster_shape(n_cols)
    if shape is None:
        return None, f"the cluster backward takes no rows of {n_cols}"
    if not _dispatch.path_on(BWD_OP, Path.CLUSTER):
        return None, "the cluster kernel is off (its first build failed here)"
    refusal = _gpu.cluster_refusal(device, x_dtype, weight_dtype)
    if refusal:
        return None, refusal
    if dy_dtype != x_dtype:
        return None, f"dy ({dy_dtype}) is not of x's dtype ({x_dtype})"
    if deterministic:
        return None, "deterministic mode (dw's and db's rounding would depend on which cluster claims a row)"
    return _gpu.cluster_grid(n_rows, n_cols, shape, device, aligned=aligned, min_rows_per_cluster=MIN_ROWS_PER_CLUSTER)


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one forward or backward call: n_rows rows of n_cols, x's dtype, `direction`
    ("forward" or "backward"), and for the backward's cluster path the weight's (None: no weight) and dy's
    dtypes, whether every row (and the weight) is 16-byte aligned and whether deterministic mode is on."""
    n_rows: int
    n_cols: int
    x_dtype: torch.dtype
    direction: str
    weight_dtype: Optional[torch.dtype] = None
    dy_dtype: Optional[torch.dtype] = None
    aligned: bool = False
    deterministic: bool = False


def _forced_path(cfg: LayerNormConfig, direction: str) -> str:
    if cfg.bwd_cluster is not None and direction == "backward":
        return Path.CLUSTER_BACKWARD
    return Path.CHUNKED if cfg.fwd_chunked else Path.CHUNKED_BACKWARD if cfg.bwd_chunked else Path.WHOLE_ROW


def plan(call: Call, device: DeviceFacts) -> Plan:
    """The launch plan of one call on `device` (its SMs size the grids; `device.interpreted`: the CPU
    interpreter's few programs). Path "whole-row" (each row in registers, read once per kernel), "chunked
    backward" (the backward sweeps column chunks twice, the second from L2), "chunked" (both), or "cluster
    backward" (the forward whole-row, the backward over a thread-block cluster, `backward_cluster`): that
    one only for a backward call. The config holds both directions' launch shapes (a backward reads its
    own fields). `_CONFIG["force"]`, a LayerNormConfig, replaces the answer (tests, dev/tune_layer_norm.py)."""
    if call.direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward'; got {call.direction!r}")
    forced = _CONFIG["force"]
    if forced is not None:
        return Plan(_forced_path(forced, call.direction), forced, "forced (_CONFIG['force'])")
    n_rows, n_cols = call.n_rows, call.n_cols
    p = _triton_plan(n_rows, n_cols, call.x_dtype, device.sm_count, device.interpreted)
    if call.direction == "forward" or device.interpreted or cluster_shape(n_cols) is None:
        return p
    launch, why = backward_cluster(n_rows, n_cols, call.x_dtype, call.weight_dtype, device=device,
                                   dy_dtype=call.dy_dtype, aligned=call.aligned, deterministic=call.deterministic)
    if launch is None:
        return Plan(p.path, p.config, f"{p.reason}; not cluster: {why}")
    return Plan(Path.CLUSTER_BACKWARD, dataclasses.replace(p.config, bwd_cluster=launch),
                f"{_forward_reason(p.config, n_cols)}; backward: {why}, dw/db partial rows one per cluster")


@functools.lru_cache(maxsize=4096)
def _triton_plan(n_rows: int, n_cols: int, dtype: torch.dtype, sm_count: int, interpreted: bool) -> Plan:
    """plan()'s Triton paths (cached: a call's shape decides them)."""
    if n_cols < 1:
        raise ValueError(f"n_cols must be >= 1; got {n_cols}")
    bytes_x = torch.empty(0, dtype=dtype).element_size()
    whole = max(16, next_pow2(n_cols))
    fwd_chunked, bwd_chunked = whole > FWD_WHOLE_ROW_MAX, whole > BWD_WHOLE_ROW_MAX
    if fwd_chunked:
        fwd_rows, fwd_block, fwd_warps, fwd_per_sm, fwd_stages = 1, _CHUNK, _FWD_CHUNK_WARPS, None, 1
    else:
        fwd_rows, fwd_warps = _whole_row_tiling(whole, _FWD_MIN_TILE)
        fwd_block, fwd_stages = whole, _STAGES
        fwd_per_sm = min(_FWD_MAX_PER_SM, max(1, _FWD_WARPS_PER_SM // fwd_warps))
    if bwd_chunked:
        bwd_rows, bwd_block, bwd_warps, bwd_per_sm, bwd_stages = 1, _CHUNK, _BWD_CHUNK_WARPS, _BWD_CHUNK_PER_SM, 1
    else:
        bwd_rows, bwd_warps = _whole_row_tiling(whole, _BWD_MIN_TILE)
        bwd_block, bwd_stages = whole, _STAGES
        bwd_per_sm = max(1, _BWD_WARPS_PER_SM // bwd_warps)
    fwd_tiles = max(1, cdiv(n_rows, fwd_rows))
    bwd_tiles = max(1, cdiv(n_rows, bwd_rows))
    if interpreted:
        fwd_programs = min(fwd_tiles, _INTERPRETER_PROGRAMS)
        bwd_programs = min(bwd_tiles, _INTERPRETER_PROGRAMS)
    else:
        fwd_programs = fwd_tiles if fwd_per_sm is None else min(fwd_tiles, fwd_per_sm * sm_count)
        bwd_programs = min(bwd_tiles, max(1, bwd_per_sm * sm_count))
        if bwd_chunked:
            per_program = bwd_rows * n_cols * 2 * bytes_x  # x and dy of a tile, held in L2 for the second sweep
            bwd_programs = min(bwd_programs, max(1, L2_BUDGET_BYTES // per_program))
    # The same number of sweeps with fewer programs where possible (fewer partial rows to sum).
    bwd_programs = cdiv(bwd_tiles, cdiv(bwd_tiles, bwd_programs))
    fwd_programs = cdiv(fwd_tiles, cdiv(fwd_tiles, fwd_programs))
    param_grid = _param_grid(n_rows, n_cols, sm_count, interpreted) if bwd_chunked else None
    cfg = LayerNormConfig(fwd_rows, fwd_block, fwd_chunked, fwd_warps, fwd_programs, fwd_stages,
                          bwd_rows, bwd_block, bwd_chunked, bwd_warps, bwd_programs, bwd_stages, param_grid)
    forward = _forward_reason(cfg, n_cols)
    if param_grid is None:
        backward = (f"backward: rows fit in registers, {bwd_programs} persistent programs of {bwd_rows}-row "
                    "tiles writing dw/db partial rows")
    else:
        backward = (f"backward: rows of {n_cols} exceed {BWD_WHOLE_ROW_MAX} columns: dx from {bwd_programs} "
                    f"persistent programs sweeping each row twice in {_CHUNK}-column chunks"
                    + (" (capped so that their tiles stay in L2)" if not interpreted else "")
                    + f"; dw/db from a column-parallel kernel ({param_grid[3]} row groups of "
                    f"{param_grid[1]}-column programs)")
    path = Path.CHUNKED if fwd_chunked else Path.CHUNKED_BACKWARD if bwd_chunked else Path.WHOLE_ROW
    reason = f"{forward}; {backward}"
    if interpreted:
        reason += f"; interpreter: at most {_INTERPRETER_PROGRAMS} programs per launch"
    return Plan(path, cfg, reason)


def _forward_reason(cfg: LayerNormConfig, n_cols: int) -> str:
    """What a plan's reason says of its forward."""
    if cfg.fwd_chunked:
        return (f"forward: rows of {n_cols} exceed {FWD_WHOLE_ROW_MAX} columns, swept twice in {_CHUNK}-column "
                f"chunks (the second from L2), {cfg.fwd_programs} programs")
    return (f"forward: rows of {n_cols} fit in registers ({cfg.fwd_block} columns), {cfg.fwd_rows} a tile, "
            f"{cfg.fwd_programs} programs")


def _param_grid(n_rows: int, n_cols: int, sm_count: int, interpreted: bool) -> tuple[int, int, int, int]:
    """(rows per load, columns per program, warps, row groups) of _param_grad_kernel: enough row groups
    that the column blocks times the groups give _PARAM_PROGRAMS_PER_SM programs an SM."""
    if interpreted:  # a few programs, each one costs about a millisecond
        rows, block, warps = 4, min(4096, max(16, next_pow2(n_cols))), 4
        return rows, block, warps, min(2, cdiv(n_rows, rows))
    col_blocks = cdiv(n_cols, _PARAM_BLOCK)
    groups = max(1, min(cdiv(n_rows, _PARAM_ROWS), cdiv(_PARAM_PROGRAMS_PER_SM * sm_count, col_blocks)))
    return _PARAM_ROWS, _PARAM_BLOCK, _PARAM_WARPS, groups




# (columns per program, partial rows per load, num_warps) of _partial_sum_kernel: narrow column blocks
# give enough programs to fill the GPU for a few hundred partial rows (rms_norm's _DW_SUM_TABLE).
_SUM_SHAPE = (32, 16, 8)
