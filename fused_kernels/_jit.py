"""Triton helpers shared by the op files: rounding to bf16 as the GPU does, for the interpreter.

The CPU interpreter truncates on fp32 -> bf16 casts where the GPU rounds to nearest even. Kernels
take a constexpr EXACT_BF16 (True only under the interpreter) and pass values through these before a
bf16 cast, so that CPU tests see the GPU's roundings; on the GPU they compile to nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rtne(v):
    """fp32 values rounded to the nearest bf16 (ties to even), kept as fp32 (bit-exact)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rounded(v, DTYPE: tl.constexpr, EXACT_BF16: tl.constexpr):
    """fp32 values rounded to DTYPE and back: the intermediate cast of a computation."""
    if EXACT_BF16 and DTYPE == tl.bfloat16:
        out = bf16_rtne(v)
    else:
        out = v.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def for_store(v, DTYPE: tl.constexpr, EXACT_BF16: tl.constexpr):
    """Values about to be stored to a DTYPE buffer; only the interpreter needs them pre-rounded."""
    if EXACT_BF16 and DTYPE == tl.bfloat16:
        v = bf16_rtne(v)
    return v
