"""Rules: one module per component kind, each on the template of autopatch.rules._template.

Each rule module defines `RULE`, a `_template.Rule` with
    name: str                      # "rms_norm", "rope", "glu_mlp", "moe_gate", "moe_experts", "loss", …
    kernels: tuple[str, ...]       # kernel names (autopatch.names) whose toggles govern it
    patch_module(module, session, enabled) -> list[Record]
where `module` is an imported transformers modeling module (e.g. transformers.models.llama.modeling_llama),
`session` the autopatch.session.Session the patched code reports to, and `enabled(kernel_name) -> bool`
says whether that kernel is on for this module's model type. A rule looks only at objects defined in
that module, detects structurally then numerically (small CPU probes in the probes' own state,
_probe.probing()), patches through autopatch.patching only on an unambiguous match, and returns one
Record per candidate, patched or left alone with the reason. It never raises and is idempotent (a
second call patches nothing again, returns the same verdicts).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

from autopatch import patching
from autopatch.rules import (
    causal_mask, gelu_mlp, glu_mlp, layer_norm, lora, loss, masked_attention, moe_experts, moe_gate, rms_norm, rope,
    vision_attention,
)
from autopatch.session import Record

# In the order they run over a module: the experts rules after glu_mlp (which leaves expert containers
# to them), the attention rules last.
RULES: tuple = (
    rms_norm.RULE,
    layer_norm.RULE,
    rope.RULE,
    glu_mlp.RULE,
    gelu_mlp.RULE,
    moe_gate.RULE,
    moe_experts.RULE,
    loss.RULE,
    causal_mask.RULE,
    vision_attention.RULE,
    masked_attention.RULE,
    lora.RULE,  # peft's lora.Linear only (autopatch.names.LIBRARY_MODULES): no candidate in a modeling module
)


def all_rules() -> list:
    return list(RULES)


# (module name, rule name) -> (kernels of the records that call patched, patching keys it added): what
# unpatch() undoes when a later apply() turns those kernels off.
_made: dict[tuple[str, str], tuple[frozenset, set]] = {}


def patch_module(module: ModuleType, session, enabled: Callable[[str], bool],
                 skip: frozenset = frozenset()) -> list[Record]:
    """Run every rule whose kernels are enabled over one modeling module (but the rules named in `skip`),
    the patched code reporting to `session`; returns the records."""
    records = []
    for rule in all_rules():
        if rule.name in skip or not any(enabled(k) for k in rule.kernels):
            continue
        before = patching.patched_keys()
        try:
            found = rule.patch_module(module, session, enabled)
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
