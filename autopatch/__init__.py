"""autopatch: fused Triton kernels put into Hugging Face Transformers models from environment
variables alone. Public API: apply(model, **toggles), applied(), settings().

This file is imported by the start-up .pth line in every interpreter of the environment, so it
imports nothing heavy: the API functions load their modules on first call."""

__version__ = "0.1.0"


def apply(model, **toggles):
    """Patch an already-built model with the same rules the import hooks use. Keywords are the
    kernel names of HF's liger_kernel_config (rope=True, rms_norm=True, ...). Returns the records."""
    from autopatch._api import apply as _apply

    return _apply(model, **toggles)


def applied():
    """Every patch and refusal recorded in this process (list of autopatch.report.Record)."""
    from autopatch.report import records

    return records()


def settings():
    """The validated settings from the environment / env file (autopatch.config.Settings)."""
    from autopatch.config import load_settings

    return load_settings()


__all__ = ["apply", "applied", "settings", "__version__"]
