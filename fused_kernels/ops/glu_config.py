"""The GLU kernels' launch tables and their one `plan(call, device)`: the layout path ("flat" for contiguous
operands, "rows" for row views; fused_kernels/ops/glu.py's docstring says what each is), the tile and why.
Plain Python, no kernels. The tables were tuned on the H200 by dev/tune_glu.py, which overrides them."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts
from fused_kernels._ints import next_pow2

# Elements one program handles, by element size in bytes; and warps for a full tile.
_TILE_ELEMS = {2: 4096, 4: 2048}
_NUM_WARPS = {"fwd": 8, "bwd": 8}
# To avoid a masked row tail, the column block may shrink down to tile / this, no further.
_MAX_TILE_SHRINK = 8


# Offsets at or past this need 64-bit index arithmetic in the kernels.
_INT32_LIMIT = 2**31


class _BlockConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int


def _block_config(n_rows: int, n_cols: int, elem_bytes: int, direction: str) -> _BlockConfig:
    """Tile shape and warps for an n_rows × n_cols launch of `direction` ("fwd" or "bwd")."""
    tile = _TILE_ELEMS[elem_bytes]
    if n_cols >= tile:
        # Prefer a power-of-two block that divides the row (14336 = 7 × 2048): no masked tail.
        block_n = tile
        while n_cols % block_n and block_n // 2 >= max(1, tile // _MAX_TILE_SHRINK):
            block_n //= 2
        if n_cols % block_n:
            block_n = tile
    else:
        block_n = next_pow2(n_cols)
    # Short rows: stack several rows in one tile, but not more rows than there are.
    block_m = max(1, min(tile // block_n, next_pow2(n_rows)))
    # At least 4 elements per thread; a tiny tile gets fewer warps.
    num_warps = max(1, min(_NUM_WARPS[direction], (block_m * block_n) // 128))
    return _BlockConfig(block_m, block_n, num_warps)


class GluConfig(NamedTuple):
    """A launch of the GLU kernels: the (block_m, block_n) tile, warps, whether every tile is full
    (no masks), whether offsets need 64-bit arithmetic, and how many programs (one per tile)."""

    block_m: int
    block_n: int
    num_warps: int
    even: bool
    wide_index: bool
    programs: int


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one launch: direction "fwd" or "bwd" over n_rows x n_cols elements of
    elem_bytes bytes; row_strides None (every operand contiguous) or the operands' row strides."""
    n_rows: int
    n_cols: int
    elem_bytes: int
    direction: str
    row_strides: Optional[tuple] = None


def plan(call: Call, device: DeviceFacts) -> Plan:
    """How a GLU kernel (direction "fwd" or "bwd") runs over n_rows x n_cols elements of elem_bytes
    bytes, and why. row_strides None: every operand is contiguous, path "flat": one row of n_rows · n_cols
    elements. Otherwise path "rows": the operands are n_rows x n_cols views with these row strides (the
    halves of a fused gate_up output: 2 · n_cols) and unit column stride. The tile comes from
    _block_config; offsets past 2**31 take 64-bit indexing. SwiGLU 16384 x 14336 bf16 contiguous:
    flat, 1 x 4096 tiles, 8 warps, 57344 programs, no masks; its gate_up halves (row stride 28672):
    rows, 2 x 2048 tiles (14336 = 7 x 2048: no masked tail), 8 warps, 57344 programs. The same on
    every device (the tables were tuned on an H200; no fact of `device` enters)."""
    n_rows, n_cols, elem_bytes, direction, row_strides = (call.n_rows, call.n_cols, call.elem_bytes, call.direction,
                                                          call.row_strides)
    if row_strides is None:
        path, rows, cols, strides = Path.FLAT, 1, n_rows * n_cols, (0,)
    else:
        path, rows, cols, strides = Path.ROWS, n_rows, n_cols, tuple(row_strides) or (n_cols,)
    cfg = _block_config(rows, cols, elem_bytes, direction)
    n_row_blocks = -(-rows // cfg.block_m)
    n_col_blocks = -(-cols // cfg.block_n)
    even = rows % cfg.block_m == 0 and cols % cfg.block_n == 0
    # Largest offset any lane computes (masked lanes included), to pick 32- or 64-bit indexing.
    max_offset = max(abs(st) for st in strides) * n_row_blocks * cfg.block_m + n_col_blocks * cfg.block_n
    wide = max_offset >= _INT32_LIMIT or n_row_blocks * n_col_blocks >= _INT32_LIMIT
    config = GluConfig(cfg.block_m, cfg.block_n, cfg.num_warps, even, wide, n_row_blocks * n_col_blocks)
    return Plan(path, config, f"{rows} x {cols} elements of {elem_bytes} B: {cfg.block_m} x {cfg.block_n} tiles "
                              f"(_TILE_ELEMS {_TILE_ELEMS[elem_bytes]}), {cfg.num_warps} warps, {config.programs} "
                              f"programs, {'no masks' if even else 'masked edges'}, "
                              f"{'64' if wide else '32'}-bit offsets")
