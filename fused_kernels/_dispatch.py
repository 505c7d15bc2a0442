"""What every op's `plan()` returns, and the one mechanism that turns a path off after it fails to build.

Each op has one `plan(call, device)` function, in fused_kernels/ops/<op>_config.py with the op's tables:
given the call's shapes and dtypes (the module's frozen `Call`) and the device's facts (DeviceFacts), it
returns a `Plan` naming the implementation that runs (`path`, one of `Path`'s names), its launch shape
(`config`) and why (`reason`). Nothing else in the op decides which kernel runs, so the dispatch of an
op is read in one place and tested on the CPU by asserting the plan for named shapes (a plan can be
asked for a device it is not running on: `plan()` takes the device's facts, not a tensor).

Some paths use experimental Triton APIs (Gluon: thread-block clusters, shared-memory layouts) that
change between Triton releases. Such a launch goes through `run_path`: when its first build for a given
key fails, the path is turned off for the process with one warning, and `plan()` (which asks
`path_on`) then picks the next path, which computes the same numbers. A launch that has run before and
then fails, or one whose path was forced, raises: that is a real error, not an unsupported build.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Hashable

import triton


class Path:
    """Every path name a Plan may carry, in one vocabulary (each op's docs say which of them it takes)."""

    TRITON = "triton"  # the op's Triton kernel (rms_norm, cross_entropy)
    CLUSTER = "cluster"  # a row over a thread-block cluster, in shared memory (rms_norm: norm_smem)
    SPLIT = "split"  # rms_norm's backward of long rows, split across programs
    WHOLE_ROW = "whole-row"  # layer_norm: each row held in registers
    CHUNKED = "chunked"  # layer_norm: rows swept twice in column chunks, both directions
    CHUNKED_BACKWARD = "chunked backward"  # layer_norm: the backward chunked, the forward whole-row
    CLUSTER_BACKWARD = "cluster backward"  # layer_norm: the backward over a cluster (norm_smem)
    FIXED = "fixed"  # rope: one launch config, no autotuning
    AUTOTUNE = "autotune"  # rope: triton.autotune picks the config
    FLAT = "flat"  # glu, gelu: contiguous operands as one flat row
    ROWS = "rows"  # glu: strided row views
    SMEM = "smem"  # cross_entropy: the row in one CTA's shared memory (cross_entropy_smem)
    SMEM_SPLIT = "smem-split"  # cross_entropy: the row split over a cluster's shared memory
    SMEM_REGISTERS = "smem-registers"  # cross_entropy: smem or smem-split, first chunks in registers
    CHUNKS = "chunks"  # fused_linear_cross_entropy: the logits in chunks of rows
    LOOP = "loop"  # moe_experts: one mm per expert
    GROUPED_MM = "grouped_mm"  # moe_experts: torch's grouped GEMM


PATHS = frozenset(v for k, v in vars(Path).items() if k.isupper())


@dataclasses.dataclass(frozen=True)
class Plan:
    """The implementation an op runs for one call: `path` (one of Path's names), `config` (its launch
    shape, or None) and `reason` (why this path, for people and for `explain`). Every op's
    `<op>_config.plan(call, device)` returns one, from the call's shapes and dtypes (a frozen `Call` of
    that module) and the device's facts (fused_kernels._gpu.DeviceFacts)."""

    path: str
    config: Any = None
    reason: str = ""

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"Plan path {self.path!r} is not one of fused_kernels._dispatch.Path's: "
                             f"{', '.join(sorted(PATHS))}")


_LOCK = threading.Lock()
_OFF: dict[tuple[str, str], str] = {}  # (op, path) -> why it was turned off
_BUILT: set[tuple] = set()  # (op, path, key) that built and launched at least once


def path_on(op: str, path: str) -> bool:
    """False once `path` of `op` failed its first build in this process (see run_path)."""
    return (op, path) not in _OFF


def run_path(op: str, path: str, key: Hashable, launch: Callable[[], None], *, instead: str,
             forced: bool = False) -> bool:
    """Run `launch()` for `path` of `op`; True when it ran. A first build of `key` that fails turns the
    path off (one RuntimeWarning naming `instead`, what runs from now on) and returns False, so the
    caller plans again. A key that ran before, or a forced path, re-raises the error."""
    try:
        launch()
    except Exception as exc:  # noqa: BLE001 - only a first build is forgiven (below)
        with _LOCK:
            seen = (op, path, key) in _BUILT
        if seen or forced:
            raise
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
        with _LOCK:
            _OFF[(op, path)] = why
        warnings.warn(
            f"fused_kernels.{op}: the {path} kernel did not build or launch with triton {triton.__version__} "
            f"({why}); {instead} from now on (same results)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    with _LOCK:
        _BUILT.add((op, path, key))
    return True


def planned_again(op: str, path: str, plan: Plan) -> Plan:
    """`plan`, an op's plan made after run_path turned `path` off; an error if it chose `path` again."""
    if plan.path == path:
        raise RuntimeError(f"{op}: plan() chose the {path} path again after it was turned off ({plan})")
    return plan


def turned_off() -> dict[str, str]:
    """{"op/path": why} for every path turned off in this process."""
    with _LOCK:
        return {f"{op}/{path}": why for (op, path), why in _OFF.items()}


def reset() -> None:
    """Forget every failure and build (tests)."""
    with _LOCK:
        _OFF.clear()
        _BUILT.clear()
