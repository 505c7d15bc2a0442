"""How every rule reaches fused_kernels at run time: imported only when a rule patches or a patched
forward runs (after the first time a sys.modules hit), one reason for a Record when it cannot be
imported, and the one line a patched component says when it has to run the original code."""

from __future__ import annotations

import torch

from autopatch.rules import _probe
from autopatch.session import say


def kernels():
    """The fused_kernels package."""
    import fused_kernels

    return fused_kernels


def import_problem() -> str:
    """"" when fused_kernels imports; otherwise why not, as a Record's reason."""
    try:
        kernels()
    except Exception as exc:  # noqa: BLE001  (any import failure leaves the model unpatched, with the reason)
        return f"fused_kernels could not be imported ({_probe.describe_exc(exc)})"
    return ""


def fallback_line(kernel: str, detail: str) -> str:
    """The one notice a patched component says the first time it runs the original code."""
    return (f"autopatch: {kernel}: {detail}; running the original code instead "
            "(Triton runs on CUDA tensors, or on the CPU with TRITON_INTERPRET=1)")


def fallback(session, kernel: str, detail: str) -> None:
    """A patched component of `kernel` is about to run the original code (`detail`: why, e.g.
    "LlamaRMSNorm got cpu tensors"): recorded in the session (strict mode raises there), said once per
    kernel."""
    if session.note_fallback(kernel, detail):
        say(fallback_line(kernel, detail))


def notice(session, kernel: str, detail: str, model=None) -> None:
    """One stderr line per distinct reason a patched path did not apply for reasons other than where
    Triton runs (fallback() says those). Skipped while torch.compile traces: printing would break the
    graph. With `model` (a patched call that falls back), the reason is also the exit check's answer
    if the kernel never runs (Session.note_bypass)."""
    if torch.compiler.is_compiling():
        return
    if session.say_once(f"{kernel}: {detail}", f"autopatch: {kernel}: {detail}") and model is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
        session.note_bypass(kernel, type(model).__name__, f"the patched forward fell back: {detail}", model_type,
                            fallback=True)
