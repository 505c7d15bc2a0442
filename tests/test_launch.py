"""fused_kernels._launch: the cached direct launch must pick the kernel Triton would pick. The key tells
apart everything Triton specialises on (CPU), and on a GPU the direct path computes what `kernel[grid]`
does for aligned and unaligned tensors, ints divisible by 16 or not, and new constexprs."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fused_kernels import _launch
from helpers import poison_


def _axpy(X, Y, OUT, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    y = tl.load(Y + offs, mask=mask).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(OUT + offs, (alpha * x + y).to(OUT.dtype.element_ty), mask=mask)


def test_key_separates_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.float32)
    key = _launch._arg_key
    assert key(base) == key(torch.ones(8, dtype=torch.float32))
    assert key(base) != key(base[1:])  # 4-byte offset: not 16-byte aligned
    assert key(base) != key(base.to(torch.bfloat16))
    assert key(base[4:]) == key(base)  # 16 bytes in: aligned again
    assert key(1) != key(2) != key(16)
    assert key(16) == key(32) and key(3) == key(5)
    assert key(2**31 - 16) != key(2**31) != key(2**63)
    assert key(0.5) == key(2.0) and key(True) != key(1) and key(None) != key(0)


def test_constexpr_slots_fill_the_parameters_in_order():
    kernel = JITFunction(_axpy)
    assert _launch._slots(kernel, 5, {"BLOCK": 128, "num_warps": 4}) == ((5, 128), (6, False))
    assert _launch._slots(kernel, 5, {"BLOCK": 64, "SQUARE": True}) == ((5, 64), (6, True))
    assert _launch._slots(kernel, 5, {"num_warps": 4}) is None  # BLOCK has no default
    assert _launch._slots(kernel, 4, {"BLOCK": 64}) is None  # a positional argument short


@pytest.mark.gpu
def test_direct_launch_matches_triton():
    kernel = triton.jit(_axpy)
    _launch.clear()
    dev = "cuda"
    for dtype in (torch.float32, torch.bfloat16):
        buf_x = torch.randn(4099, device=dev).to(dtype)
        buf_y = torch.randn(4099, device=dev).to(dtype)
        # aligned and unaligned views, sizes divisible by 16 or not, both constexpr values; each twice so
        # that the second call takes the cached path
        for start, n, square in [(0, 4096, False), (1, 4096, False), (0, 4001, True), (3, 1000, True)] * 2:
            x, y = buf_x[start:start + n], buf_y[start:start + n]
            out = poison_(torch.empty(n, device=dev, dtype=dtype))
            _launch.launch(kernel, (triton.cdiv(n, 256),), (x, y, out, n, 0.75),
                           {"BLOCK": 256, "SQUARE": square, "num_warps": 4})
            xf = x.double()
            ref = 0.75 * (xf * xf if square else xf) + y.double()
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert not out.isnan().any()
            assert ((out.double() - ref).norm() / ref.norm()).item() <= tol, (dtype, start, n, square)
    # every (dtype, alignment, size class, constexpr) combination got its own compiled kernel, and the
    # repeated launches reused them
    assert len(_launch._COMPILED) == 8
