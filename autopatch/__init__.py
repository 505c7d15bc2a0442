"""autopatch: fused Triton kernels put into Hugging Face Transformers models from environment
variables alone. Public API: apply(model, config=None, **toggles), applied(), enable(), settings().

This file is imported by the start-up .pth line in every interpreter of the environment, so it
imports nothing heavy: the API functions load their modules on first call."""

__version__ = "0.1.0"


def apply(model, config=None, **toggles):
    """Patch an already-built model with the same rules the import hooks use. Keywords are the
    kernel names of HF's liger_kernel_config (rope=True, rms_norm=True, ...); `config` may be that dict,
    None, or the TrainingArguments itself. A kernel set to False is restored to the original code for
    the model's classes. Returns the records."""
    from autopatch._api import apply as _apply

    return _apply(model, config, **toggles)


def applied():
    """Every patch and refusal recorded in this process (list of autopatch.session.Record); a patched
    record's `runs` says how often its kernel's patched path ran so far (None: not counted)."""
    from autopatch.report import records_with_runs

    return records_with_runs()


def enable():
    """Register the import hooks now, as start-up does when FUSED_KERNELS / AUTOPATCH_* are set when
    the interpreter starts. For variables set later in the process (a notebook's `%env`, or
    os.environ in the script): modeling modules imported already are patched at once, later ones
    as they load. Idempotent. A bad setting raises autopatch.config.ConfigError here."""
    from autopatch.config import load_settings

    load_settings()  # raise to the caller now, rather than stop the program from the hook
    # Imported only after validation: importing _startup with a variable set registers the hooks,
    # and the hook on an already-imported transformers would stop the program instead of raising.
    from autopatch._startup import start

    start()


def settings():
    """The settings in force (autopatch.config.Settings): those the process session began with (the
    import hooks', or apply()'s), else the environment / env file's, validated now."""
    from autopatch import session

    current = session.started()
    if current is not None and current.settings is not None:
        return current.settings
    from autopatch.config import load_settings

    return load_settings()


__all__ = ["apply", "applied", "enable", "settings", "__version__"]
