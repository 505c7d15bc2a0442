"""fused_linear_cross_entropy's chunking and its one `plan(call, device)`: how many rows of logits each
chunk holds ("chunks", fused_kernels/ops/fused_linear_cross_entropy.py's docstring says why these numbers),
and why. Plain Python, no kernels."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts
from fused_kernels._ints import cdiv

DEFAULT_CHUNK_MB = 252  # MiB of logits per chunk when the caller names no budget (see the op's docstring)
GRANULE = 8  # chunk rows are a multiple of this (cuBLAS' leading-dimension granule) unless fewer fit

_CONFIG = {
    "chunk_rows": None,  # force the chunk size (tests)
}


def check_chunk_mb(chunk_mb) -> int:
    """The chunk budget in bytes for chunk_mb MiB (None: DEFAULT_CHUNK_MB); ValueError unless it is a
    positive finite number."""
    if chunk_mb is None:
        return DEFAULT_CHUNK_MB * 2**20
    if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not (
            math.isfinite(chunk_mb) and chunk_mb > 0):
        raise ValueError(f"chunk_mb must be a positive number of MiB for the logits chunk, e.g. 128 "
                         f"(None: the default {DEFAULT_CHUNK_MB}); got {chunk_mb!r}")
    return int(chunk_mb * 2**20)


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one call: n tokens over v classes, logits of elem_size bytes, and the
    chunk budget in MiB (None: DEFAULT_CHUNK_MB)."""
    n: int
    v: int
    elem_size: int
    chunk_mb: Optional[Union[int, float]] = None


def plan(call: Call, device: DeviceFacts) -> Plan:
    """Rows per chunk, and why: Plan("chunks", rows, reason). C = budget / (V · elem_size) rounded down
    to a multiple of GRANULE (at least 1, at most n), then shrunk so that the n rows split into equal
    chunks of at most C. The budget alone decides, on every device (no fact of `device` enters).
    Default budget: 1024 rows at V = 128256 bf16 for 8192 tokens (8 chunks), 864 at 151936 for 16384,
    504 at 262144 for 16384, 4096 at 32000 for 8192."""
    n, v, elem_size = call.n, call.v, call.elem_size
    budget = check_chunk_mb(call.chunk_mb)
    if n == 0:
        return Plan(Path.CHUNKS, 1, "no tokens")
    if _CONFIG["chunk_rows"]:
        return Plan(Path.CHUNKS, max(1, min(n, int(_CONFIG["chunk_rows"]))), "forced (_CONFIG['chunk_rows'])")
    fit = budget // max(1, v * elem_size)
    granule = GRANULE if fit >= GRANULE else 1
    rows = min(max(1, fit // granule * granule), n)
    n_chunks = cdiv(n, rows)
    # Equal chunks, still a multiple of the granule: never more than `rows` (a granule multiple).
    rows = min(rows, cdiv(cdiv(n, n_chunks), granule) * granule)
    return Plan(Path.CHUNKS, rows, f"{fit} rows of {v} x {elem_size} B fit {budget / 2**20:g} MiB; {n} tokens in "
                                   f"{cdiv(n, rows)} chunks of {rows} (multiples of {granule})")
