"""Import hooks: patch each `transformers.models.*.modeling_*` module the moment it finishes importing.

install() puts one finder first on sys.meta_path (_Finder; it imports nothing). It answers only for
`transformers` and, once the settings are loaded, for modeling module names; for those it lets the
rest of sys.meta_path find the module and runs a hook right after the module's code has run:
  1. `transformers`: load and validate the settings. A bad configuration stops the program here,
     before any model class can be touched, with one message and exit code 2 (see _stop). A program
     that never imports transformers never reaches this point, so a bad variable cannot disturb it.
     Modeling modules imported already (install() after transformers) are patched at once;
  2. every `transformers.models.<x>.modeling_<y>`, recognised by its name (no listing of
     transformers' models/ folder): compute the module's model type(s), run
     autopatch.rules.patch_module with the kernels enabled for them and record the result
     (autopatch.report). Its one-line stderr summary waits until a model whose components come
     from that module is built (PreTrainedModel.post_init), so a module imported by a library for
     its constants (peft imports modeling_bloom) stays silent; autopatch.applied() and
     AUTOPATCH_REPORT still hold every record.

Why our own finder and not wrapt's post-import hooks: importing wrapt (asyncio, inspect,
importlib.metadata) cost ~85 ms at the start of every Python process of the environment once a
variable was set, whether or not it used transformers. Measured on a 2-core CPU machine, best of 20,
`python -c pass` with FUSED_KERNELS=all: 91 ms with wrapt, 14 ms with this finder, 12 ms with no
variable; -X importtime of autopatch._startup: 99 ms -> 0.7 ms. Not importing threading (_thread's
RLock instead) is part of that.

A hook must never raise: transformers would turn the exception into a misleading
"ModuleNotFoundError: Could not import module 'modeling_llama'". Everything inside is caught; the
only deliberate way out is _stop.
"""

import _thread
import os
import sys

# _thread, not threading: importing threading (collections, functools) is most of what start-up
# would cost otherwise, and a builtin module is free
_lock = _thread.RLock()
_installed = False
_settings = None  # autopatch.config.Settings, once transformers was imported and the settings held
_suspended = False  # doctor runs the rules itself and turns the hooks off
_watch_modeling = False  # set once the settings turn a kernel on: the finder then answers for modeling modules
_patched: dict[str, int] = {}  # modeling module name -> id() of the module object the rules ran over
_pending: dict[str, str] = {}  # modeling module name -> its stderr line, said when a model from it is built
EXIT_CODE = 2


def install() -> None:
    """Put the finder on sys.meta_path (idempotent; cheap: imports nothing). When transformers is
    imported already, its hook runs now."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    if "transformers" in sys.modules:
        _on_transformers()


def installed() -> bool:
    return _installed


def suspend(on: bool = True) -> None:
    """Make the hooks do nothing (doctor: it runs the rules itself, with its own kernel set)."""
    global _suspended
    _suspended = on


def active_settings():
    """The Settings the hooks loaded in this process (None before transformers was imported)."""
    return _settings


def is_modeling_module_name(name: str) -> bool:
    """`transformers.models.<x>.modeling_<y>` or `transformers.models.deprecated.<x>.modeling_<y>`;
    not auto/ (the Auto* factories), not TF/Flax modules (transformers 4.x)."""
    if not name.startswith("transformers.models."):
        return False
    parts = name.split(".")
    if len(parts) == 5 and parts[2] == "deprecated":
        del parts[2]
    if len(parts) != 4 or parts[2] in ("auto", "deprecated") or parts[2].startswith(("_", ".")):
        return False
    leaf = parts[3]
    return leaf.startswith("modeling_") and not leaf.startswith(("modeling_tf_", "modeling_flax_"))


def modeling_module_names(package_dir: str | None = None) -> list[str]:
    """Every `transformers.models.<x>.modeling_<y>` module name (deprecated models included), from
    a directory listing: nothing is imported. TF/Flax modules (transformers 4.x) are skipped.
    (doctor --all; the hooks themselves recognise modeling modules by name, see _Finder.)"""
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
            if not entry.is_dir():
                continue
            try:
                files = sorted(os.listdir(entry.path))
            except OSError:
                continue
            for fname in files:
                name = f"{prefix}.{entry.name}.{fname[:-3]}"
                if fname.endswith(".py") and is_modeling_module_name(name):
                    names.append(name)
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


# --------------------------------------------------------------------------- the finder
class _Finder:
    """A sys.meta_path finder that finds nothing itself: for the modules we watch it asks the finders
    after it for the spec and wraps the spec's loader so that our hook runs once the module's code
    has run. For every other name it returns None after one string comparison."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("transformers"):
            return None
        if fullname == "transformers":
            hook = _on_transformers_loaded
        elif _watch_modeling and is_modeling_module_name(fullname):
            hook = _on_modeling
        else:
            return None
        try:
            finders = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, _Loader):
            spec.loader = _Loader(loader, hook)
        return spec

    def invalidate_caches(self):
        pass


class _Loader:
    """The module's own loader, with `hook(module)` run after exec_module. The module keeps the real
    loader in __loader__ and __spec__.loader (inspect, linecache and importlib.resources use it)."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def __getattr__(self, name):
        if name in ("_loader", "_hook"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module):
        try:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        except Exception:
            pass
        self._loader.exec_module(module)
        self._hook(module)


# --------------------------------------------------------------------------- the hooks
def _on_transformers_loaded(module) -> None:
    _on_transformers()


def _on_transformers() -> None:
    global _settings, _watch_modeling
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
        _watch_modeling = True
        # imported before the hooks were installed (enable() late): patch them now, and say so now,
        # as their models may be built already
        for name in sorted(n for n, m in list(sys.modules.items()) if m is not None and is_modeling_module_name(n)):
            _patch_hooked(sys.modules[name], announce=True)
    except _Stopping:
        raise
    except Exception as exc:  # our bug must not break the user's import
        _say(f"internal error while setting up ({type(exc).__name__}: {exc}); models will not be patched")


def _on_modeling(module) -> None:
    _patch_hooked(module, announce=False)


def _patch_hooked(module, *, announce: bool) -> None:
    if _suspended or _settings is None:
        return
    try:
        with _lock:
            if _patched.get(module.__name__) == id(module):
                return  # this very module object was patched already (the finder and install() both saw it)
            _patched[module.__name__] = id(module)
        patch_modeling_module(module, _settings, quiet=not announce, defer=not announce)
    except _Stopping:
        raise
    except Exception as exc:
        message = f"{module.__name__.rpartition('.')[2]}: internal error ({type(exc).__name__}: {exc}); left unpatched"
        if _settings.strict:
            _stop(f"AUTOPATCH_STRICT: {message}")
        else:
            _say(message)


def patch_modeling_module(module, settings, *, quiet: bool = False, defer: bool = False) -> list:
    """Run the rules over one modeling module with the kernels `settings` enables for its model
    type(s); record and announce the result (one stderr line: now, or with `defer` when a model
    using the module is built; never with `quiet` and no `defer`). Strict mode: a refusal stops the
    program."""
    from autopatch import report, rules

    types = model_types_of(module)

    def enabled(kernel: str) -> bool:
        return settings.enabled_for(kernel, types)

    records = rules.patch_module(module, enabled)
    report.add(records)
    line = report.summary_line(module.__name__, records, enabled)
    if line and defer:
        with _lock:
            _pending[module.__name__] = line
        _watch_model_builds()
    elif line and not quiet:
        report.say(line)
    if settings.strict:
        refused = report.refusals(records, enabled)
        if refused:
            overrides = " ".join(f"AUTOPATCH_MODELS__{types[0]}__{k.upper()}=false"
                                 for k in report.refused_kernels(refused))
            _stop(report.strict_refusal_message(
                module.__name__, refused, f"Turn those kernels off for this model ({overrides})"))
    return records


# --------------------------------------------------------------------------- saying the lines when a model is built
def _watch_model_builds() -> None:
    """Wrap PreTrainedModel.post_init (every transformers model calls it at the end of __init__, also
    under from_pretrained) to say the pending lines of the modules the new model's classes come from.
    A modeling module has imported transformers.modeling_utils by the time its hook runs."""
    from autopatch import patching

    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    if base is None or "post_init" not in vars(base):
        return
    with _lock:
        if patching.is_patched(base, "post_init"):
            return
        original = base.post_init

        def post_init(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _pending:
                try:
                    say_pending_for(self)
                except Exception:
                    pass  # a summary line is not worth breaking a model build
            return result

        post_init.__wrapped__ = original
        post_init.__doc__ = original.__doc__
        post_init.__name__ = original.__name__
        post_init.__qualname__ = original.__qualname__
        patching.replace(base, "post_init", post_init)


def say_pending_for(model) -> list[str]:
    """Say (stderr) the waiting summary lines of the modeling modules that `model`'s class, its bases
    and its submodules' classes come from; returns the lines said."""
    from autopatch import report

    classes = list(type(model).__mro__)
    modules_fn = getattr(model, "modules", None)
    if callable(modules_fn):
        classes += [type(m) for m in modules_fn()]
    names = {getattr(c, "__module__", None) for c in classes}
    with _lock:
        lines = [_pending.pop(n) for n in list(_pending) if n in names]
    for line in lines:
        report.say(line)
    return lines


def pending_lines() -> dict[str, str]:
    """The summary lines still waiting for a model of their module (module name -> line)."""
    with _lock:
        return dict(_pending)


# --------------------------------------------------------------------------- stopping
class _Stopping(SystemExit):
    """Raised only where raising is the right stop (IPython); passes through our own guards."""


def _say(message: str) -> None:
    try:
        from autopatch import report

        report.say(f"autopatch: {message}")
    except Exception:
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
    ModuleNotFoundError, and a `try/except BaseException` or an import in a worker thread would
    swallow SystemExit. So the message goes to stderr, buffers are flushed, and the process ends
    with os._exit (no model work has happened yet; atexit handlers are skipped on purpose). In
    IPython/Jupyter, where ending the kernel would hide the message, SystemExit is raised instead
    (the settings stay unloaded after that: fix the setting and restart the kernel)."""
    _say(message)
    if _in_ipython():
        _say("fix the setting, then restart the kernel")
        raise _Stopping(EXIT_CODE)
    exit_now(EXIT_CODE)


def exit_now(code: int) -> None:
    """End the process at once with `code`, stdout and stderr flushed, atexit handlers skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
