"""Rules: one module per component kind. A rule = the kernel names it serves + detect + patch.

Each rule module defines `RULE`, an object with
    name: str                      # "rms_norm", "rope", "glu_mlp", "moe_gate", "loss", "causal_mask"
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
    "autopatch.rules.moe_gate",
    "autopatch.rules.loss",
    "autopatch.rules.causal_mask",
)


def all_rules() -> list:
    return [importlib.import_module(name).RULE for name in RULE_MODULES]


def patch_module(module: ModuleType, enabled: Callable[[str], bool]) -> list:
    """Run every rule whose kernels are enabled over one modeling module; returns the records."""
    from autopatch.report import Record

    records = []
    for rule in all_rules():
        if not any(enabled(k) for k in rule.kernels):
            continue
        try:
            records.extend(rule.patch_module(module, enabled))
        except Exception as exc:  # a rule bug must never break the user's import
            records.append(
                Record(kernel=rule.name, module=module.__name__, target="*", patched=False,
                       reason=f"rule raised {type(exc).__name__}: {exc}")
            )
    return records
