"""moe_experts' launch shapes and its one `plan(call, device)`: which GEMM path runs a call ("grouped_mm"
or "loop", fused_kernels/ops/moe_experts.py's docstring says what each is), the Triton kernels' blocks,
and why. Plain Python, no kernels."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts
from fused_kernels._ints import next_pow2

# torch's grouped GEMM (a public name from torch 2.9 on, private before), or None where this torch has none
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_CAPABILITY = (8, 0)  # the grouped GEMM's CUDA kernels: sm_80 and newer


class ExpertsConfig(NamedTuple):
    combine_block: int  # columns per combine program
    combine_warps: int
    bwd_block_m: int  # rows per program of the backward's elementwise pass
    bwd_block_n: int  # columns per chunk (the pass loops over the width in chunks)
    bwd_warps: int


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one call: S = n_rows routed rows, hidden size H, expert width I, the
    operands' dtype, and whether every GEMM operand's row stride and base address are multiples of
    16 bytes (the grouped GEMM needs that)."""
    n_rows: int
    hidden_size: int
    width: int
    dtype: torch.dtype
    aligned: bool = True


def plan(call: Call, device: DeviceFacts) -> Plan:
    """Which GEMM path runs and the launch shapes of the Triton kernels: "grouped_mm" for bfloat16 on a
    CUDA GPU of sm_80 or newer, float32 or bfloat16 off the GPU, aligned operands and a torch that has
    the grouped GEMM; else "loop" (one mm per expert), with the reason."""
    combine_block = min(next_pow2(call.hidden_size), 4096)
    bwd_block_n = min(next_pow2(call.width), 1024)
    cfg = ExpertsConfig(combine_block=combine_block, combine_warps=4 if combine_block <= 2048 else 8,
                        bwd_block_m=max(1, 2048 // bwd_block_n), bwd_block_n=bwd_block_n, bwd_warps=4)
    dtype = call.dtype
    if call.n_rows == 0:
        return Plan(Path.LOOP, cfg, "no routed rows: nothing to multiply")
    if GROUPED_MM is None:
        return Plan(Path.LOOP, cfg, f"torch {torch.__version__} has no grouped GEMM: one mm per expert")
    if not call.aligned:
        return Plan(Path.LOOP, cfg, "an operand's row stride or address is not a multiple of 16 bytes, which the "
                                    "grouped GEMM needs: one mm per expert")
    if device.cuda:
        if device.capability < GROUPED_MM_CAPABILITY:
            return Plan(Path.LOOP, cfg, f"sm_{device.capability[0]}{device.capability[1]}: the grouped GEMM needs "
                                        "sm_80 or newer")
        if dtype != torch.bfloat16:
            return Plan(Path.LOOP, cfg, f"{dtype} on CUDA: the grouped GEMM takes bfloat16")
        return Plan(Path.GROUPED_MM, cfg, "bfloat16 on sm_80+: torch's grouped GEMM, offsets on the GPU")
    if dtype not in (torch.float32, torch.bfloat16):
        return Plan(Path.LOOP, cfg, f"{dtype} on the CPU: the grouped GEMM takes float32 and bfloat16")
    return Plan(Path.GROUPED_MM, cfg, "torch's grouped GEMM on the CPU")
