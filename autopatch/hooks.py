"""Import hooks: patch each `transformers.models.*.modeling_*` module the moment it finishes importing.

Two stages, so that a process pays for nothing until it imports transformers:
  1. install() puts one cheap finder first on sys.meta_path (_Finder; it imports nothing). It answers
     only for the name `transformers`: it lets the rest of sys.meta_path find the package and runs
     _on_transformers right after the package's code has run.
  2. _on_transformers loads and validates the settings (the one place the settings are looked up for
     the hooks; a bad configuration stops the program here, before any model class can be touched,
     with one message and exit code 2), begins the process Session (autopatch.runtime.begin) and, if
     a kernel is on, imports wrapt and registers wrapt post-import hooks
     (wrapt.register_post_import_hook) for every `transformers.models.<x>.modeling_<y>` name, found
     by a directory listing (nothing imported), and for `transformers.modeling_utils`. wrapt calls a
     hook when its module finishes importing, or at once for a module imported already.
  3. each modeling module's hook runs the rules with the kernels enabled for its model type(s)
     (autopatch.runtime.patch_module); its one-line stderr summary waits until a model whose
     components come from that module is built. `transformers.modeling_utils`' hook wraps
     PreTrainedModel.post_init (model_built: the lines, strict mode, the audit) and
     PreTrainedModel.train (the audit again when the mode changes: transformers 5.25 re-kernelizes there).

Cost, measured on this project's 2-core CPU machine (Python 3.11, torch 2.13, transformers 5.25,
wrapt 2.5, bytecode cached; best of 20 runs): `python -c pass` takes 11.2 ms with no variable and
11.6 ms with FUSED_KERNELS=all (the finder; importing wrapt at interpreter start would add ~60 ms, which
is why it waits for transformers). `import transformers` (best of 5): 0.71 s plain, 0.83 s with
FUSED_KERNELS=all (+0.12 s: pydantic-settings and the settings, wrapt, ~560 post-import hooks
registered); `import transformers` + building a 1-layer hidden-64 Llama: 4.10 s plain, 4.41 s with
FUSED_KERNELS=all (+0.3 s: the rules over modeling_llama with their numerical proofs, and the audit).
Not importing threading (_thread's RLock instead) keeps the finder free. The swaps themselves are
plain functions, not wrapt wrappers (autopatch/patching.py says why).

A hook must never raise: transformers would turn the exception into a misleading
"ModuleNotFoundError: Could not import module 'modeling_llama'", and wrapt drops a hook that raised.
Everything inside is caught; the only deliberate way out is autopatch.runtime.stop.
"""

import _thread
import os
import sys

# _thread, not threading: importing threading (collections, functools) is most of what start-up
# would cost otherwise, and a builtin module is free
_lock = _thread.RLock()
_state = {"installed": False, "suspended": False}


def install() -> None:
    """Put the finder on sys.meta_path (idempotent; cheap: imports nothing). When transformers is
    imported already, its hook runs now."""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    if "transformers" in sys.modules:
        _on_transformers()


def installed() -> bool:
    return _state["installed"]


def suspend(on: bool = True) -> None:
    """Make the hooks do nothing (doctor: it runs the rules itself, with its own kernel set)."""
    _state["suspended"] = on


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
    a directory listing: nothing is imported. TF/Flax modules (transformers 4.x) are skipped."""
    if package_dir is None:
        module = sys.modules.get("transformers")
        paths = list(getattr(module, "__path__", None) or [])
        if not paths:
            import importlib.util

            spec = importlib.util.find_spec("transformers")
            if spec is None or not spec.submodule_search_locations:
                return []
            paths = list(spec.submodule_search_locations)
        package_dir = paths[0]
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


# --------------------------------------------------------------------------- the finder
class _Finder:
    """A sys.meta_path finder that finds nothing itself: for `transformers` it asks the finders after
    it for the spec and wraps the spec's loader so that our hook runs once the package's code has run.
    For every other name it returns None after one string comparison."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
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
            spec.loader = _Loader(loader)
        return spec

    def invalidate_caches(self):
        pass


class _Loader:
    """The package's own loader, with _on_transformers run after exec_module. The module keeps the
    real loader in __loader__ and __spec__.loader (inspect, linecache and importlib.resources use it)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        if name == "_loader":  # not set yet (a copy being made): no recursion
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
        _on_transformers()


# --------------------------------------------------------------------------- the hooks
def _on_transformers() -> None:
    if _state["suspended"]:
        return
    try:
        from autopatch import runtime
        from autopatch.config import ConfigError, load_settings

        try:
            settings = load_settings()
        except ConfigError as exc:
            runtime.stop(f"configuration error: {exc}")
            return
        session = runtime.begin(settings)
        session.installed.add("hooks")  # the settings of start-up hold for apply() too
        if not settings.active():
            return  # nothing on for any model: leave transformers alone
        import wrapt

        from autopatch import hub

        hub.install()  # Hub kernels: FUSED_KERNELS over transformers' default kernelize
        # imported before the hooks were installed (enable() late): patched at once by wrapt, and
        # said now, as their models may be built already
        already = {n for n, m in list(sys.modules.items()) if m is not None and is_modeling_module_name(n)}
        wrapt.register_post_import_hook(_on_modeling_utils, "transformers.modeling_utils")
        wrapt.register_post_import_hook(lambda module: runtime.watch_training(session, module), "torch.optim.optimizer")
        for name in sorted(set(modeling_module_names()) | already):
            wrapt.register_post_import_hook(_modeling_hook(session, announce=name in already), name)
        from autopatch.names import LIBRARY_MODULES

        for name, rule_name in LIBRARY_MODULES.items():  # peft's LoRA layers: one rule each
            wrapt.register_post_import_hook(_library_hook(session, rule_name), name)
    except SystemExit:
        raise
    except Exception as exc:  # our bug must not break the user's import
        _say(f"internal error while setting up ({type(exc).__name__}: {exc}); models will not be patched")


def _modeling_hook(session, *, announce: bool):
    def hook(module):
        _patch_hooked(module, session, announce=announce)

    return hook


def _first_visit(module, session) -> bool:
    """True once per module object (a reload is another object), and never while hooks are suspended."""
    if _state["suspended"]:
        return False
    key = f"module:{module.__name__}:{id(module)}"
    with session.lock:
        if key in session.installed:
            return False
        session.installed.add(key)
    return True


def _patch_hooked(module, session, *, announce: bool) -> None:
    if not _first_visit(module, session):
        return
    try:
        from autopatch import runtime

        runtime.patch_module(module, session, announce=announce)
    except SystemExit:
        raise
    except Exception as exc:
        _say(f"{module.__name__.rpartition('.')[2]}: internal error ({type(exc).__name__}: {exc}); left unpatched")


def _library_hook(session, rule_name: str):
    def hook(module):
        _patch_library(module, session, rule_name)

    return hook


def _patch_library(module, session, rule_name: str) -> None:
    """Run one rule over another library's module (autopatch.names.LIBRARY_MODULES) and record it. Its
    line waits in session.pending until a model holding the module's classes is audited (a library
    imported but not used says nothing: Trainer imports peft)."""
    if not _first_visit(module, session):
        return
    try:
        from autopatch import report, rules, runtime

        enabled = runtime.enabled_in(session.settings, module.__name__)
        skip = frozenset(r.name for r in rules.all_rules() if r.name != rule_name)
        records = runtime.run_rules(module, session, enabled, skip)
        session.add(records)
        line = report.summary_line(module.__name__.partition(".")[0], records, enabled)  # "autopatch: peft: ..."
        if line:
            with session.lock:
                session.pending[module.__name__] = line
    except SystemExit:
        raise
    except Exception as exc:
        _say(f"{module.__name__}: internal error ({type(exc).__name__}: {exc}); left unpatched")


def _on_modeling_utils(modeling_utils) -> None:
    """Wrap PreTrainedModel.post_init (every transformers model calls it at the end of __init__, also
    under from_pretrained) and PreTrainedModel.train (eval() calls it) through autopatch.patching."""
    try:
        from autopatch import patching, runtime

        base = getattr(modeling_utils, "PreTrainedModel", None)
        if base is None:
            return
        if "post_init" in vars(base) and not patching.is_patched(base, "post_init"):
            original_post_init = vars(base)["post_init"]

            def post_init(self, *args, **kwargs):
                result = original_post_init(self, *args, **kwargs)
                _after(runtime.model_built, self)
                return result

            patching.replace(base, "post_init", post_init)
        if "train" in vars(base) and not patching.is_patched(base, "train"):
            original_train = vars(base)["train"]

            def train(self, *args, **kwargs):
                result = original_train(self, *args, **kwargs)
                _after(runtime.model_mode_set, self)
                return result

            patching.replace(base, "train", train)
    except Exception as exc:
        _say(f"internal error while watching model builds ({type(exc).__name__}: {exc})")


def _after(step, model) -> None:
    """Run a runtime step for a model; strict mode's stop passes (SystemExit), anything else of ours is
    said in one line, never raised into the user's model code."""
    try:
        step(model)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001
        _say(f"internal error after building {type(model).__name__} ({type(exc).__name__}: {exc})")


def _say(message: str) -> None:
    print(f"autopatch: {message}", file=sys.stderr, flush=True)

