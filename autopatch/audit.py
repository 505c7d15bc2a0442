"""Did something replace what autopatch patched? Compares what autopatch.patching set with what is
there now, for the classes a built model uses:

  - a modeling module's global: Liger's apply_liger_kernel_to_llama() rebinds
    `modeling_llama.LlamaRMSNorm = LigerRMSNorm` and `modeling_llama.apply_rotary_pos_emb = ...`, so a
    model built afterwards holds Liger's classes where ours were patched;
  - a class attribute: `LlamaForCausalLM.forward = lce_forward` (Liger), a user's monkeypatch;
  - an instance's own `forward` (in vars(module)): Trainer's use_liger_kernel and Liger's instance
    path, Hub `kernels.kernelize`.

Other libraries' classes we patched (autopatch.names.LIBRARY_MODULES: peft's lora.Linear) are watched
the same way in the models that hold them; our own swap there is ours, not a replacement.

Each replacement is recorded once (Session.note_replaced(kernel, class, by)) and said in one line
(autopatch.report.replaced_line; those by Liger-Kernel grouped in one line, report.liger_line). The
kernel of a patched attribute is the one of the session's patched record for that class or function.
The start-up side runs the audit when a model is built, at model.train()/eval(), before the first
training forward and at exit; autopatch.hub calls audit_model after kernelize. Nothing here raises:
strict mode's stop is the caller's (`audit_model` returns what it found new).
"""

from __future__ import annotations

import sys
import types

from autopatch import patching, report
from autopatch.names import LIBRARY_MODULES, is_model_module
from autopatch.session import Session
from autopatch.session import say as _say


def describe(value) -> str:
    """`module.qualname` of what runs instead (a function, a bound method, a class, a partial). For a
    function, where its code was written (its globals' module, its code's qualname), not what
    functools.wraps copied onto it: TRL's fused head is dressed as the model's own forward."""
    func = getattr(value, "__func__", value)
    func = getattr(func, "func", func) if type(func).__name__ == "partial" else func
    if isinstance(func, types.FunctionType):
        code = func.__code__
        return f"{func.__globals__.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
    module = getattr(func, "__module__", None) or type(func).__module__
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{module}.{name}"


def _modeling_names(model) -> set[str]:
    classes = list(type(model).__mro__)
    modules_fn = getattr(model, "modules", None)
    if callable(modules_fn):
        classes += [type(m) for m in modules_fn()]
    return {c.__module__ for c in classes if isinstance(getattr(c, "__module__", None), str)
            and (is_model_module(c.__module__) or c.__module__ in LIBRARY_MODULES)}


def _kernel_index(session: Session) -> dict[tuple[str, str, str], str]:
    """(module, class or function name, attribute) -> kernel, from the session's patched records (a
    record's target "LlamaRMSNorm" is the class's forward; "LlamaForCausalLM.loss_function" names it;
    (module, name, "*") is any attribute of it)."""
    index: dict[tuple[str, str, str], str] = {}
    for r in session.all_records():
        if r.patched:
            head, _, attr = r.target.partition(".")
            index.setdefault((r.module, head, attr or "forward"), r.kernel)
            index.setdefault((r.module, head, "*"), r.kernel)
    return index


def _ours(value, installed) -> bool:
    """`value` is what we set, or a wrapper that still calls it (accelerate's hook keeps the patched
    forward as `_old_forward`; a decorator keeps it as __wrapped__)."""
    if value is installed:
        return True
    seen = 0
    while value is not None and seen < 8:
        if value is installed:
            return True
        value = getattr(value, "__func__", None) or getattr(value, "__wrapped__", None)
        seen += 1
    return False


def _instance_forward_ours(module, installed) -> bool:
    own = vars(module).get("forward")
    if _ours(own, installed):
        return True
    old = vars(module).get("_old_forward")  # accelerate's hooks call the forward they found
    return old is not None and "_hf_hook" in vars(module) and _ours(old, installed)


def find(model, session: Session) -> list[tuple[str, str, str]]:
    """(kernel, target class or function, what runs instead) for every patched thing of `model`'s
    modeling modules that something replaced."""
    names = _modeling_names(model)
    if not names:
        return []
    index = _kernel_index(session)
    modules_fn = getattr(model, "modules", None)
    submodules = list(modules_fn()) if callable(modules_fn) else [model]
    found: list[tuple[str, str, str]] = []
    for owner, name, installed in patching.entries():
        if isinstance(owner, types.ModuleType):
            kernel = index.get((owner.__name__, name, "forward"))
            if kernel is None or owner.__name__ not in names:
                continue
            now = vars(owner).get(name)
            if not _ours(now, installed):
                found.append((kernel, name, describe(now)))
            continue
        if not isinstance(owner, type):
            continue
        kernel = index.get((owner.__module__, owner.__name__, name)) or index.get((owner.__module__, owner.__name__, "*"))
        if kernel is None or owner.__module__ not in names:
            continue
        target = f"{owner.__name__}.{name}" if name != "forward" else owner.__name__
        users = [m for m in submodules if isinstance(m, owner)]
        module = sys.modules.get(owner.__module__)
        rebound = vars(module).get(owner.__name__) if module is not None else owner
        if not users and isinstance(rebound, type) and rebound is not owner:
            if any(isinstance(m, rebound) for m in submodules):  # built from the rebound global
                found.append((kernel, target, describe(rebound)))
            continue
        if users and not _ours(vars(owner).get(name), installed):
            found.append((kernel, target, describe(vars(owner).get(name))))
            continue
        if name == "forward":
            for m in users:
                if "forward" in vars(m) and not _instance_forward_ours(m, installed):
                    found.append((kernel, target, describe(vars(m)["forward"])))
                    break
    return list(dict.fromkeys(found))


def audit_model(model, session: Session, *, say: bool = True) -> list[tuple[str, str, str]]:
    """Find what replaced our patches in `model`, record each in `session` (note_replaced) and, with
    `say`, say the new ones: one line each, those by Liger-Kernel in one line. Returns the new ones
    (kernel, target, by). Never raises."""
    try:
        found = find(model, session)
        if say:
            say_library_lines(model, session)
    except Exception:  # noqa: BLE001 - an audit must never break the model or the loop
        return []
    new = [item for item in found if session.note_replaced(*item)]
    if new and say:
        say_lines(new, session, model_type_of(model))
    return new


def say_library_lines(model, session: Session) -> list[str]:
    """Say the waiting lines of the other libraries' modules whose classes `model` holds (peft's LoRA
    layers: injected after the model was built, seen here first); returns them."""
    names = _modeling_names(model) & set(LIBRARY_MODULES)
    if not names:
        return []
    with session.lock:
        lines = [session.pending.pop(n) for n in list(session.pending) if n in names]
    for line in lines:
        _say(line)
    return lines


def model_type_of(model) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    return model_type if isinstance(model_type, str) else ""


def say_lines(items, session: Session, model_type: str = "") -> list[str]:
    """Say the lines for these replacements (strict wording in strict mode); returns them."""
    liger = [i for i in items if report.is_liger(i[2])]
    lines = [report.replaced_line(k, t, by, strict=session.strict, model_type=model_type)
             for k, t, by in items if not report.is_liger(by)]
    if liger:
        lines.insert(0, report.liger_line(liger, strict=session.strict))
    for line in lines:
        _say(line)
    return lines
