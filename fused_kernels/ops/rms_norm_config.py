"""RMSNorm's launch tables and heuristics, and its one `plan(call, device)`: which path runs a call
("cluster", "split" or "triton", fused_kernels/ops/rms_norm.py's docstring says what each is), with which
launch shape, and why. Plain Python, no kernels: the tables the CPU interpreter runs, the autotuner's
candidate space on a GPU, the cluster kernels' shapes and the thresholds between the paths."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fused_kernels import _dispatch, _gpu
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import ClusterLaunch, ClusterShape, DeviceFacts
from fused_kernels._ints import cdiv, next_pow2

# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # columns per load (a power of two)
    rows: int  # rows per tile (a power of two): many for short rows, so each load is big enough
    num_warps: int
    # Persistent programs per SM (the backward always: each program writes one dw partial row; the
    # forward when > 0, else one program per tile).
    programs_per_sm: float
    # False: block_n >= n_cols and the row is held in registers (x read once per kernel).
    # True: the row is swept twice in chunks of block_n columns (second sweep from L2).
    chunked: bool = False
    # Software pipelining of the tile (or chunk) loop: num_stages - 1 tiles in flight (1: none).
    num_stages: int = 1
    # Chunked backward: cap the persistent programs so that their rows stay in L2 (L2_BUDGET_BYTES)
    # for the second sweep. Uncapped is the other candidate: more SMs busy, more re-reads from HBM.
    l2_cap: bool = True

    @property
    def tile(self) -> int:
        return self.block_n * self.rows

    def meta(self) -> dict:
        """The kernel's constexpr arguments that this config sets."""
        return dict(BLOCK_N=self.block_n, ROWS=self.rows, SINGLE_PASS=not self.chunked,
                    PROGRAMS_PER_SM=self.programs_per_sm, NUM_STAGES=self.num_stages, L2_CAP=self.l2_cap)


# The heuristic tables: what the CPU interpreter runs (one config per row length, so it stays fast),
# and the reference the autotuned configs are compared with in dev/tune_rms_norm.py.
# Forward: (largest n_cols, rows per tile, num_warps); backward adds persistent programs per SM.
# The block is n_cols rounded up to a power of two, so the whole row sits in registers and x is read
# once. Sizing rule behind the numbers: 2–4 K elements per tile for short rows (8 KiB of bf16 per load
# and program); 16 fp32 values per thread per held array (x, w in the forward; x, dy, w, dw in the
# backward) so nothing spills; backward programs per SM = what fits in the register file alongside.
_FWD_TABLE = (
    (64, 32, 4),
    (256, 16, 8),
    (512, 8, 8),
    (1024, 4, 8),
    (2048, 2, 8),
    (4096, 1, 8),
    (8192, 1, 16),
    (16384, 1, 32),
)
_BWD_TABLE = (
    (64, 32, 4, 4),
    (256, 16, 8, 2),
    (512, 8, 8, 2),
    (1024, 4, 8, 2),
    (2048, 2, 8, 2),
    (4096, 1, 8, 2),
    (8192, 1, 16, 1),
)
# Rows longer than the last table entry: chunks of block_n columns, each row swept twice.
# The forward's grid is not persistent: keep its CTAs large (32 warps at ~32 registers: 2 per SM) so
# that the rows in flight, ~ 132 SMs × 2 × n_cols × bytes(x) (34 MiB at 65536 bf16), stay in L2 for
# the second sweep. Backward at 32 warps compiles to 64 registers, no spills (ptxas, sm_90a).
_FWD_LONG = LaunchConfig(block_n=16384, rows=1, num_warps=32, programs_per_sm=0, chunked=True)
_BWD_LONG = LaunchConfig(block_n=16384, rows=1, num_warps=32, programs_per_sm=1, chunked=True)
# Long-row backward: the second sweep re-reads x and dy and read-modify-writes the program's fp32
# dw partial row; both should still be in L2. Persistent programs are capped so that
# programs × n_cols × (4 + bytes(x) + bytes(dy)) stays within this budget (H100/H200 L2: 50 MiB).
L2_BUDGET_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class SplitBackwardConfig:
    """The backward of rows too long to hold whole, split across programs by columns: a row-dot kernel
    (one program per row and dot_block columns: the partial sums of g·xhat), then a dx/dw kernel (one
    program per group of rows and block_n columns: c from the partial sums, dx, and the group's dw
    partial row kept in registers). x and dy are read twice from HBM, but every SM is busy however few
    the rows, and no dw partial row is read-modify-written through L2 (the chunked kernel's limit)."""
    dot_block: int = 4096  # columns per row-dot program (power of two)
    dot_warps: int = 8
    block_n: int = 2048  # columns per dx/dw program (power of two)
    num_warps: int = 4
    programs_per_sm: int = 4  # sizes the row groups: about this many dx/dw programs per SM
    num_stages: int = 3  # software pipelining of the dx/dw kernel's row loop


def heuristic_config(n_cols: int, backward: bool) -> LaunchConfig:
    """Block, rows per tile, warps (and, for backward, persistent programs per SM) for a row length,
    from the tables above: the one-kernel path's config under the CPU interpreter."""
    block_n = max(16, next_pow2(n_cols))
    if backward:
        for max_cols, rows, num_warps, per_sm in _BWD_TABLE:
            if n_cols <= max_cols:
                return LaunchConfig(block_n, rows, num_warps, per_sm, num_stages=2)
        return _BWD_LONG
    for max_cols, rows, num_warps in _FWD_TABLE:
        if n_cols <= max_cols:
            return LaunchConfig(block_n, rows, num_warps, 0)
    return _FWD_LONG


# ----------------------------------------------------------------------------------------------
# Dispatch: plan() decides the path and config of every call; all of its thresholds are here
# ----------------------------------------------------------------------------------------------

# Backward rows longer than this take the split kernels (no one-kernel config holds them whole).
SPLIT_BACKWARD_FROM = 16384
# The row lengths norm_smem's kernels take, and their shape for each: every length is whole chunks
# of its shape (2-4 in the backward, 8 in the forward: the kernels' dw0-dw3 and x0-x7). Shorter backward
# rows: the one-kernel backward holds them whole in registers. The forward takes 65536 only: at 32768
# (4 chunks) the Triton forward, which holds such a row whole, is faster.
CLUSTER_BACKWARD_SHAPES = {
    16384: ClusterShape(warps=4, ctas=4, per_sm=6),  # 4 chunks of 4096
    24576: ClusterShape(warps=4, ctas=8, per_sm=6),  # 3 chunks of 8192
    32768: ClusterShape(warps=4, ctas=8, per_sm=6),  # 4 chunks of 8192
    49152: ClusterShape(warps=8, ctas=8, per_sm=4),  # 3 chunks of 16384
    65536: ClusterShape(warps=8, ctas=8, per_sm=4),  # 4 chunks of 16384
}
CLUSTER_FORWARD_SHAPES = {
    65536: ClusterShape(warps=4, ctas=8, per_sm=6),  # 8 chunks of 8192
}
# Fewer rows than this per cluster and the dw partial rows (one per cluster), or the per-CTA copies of w,
# start to cost as much as the rows themselves: the other paths take those calls.
MIN_ROWS_PER_CLUSTER = 4
OP_NAMES = {"forward": "rms_norm_fwd", "backward": "rms_norm_bwd"}  # the op names _dispatch knows the paths by



def cluster_shape(n_cols: int, backward: bool) -> Optional[ClusterShape]:
    """The cluster kernels' shape for rows of n_cols (CLUSTER_BACKWARD_SHAPES / CLUSTER_FORWARD_SHAPES),
    or None for a length they do not take."""
    return (CLUSTER_BACKWARD_SHAPES if backward else CLUSTER_FORWARD_SHAPES).get(n_cols)


def cluster_launch(n_rows: int, n_cols: int, x_dtype: torch.dtype, weight_dtype: Optional[torch.dtype],
                   direction: str, *, device: DeviceFacts, dy_dtype: Optional[torch.dtype] = None,
                   from_output: bool = False, aligned: bool = True,
                   deterministic: bool = False) -> tuple[Optional[ClusterLaunch], str]:
    """(the "cluster" path's config, why) for a call, or (None, why not): plan()'s conditions for
    norm_smem's kernels. Both directions: a length of its table, Gluon, an NVIDIA GPU with
    thread-block clusters (compute capability >= 9.0), x and the weight (if any) of one 16-bit dtype,
    16-byte aligned rows (`aligned`), at least MIN_ROWS_PER_CLUSTER rows per cluster. The backward also:
    a weight, dy of x's dtype, from the input (the backward from the saved output recovers xhat per
    element, which the other paths do), and not deterministic mode (which rows a cluster's dw partial
    row sums varies between runs; a row's y and rstd do not, so the forward runs there)."""
    backward = direction == "backward"
    shape = cluster_shape(n_cols, backward)
    if shape is None:
        return None, f"the cluster kernels take no rows of {n_cols}"
    refusal = _gpu.cluster_refusal(device, x_dtype, weight_dtype)
    if refusal:
        return None, refusal
    if backward:
        if weight_dtype is None:
            return None, "no weight"
        if dy_dtype != x_dtype:
            return None, f"dy ({dy_dtype}) is not of x's dtype ({x_dtype})"
        if from_output:
            return None, "the backward from the saved output"
        if deterministic:
            return None, "deterministic mode (dw's rounding would depend on which cluster claims a row)"
    return _gpu.cluster_grid(n_rows, n_cols, shape, device, aligned=aligned, min_rows_per_cluster=MIN_ROWS_PER_CLUSTER)


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one forward or backward call: n_rows rows of n_cols, x's and the weight's
    dtypes (weight None: no weight), `direction` ("forward" or "backward"), and for the cluster path dy's
    dtype, whether the backward starts from the saved output, whether every row (and the weight) is
    16-byte aligned, and whether deterministic mode is on."""
    n_rows: int
    n_cols: int
    x_dtype: torch.dtype
    weight_dtype: Optional[torch.dtype]
    direction: str
    dy_dtype: Optional[torch.dtype] = None
    from_output: bool = False
    aligned: bool = True
    deterministic: bool = False


def plan(call: Call, device: DeviceFacts) -> Plan:
    """The path and config of one forward or backward call (`direction`) on n_rows rows of n_cols:
    "cluster" (a ClusterLaunch) where `cluster_launch` allows it and `_dispatch` has not turned it off,
    else for the backward of rows longer than SPLIT_BACKWARD_FROM "split" (a SplitBackwardConfig), else
    "triton": the one kernel, with the heuristic table's LaunchConfig under the CPU interpreter or None
    (triton.autotune chooses) on a GPU. The facts: x's and the weight's dtypes (weight None: no weight),
    the device's (DeviceFacts), and for the cluster path dy's dtype, whether the backward starts from the
    saved output, whether every row is 16-byte aligned and whether deterministic mode is on (all in
    `call`); the heuristic table where `device.interpreted` (the CPU interpreter)."""
    if call.direction not in OP_NAMES:
        raise ValueError(f"direction must be 'forward' or 'backward'; got {call.direction!r}")
    n_cols = call.n_cols
    backward = call.direction == "backward"
    if _dispatch.path_on(OP_NAMES[call.direction], "cluster"):
        config, why = cluster_launch(call.n_rows, n_cols, call.x_dtype, call.weight_dtype, call.direction,
                                     device=device, dy_dtype=call.dy_dtype, from_output=call.from_output,
                                     aligned=call.aligned, deterministic=call.deterministic)
        if config is not None:
            return Plan(Path.CLUSTER, config, why)
    else:
        why = "the cluster kernel is off (its first build failed here)"
    if backward and n_cols > SPLIT_BACKWARD_FROM:
        return Plan(Path.SPLIT, SplitBackwardConfig(),
                    f"rows of {n_cols} > {SPLIT_BACKWARD_FROM} columns, split across programs; not cluster: {why}")
    if device.interpreted:
        return Plan(Path.TRITON, heuristic_config(n_cols, backward), f"one kernel, heuristic table; not cluster: {why}")
    return Plan(Path.TRITON, None, f"one kernel, autotuned among candidate_configs; not cluster: {why}")


# ----------------------------------------------------------------------------------------------
# The one-kernel path on a GPU: the autotuner's candidates; grid sizes
# ----------------------------------------------------------------------------------------------

# Autotuning: the candidate space. Rows up to these lengths may be held whole in registers (the
# backward holds ~4 arrays per element, the forward ~2); longer rows go through the chunked path,
# which is also tried from _CHUNKED_FROM columns on, so the autotuner compares both where they meet.
_SINGLE_PASS_MAX = {False: 32768, True: 16384}
_CHUNKED_FROM = 8192
_CHUNK_BLOCKS = (4096, 8192, 16384)
_MAX_PROGRAMS_PER_SM = 4


def _regs_per_thread(per_thread: int, rows: int, num_stages: int, backward: bool) -> int:
    """Registers per thread, rounded up from sm_90a compiles (bf16, llama casting, triton 3.9; see
    dev/check_sm90.py), by fp32 values per thread per held array."""
    if backward:
        if rows > 1:
            return 128
        if per_thread <= 8:
            return 64 if num_stages <= 2 else 80
        return 96
    return 64 if per_thread <= 16 else 80


def _resident_programs(cfg: LaunchConfig, backward: bool, device: DeviceFacts) -> int:
    """Persistent programs per SM that surely fit at once on `device` (registers, threads, the shared
    memory one program may take for the pipelined tiles of fp32-sized inputs), 1..4: a persistent grid
    larger than what fits would run in two unequal waves, so this errs low (the pipelining keeps the
    loads in flight)."""
    threads = 32 * cfg.num_warps
    per_thread = cfg.tile // threads
    by_regs = 65536 // (_regs_per_thread(per_thread, cfg.rows, cfg.num_stages, backward) * threads)
    arrays = 2 if backward else 1
    shared = (max(cfg.num_stages, 2) - 1) * cfg.tile * 4 * arrays + cfg.tile * 4
    by_shared = device.smem_per_block // shared
    return max(1, min(by_regs, 2048 // threads, by_shared, _MAX_PROGRAMS_PER_SM))


# The GPU the tables above were measured on and dev/check_sm90.py compiles for: the facts that
# candidate_configs and _prune use when no device is named (tests, sm_90a compiles).
SM90 = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)


def candidate_configs(backward: bool, device: DeviceFacts = SM90) -> list[LaunchConfig]:
    """Every config the autotuner may try on `device`, for all row lengths; `_prune` keeps those that fit
    one. `device` sizes the persistent grids (`_resident_programs`: its shared memory per program).

    Single pass (block_n = n_cols rounded up to a power of two): one row per tile with 8, 16 (and,
    forward only, 32) fp32 values per thread, or several rows stacked into a 2–4 K element tile for
    short rows. The forward tries one program per tile and a persistent grid whose tile loop Triton
    pipelines (3 stages); the backward is always persistent, with 2 or 4 stages. Chunked: 4–16 K
    column chunks with 8 or 16 values per thread, chunk loops pipelined or not."""
    shapes = []  # (block_n, rows, num_warps, chunked)
    block_n = 16
    while block_n <= _SINGLE_PASS_MAX[backward]:
        rows = 1
        while rows == 1 or rows * block_n <= 4096:
            tile = rows * block_n
            if rows == 1 or tile >= 2048:
                for num_warps in (1, 2, 4, 8, 16, 32):
                    per_thread = tile // (32 * num_warps)
                    allowed = (8, 16) if (backward or rows > 1) else (8, 16, 32)
                    fits_regs = _regs_per_thread(per_thread, rows, 2, backward) * num_warps <= 2048
                    # a long row held whole by 32 warps: the backward's 16 K spills, the forward's 32 K
                    # needs 63 registers (dev/check_sm90.py); each reads its inputs once where the
                    # chunked path reads them twice, and the autotuner weighs the two
                    whole_long_row = num_warps == 32 and block_n == (16384 if backward else 32768)
                    if whole_long_row or (per_thread in allowed and fits_regs):
                        shapes.append((block_n, rows, num_warps, False))
            rows *= 2
        block_n *= 2
    for block_n in _CHUNK_BLOCKS:
        for num_warps in (8, 16, 32):
            if block_n // (32 * num_warps) in (8, 16):
                shapes.append((block_n, 1, num_warps, True))
    out = []
    for block_n, rows, num_warps, chunked in shapes:
        if chunked:
            stage_choices = (1, 3)
        elif backward:
            stage_choices = (2, 4)
        else:
            stage_choices = (1, 3)  # 1: one program per tile; 3: persistent and pipelined
        for num_stages in stage_choices:
            cfg = LaunchConfig(block_n, rows, num_warps, 0, chunked, num_stages)
            persistent = backward or (num_stages > 1 and not chunked)
            per_sm = _resident_programs(cfg, backward, device) if persistent else 0
            out.append(dataclasses.replace(cfg, programs_per_sm=per_sm))
            if backward and chunked and num_stages == 1:  # the autotuner weighs L2 re-use against idle SMs
                out.append(dataclasses.replace(cfg, programs_per_sm=per_sm, l2_cap=False))
    return out


def _fits(meta: dict, n_cols: int) -> bool:
    if meta["SINGLE_PASS"]:
        return meta["BLOCK_N"] == max(16, next_pow2(n_cols))
    return n_cols > _CHUNKED_FROM and n_cols > meta["BLOCK_N"]


_REDUCTION_SCRATCH = 7 * 1024  # shared memory a program keeps beside its pipelined tiles (reductions)


def shared_limit(device: DeviceFacts) -> int:
    """Shared memory the pipelined tiles of one program may take on `device`: what a program may opt in
    to, less room for reduction scratch (220 KiB on an H100/H200, 156 KiB on an A100)."""
    return device.smem_per_block - _REDUCTION_SCRATCH


_SHARED_LIMIT = shared_limit(SM90)  # SM90's, which _prune uses when no device is named


def _pipelined_shared_bytes(meta: dict, bytes_per_col: int, partial_bytes: int) -> int:
    """Shared memory the pipeliner takes: num_stages - 1 buffered tiles of every input the loop loads,
    per pipelined loop (the chunked path has two; its backward's second also loads the dw partial)."""
    buffers = meta["NUM_STAGES"] - 1
    if meta["SINGLE_PASS"]:
        return buffers * meta["ROWS"] * meta["BLOCK_N"] * bytes_per_col
    return buffers * meta["BLOCK_N"] * (2 * bytes_per_col + partial_bytes)


def _prune(configs, named_args, device: DeviceFacts = SM90, **kwargs):
    """triton.autotune's early_config_prune: the candidates for this row length whose pipelined tiles
    fit in `device`'s shared memory for these dtypes (and, for few rows, no more rows per tile than there
    are). rms_norm builds each GPU's autotuner with that GPU's facts bound here."""
    n_cols, row_bucket = named_args["n_cols"], named_args["row_bucket"]
    x = named_args.get("X")
    dy = named_args.get("DY")
    bytes_per_col = (x.element_size() if x is not None else 2) + (dy.element_size() if dy is not None else 0)
    partial_bytes = 4 if dy is not None else 0
    fitting = [c for c in configs if _fits(c.kwargs, n_cols)
               and _pipelined_shared_bytes(c.kwargs, bytes_per_col, partial_bytes) <= shared_limit(device)]
    fitting = fitting or [c for c in configs if _fits(c.kwargs, n_cols)]
    few_rows = [c for c in fitting if c.kwargs["ROWS"] <= row_bucket]
    if few_rows:
        return few_rows
    least = min(c.kwargs["ROWS"] for c in fitting)
    return [c for c in fitting if c.kwargs["ROWS"] == least]


def _row_bucket(n_rows: int) -> int:
    """Part of the autotuning key: the row count rounded up to a power of two (16 .. 65536), so that
    the choice is remade when the grid's size class changes, not for every new batch shape."""
    return min(max(16, next_pow2(n_rows)), 65536)


def _programs(rows: int, per_sm: float, chunked: bool, n_rows: int, n_cols: int, bytes_per_col: int,
              sm_count: int, l2_cap: bool = True) -> int:
    """Grid size: one program per tile when per_sm is 0, else a persistent grid of about per_sm
    programs per SM (never more than tiles; chunked backward: capped by the L2 budget, unless not)."""
    n_tiles = cdiv(n_rows, rows)
    if per_sm <= 0:
        return n_tiles
    programs = max(1, int(per_sm * sm_count))
    if chunked and bytes_per_col and l2_cap:
        programs = min(programs, max(1, L2_BUDGET_BYTES // (n_cols * bytes_per_col)))
    programs = min(programs, n_tiles)
    # Same number of sweeps with fewer programs where possible (fewer dw partial rows to sum).
    return cdiv(n_tiles, cdiv(n_tiles, programs))


def backward_programs(cfg: LaunchConfig, n_rows: int, n_cols: int, bytes_per_col: int, sm_count: int) -> int:
    """How many persistent backward programs to launch (each owns one fp32 dw partial row)."""
    return _programs(cfg.rows, cfg.programs_per_sm, cfg.chunked, n_rows, n_cols, bytes_per_col, sm_count,
                     cfg.l2_cap)



# dw's last step: the sum over the backward's fp32 partial rows, cast to the weight's dtype, one column
# block per program: one launch where torch takes two (a reduce, then the cast). Rows: (largest n_cols,
# columns per program, partial rows per load, num_warps); narrow blocks give enough programs.
_DW_SUM_TABLE = (
    (16384, 32, 16, 8),
    (None, 64, 16, 1),  # e.g. the cluster backward's 64 partial rows of 65536
)


def dw_sum_config(n_cols: int) -> tuple[int, int, int]:
    """(columns per program, partial rows per load, num_warps) of _dw_sum_kernel for a row length."""
    for max_cols, block_n, parts, num_warps in _DW_SUM_TABLE:
        if max_cols is None or n_cols <= max_cols:
            return block_n, parts, num_warps
    raise AssertionError("the table's last row takes every width")
