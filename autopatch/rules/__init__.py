"""Rules: one module per component kind. A rule = the kernel names it serves + detect + patch.

Each rule module defines `RULE`, an object with
    name: str                      # "rms_norm", "rope", "glu_mlp", "moe_gate", "moe_experts", "loss", …
    kernels: tuple[str, ...]       # kernel names (autopatch.names) whose toggles govern it
    patch_module(module, enabled) -> list[report.Record]
where `module` is an imported transformers modeling module (e.g. transformers.models.llama.modeling_llama)
and `enabled(kernel_name) -> bool` says whether that kernel is on for this module's model type.
patch_module looks only at objects defined in that module (obj.__module__ == module.__name__),
detects structurally then numerically (small CPU probes, float64/float32/bf16), patches through
autopatch.patching.replace only on an unambiguous match, and returns one Record per candidate,
patched or left alone with the reason. It must never raise (callers also guard it) and must be
idempotent (a second call patches nothing again, returns the same verdicts).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

RULE_MODULES: tuple[str, ...] = (
    "autopatch.rules.rms_norm",
    "autopatch.rules.layer_norm",
    "autopatch.rules.rope",
    "autopatch.rules.glu_mlp",
    "autopatch.rules.gelu_mlp",
    "autopatch.rules.moe_gate",
    "autopatch.rules.moe_experts",
    "autopatch.rules.loss",
    "autopatch.rules.causal_mask",
    "autopatch.rules.vision_attention",
    "autopatch.rules.masked_attention",
)


def all_rules() -> list:
    return [importlib.import_module(name).RULE for name in RULE_MODULES]


# (module name, rule name) -> (kernels of the records that call patched, patching keys it added): what
# unpatch() undoes when a later apply() turns those kernels off.
_made: dict[tuple[str, str], tuple[frozenset, set]] = {}


def patch_module(module: ModuleType, enabled: Callable[[str], bool], skip: frozenset = frozenset()) -> list:
    """Run every rule whose kernels are enabled over one modeling module (but the rules named in `skip`);
    returns the records."""
    from autopatch import patching
    from autopatch.report import Record

    records = []
    for rule in all_rules():
        if rule.name in skip or not any(enabled(k) for k in rule.kernels):
            continue
        before = patching.patched_keys()
        try:
            found = rule.patch_module(module, enabled)
            records.extend(found)
            added = patching.patched_keys() - before
            if added:
                key = (module.__name__, rule.name)
                kernels, keys = _made.get(key, (frozenset(), set()))
                _made[key] = (kernels | {r.kernel for r in found if r.patched}, keys | added)
        except Exception as exc:  # a rule bug must never break the user's import
            records.append(
                Record(kernel=rule.name, module=module.__name__, target="*", patched=False,
                       reason=f"rule raised {type(exc).__name__}: {exc}")
            )
    return records


def unpatch(module: ModuleType, disabled: Callable[[str], bool]) -> list[str]:
    """Undo the patches the rules made in `module` for kernels now turned off (`disabled(kernel)`).
    A rule's patches in a module are undone together, so all the kernels they serve there must be off;
    ValueError names them otherwise. Returns the kernels whose patches were undone."""
    from autopatch import patching

    undone: list[str] = []
    for (name, rule_name), (kernels, keys) in list(_made.items()):
        if name != module.__name__:
            continue
        keys = keys & patching.patched_keys()  # patches undone since (patching.restore_all) are gone
        if not keys:
            del _made[(name, rule_name)]
            continue
        off = [k for k in sorted(kernels) if disabled(k)]
        if not off:
            continue
        if len(off) != len(kernels):
            on = [k for k in sorted(kernels) if k not in off]
            raise ValueError(
                f"apply(): {', '.join(off)} cannot be turned off alone in {name}: the {rule_name} rule patched "
                f"{', '.join(sorted(kernels))} there together; turn {', '.join(on)} off too, or keep them all on"
            )
        patching.restore(keys)
        del _made[(name, rule_name)]
        undone.extend(off)
    return undone
