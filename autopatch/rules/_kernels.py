"""How every rule reaches fused_kernels: imported only when a rule patches or a patched forward runs
(after the first time a sys.modules hit), and one reason for a Record when it cannot be imported."""

from __future__ import annotations

from autopatch.rules import _probe


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
