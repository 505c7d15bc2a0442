"""Launching a Triton kernel with less host time than `kernel[grid](*args, **meta)`.

Why: a fused op's forward+backward moves 0.1–0.3 ms of data on an H200, and `JITFunction.run` spends
tens of µs per launch re-binding every argument, rebuilding its cache key and reading its knobs. Three
or four launches per op then cost more CPU time than the GPU needs, and a training step waits on Python.

How: the first launch for a given specialisation goes through `kernel[grid]`, which compiles (or finds)
the kernel and returns it; we keep that CompiledKernel under a key holding everything Triton specialises
on, and later launches with the same key call it directly (`compiled[grid](*all_args, stream=...)`,
Triton's own launcher, with the constexprs in their parameter slots). The key is a superset of Triton's:
  - each tensor: dtype and whether its address is 16-byte aligned;
  - each int: whether it is 1, divisible by 16, and which of i32 / i64 / u64 holds it;
  - each float, bool or None: its kind;
  - the constexprs and launch options (num_warps, num_stages, ...) by value, and the current device.
A key Triton would tell apart from another is told apart here too, so a cached kernel is always the one
Triton would have picked. The direct path goes through the CompiledKernel's own launcher, which calls
Triton's launch hooks (profilers such as proton) as `kernel[grid]` does. It is not used under the
interpreter, or for a launch whose arguments do not fill the kernel's parameters positionally in order
with every constexpr in `meta`.
"""

from __future__ import annotations

import inspect

import torch
from triton.runtime import driver

from fused_kernels._utils import interpreter_on

_INTERPRETED = interpreter_on()
_COMPILED: dict = {}


def _launcher_takes_constexprs():
    """How this Triton's JITFunction.run hands arguments to a CompiledKernel's launcher: every bound
    argument, constexprs included (True, Triton >= 3.3), only the others (False, older), or unknown
    (None: the direct path is off)."""
    try:
        from triton.runtime.jit import JITFunction

        src = inspect.getsource(JITFunction.run)
    except Exception:  # noqa: BLE001 - no source to read: take the checked path
        return None
    if "*bound_args.values()" in src:
        return True
    if "*non_constexpr_vals" in src:
        return False
    return None


_WITH_CONSTEXPRS = None if _INTERPRETED else _launcher_takes_constexprs()


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return type(a)
    if isinstance(a, int):
        width = "u64" if a >= 2**63 else "i32" if -(2**31) <= a < 2**31 else "i64"
        return width, a == 1, a % 16 == 0
    if isinstance(a, float):
        return float
    return None  # anything else: not cached (see _slots)


def _slots(kernel, n_positional: int, meta: dict):
    """The constexpr values to insert, as (parameter index, value) in order, when `n_positional`
    arguments fill the non-constexpr parameters in order and `meta` (or a default) gives every
    constexpr; else None."""
    inserts = []
    for p in kernel.params:
        if p.is_constexpr:
            if p.name in meta:
                inserts.append((p.num, meta[p.name]))
            elif p.default is not inspect.Parameter.empty:
                inserts.append((p.num, p.default))
            else:
                return None
    if n_positional + len(inserts) != len(kernel.params):
        return None
    return tuple(inserts)


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """`kernel[grid](*args, **meta)`: args are the kernel's non-constexpr parameters in order, meta its
    constexprs by name plus Triton's launch options (num_warps, num_stages)."""
    if _WITH_CONSTEXPRS is None:
        kernel[grid](*args, **meta)
        return
    keys = tuple(_arg_key(a) for a in args)
    device = driver.active.get_current_device()
    key = (kernel, device, tuple(meta.items()), keys)
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        inserts = _slots(kernel, len(args), meta)
        if inserts is not None and None not in keys and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = (compiled, inserts if _WITH_CONSTEXPRS else ())
        return
    compiled, inserts = entry
    full = list(args)
    for index, value in inserts:
        full.insert(index, value)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    compiled[grid3](*full, stream=driver.active.get_current_stream(device))


def clear() -> None:
    """Forget the cached kernels (tests; after changing Triton knobs)."""
    _COMPILED.clear()
