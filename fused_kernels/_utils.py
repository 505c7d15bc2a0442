"""Shared plumbing for the kernel files: where Triton can run, launch counting, input checks.

Nothing here imports transformers. Each op file (rms_norm.py, rope.py, ...) keeps its own Triton
kernels, custom-op registration and functional entry; this module only holds what every one of them
needs in the same way.
"""

from __future__ import annotations

import collections
import functools
import os
import threading

import torch

_LAUNCHES: collections.Counter[str] = collections.Counter()
_LAUNCH_LOCK = threading.Lock()


def interpreter_on() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """Whether our Triton kernels can run on these tensors: all on CUDA, or all on the CPU under the
    interpreter. Patched components call the original code when this is False."""
    if not tensors:
        return False
    devices = {t.device.type for t in tensors if t is not None}
    if devices == {"cuda"}:
        return True
    if devices == {"cpu"}:
        check_interpreter_unchanged()
    return devices == {"cpu"} and interpreter_on()


def require_triton(op: str, *tensors: torch.Tensor) -> None:
    """RuntimeError naming `op` and the devices when the Triton kernels cannot run on `tensors` (an op's
    entry calls this; patched components check triton_can_run first and call the original code)."""
    if not triton_can_run(*tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"{op}: the Triton kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; "
            f"got tensors on {', '.join(devices)}"
        )


def check_interpreter_unchanged() -> None:
    """Before a launch on CPU tensors: were the kernels built in the TRITON_INTERPRET mode that
    os.environ shows now? triton.jit reads the variable once per kernel, when the kernel's module is
    imported, so setting it later in the script leaves kernels built for the GPU, and launching one
    on CPU tensors fails inside Triton with "0 active drivers". RuntimeError for that case; a
    warning for the reverse (built for the interpreter, variable off since: CPU tensors then take
    the original code). One of our kernels (fused_kernels._jit) tells how they were built."""
    import sys
    import warnings

    kernel = getattr(sys.modules.get("fused_kernels._jit"), "bf16_rtne", None)
    if kernel is None:
        return
    interpreter = sys.modules.get("triton.runtime.interpreter")  # imported by triton.jit in interpreter mode only
    built_interpreted = interpreter is not None and isinstance(kernel, interpreter.InterpretedFunction)
    if built_interpreted == interpreter_on():
        return
    if not built_interpreted:
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set now, but triton and the fused kernels were imported while it was off, "
            "so the kernels were built for a GPU and cannot run on CPU tensors. TRITON_INTERPRET=1 must be set "
            "before triton is imported: export it in the shell, or set it at the top of the script"
        )
    warnings.warn(
        "TRITON_INTERPRET was on when triton and the fused kernels were imported and is off now: CPU tensors "
        "take the original code. Set or unset TRITON_INTERPRET before triton is imported (in the shell, or at "
        "the top of the script), not later",
        RuntimeWarning,
        stacklevel=3,
    )


def count_launch(op: str) -> None:
    """Record that the op `op` ran its Triton kernels once (forward or backward)."""
    with _LAUNCH_LOCK:
        _LAUNCHES[op] += 1


def launch_counts() -> dict[str, int]:
    """How many times each op's kernels ran in this process, e.g. {"rms_norm_fwd": 12, ...}."""
    with _LAUNCH_LOCK:
        return dict(_LAUNCHES)


def reset_launch_counts() -> None:
    with _LAUNCH_LOCK:
        _LAUNCHES.clear()


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer a kernel writes in full. Ops allocate through their module's `_new_output` name, which
    tests replace to fill buffers with NaN and catch unwritten elements."""
    return torch.empty(shape, dtype=dtype, device=device)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """t as a 2-D (rows, n_cols) tensor with unit column stride; a view when the strides allow."""
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    if t2.shape[-1] > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def row_stride(t2: torch.Tensor) -> int:
    """The row stride of a rows_view; a (1, N) or (0, N) view may report any stride, and the kernel
    never steps by it then."""
    return t2.stride(0) if t2.shape[0] > 1 else t2.shape[1]


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise TypeError unless `t` is a tensor of a dtype our kernels take."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
        )


def check_projection(input_name: str, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """Raise unless `weight` (out_features, x.shape[-1]) and `bias` (or None) can project `x` (named
    `input_name` in the message) in x's dtype and on its device: a fused activation + Linear's second half."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (out_features, {x.shape[-1]}) to follow {input_name} of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"{name} must have {input_name}'s dtype {x.dtype} and device {x.device}, "
                            f"got {t.dtype} on {t.device}")


def check_choice(name: str, value, choices) -> None:
    """Raise ValueError unless value is one of choices, naming the valid ones."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def launches_on_device_of(index: int):
    """Decorator for a host function that launches Triton kernels on its positional argument `index`:
    run it with that tensor's GPU as the current device. Triton launches on the current device, which a
    model split over GPUs (device_map="auto") does not switch; on another GPU's memory the launch fails
    or reads wrong data. Costs one device comparison when the device is already current."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = args[index]
            if t.is_cuda and t.get_device() != torch.cuda.current_device():
                with torch.cuda.device(t.device):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return run

    return wrap
