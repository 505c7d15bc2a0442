"""autopatch.apply(model, config=None, **toggles): the import hooks' rules, applied to an already-built model.

The keywords are the kernel names (autopatch.names), the same keys as Hugging Face's
`TrainingArguments.liger_kernel_config`, so `apply(model, **liger_kernel_config)` carries over, and so does
`apply(model, training_args)` (its liger_kernel_config may be None). Liger's keys that this library has no
kernel for (autopatch.names.NOT_PROVIDED: relu_squared) are accepted and recorded as not provided here.
A kernel not named takes the default HF/Liger use when `use_liger_kernel=True` gives no config:
rope, rms_norm, layer_norm, swiglu, geglu and fused_linear_cross_entropy on, cross_entropy off; and our
gelu_mlp, causal_mask, vision_attention and masked_attention on. The
environment's kernel set (FUSED_KERNELS, toggles, per-model overrides) plays no part: the call says
what it wants. AUTOPATCH_STRICT does apply.

Patches are made where the hooks make them: on the classes and module functions of the modeling
modules that define the model's class and its submodules' classes. So every instance of those
classes in the process is patched, not only this model; apply() twice is harmless. A kernel set to False
in a later call is undone in those modules (the original code runs again for their classes), so the
records and the stderr line say what is in force. torch.nn.LayerNorm is the exception to class-level
patching: only this model's instances get the fused forward (autopatch.rules.layer_norm).
"""

from __future__ import annotations

import difflib

from autopatch.names import KERNEL_NAMES, NOT_PROVIDED

# HF's defaults when use_liger_kernel=True (Liger's apply_liger_kernel_to_<model> defaults).
APPLY_DEFAULTS: dict[str, bool] = {
    "rope": True,
    "rms_norm": True,
    "layer_norm": True,
    "swiglu": True,
    "geglu": True,
    "gelu_mlp": True,  # ours, not Liger's: the same numbers, less memory
    "cross_entropy": False,
    "fused_linear_cross_entropy": True,
    "causal_mask": True,  # ours, not Liger's: exact, and only changes what a compiled SDPA model runs
    "vision_attention": True,  # ours, not Liger's: exact, fewer and larger SDPA calls in vision towers
    "masked_attention": True,  # ours, not Liger's: exact, masked-out key blocks not computed
}


def resolve_toggles(toggles: dict) -> dict[str, bool]:
    """The kernel set of an apply() call; TypeError for unknown keywords or non-boolean values. Keys of
    NOT_PROVIDED (Liger's relu_squared) are accepted and left out of the set (see note_not_provided)."""
    unknown = [k for k in toggles if k not in KERNEL_NAMES and k not in NOT_PROVIDED]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), [*KERNEL_NAMES, *NOT_PROVIDED], n=3, cutoff=0.6)
            if close:
                hints.append(f"{key!r}: did you mean {' or '.join(close)}?")
        raise TypeError(
            f"apply() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            + (" ".join(hints) + " " if hints else "")
            + f"valid kernel keywords: {', '.join(KERNEL_NAMES)} (accepted, not provided here: "
            f"{', '.join(NOT_PROVIDED)})"
        )
    chosen = {k: APPLY_DEFAULTS.get(k, False) for k in KERNEL_NAMES}
    for kernel, value in toggles.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply(): {kernel} must be True or False, got {value!r}")
        if kernel in chosen:
            chosen[kernel] = value
    return chosen


def toggles_from_config(config) -> dict:
    """The kernel toggles a Liger user has: None (the defaults), a dict (TrainingArguments'
    liger_kernel_config), or a TrainingArguments-like object, read for its liger_kernel_config."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "liger_kernel_config"):
        value = config.liger_kernel_config
        if value is None:
            return {}
        if isinstance(value, dict):
            return dict(value)
        raise TypeError(f"apply(): {type(config).__name__}.liger_kernel_config must be a dict or None; "
                        f"got {type(value).__name__}")
    raise TypeError(f"apply(): config must be None, a dict of kernel toggles or a TrainingArguments; "
                    f"got {type(config).__name__}")


def modules_of(model) -> list:
    """The modeling modules defining the model's class (and its bases) and its submodules' classes,
    in first-seen order."""
    import sys

    from autopatch.runtime import modeling_module_names_of

    return [sys.modules[n] for n in modeling_module_names_of(model) if n in sys.modules]


def _rebind_hooked_forwards(model) -> None:
    """accelerate's hooks (device_map="auto", CPU offload) keep each hooked module's forward as it was
    when the hook was added, a bound method in `module._old_forward`, and call that. A model loaded
    before apply() would keep running the unpatched forwards there; point them at the patched ones."""
    import types

    from autopatch import patching

    modules_fn = getattr(model, "modules", None)
    if not callable(modules_fn):
        return
    for module in modules_fn():
        old = vars(module).get("_old_forward")
        func = getattr(old, "__func__", None)
        if func is None or getattr(old, "__self__", None) is not module:
            continue
        for owner in type(module).__mro__:
            if "forward" in vars(owner):
                break
        else:
            continue
        if patching.is_patched(owner, "forward") and func is patching.original(owner, "forward"):
            module._old_forward = types.MethodType(owner.forward, module)


def _patch_layer_norm_instances(model, records: list) -> None:
    """torch.nn.LayerNorm is not patched process-wide: the instances of a model built before its modeling
    module was patched get FusedLayerNorm here (autopatch.rules.layer_norm), when a record proved it."""
    proved = any(r.kernel == "layer_norm" and r.patched and r.target.startswith("torch.nn.LayerNorm")
                 for r in records)
    if not proved:
        return
    from autopatch.rules import layer_norm

    layer_norm.patch_instances(model)


def _unpatch_layer_norm_instances(model) -> None:
    from autopatch.rules import layer_norm

    layer_norm.unpatch_instances(model)


def _session_for_apply():
    """The process session: the import hooks' when they began it (their settings hold), else begun
    here with the environment's settings as they are now (for AUTOPATCH_STRICT and AUTOPATCH_REPORT;
    a bad environment raises ConfigError here)."""
    from autopatch import runtime
    from autopatch import session as sessions

    session = sessions.started()
    if session is not None and session.settings is not None and "hooks" in session.installed:
        return session
    from autopatch import hub
    from autopatch.config import load_settings

    session = runtime.begin(load_settings())
    hub.install()  # later kernelize passes (train(), eval()) keep what apply() patches
    return session


def apply(model, config=None, **toggles) -> list:
    """Patch the components `model` uses; returns the records of this call (also in applied()).

    config: None, a dict of kernel toggles (TrainingArguments.liger_kernel_config) or a TrainingArguments
    (its liger_kernel_config, which may be None), so `apply(model, training_args)` works where
    `apply(model, **training_args.liger_kernel_config)` fails on a None field. Keyword toggles override
    it. A kernel turned off here that an earlier call (or the import hooks) patched in the model's
    modeling modules is restored to the original code for those modules' classes."""
    from autopatch import audit, report, rules, runtime
    from autopatch.session import Record, StrictModeError, say

    merged = toggles_from_config(config)
    merged.update(toggles)
    chosen = resolve_toggles(merged)
    session = _session_for_apply()
    not_provided = runtime.note_not_provided(session, [k for k, v in merged.items() if k in NOT_PROVIDED and v],
                                             "apply()")

    def enabled(kernel: str) -> bool:
        if kernel not in chosen:
            raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
        return chosen[kernel]

    records: list = list(not_provided)
    modules = modules_of(model)
    for module in modules:  # first undo what is now off, so that the rules record what is in force
        for kernel in rules.unpatch(module, lambda k: k in chosen and not chosen[k]):
            undone = Record(kernel, module.__name__, "*", False,
                            reason=f"kernel {kernel} turned off by apply(): the original code runs again")
            session.add([undone])
            records.append(undone)
    if not chosen["layer_norm"]:
        _unpatch_layer_norm_instances(model)
    for module in modules:
        found = runtime.run_rules(module, session, enabled)
        session.add(found)
        line = report.summary_line(module.__name__, found, enabled)
        if line:
            say(line)
        records.extend(found)
    _rebind_hooked_forwards(model)
    if chosen.get("layer_norm"):
        _patch_layer_norm_instances(model, records)
    session.note_built(type(model).__name__, [m.__name__ for m in modules])
    session.note_model(model, getattr(model, "training", None))
    if session.strict:
        refused = report.refusals([r for r in records if r.kernel not in NOT_PROVIDED], enabled)
        if refused:
            toggles_off = ", ".join(f"{k}=False" for k in report.refused_kernels(refused))
            where = ", ".join(dict.fromkeys(r.module for r in refused))
            raise StrictModeError("autopatch " + report.strict_refusal_message(
                where, refused, f"Turn those kernels off in the call (autopatch.apply(model, {toggles_off}))"))
    replaced = audit.audit_model(model, session, say=not session.strict)
    if replaced and session.strict:
        k, t, by = replaced[0]
        raise StrictModeError(report.replaced_line(k, t, by, strict=True, model_type=audit.model_type_of(model)))
    return records
