"""MoE expert gates -> fused_kernels.swiglu / fused_kernels.geglu (kernels "swiglu", "geglu").

transformers' expert containers (classes decorated with `@use_experts_implementation`, 3-D
`gate_up_proj` / `down_proj` parameters) run their gated activation through one method,
`self._apply_gate(gate_up_out)`, in the batched_mm and grouped_mm implementations (grouped_mm is the
default where torch can dispatch it, i.e. on a GPU). The decorator gives every class that does not
define its own the shared `transformers.integrations.moe._default_apply_gate`:

    gate, up = gate_up_out.chunk(2, dim=-1)
    return self.act_fn(gate) * up

Detection: a class defined in the modeling module whose own `_apply_gate` *is* that function. A class
with a gate of its own (gpt-oss's clamped gate, DeepSeek-V4's) is not a candidate: its formula is
something else. No probe is needed for the formula; the activation is read from each instance at run
time, exactly as the glu_mlp rule does (its classifier and table are used here): SiLU -> swiglu,
GELU-tanh / GELU-erf -> geglu, anything else or a disabled kernel -> the original gate.

Records are labelled with the kernel of the activation the architecture's default config gives its
experts (_gated.default_activation_kernel): a GELU MoE's record is `geglu`'s, a SiLU one `swiglu`'s,
so a refusal or a disabled kernel is judged under the toggle that would have run.

Patch. `_apply_gate` on the class is replaced by one that hands the two halves (views of
gate_up_out, no copy) to the fused kernel. The "eager" experts implementation (the model's own
per-expert loop) never calls `_apply_gate`; there the experts run as written.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from autopatch.rules import _gated, _probe
from autopatch.rules._gated import default_gate, handles  # noqa: F401 - this rule's candidates
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict

METHOD = _gated.GATE_METHOD
VARIANT = "experts gate: act(gate) * up of gate_up_out.chunk(2); swiglu/geglu by the instance's act_fn"


@dataclasses.dataclass(frozen=True)
class GateVariant:
    kernel: str  # the kernel of the activation the architecture's instances hold (swiglu / geglu)

    def describe(self) -> str:
        return VARIANT


def make_apply_gate(original: Callable, kernels_on: frozenset, session) -> Callable:
    def _apply_gate(self, gate_up_out):
        kind = _gated.activation_kind(getattr(self, "act_fn", None))
        if (kind is None or _gated.KINDS[kind][0] not in kernels_on or not isinstance(gate_up_out, torch.Tensor)
                or gate_up_out.dtype not in _gated.FLOAT_DTYPES or gate_up_out.shape[-1] % 2
                or hasattr(gate_up_out, "device_mesh")):  # a DTensor (tensor parallel): torch's own ops
            return original(self, gate_up_out)
        if not kernels().triton_can_run(gate_up_out):
            fallback(session, _gated.KINDS[kind][0], f"{type(self).__name__} got {gate_up_out.device.type} tensors")
            return original(self, gate_up_out)
        gate, up = gate_up_out.chunk(2, dim=-1)
        return _gated.gated(kind, gate, up)

    _apply_gate.__name__ = _apply_gate.__qualname__ = METHOD
    _apply_gate.__doc__ = getattr(original, "__doc__", None)
    _apply_gate.__wrapped__ = original
    _apply_gate._autopatch_variant = VARIANT
    return _apply_gate


class _Rule(Rule):
    name = "moe_gate"
    kernels = ("swiglu", "geglu")

    def candidates(self, module: ModuleType) -> list[Candidate]:
        if default_gate() is None:
            return []
        return [Candidate(f"{c.__name__}.{METHOD}", c) for c in _probe.defined_classes(module) if handles(c)]

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        # No probe of the formula (the gate is transformers' own function); the record's kernel is the
        # one the architecture's activation runs on.
        kernel = _gated.default_activation_kernel(candidate.key, module) or "swiglu"
        return Verdict(candidate.target, GateVariant(kernel))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        kernels_on = frozenset(k for k in self.kernels if enabled(k))
        return [Swap(candidate.key, METHOD, lambda: make_apply_gate(default_gate(), kernels_on, session))]


RULE = _Rule()
_verdicts = RULE.verdicts
