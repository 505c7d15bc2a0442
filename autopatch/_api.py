"""autopatch.apply(model, **toggles): the import hooks' rules, applied to an already-built model.

The keywords are the kernel names (autopatch.names), the same keys as Hugging Face's
`TrainingArguments.liger_kernel_config`, so `apply(model, **liger_kernel_config)` carries over.
A kernel not named takes the default HF/Liger use when `use_liger_kernel=True` gives no config:
rope, rms_norm, swiglu, geglu and fused_linear_cross_entropy on, cross_entropy off; and our
causal_mask on. The
environment's kernel set (FUSED_KERNELS, toggles, per-model overrides) plays no part: the call says
what it wants. AUTOPATCH_STRICT does apply.

Patches are made where the hooks make them: on the classes and module functions of the modeling
modules that define the model's class and its submodules' classes. So every instance of those
classes in the process is patched, not only this model; apply() twice is harmless.
"""

from __future__ import annotations

import sys

from autopatch.names import KERNEL_NAMES

# HF's defaults when use_liger_kernel=True (Liger's apply_liger_kernel_to_<model> defaults).
APPLY_DEFAULTS: dict[str, bool] = {
    "rope": True,
    "rms_norm": True,
    "layer_norm": True,
    "swiglu": True,
    "geglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": True,
    "causal_mask": True,  # ours, not Liger's: exact, and only changes what a compiled SDPA model runs
}


def resolve_toggles(toggles: dict) -> dict[str, bool]:
    """The kernel set of an apply() call; TypeError for unknown keywords or non-boolean values."""
    unknown = [k for k in toggles if k not in KERNEL_NAMES]
    if unknown:
        raise TypeError(
            f"apply() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"valid kernel keywords: {', '.join(KERNEL_NAMES)}"
        )
    chosen = {k: APPLY_DEFAULTS.get(k, False) for k in KERNEL_NAMES}
    for kernel, value in toggles.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply(): {kernel} must be True or False, got {value!r}")
        chosen[kernel] = value
    return chosen


def _is_modeling_module(name: str) -> bool:
    # transformers.models.*.modeling_*, and remote-code models (transformers_modules.*.modeling_*)
    return name.rpartition(".")[2].startswith("modeling_") and not name.startswith("torch.")


def modules_of(model) -> list:
    """The modeling modules defining the model's class (and its bases) and its submodules' classes,
    in first-seen order."""
    names: list[str] = []
    classes = list(type(model).__mro__)
    modules_fn = getattr(model, "modules", None)
    if callable(modules_fn):
        classes += [type(m) for m in modules_fn()]
    for cls in classes:
        name = getattr(cls, "__module__", None)
        if isinstance(name, str) and name not in names and _is_modeling_module(name):
            names.append(name)
    return [sys.modules[n] for n in names if n in sys.modules]


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


def apply(model, **toggles) -> list:
    """Patch the components `model` uses; returns the records of this call (also in applied())."""
    from autopatch import hooks, report, rules

    chosen = resolve_toggles(toggles)

    def enabled(kernel: str) -> bool:
        if kernel not in chosen:
            raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
        return chosen[kernel]

    settings = hooks.active_settings()
    if settings is None:
        from autopatch.config import load_settings

        settings = load_settings()  # for AUTOPATCH_STRICT; a bad environment raises ConfigError here
    report.set_strict(settings.strict)

    records: list = []
    for module in modules_of(model):
        found = rules.patch_module(module, enabled)
        report.add(found)
        line = report.summary_line(module.__name__, found, enabled)
        if line:
            print(line, file=sys.stderr, flush=True)
        records.extend(found)
    _rebind_hooked_forwards(model)
    if chosen.get("layer_norm"):
        _patch_layer_norm_instances(model, records)
    if settings.strict:
        refused = report.refusals(records, enabled)
        if refused:
            toggles_off = ", ".join(f"{k}=False" for k in report.refused_kernels(refused))
            where = ", ".join(dict.fromkeys(r.module for r in refused))
            raise report.StrictModeError("autopatch " + report.strict_refusal_message(
                where, refused, f"Turn those kernels off in the call (autopatch.apply(model, {toggles_off}))"))
    return records
