"""The one skeleton every rule runs on, in the spirit of OpenTelemetry's BaseInstrumentor: the
template owns the per-candidate loop, a rule supplies only what differs.

For each candidate a rule finds in a modeling module (`candidates`), the template
  1. takes the rule's verdict for it from the cache (`verdicts`, per class or function; tests may
     clear it), or has the rule prove one (`prove`) inside `_probe.probing()`: the probes' own state
     (CPU, float32, grad on, no autocast, the user's RNG untouched), whatever the user's code is in;
  2. records a refusal under the kernel of the variant that would have run (a GELU MoE refusal is
     `geglu`'s, a SiLU one `swiglu`'s), with the rule's reason;
  3. asks the rule which attributes to swap (`swaps`) and refuses when any of them was swapped by
     another rule; reports the candidate patched when every swap is already ours;
  4. refuses when the variant's kernel is off, or fused_kernels cannot be imported;
  5. swaps through autopatch.patching (the original kept, idempotent, undone by patching.restore)
     and records the patch, labelled with the variant's kernel and description.
Any exception in a rule becomes a refusal with the reason: a rule never raises into an import.

A rule subclasses `Rule` and sets `name` and `kernels`; it defines `candidates(module)`,
`prove(candidate, module) -> Verdict` and `swaps(candidate, verdict, session, enabled) -> [Swap]`,
and may define `wants(candidate, enabled)` (a candidate recorded only when it holds) and
`patched(candidate, verdict)` (after its swaps are in force). Patched code keeps the Session it was
made with (swaps gets it) and reports through it.
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType
from typing import Callable

from autopatch import patching
from autopatch.rules import _probe
from autopatch.rules._kernels import import_problem
from autopatch.session import Record


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a rule proved about one candidate: the variant it computes (an object with `describe()`
    and, for rules serving several kernels, `kernel`), or None and why not. `kernel` names the kernel
    a refusal is recorded under when there is no variant (the one its activation would have used);
    empty: the variant's, else the rule's first."""

    target: str
    variant: object | None
    reason: str = ""
    kernel: str = ""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One thing a rule may patch: `target` is what the Record names, `key` what the verdict is cached
    under (a class, a function, ...), `subject` what prove() looks at (default: the key)."""

    target: str
    key: object
    subject: object = None
    kernel: str = ""  # for rules with one candidate per kernel (the loss rule)

    @property
    def what(self):
        return self.key if self.subject is None else self.subject


@dataclasses.dataclass(frozen=True)
class Swap:
    """owner.name = make() (or owner[name] = make() for a mapping item), through autopatch.patching.
    `make` is called only when the swap is not in force yet."""

    owner: object
    name: object
    make: Callable[[], object]
    item: bool = False

    @property
    def key(self):
        return (id(self.owner), ("item", self.name) if self.item else self.name)

    def in_force(self) -> bool:
        return (patching.is_item_patched(self.owner, self.name) if self.item
                else patching.is_patched(self.owner, self.name))

    def apply(self) -> None:
        value = self.make()
        if self.item:
            patching.replace_item(self.owner, self.name, value)
        else:
            patching.replace(self.owner, self.name, value)

    def installed(self):
        """What autopatch.patching set under this swap's key (None when not patched)."""
        return patching.installed(self.owner, self.key[1])

    def label(self) -> str:
        return f"{self.name!r} of the attention registry" if self.item else str(self.name)


# Swap.key -> (the rule that made the swap, the value it set). Process-wide, not a Session's, because the
# swaps are: autopatch.patching holds them for the interpreter, and one made under a Session stays in
# force under another (doctor's own, a test's). An entry counts only while its value is the one patching
# holds, so a patch restored and made again by something else is never taken for the rule's.
_owners: dict = {}
_owners_lock = threading.Lock()


def owner_of(swap: Swap) -> str | None:
    """The rule that made `swap`'s patch in force now; None when not in force, "" when in force but
    not made by a rule (a test, an older patch)."""
    if not swap.in_force():
        return None
    installed = swap.installed()
    with _owners_lock:
        rule, value = _owners.get(swap.key, ("", None))
        if value is not installed:
            _owners.pop(swap.key, None)  # left by a patch since restored
            return ""
        return rule


def _note_owner(swap: Swap, rule: str) -> None:
    with _owners_lock:
        _owners[swap.key] = (rule, swap.installed())


class Rule:
    """The skeleton (module docstring). Subclasses supply name, kernels, candidates, prove, swaps."""

    name: str = ""
    kernels: tuple[str, ...] = ()
    tag: str = ""  # when set, every refusal's reason starts with it ("fused experts: ...")

    def __init__(self):
        self.verdicts: dict = {}  # candidate key -> Verdict

    # ---------------------------------------------------------------- what a rule supplies
    def candidates(self, module: ModuleType) -> list[Candidate]:
        raise NotImplementedError

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        raise NotImplementedError

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        raise NotImplementedError

    def wants(self, candidate: Candidate, enabled: Callable[[str], bool]) -> bool:
        """Whether the candidate gets a record at all (default: always, a disabled kernel's included)."""
        return True

    def patched(self, candidate: Candidate, verdict: Verdict) -> None:
        """Called once the candidate's swaps are all in force (just made, or already)."""

    # ---------------------------------------------------------------- the skeleton
    def kernel_of(self, verdict: Verdict | None) -> str:
        if verdict is not None:
            if verdict.kernel:
                return verdict.kernel
            kernel = getattr(verdict.variant, "kernel", "")
            if kernel:
                return kernel
        return self.kernels[0]

    def tagged(self, reason: str) -> str:
        if reason and self.tag and not reason.startswith(self.tag):
            return f"{self.tag}: {reason}"
        return reason

    def verdict(self, candidate: Candidate, module: ModuleType) -> Verdict:
        """The cached verdict, proved inside the probes' own state the first time."""
        verdict = self.verdicts.get(candidate.key)
        if verdict is None:
            verdict = self.verdicts[candidate.key] = _probe.sealed(self.prove, candidate, module)
        return verdict

    def patch_module(self, module: ModuleType, session, enabled: Callable[[str], bool]) -> list[Record]:
        """One Record per candidate of `module`: patched with the variant, or left alone with the reason."""
        try:
            found = [c for c in self.candidates(module) if self.wants(c, enabled)]
        except Exception as exc:  # noqa: BLE001 - never raise into an import
            return [Record(self.kernels[0], module.__name__, "*", False,
                           reason=self.tagged(f"rule error: {_probe.describe_exc(exc)}"))]
        records = []
        for candidate in found:
            try:
                records.append(self.patch_candidate(candidate, module, session, enabled))
            except Exception as exc:  # noqa: BLE001 - never raise into an import
                kernel = candidate.kernel or self.kernel_of(self.verdicts.get(candidate.key))
                records.append(Record(kernel, module.__name__, candidate.target, False,
                                      reason=self.tagged(f"rule error: {_probe.describe_exc(exc)}")))
        return records

    def patch_candidate(self, candidate: Candidate, module: ModuleType, session, enabled) -> Record:
        verdict = self.verdict(candidate, module)
        kernel = candidate.kernel or self.kernel_of(verdict)

        def record(patched: bool, variant: str = "", reason: str = "") -> Record:
            return Record(kernel, module.__name__, verdict.target, patched, variant, self.tagged(reason))

        if verdict.variant is None:
            return record(False, reason=verdict.reason)
        variant = describe(verdict.variant)
        swaps = self.swaps(candidate, verdict, session, enabled)
        owners = [owner_of(s) for s in swaps]
        for swap, owner in zip(swaps, owners):
            if owner is not None and owner != self.name:
                by = f" ({owner})" if owner else ""
                return record(False, variant, f"{swap.label()} patched by another rule{by}")
        pending = [s for s, owner in zip(swaps, owners) if owner is None]
        if not pending:
            self.patched(candidate, verdict)
            return record(True, variant)
        if not enabled(kernel):
            return record(False, variant, f"kernel {kernel} disabled")
        problem = import_problem()
        if problem:
            return record(False, variant, problem)
        for swap in pending:
            swap.apply()
            _note_owner(swap, self.name)
        self.patched(candidate, verdict)
        return record(True, variant)


def describe(variant) -> str:
    """A variant's text for the Record."""
    text = getattr(variant, "describe", None)
    return text() if callable(text) else str(variant)


def class_candidates(module: ModuleType, keep: Callable[[type], bool], attr: str = "forward",
                     suffix: bool = False) -> list[Candidate]:
    """A Candidate per class defined in `module` for which keep(cls) holds (target: the class name, or
    "Class.attr" with `suffix`); the verdict is cached per class."""
    return [Candidate(f"{c.__name__}.{attr}" if suffix else c.__name__, c)
            for c in _probe.defined_classes(module) if keep(c)]


def input_name(forward, default: str = "hidden_states") -> str:
    """The name of a forward's first parameter after self (how a caller may pass the input by keyword)."""
    params = _probe.positional_params(forward) or []
    return params[0].name if params else default
