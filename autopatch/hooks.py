"""Import hooks: patch each `transformers.models.*.modeling_*` module the moment it finishes importing.

install() registers one wrapt post-import hook, on `transformers` itself. When transformers is
imported (or at once, if it already is), that hook
  1. loads and validates the settings. A bad configuration stops the program here, before any model
     class can be touched, with one message and exit code 2 (see _stop). A program that never imports
     transformers never reaches this point, so a bad variable cannot disturb it;
  2. registers a hook on every modeling module name, found by listing transformers' models/ folder
     (nothing is imported; wrapt calls the hook at once for modules already imported).
Each modeling hook computes the module's model type(s), runs autopatch.rules.patch_module with the
kernels enabled for them, records the result (autopatch.report) and prints one short stderr line.

A hook must never raise: transformers would turn the exception into a misleading
"ModuleNotFoundError: Could not import module 'modeling_llama'", and wrapt has already dropped the
hook, so a second import would silently succeed unpatched. Everything inside is caught; the only
deliberate way out is _stop.
"""

from __future__ import annotations

import os
import sys
import threading

_lock = threading.RLock()
_installed = False
_settings = None  # autopatch.config.Settings, once transformers was imported and the settings held
_suspended = False  # doctor runs the rules itself and turns the hooks off
EXIT_CODE = 2


def install() -> None:
    """Register the hook on `transformers` (idempotent; cheap: imports wrapt only)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import wrapt

    wrapt.register_post_import_hook(_on_transformers, "transformers")


def installed() -> bool:
    return _installed


def suspend(on: bool = True) -> None:
    """Make the hooks do nothing (doctor: it runs the rules itself, with its own kernel set)."""
    global _suspended
    _suspended = on


def active_settings():
    """The Settings the hooks loaded in this process (None before transformers was imported)."""
    return _settings


def modeling_module_names(package_dir: str | None = None) -> list[str]:
    """Every `transformers.models.<x>.modeling_<y>` module name (deprecated models included), from
    a directory listing: nothing is imported. TF/Flax modules (transformers 4.x) are skipped."""
    if package_dir is None:
        import importlib.util

        spec = importlib.util.find_spec("transformers")
        if spec is None or not spec.submodule_search_locations:
            return []
        package_dir = list(spec.submodule_search_locations)[0]
    names = []
    for prefix, root in (
        ("transformers.models", os.path.join(package_dir, "models")),
        ("transformers.models.deprecated", os.path.join(package_dir, "models", "deprecated")),
    ):
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            # auto/ holds the Auto* factories, no model components
            if not entry.is_dir() or entry.name.startswith(("_", ".")) or entry.name in ("deprecated", "auto"):
                continue
            try:
                files = sorted(os.listdir(entry.path))
            except OSError:
                continue
            for fname in files:
                if (fname.startswith("modeling_") and fname.endswith(".py")
                        and not fname.startswith(("modeling_tf_", "modeling_flax_"))):
                    names.append(f"{prefix}.{entry.name}.{fname[:-3]}")
    return names


def model_types_of(module) -> list[str]:
    """The model_type(s) of a modeling module: those of the config classes defined in its package's
    configuration_* modules (gemma3 -> gemma3, gemma3_text), else the package's folder name."""
    package = module.__name__.rpartition(".")[0]
    prefix = package + ".configuration_"
    types: list[str] = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == name:
                model_type = getattr(obj, "model_type", None)
                if isinstance(model_type, str) and model_type and model_type not in types:
                    types.append(model_type)
    return types or [package.rpartition(".")[2]]


# --------------------------------------------------------------------------- the hooks
def _on_transformers(module) -> None:
    global _settings
    if _suspended:
        return
    try:
        from autopatch import report
        from autopatch.config import ConfigError, load_settings

        try:
            settings = load_settings()
        except ConfigError as exc:
            _stop(f"configuration error: {exc}")
            return
        _settings = settings
        report.set_strict(settings.strict)
        report.set_meta(settings=settings.summary())
        if settings.report:
            report.write_at_exit(settings.report)
        if not settings.active():
            return  # nothing on for any model: leave transformers alone
        import wrapt

        for name in modeling_module_names(os.path.dirname(module.__file__)):
            wrapt.register_post_import_hook(_on_modeling, name)
    except _Stopping:
        raise
    except Exception as exc:  # our bug must not break the user's import
        _say(f"internal error while setting up ({type(exc).__name__}: {exc}); models will not be patched")


def _on_modeling(module) -> None:
    if _suspended or _settings is None:
        return
    try:
        patch_modeling_module(module, _settings)
    except _Stopping:
        raise
    except Exception as exc:
        message = f"{module.__name__.rpartition('.')[2]}: internal error ({type(exc).__name__}: {exc}); left unpatched"
        if _settings.strict:
            _stop(f"AUTOPATCH_STRICT: {message}")
        else:
            _say(message)


def patch_modeling_module(module, settings, *, quiet: bool = False) -> list:
    """Run the rules over one modeling module with the kernels `settings` enables for its model
    type(s); record and announce the result. Strict mode: a refusal stops the program."""
    from autopatch import report, rules

    types = model_types_of(module)

    def enabled(kernel: str) -> bool:
        return settings.enabled_for(kernel, types)

    records = rules.patch_module(module, enabled)
    report.add(records)
    if not quiet:
        line = report.summary_line(module.__name__, records, enabled)
        if line:
            print(line, file=sys.stderr, flush=True)
    if settings.strict:
        refused = report.refusals(records, enabled)
        if refused:
            overrides = " ".join(f"AUTOPATCH_MODELS__{types[0]}__{k.upper()}=false"
                                 for k in report.refused_kernels(refused))
            _stop(report.strict_refusal_message(
                module.__name__, refused, f"Turn those kernels off for this model ({overrides})"))
    return records


# --------------------------------------------------------------------------- stopping
class _Stopping(SystemExit):
    """Raised only where raising is the right stop (IPython); passes through our own guards."""


def _say(message: str) -> None:
    print(f"autopatch: {message}", file=sys.stderr, flush=True)


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and ipython.get_ipython() is not None
    except Exception:
        return False


def _stop(message: str) -> None:
    """Stop the program from inside an import hook with one readable message, exit code 2.

    Raising would not do: transformers rewraps exceptions from a modeling import as a misleading
    ModuleNotFoundError, a `try/except BaseException` or an import in a worker thread would swallow
    SystemExit, and wrapt has dropped the hook, so the next import would go on unpatched. So the
    message goes to stderr, buffers are flushed, and the process ends with os._exit (no model work
    has happened yet; atexit handlers are skipped on purpose). In IPython/Jupyter, where ending the
    kernel would hide the message, SystemExit is raised instead (the hook is gone after that: fix
    the setting and restart the kernel)."""
    _say(message)
    if _in_ipython():
        _say("fix the setting, then restart the kernel")
        raise _Stopping(EXIT_CODE)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(EXIT_CODE)
