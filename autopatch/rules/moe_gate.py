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

Patch. `_apply_gate` on the class is replaced by one that hands the two halves (views of
gate_up_out, no copy) to the fused kernel. The "eager" experts implementation (the model's own
per-expert loop) never calls `_apply_gate`; there the experts run as written.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from autopatch import patching
from autopatch.report import Record, fallback_notice
from autopatch.rules import _probe, glu_mlp
from autopatch.rules._kernels import import_problem, kernels

METHOD = "_apply_gate"


def default_gate():
    """transformers' shared gate function, or None where this transformers has none."""
    try:
        from transformers.integrations import moe
    except Exception:  # noqa: BLE001 - older transformers, or an import problem: no candidates
        return None
    return getattr(moe, "_default_apply_gate", None)


def handles(cls: type) -> bool:
    """Whether `cls` is a candidate: its own _apply_gate is transformers' default gate (or was,
    before this rule patched it)."""
    gate_fn = default_gate()
    if gate_fn is None:
        return False
    if patching.is_patched(cls, METHOD):
        return patching.original(cls, METHOD) is gate_fn
    return vars(cls).get(METHOD) is gate_fn


def make_apply_gate(original: Callable, kernels_on: frozenset) -> Callable:
    def _apply_gate(self, gate_up_out):
        kind = glu_mlp.activation_kind(getattr(self, "act_fn", None))
        if (kind is None or glu_mlp.KINDS[kind][0] not in kernels_on or not isinstance(gate_up_out, torch.Tensor)
                or gate_up_out.dtype not in glu_mlp._FLOAT_DTYPES or gate_up_out.shape[-1] % 2
                or hasattr(gate_up_out, "device_mesh")):  # a DTensor (tensor parallel): torch's own ops
            return original(self, gate_up_out)
        if not kernels().triton_can_run(gate_up_out):
            fallback_notice(glu_mlp.KINDS[kind][0], f"{type(self).__name__} got {gate_up_out.device.type} tensors")
            return original(self, gate_up_out)
        gate, up = gate_up_out.chunk(2, dim=-1)
        return glu_mlp.gated(kind, gate, up)

    _apply_gate.__name__ = _apply_gate.__qualname__ = METHOD
    _apply_gate.__doc__ = getattr(original, "__doc__", None)
    _apply_gate.__wrapped__ = original
    _apply_gate._autopatch_variant = VARIANT
    return _apply_gate


VARIANT = "experts gate: act(gate) * up of gate_up_out.chunk(2); swiglu/geglu by the instance's act_fn"


class _Rule:
    name = "moe_gate"
    kernels = ("swiglu", "geglu")

    def patch_module(self, module: ModuleType, enabled: Callable[[str], bool]) -> list[Record]:
        gate_fn = default_gate()
        if gate_fn is None:
            return []
        try:
            classes = [c for c in _probe.defined_classes(module) if handles(c)]
        except Exception as exc:  # noqa: BLE001 - never raise into an import
            return [Record("swiglu", module.__name__, "*", False, reason=_probe.describe_exc(exc))]
        kernels_on = frozenset(k for k in self.kernels if enabled(k))
        records = []
        for cls in classes:
            target = f"{cls.__name__}.{METHOD}"
            if not kernels_on:
                records.append(Record("swiglu", module.__name__, target, False, VARIANT, "kernels swiglu and geglu disabled"))
                continue
            problem = import_problem()
            if problem:
                records.append(Record("swiglu", module.__name__, target, False, VARIANT, problem))
                continue
            patching.replace(cls, METHOD, make_apply_gate(gate_fn, kernels_on))  # False when done already
            records.append(Record("swiglu", module.__name__, target, True, VARIANT))
        return records


RULE = _Rule()
