"""Hugging Face Hub kernels (the `kernels` package) and autopatch: who runs which layer, and our kernels
served as a `kernels` layer repository.

Since transformers 5.25, `from_pretrained` kernelizes by default (`use_kernels=None` is on unless
`USE_HUB_KERNELS=0`): `kernels.kernelize` sets `forward` on every instance of a class decorated with a
layer name mapped for the model's device and mode (transformers' default mapping: `RMSNorm` ->
kernels-community/liger-kernels and `rotary_pos_emb` -> kernels-community/rotary, on CUDA), and again
at each `train()` / `eval()`. An instance's `forward` beats a class's, so left alone it would silently
replace what FUSED_KERNELS patched. Precedence, decided per layer at every kernelize:

  1. an explicit choice in the user's code wins for the layers it names: a `kernel_config` passed to
     from_pretrained (or set_use_kernels) naming the layer, or a mapping of their own around their own
     kernelize (`use_kernel_mapping` / `register_kernel_mapping` with a repository that is not
     transformers' default). Theirs runs; one line says so and the session records it
     (Session.note_replaced), also in strict mode: the user asked for it in code.
  2. FUSED_KERNELS / apply() win over transformers' implicit default mapping for the components the
     rules proved and patched: kernelize is kept off those instances (the patched class's
     `kernel_condition` says no while our kernelize runs; a rotary function's per-instance layer is
     held out of the pass), so their forward stays ours and the default repository is never loaded
     for them (offline, nothing to fetch).
  3. every other layer (Mamba, FLA, deformable attention, classes the rules left alone) stays as
     transformers chose.

The mechanism is one wrapper around `kernels.kernelize` (every binding of it: `kernels.kernelize`,
its module, transformers' `_kernels_kernelize`), so it holds for from_pretrained, set_use_kernels,
train()/eval() re-kernelization and a user's direct call alike. The patched forwards are plain
functions torch.compile traces through. Where a rotary function is explicitly mapped, the module's
patched global gets a dispatcher that calls the user's layer inside the models they kernelized with it.

`session.meta["hub_kernels"]` (in AUTOPATCH_REPORT's JSON) holds, per layer name and class, what runs.

The repository: `python -m autopatch kernel-repo` writes (if needed) and prints a local `kernels` layer
repository, `build/torch-cpu/` and `build/torch-cuda/`, each a `metadata.json` (with the digest of its
files) and an `__init__.py` importing autopatch.hub_layers, whose layers carry the names transformers
decorates (RMSNorm, RMSNormZeroCentered, rotary_pos_emb) and keep the rules' proof. Directory:
$AUTOPATCH_KERNEL_REPO, else <cache>/autopatch/kernel-repo.

wrapt and kernels are imported only from install(), which autopatch.hooks calls once transformers is
imported.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

from autopatch import patching
from autopatch import session as sessions
from autopatch.session import Session, say

ENV_REPO = "AUTOPATCH_KERNEL_REPO"
VARIANTS = {"torch-cpu": "cpu", "torch-cuda": "cuda"}  # build variant -> backend in metadata.json
REPO_NAME = "autopatch"
KERNEL_OF = {"RMSNorm": "rms_norm", "RMSNormZeroCentered": "rms_norm", "rotary_pos_emb": "rope"}  # Hub layer -> kernel

_INIT = '''"""autopatch's kernels as a Hugging Face `kernels` layer repository (python -m autopatch kernel-repo).
The layers are autopatch.hub_layers': they need autopatch installed where this repository is loaded."""

from autopatch.hub_layers import layers  # noqa: F401
'''

_lock = threading.RLock()
# Process-wide, not a Session's: wrapt's post-import hooks on kernels and transformers' hub modules are
# registered once per interpreter and cannot be taken back, whichever session is current.
_hooks_registered = False
_hidden: contextvars.ContextVar[frozenset] = contextvars.ContextVar("autopatch_hub_hidden", default=frozenset())


# =========================================================================== the repository
class RepoError(RuntimeError):
    """The repository directory cannot be written; the message names it and the variable."""


def default_repo_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopatch" / "kernel-repo"


def repo_dir() -> Path:
    value = os.environ.get(ENV_REPO, "").strip()
    return Path(value).expanduser() if value else default_repo_dir()


def _variant_files(variant: str) -> dict[str, bytes]:
    return {"__init__.py": _INIT.encode()}


def _metadata(variant: str, files: dict[str, bytes]) -> dict:
    digest = {name: __import__("base64").b64encode(hashlib.sha256(data).digest()).decode()
              for name, data in sorted(files.items())}
    # the id names the module kernels imports (sys.modules[id]): one per variant and content
    tag = hashlib.sha256(b"".join(files[n] for n in sorted(files))).hexdigest()[:10]
    return {
        "id": f"{REPO_NAME}_{variant.replace('-', '_')}_{tag}",
        "name": REPO_NAME,
        "version": 1,
        "license": "Apache-2.0",
        "backend": {"type": VARIANTS[variant]},
        "python-depends": [],
        "digest": {"algorithm": "sha256", "files": digest},
    }


def ensure_repo(path: Path | None = None) -> Path:
    """Write the repository at `path` (default: repo_dir()) where a file is missing or differs;
    returns the directory. RepoError (one line naming the directory and ENV_REPO) when it cannot."""
    root = Path(path) if path is not None else repo_dir()
    try:
        for variant in VARIANTS:
            folder = root / "build" / variant
            files = _variant_files(variant)
            wanted = dict(files)
            wanted["metadata.json"] = (json.dumps(_metadata(variant, files), indent=2, sort_keys=True) + "\n").encode()
            for name, data in wanted.items():
                target = folder / name
                if target.is_file() and target.read_bytes() == data:
                    continue
                folder.mkdir(parents=True, exist_ok=True)
                partial = folder / f".{name}.{os.getpid()}.tmp"
                partial.write_bytes(data)
                os.replace(partial, target)  # atomic: a concurrent reader sees the old file or the new
    except OSError as exc:
        raise RepoError(f"cannot write the autopatch kernel repository at {root} ({exc.strerror or exc}); "
                        f"set {ENV_REPO} to a writable directory") from None
    return root


def layer_names() -> list[str]:
    return list(KERNEL_OF)


# =========================================================================== precedence
def install() -> None:
    """Once per process, when transformers is imported: wrap `kernels.kernelize` wherever it is bound
    (now or when kernels / transformers' hub integration is imported). Each kernelize reports to the
    session current when it runs (sessions.current()). Never raises."""
    global _hooks_registered
    with _lock:
        first = not _hooks_registered
        _hooks_registered = True
    try:
        if not first:  # again: a test may have restored every patch since
            _on_kernels()
            if "transformers.utils.kernel_config" in sys.modules:
                _on_kernel_config(sys.modules["transformers.utils.kernel_config"])
            return
        import wrapt

        wrapt.register_post_import_hook(_on_kernels, "kernels")
        wrapt.register_post_import_hook(_on_kernels, "transformers.integrations.hub_kernels")
        wrapt.register_post_import_hook(_on_kernel_config, "transformers.utils.kernel_config")
    except Exception as exc:  # noqa: BLE001 - our bug must not break the user's import
        say(f"autopatch: internal error while watching Hub kernels ({type(exc).__name__}: {exc})")


def installed() -> bool:
    """Whether install() ran in this process (kernelize is watched from then on)."""
    return _hooks_registered


def _on_kernels(_module=None) -> None:
    try:
        core = sys.modules.get("kernels._internals.layer.kernelize")
        if core is None:
            return
        original = patching.original(core, "kernelize") if patching.is_patched(core, "kernelize") else core.kernelize
        ours = _make_kernelize(original)
        owners = [(core, "kernelize"), (sys.modules.get("kernels._internals.layer"), "kernelize"),
                  (sys.modules.get("kernels"), "kernelize"),
                  (sys.modules.get("transformers.integrations.hub_kernels"), "_kernels_kernelize")]
        for owner, name in owners:
            if owner is not None and vars(owner).get(name) is original and not patching.is_patched(owner, name):
                patching.replace(owner, name, ours)
    except Exception as exc:  # noqa: BLE001
        say(f"autopatch: internal error while watching Hub kernels ({type(exc).__name__}: {exc})")


def _on_kernel_config(module) -> None:
    """transformers 5.25: from_pretrained(kernel_config=KernelConfig(..., use_local_kernel=True)) turns
    each mapping entry into (path:layer, metadata) before create_compatible_mapping hands it to
    add_to_mapping_local, which splits it as a string (AttributeError: 'tuple' object has no attribute
    'split'). Give it the string."""
    try:
        original = vars(module).get("add_to_mapping_local")
        if original is None or patching.is_patched(module, "add_to_mapping_local"):
            return

        def add_to_mapping_local(layer_name, device, repo_name, mode, compatible_mapping):
            if isinstance(repo_name, tuple) and repo_name and isinstance(repo_name[0], str):
                repo_name = repo_name[0]
            return original(layer_name, device, repo_name, mode, compatible_mapping)

        patching.replace(module, "add_to_mapping_local", add_to_mapping_local)
    except Exception as exc:  # noqa: BLE001
        say(f"autopatch: internal error while watching KernelConfig ({type(exc).__name__}: {exc})")


def _make_kernelize(original):
    def kernelize(model, *args, **kwargs):
        plan = _plan(model, kwargs.get("mode"), kwargs.get("device"))
        token = _hidden.set(frozenset(id(m) for m in plan.hidden_modules))
        held = _hold_funcs(plan.hidden_funcs)
        try:
            with _all_modes_of_ours(plan):
                result = original(model, *args, **kwargs)
        finally:
            _hidden.reset(token)
            _release_funcs(held)
        _settle(model, plan)
        return result

    kernelize.__name__ = kernelize.__qualname__ = "kernelize"
    return kernelize


def is_our_repository(repo) -> bool:
    """A LocalLayerRepository of a directory autopatch wrote (its metadata names "autopatch")."""
    path = getattr(repo, "_repo_path", None)
    if path is None:
        return False
    try:
        return any(json.loads((Path(path) / "build" / v / "metadata.json").read_text()).get("name") == REPO_NAME
                   for v in VARIANTS if (Path(path) / "build" / v / "metadata.json").is_file())
    except (OSError, ValueError):
        return False


class _all_modes_of_ours:
    """Our layers have a backward and compile: where the mapping in force serves a layer from our
    repository for some modes only (KernelConfig keys its mapping by the mode the model was in at
    from_pretrained, inference), serve it for the mode kernelize asks for too, for this call."""

    def __init__(self, plan):
        self.extra = plan.ours_other_modes
        self.context = None

    def __enter__(self):
        if self.extra:
            from kernels import use_kernel_mapping

            self.context = use_kernel_mapping(self.extra, inherit_mapping=True)
            self.context.__enter__()
        return self

    def __exit__(self, *exc):
        if self.context is not None:
            self.context.__exit__(*exc)
        return False


class _Plan:
    def __init__(self):
        self.hidden_modules: list = []  # class instances kernelize must leave alone (ours stays)
        self.hidden_funcs: list = []  # (owner module, key, Func layer) held out of the pass
        self.explicit: list = []  # (layer name, instance, kernel, target) the user's choice may take
        self.explicit_funcs: list = []  # (layer name, Func layer, plain function, module)
        self.uncovered: list = []  # (layer name, kernel, target): named by the user, not for this mode
        self.mode = None
        self.ours_other_modes: dict = {}  # mapping that adds this mode for layers our repository serves


def _kernels_parts():
    """kernels' own look-up pieces (0.19): the mapping in force, the repository choice per mode, and
    the device resolution kernelize uses."""
    glob = sys.modules["kernels._internals.layer.globals"]
    repos = sys.modules["kernels._internals.layer.repos"]
    core = sys.modules["kernels._internals.layer.kernelize"]
    return glob._KERNEL_MAPPING, repos._select_repository, core


def _device_of(model, device, core):
    from kernels import Device

    if device is None:
        return core._find_device(model), None
    if isinstance(device, str):
        return Device(type=device), None
    return core._device_type_from_torch(device.type), device.index


def _selected(name: str, mapping, select, device, index, mode):
    """The repository kernelize picks for layer `name` (None: it falls back to the module's forward)."""
    entry = mapping.get().get(str(name))
    if entry is None:
        return None
    per_device = entry.get(device.type)
    if per_device is None:
        return None
    repos = per_device.repos_for_device(index)
    if not repos:
        return None
    chosen = select(repos, mode=mode)
    return None if chosen is None else chosen[0]


def _defaults(name: str) -> list:
    """The repositories transformers' default mapping holds for layer `name` (any device, any mode)."""
    hub = sys.modules.get("transformers.integrations.hub_kernels")
    get = getattr(hub, "get_kernel_mapping_transformers", None)
    if get is None:
        return []
    out = []
    for value in (get().get(name) or {}).values():
        out.extend(value.values() if isinstance(value, dict) else [value])
    return out


def _is_default(name: str, repo) -> bool:
    return any(repo == default for default in _defaults(name))


def _user_names(model) -> set:
    """Layer names the model's kernel_config names (from_pretrained(kernel_config=...))."""
    config = getattr(model, "kernel_config", None)
    mapping = getattr(config, "kernel_mapping", None)
    return set(mapping) if isinstance(mapping, dict) else set()


def _ours_class(cls) -> str | None:
    """The kernel whose patched forward a decorated class holds now (FUSED_KERNELS / apply()), else None."""
    if not patching.is_patched(cls, "forward"):
        return None
    kernel = KERNEL_OF.get(str(getattr(cls, "kernel_layer_name", "")))
    return kernel


def _ours_func(func_layer):
    """(plain function, its module) when the function behind a rotary Func layer is patched by us."""
    from autopatch.rules._probe import hub_function

    plain = hub_function(func_layer)
    if plain is func_layer:
        return None
    module = sys.modules.get(getattr(plain, "__module__", ""))
    if module is None or not patching.is_patched(module, plain.__name__):
        return None
    if KERNEL_OF.get(str(getattr(type(func_layer), "kernel_layer_name", ""))) is None:
        return None
    return plain, module


def _plan(model, mode, device) -> _Plan:
    """Who wins for each decorated instance of `model` in this kernelize (never raises: on trouble,
    nothing is held and _settle sorts out what kernelize did)."""
    plan = _Plan()
    plan.mode = mode
    try:
        mapping, select, core = _kernels_parts()
        dev, index = _device_of(model, device, core)
        named = _user_names(model)

        extra_repo = {}
        for name, per_device in list(mapping.get().items()):
            repos = per_device.get(dev.type)
            repos = repos.repos_for_device(index) if repos is not None else None
            if repos and select(repos, mode=mode) is None:
                ours = [r for r in repos.values() if is_our_repository(r)]
                if ours and mode is not None:
                    plan.ours_other_modes[name] = {dev.type: {**repos, mode: ours[0]}}
                    extra_repo[name] = ours[0]

        def decide(name, kernel, target):
            repo = _selected(name, mapping, select, dev, index, mode) or extra_repo.get(name)
            if repo is None:
                if name in named:
                    plan.uncovered.append((name, kernel, target))
                return None
            return "ours" if name not in named and _is_default(name, repo) else "theirs"

        for module in model.modules():
            cls = type(module)
            name = getattr(cls, "kernel_layer_name", None)
            kernel = _ours_class(cls) if name is not None else None
            if kernel is not None:
                verdict = decide(name, kernel, cls.__name__)
                if verdict == "ours":
                    guard_class(cls)
                    plan.hidden_modules.append(module)
                elif verdict == "theirs":
                    plan.explicit.append((name, module, kernel, cls.__name__))
            for key, func_layer in list((getattr(module, "_kernel_funcs", None) or {}).items()):
                found = _ours_func(func_layer)
                if found is None:
                    continue
                name = type(func_layer).kernel_layer_name
                verdict = decide(name, KERNEL_OF[name], found[0].__name__)
                if verdict == "ours":
                    plan.hidden_funcs.append((module, key, func_layer))
                elif verdict == "theirs":
                    plan.explicit_funcs.append((name, func_layer, found[0], found[1]))
    except Exception:  # noqa: BLE001 - a kernels version we do not know: hold nothing
        plan.hidden_modules.clear()
        plan.hidden_funcs.clear()
    return plan


def _condition_for(cls):
    """kernel_condition for a patched class: no while our kernelize holds the instance, else the
    class's own condition."""
    before = vars(cls).get("kernel_condition")
    own = getattr(before, "__func__", before)

    def kernel_condition(module):
        if id(module) in _hidden.get():
            return False
        return True if own is None else own(module)

    return staticmethod(kernel_condition)


def guard_class(cls) -> None:
    """Give a patched decorated class our kernel_condition (once; through autopatch.patching)."""
    if getattr(cls, "kernel_layer_name", None) is None or patching.is_patched(cls, "kernel_condition"):
        return
    patching.replace(cls, "kernel_condition", _condition_for(cls))


def _hold_funcs(items) -> list:
    held = []
    for owner, key, func_layer in items:
        funcs = vars(owner).get("_kernel_funcs")
        if isinstance(funcs, dict) and funcs.get(key) is func_layer:
            del funcs[key]
            held.append((funcs, key, func_layer))
    return held


def _release_funcs(held) -> None:
    for funcs, key, func_layer in held:
        funcs[key] = func_layer


# --------------------------------------------------------------------------- after kernelize
def _repo_text(repo) -> str:
    path = getattr(repo, "_repo_path", None)
    repo_id = getattr(repo, "_repo_id", None)
    where = str(path) if path is not None else str(repo_id or repo)
    layer = getattr(repo, "layer_name", "")
    return f"{where}:{layer}" if layer else where


def _is_our_layer(instance) -> bool:
    forward = vars(instance).get("forward")
    func = getattr(forward, "__func__", None)
    return getattr(func, "__module__", "") == "autopatch.hub_layers"


def _record(session: Session, name: str, target: str, runs: str) -> None:
    with session.lock:
        session.meta.setdefault("hub_kernels", {})[f"{name} {target}"] = runs


def _settle(model, plan: _Plan) -> None:
    """After kernelize: say and record the user's explicit choices that took a layer of ours; drop a
    default Hub forward left on an instance whose class is ours (an earlier kernelize, before the
    patch); record what runs per layer."""
    session = sessions.current()
    try:
        for module in plan.hidden_modules:
            _drop_default_forward(module)
            _record(session, type(module).kernel_layer_name, type(module).__name__,
                    f"autopatch {KERNEL_OF[type(module).kernel_layer_name]} (FUSED_KERNELS beats the default mapping)")
        for _, _, func_layer in plan.hidden_funcs:
            name = type(func_layer).kernel_layer_name
            _record(session, name, _func_target(func_layer),
                    f"autopatch {KERNEL_OF[name]} (FUSED_KERNELS beats the default mapping)")
        for name, instance, kernel, target in plan.explicit:
            if "forward" not in vars(instance):
                continue
            if _is_our_layer(instance):
                del vars(instance)["forward"]  # our layer would call the patched class forward: the same code
                _record(session, name, target, f"autopatch {kernel} (kernel repository)")
                continue
            _explicit_said(session, name, kernel, target, vars(instance).get("_kernel_repo"))
        for name, func_layer, plain, owner in plan.explicit_funcs:
            if "forward" not in vars(func_layer):
                continue
            if _is_our_layer(func_layer):
                _record(session, name, plain.__name__, f"autopatch {KERNEL_OF[name]} (kernel repository)")
                continue
            vars(func_layer)["_autopatch_explicit"] = True
            _dispatch_global(owner, plain.__name__, func_layer)
            _explicit_said(session, name, KERNEL_OF[name], plain.__name__, vars(func_layer).get("_kernel_repo"))
        _prepare_our_layers(model)
        for name, kernel, target in plan.uncovered:
            session.say_once(
                f"hub-uncovered:{name}:{target}:{plan.mode}",
                f"autopatch: your kernel_config names {name} but not for {_mode_text(plan.mode)} mode, so "
                f"transformers' kernelize keeps {target}'s own forward there, which is autopatch's {kernel}; "
                f"map {name} for that mode (kernels' use_kernel_mapping with Mode.TRAINING) to run yours")
            _record(session, name, target, f"autopatch {kernel} (your kernel_config has no {_mode_text(plan.mode)} mapping)")
    except Exception as exc:  # noqa: BLE001 - never break the user's kernelize
        say(f"autopatch: internal error after kernelize ({type(exc).__name__}: {exc})")


def _prepare_our_layers(model) -> None:
    """Resolve now, outside any torch.compile trace, what our layers run for each class they were
    given (the rules' proof runs probes: not something to trace)."""
    layers = sys.modules.get("autopatch.hub_layers")
    if layers is None:
        return
    for module in model.modules():
        if _is_our_layer(module):
            layers.prepare(module)
        for func_layer in (getattr(module, "_kernel_funcs", None) or {}).values():
            if _is_our_layer(func_layer):
                layers.prepare(func_layer)


def _mode_text(mode) -> str:
    text = str(getattr(mode, "name", None) or mode)
    return "training" if "TRAINING" in text else "inference" if "INFERENCE" in text else text


def _func_target(func_layer) -> str:
    from autopatch.rules._probe import hub_function

    plain = hub_function(func_layer)
    return getattr(plain, "__name__", type(func_layer).__name__)


def _drop_default_forward(module) -> None:
    """An implicit default's forward left on an instance of a class of ours: remove it (ours runs)."""
    repo = vars(module).get("_kernel_repo")
    if "forward" in vars(module) and repo is not None and _is_default(type(module).kernel_layer_name, repo):
        del vars(module)["forward"]
        vars(module).pop("_kernel_repo", None)


def _explicit_said(session: Session, name: str, kernel: str, target: str, repo) -> None:
    by = f"Hub kernel {_repo_text(repo)} (your kernel mapping for {name})"
    _record(session, name, target, by)
    if session.note_replaced(kernel, target, by):
        say(f"autopatch: {kernel} on {target}: your Hub kernel {_repo_text(repo)} runs there, not autopatch's "
            f"(an explicit kernel_config / kernel mapping in your code wins over FUSED_KERNELS for the layers "
            f"it names; leave {name} out of it to run autopatch's {kernel})")


def _dispatch_global(owner, name: str, func_layer) -> None:
    """Make the patched module global call the user's layer inside the models kernelized with it."""
    current = vars(owner).get(name)
    if getattr(current, "_autopatch_dispatch", False):
        return
    ours = current
    original = patching.original(owner, name)
    active = sys.modules["kernels._internals.layer.layer"]._ACTIVE_KERNEL_FUNCS

    @functools.wraps(ours)
    def dispatch(*args, **kwargs):
        funcs = active.get()
        if funcs:
            entry = funcs.get(id(original))
            if entry is not None and getattr(entry[0], "_autopatch_explicit", False):
                return entry[0](*args, **kwargs)
        return ours(*args, **kwargs)

    dispatch._autopatch_dispatch = True
    setattr(owner, name, dispatch)  # __wrapped__ is ours: the audit and patching.restore see our patch
