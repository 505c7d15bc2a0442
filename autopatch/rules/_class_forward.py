"""What the norm rules share: a class of a modeling module whose `forward` a numerical probe proved
equal to a kernel's formula gets that forward replaced (isinstance, state_dict keys, init and
extra_repr stay); a class the probe could not prove is left alone, recorded with the reason."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

from autopatch import patching
from autopatch.report import Record
from autopatch.rules import _probe
from autopatch.rules._kernels import import_problem


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the probe found for one class: the variant it computes, or None and why not."""

    target: str
    variant: object | None
    reason: str = ""


class ClassForwardRule:
    """Patches the classes a rule picked: `detect(cls, module) -> Verdict` proves a variant (cached in
    `verdicts`, which tests may clear), `make_forward(original, variant, input_name)` builds the fused
    forward."""

    def __init__(self, kernel: str, detect: Callable, make_forward: Callable, verdicts: dict):
        self.kernel = kernel
        self.detect = detect
        self.make_forward = make_forward
        self.verdicts = verdicts

    def patch_classes(self, module: ModuleType, classes, enabled: Callable[[str], bool]) -> list[Record]:
        records = []
        for cls in classes:
            try:
                records.append(self.patch_class(cls, module, enabled))
            except Exception as exc:  # noqa: BLE001 - never raise into an import
                records.append(Record(self.kernel, module.__name__, cls.__name__, False,
                                      reason=f"rule error: {_probe.describe_exc(exc)}"))
        return records

    def patch_class(self, cls: type, module: ModuleType, enabled: Callable[[str], bool]) -> Record:
        verdict = self.verdicts.get(cls)
        if verdict is None:
            verdict = self.verdicts[cls] = self.detect(cls, module)
        record = lambda patched, variant="", reason="": Record(  # noqa: E731
            self.kernel, module.__name__, verdict.target, patched, variant, reason)
        if verdict.variant is None:
            return record(False, reason=verdict.reason)
        variant = verdict.variant.describe()
        if patching.is_patched(cls, "forward"):
            ours = getattr(cls.forward, "_autopatch_variant", None) == variant
            return record(True, variant) if ours else record(False, variant, "forward patched by another rule")
        if not enabled(self.kernel):
            return record(False, variant, f"kernel {self.kernel} disabled")
        missing = import_problem()
        if missing:
            return record(False, variant, missing)
        original = cls.forward
        params = _probe.positional_params(original) or []
        input_name = params[0].name if params else "hidden_states"
        patching.replace(cls, "forward", self.make_forward(original, verdict.variant, input_name))
        return record(True, variant)
