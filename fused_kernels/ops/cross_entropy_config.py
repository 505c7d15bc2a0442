"""Cross entropy's launch tables and its one `plan(call, device)`: which kernel runs a call ("triton", or
one of the shared-memory paths "smem", "smem-split", "smem-registers"; fused_kernels/ops/cross_entropy.py's
docstring says what each is), with which launch shape, and why; and the sizes of the shared-memory
kernel's row buffers (cross_entropy_smem runs them) that decide where a shape fits. Plain Python, no
kernels."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from fused_kernels import _dispatch
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import SMEM_RESERVED, VEC, DeviceFacts, device_facts
from fused_kernels._ints import cdiv

class LaunchConfig(NamedTuple):
    block: int  # classes per block (power of 2); a row of <= block classes is held whole in registers
    warps: int  # num_warps
    per_sm: float  # programs per SM, each looping over rows; 0: one program per row
    stages: int = 1  # software-pipelining stages of the block loops (tl.range num_stages); 1: none
    l2_hints: bool = False  # first-pass loads evict_last, second-pass loads and grad stores evict_first
    smem: bool = False  # the row held in shared memory (cross_entropy_smem; block: classes per chunk)
    ctas: int = 1  # smem: CTAs (SMs) a row is split over, a thread-block cluster when > 1; per_sm counts CTAs
    in_registers: int = 0  # smem: chunks of each CTA's share held in registers (ptxas capped so per_sm fit)


# (largest V, config): the Triton kernel's shape, the first row whose bound is >= V. The rows for
# V > 8192 are dev/tune_cross_entropy.py's winners on the H200 (forward writing the gradient, 8192
# rows bf16). V <= 65536: 8192-class blocks, 8 warps, 2-stage pipelined sweeps; longer rows: 32768-class
# blocks with 32 warps, one program per row (one per SM at a time: ~132 rows of 256-512 KB in flight,
# so the second sweep reads from L2), and the L2 hints (first sweep evict_last, second sweep and stores
# evict_first).
LAUNCH_TABLE: tuple[tuple[float, LaunchConfig], ...] = (
    (2048, LaunchConfig(block=2048, warps=4, per_sm=0)),
    (8192, LaunchConfig(block=8192, warps=8, per_sm=0)),
    (65536, LaunchConfig(block=8192, warps=8, per_sm=0, stages=2, l2_hints=True)),
    (196608, LaunchConfig(block=32768, warps=32, per_sm=0, stages=1, l2_hints=True)),
    (math.inf, LaunchConfig(block=32768, warps=32, per_sm=0, stages=1, l2_hints=True)),
)

# Tried before LAUNCH_TABLE when the rows may live in shared memory (plan(): CUDA, Gluon, 16-bit,
# aligned, the gradient wanted): the first row whose bound is >= V and whose shape runs here
# (shape_refusal: per_sm CTAs' row buffers fit an SM, clusters on sm_90+, enough rows per cluster, the
# shape's path not turned off) wins. Rows up to 57344 classes stay in one CTA (4, 3 or 2 per SM as shared
# memory allows: an A100's 164 KB takes V = 32000 at 2 per SM). Longer rows are split over a cluster of
# 2, 4 or 8 CTAs on as many SMs, each CTA holding <= 64 KB of the row; the CTAs exchange their partial
# max / Σ exp through global memory and one cluster barrier per row. Without clusters (before Hopper)
# V = 65536 takes the unsplit 32-warp row and longer rows the Triton kernel. Rows with in_registers hold
# the first chunks of each CTA's share in registers and cap ptxas's registers (maxnreg) so that per_sm
# CTAs fit: more rows in flight per SM. For each V the shapes without registers follow as fallbacks
# (fewer rows than the register shape's clusters want, or a Triton that cannot build them).
# Rows of at most SMEM_FROM - 1 classes stay with the Triton kernel, which holds them whole in registers
# (one read already).
SMEM_FROM = 8193
# A split row's cluster pays off over many rows only: with few rows per cluster (a
# fused_linear_cross_entropy chunk of 640-1024 rows gives 7-10) the first row's load is never
# overlapped and the Triton kernel is faster. Split rows are used from this many rows per cluster.
SPLIT_MIN_ROWS_PER_CLUSTER = 16
SMEM_TABLE: tuple[tuple[float, LaunchConfig], ...] = (
    (36864, LaunchConfig(block=2048, warps=8, per_sm=4, smem=True, in_registers=4)),
    (36864, LaunchConfig(block=2048, warps=8, per_sm=3, smem=True)),
    (57344, LaunchConfig(block=2048, warps=8, per_sm=2, smem=True)),
    (65536, LaunchConfig(block=2048, warps=8, per_sm=4, smem=True, ctas=2, in_registers=3)),
    (65536, LaunchConfig(block=2048, warps=8, per_sm=3, smem=True, ctas=2)),
    (65536, LaunchConfig(block=8192, warps=32, per_sm=1, smem=True)),
    (131072, LaunchConfig(block=1024, warps=4, per_sm=8, smem=True, ctas=8, in_registers=3)),
    (131072, LaunchConfig(block=2048, warps=8, per_sm=3, smem=True, ctas=4)),
    (212992, LaunchConfig(block=1024, warps=4, per_sm=7, smem=True, ctas=8, in_registers=4)),
    (212992, LaunchConfig(block=1024, warps=4, per_sm=6, smem=True, ctas=8, in_registers=4)),
    (212992, LaunchConfig(block=1024, warps=4, per_sm=5, smem=True, ctas=8, in_registers=4)),
    (212992, LaunchConfig(block=2048, warps=8, per_sm=4, smem=True, ctas=8)),
    (262144, LaunchConfig(block=2048, warps=8, per_sm=4, smem=True, ctas=8, in_registers=3)),
    (262144, LaunchConfig(block=2048, warps=8, per_sm=3, smem=True, ctas=8)),
)

OP = "cross_entropy"  # the op's name in fused_kernels._dispatch

_CONFIG = {
    "force": None,  # a LaunchConfig used for every V instead of the table (tests, tuning)
    "sm_count": None,  # stands in for the device's SM count (tests: persistent grids on the CPU)
    "device": None,  # DeviceFacts standing in for the logits' device in plan_for (tests)
    "poison": False,  # tests: fill every fresh output buffer with NaN before the kernels run
    "on_buffer": None,  # tests: called with every buffer new_buffer returns (to follow the gradient)
}


# ----------------------------------------------------------------------------------------------
# The shared-memory kernel's row buffers (cross_entropy_smem)

_SMEM_SLACK = 256  # the compiler's own scratch (reductions) beside the row buffer


def chunk_classes(warps: int, ctas: int = 1) -> int:
    """Classes per chunk of a row: 8 per thread of the program (or of the cluster)."""
    return 32 * warps * VEC * ctas


def buffer_bytes(v: int, warps: int, element_size: int, ctas: int = 1, in_registers: int = 0) -> int:
    """Shared memory of one CTA's row buffer: its share of V rounded up to whole chunks, less the
    in_registers chunks held in registers."""
    return (cdiv(v, chunk_classes(warps, ctas)) - in_registers) * chunk_classes(warps) * element_size


MAX_IN_REGISTERS = 4  # r0-r3 in the kernel
# A shared buffer of one chunk ([1, CTAS, T, 8]) does not build on triton 3.6 (PassManager::run
# failed): chunks held in registers leave at least two in shared memory.
MIN_SHARED_CHUNKS = 2


def registers_allowed(v: int, warps: int, ctas: int, in_registers: int) -> bool:
    """Whether in_registers chunks of each CTA's share may live in registers: whole chunks only (the
    masked tail stays in shared memory), at most MAX_IN_REGISTERS, and MIN_SHARED_CHUNKS left."""
    chunk = chunk_classes(warps, ctas)
    return in_registers == 0 or (
        in_registers <= min(MAX_IN_REGISTERS, v // chunk) and cdiv(v, chunk) - in_registers >= MIN_SHARED_CHUNKS)


def programs_that_fit(v: int, warps: int, element_size: int, smem_per_sm: int, ctas: int = 1,
                      in_registers: int = 0) -> int:
    """How many CTAs' row buffers one SM's shared memory (smem_per_sm bytes: _gpu.smem_per_sm) holds."""
    need = buffer_bytes(v, warps, element_size, ctas, in_registers) + SMEM_RESERVED + _SMEM_SLACK
    return smem_per_sm // need


# ----------------------------------------------------------------------------------------------
# Launch shapes and plan()


def _grid_sms(facts: DeviceFacts) -> Optional[int]:
    """SMs a persistent grid is sized for: the forced count (_CONFIG["sm_count"]), else the GPU's; None
    off the GPU, where the grid is one program per row."""
    if _CONFIG["sm_count"]:
        return int(_CONFIG["sm_count"])
    return facts.sm_count if facts.cuda else None


def _programs(cfg: LaunchConfig, n_rows: int, sms: Optional[int]) -> int:
    if cfg.per_sm <= 0 or sms is None:
        return n_rows
    return max(1, min(n_rows, int(round(cfg.per_sm * sms)) // cfg.ctas))


def grid_programs(cfg: LaunchConfig, n_rows: int, device) -> int:
    """Programs launched for n_rows rows: one per row, or per_sm per SM (never more than the rows); a
    cluster of cfg.ctas CTAs (a split row) counts as one program. `device`: a torch.device or the
    DeviceFacts of one."""
    facts = device if isinstance(device, DeviceFacts) else device_facts(device)
    return _programs(cfg, n_rows, _grid_sms(facts))


def launch_config(v: int, smem_fits=None) -> LaunchConfig:
    """The launch shape for rows of v classes: the forced one, else (v >= SMEM_FROM) SMEM_TABLE's first
    row for v that smem_fits(cfg) accepts (None: the rows may not live in shared memory), else
    LAUNCH_TABLE's."""
    if _CONFIG["force"] is not None:
        return _CONFIG["force"]
    if smem_fits is not None and v >= SMEM_FROM:
        for bound, cfg in SMEM_TABLE:
            if v <= bound and smem_fits(cfg):
                return cfg
    for bound, cfg in LAUNCH_TABLE:
        if v <= bound:
            return cfg
    return LAUNCH_TABLE[-1][1]


def path_of(cfg: LaunchConfig) -> str:
    """The path a launch shape belongs to (see the module docstring): "smem-registers" (chunks in
    registers, split or not), "smem-split" (a row over a cluster), "smem" or "triton"."""
    if not cfg.smem:
        return Path.TRITON
    if cfg.in_registers:
        return Path.SMEM_REGISTERS
    return Path.SMEM_SPLIT if cfg.ctas > 1 else Path.SMEM


def shape_refusal(cfg: LaunchConfig, n_rows: int, v: int, element_size: int, facts: DeviceFacts) -> Optional[str]:
    """Why SMEM_TABLE's shape cfg cannot run for n_rows rows of v classes on a device with these facts,
    or None when it can: its paths are on (_dispatch.path_on), a split row has thread-block clusters
    (compute capability >= 9.0) of at most 8 CTAs and >= SPLIT_MIN_ROWS_PER_CLUSTER rows per cluster,
    the chunks in registers are allowed, and per_sm CTAs' row buffers fit one SM's shared memory."""
    path = path_of(cfg)
    if not _dispatch.path_on(OP, path):
        return f"{path} turned off"
    if cfg.ctas > 1:
        if not _dispatch.path_on(OP, Path.SMEM_SPLIT):
            return "smem-split turned off"
        if cfg.ctas > 8 or facts.capability < (9, 0):
            return f"a cluster of {cfg.ctas} CTAs needs compute capability >= 9.0, got {facts.capability}"
        clusters = _programs(cfg, n_rows, _grid_sms(facts))
        if n_rows < SPLIT_MIN_ROWS_PER_CLUSTER * clusters:
            return f"{n_rows} rows < {SPLIT_MIN_ROWS_PER_CLUSTER} per cluster for {clusters} clusters"
    if not registers_allowed(v, cfg.warps, cfg.ctas, cfg.in_registers):
        return f"{cfg.in_registers} chunks in registers not allowed at V = {v}"
    held = programs_that_fit(v, cfg.warps, element_size, facts.smem_per_sm, cfg.ctas, cfg.in_registers)
    if held < cfg.per_sm:
        return f"{held} CTAs' row buffers fit {facts.smem_per_sm} B per SM, {cfg.per_sm} wanted"
    return None


def _describe(cfg: LaunchConfig) -> str:
    if not cfg.smem:
        return f"block {cfg.block}, {cfg.warps} warps, " + (f"{cfg.per_sm} per SM" if cfg.per_sm else "a program per row")
    return (f"{cfg.warps} warps, {cfg.per_sm} CTAs per SM, {cfg.ctas} CTA(s) per row, "
            f"{cfg.in_registers} chunks in registers")


def _smem_refusal(n_rows: int, dtype: torch.dtype, grad_dtype, aligned: bool,
                  facts: DeviceFacts) -> Optional[str]:
    """Why rows of these logits cannot live in shared memory at all, or None (SMEM_TABLE then decides)."""
    if grad_dtype is None:
        return "no gradient wanted (the Triton kernel reads each row once anyway)"
    if not facts.gluon:
        return "no Gluon kernels here (not a CUDA GPU, the interpreter, or no Gluon in this Triton)"
    if not _dispatch.path_on(OP, Path.SMEM):
        return "smem turned off"
    if dtype.itemsize != 2 or grad_dtype != dtype:
        return f"{dtype} logits with a {grad_dtype} gradient: the row in shared memory takes 16-bit logits and gradient"
    if n_rows == 0:
        return "no rows"
    if not aligned:
        return "rows not 16-byte aligned (row strides a multiple of 16 elements, 16-byte aligned bases)"
    if facts.capability < (8, 0):
        return f"compute capability {facts.capability} < 8.0 (cp.async)"
    return None


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one launch: n_rows rows of v classes of `dtype` logits, the gradient's dtype
    (None: no gradient written), and whether the logits' and gradient's rows are 16-byte aligned with
    strides a multiple of 16 elements."""
    n_rows: int
    v: int
    dtype: torch.dtype
    grad_dtype: Optional[torch.dtype] = None
    aligned: bool = True


def plan(call: Call, device: DeviceFacts) -> Plan:
    """Which kernel runs cross entropy for `call` on a device with these facts, with what launch shape (a
    LaunchConfig) and why.

    Paths: "smem" (the row held in shared memory by one CTA), "smem-split" (a row split over a cluster
    of CTAs), "smem-registers" (either, with the first chunks of each CTA's share held in registers) —
    all cross_entropy_smem — and "triton" (this module's kernel, LAUNCH_TABLE's shape). The smem paths
    are tried first when the rows may live in shared memory (_smem_refusal): SMEM_TABLE's first row whose
    bound is >= V and that runs here (shape_refusal); the reason lists the rows skipped and why.
    On an H200 (DeviceFacts(True, 132, (9, 0), 233472, True)), 8192 rows with a bf16 gradient:
    V = 32000 -> smem-registers, one CTA per row (8 warps, 4 per SM, 4 chunks in registers); 50304 ->
    smem (2 per SM); 128256 -> smem-registers over a cluster of 8 (4 warps, 8 per SM, 3 in registers),
    which wants 16 rows for each of its 132 clusters: at 2111 rows smem-split over 4 CTAs instead, at
    768 (a fused_linear_cross_entropy chunk) triton; 262144 -> smem-registers over 8 (8 warps, 4 per
    SM, 3 in registers). An A100 (sm_80, 167936 B per SM): V = 32000 smem at 2 per SM, 65536 the
    unsplit 32-warp row, longer rows triton. fp32 logits, no gradient, V <= 8192 or V > 262144: triton.
    `_CONFIG["force"]` forces one shape (a smem one raises where the rows cannot live in shared memory)."""
    n_rows, v, dtype = call.n_rows, call.v, call.dtype
    forced = _CONFIG["force"]
    refusal = _smem_refusal(n_rows, dtype, call.grad_dtype, call.aligned, device)
    if forced is not None:
        if forced.smem and refusal is not None:
            raise RuntimeError(
                f"cross_entropy: launch shape {forced} holds rows in shared memory, which needs a CUDA GPU of "
                f"compute capability >= 8.0 (9.0 for ctas > 1) with Gluon, 16-bit logits and gradient with row "
                f"strides a multiple of 16; here: {refusal}")
        return Plan(path_of(forced), forced, "forced (_CONFIG['force'])")
    if refusal is None and v < SMEM_FROM:
        refusal = f"V = {v} < SMEM_FROM = {SMEM_FROM}: the Triton kernel holds the row whole in registers"
    if refusal is None:
        skipped = []
        for bound, cfg in SMEM_TABLE:
            if v > bound:
                continue
            why = shape_refusal(cfg, n_rows, v, dtype.itemsize, device)
            if why is None:
                skip = f" (skipped: {'; '.join(skipped)})" if skipped else ""
                return Plan(path_of(cfg), cfg, f"V = {v} <= {bound}: SMEM_TABLE's first shape that runs here, "
                                               f"{_describe(cfg)}{skip}")
            skipped.append(f"{_describe(cfg)}: {why}")
        refusal = ("no SMEM_TABLE shape runs here: " + "; ".join(skipped)) if skipped else \
            f"V = {v} > {SMEM_TABLE[-1][0]}, SMEM_TABLE's last bound"
    cfg = launch_config(v)
    return Plan(Path.TRITON, cfg, f"LAUNCH_TABLE's shape for V = {v} ({_describe(cfg)}): {refusal}")
