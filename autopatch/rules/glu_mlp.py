"""Gated MLPs -> fused_kernels.swiglu / fused_kernels.geglu (kernels "swiglu", "geglu").

Detection. Candidates are the classes a modeling module defines whose __init__ mentions `down_proj`
and either `gate_proj` + `up_proj` or a fused `gate_up_proj`. One instance is built from a tiny
config of the module's own config class (Llama4TextMLP -> Llama4TextConfig). It must hold exactly
the projections as plain nn.Linear modules (a 3-D `gate_up_proj` parameter is an MoE expert container:
autopatch/rules/moe_gate.py takes those whose gate is transformers' default; others are left alone)
plus the activation in `act_fn` / `activation_fn` / `act`, and nothing else — no dropout, no norm, no
parameters of its own. Its forward is run in float64 on random weights and inputs against

    down(act(gate(x)) * up(x))        act in {silu, gelu_tanh, gelu_erf}
    gate, up = gate_up(x).chunk(2)    for the fused projection, in either order

and exactly one candidate must match. The activation is then read from each instance at run time —
not from the config name: the same class runs SiLU in one checkpoint and GELU in another — by probing
the activation object once (cached by its type and settings): SiLU -> swiglu, GELU-tanh -> geglu
approximate="tanh", GELU-erf -> geglu approximate="none", anything else (or a disabled kernel) -> the
original forward.

Patch. The class's `forward` is replaced by one that calls the instance's own projections (so LoRA
wrappers around them keep working) and the fused gate kernel. When `down_proj` is a plain nn.Linear
(no hooks, no subclass, no autocast) the gate and the down projection run as one node,
fused_kernels.glu_linear, which recomputes act(gate) * up in the backward instead of keeping it; tensors Triton cannot run on go to the
original forward, with one notice per process.

Tiled. Above AUTOPATCH_TILED_MLP_TOKENS tokens in training, the same computation runs over chunks of
the tokens and is recomputed in the backward (autopatch.rules._tiled): the tokens × intermediate
activations never exist whole.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from autopatch.rules import _probe, _tiled, moe_gate
from autopatch.rules._gated import (  # noqa: F401 - the activation table, used by the MoE and GELU rules too
    ACT_REFERENCES, FLOAT_DTYPES, GLU_LINEAR_ACTIVATION, KINDS, _gelu_erf, _gelu_tanh, activation_kind,
    classify_activation, gated, weights_fit,
)
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict as _Verdict, input_name

ACT_ATTRS = ("act_fn", "activation_fn", "act")
_FLOAT_DTYPES = FLOAT_DTYPES
PROBE_TOL = 1e-6  # float64 probe; gelu tanh vs erf differ by ~1e-4 here, a wrong layout by O(1)


# --- detection ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # activation kind of the probe instance
    fused: bool  # one gate_up_proj instead of gate_proj + up_proj
    gate_first: bool  # fused: gate_up_proj(x).chunk(2) == (gate, up)
    act_attr: str
    state: tuple = ()  # the probed instance's switches (_probe.instance_state); others run the original

    @property
    def kernel(self) -> str:
        return KINDS[self.kind][0]

    def describe(self) -> str:
        kernel, kwargs = KINDS[self.kind]
        text = kernel + "".join(f" {k}={v}" for k, v in kwargs.items())
        if self.fused:
            text += " fused gate_up_proj (" + ("gate, up" if self.gate_first else "up, gate") + ")"
        return text


def Verdict(target: str, variant: Variant | None, reason: str = "", kernel: str = "swiglu") -> _Verdict:
    """The template's Verdict; a refusal is recorded under the kernel its activation would use."""
    return _Verdict(target, variant, reason, kernel)


def looks_like_glu_mlp(cls: type) -> bool:
    """Its __init__, or one it inherits and extends, mentions the gated-MLP projections."""
    source = _probe.init_source(cls)
    return "down_proj" in source and ("gate_up_proj" in source or ("gate_proj" in source and "up_proj" in source))


def detect(cls: type, module: ModuleType) -> Verdict:
    target = cls.__name__
    extra = _probe.forward_extra_args(cls)
    instance, why = _probe.build_mlp(cls, module)
    if instance is None:
        return Verdict(target, None, extra or why)
    if _is_expert_container(instance):
        if callable(getattr(cls, "_apply_gate", None)):
            return Verdict(target, None, "MoE expert container with a gate of its own (_apply_gate); the "
                                         "moe_gate rule takes transformers' default expert gate only")
        return Verdict(target, None, "MoE expert container with 3-D parameters outside transformers' experts "
                                     "interface (no _apply_gate)")
    if extra:
        return Verdict(target, None, extra)
    return _probe_instance(target, cls, instance)


def _is_expert_container(instance) -> bool:
    return any(
        isinstance(getattr(instance, name, None), torch.Tensor) and getattr(instance, name).dim() == 3
        for name in ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
    )


def _structure(instance) -> tuple[bool | None, str, str]:
    """(fused, act_attr, reason): reason '' when the instance is a plain gated MLP."""
    fused = getattr(instance, "gate_up_proj", None) is not None
    projections = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    for name in projections:
        proj = getattr(instance, name, None)
        if type(proj) is not nn.Linear:
            return None, "", f"{name} is {type(proj).__name__}, not a plain nn.Linear"
    act_attr = next((a for a in ACT_ATTRS if getattr(instance, a, None) is not None), "")
    if not act_attr:
        return None, "", f"no activation attribute ({', '.join(ACT_ATTRS)})"
    extra = [n for n, _ in instance.named_children() if n not in projections and n != act_attr]
    if extra:
        return None, "", f"has other submodules ({', '.join(extra)})"
    own = [n for n, _ in instance.named_parameters(recurse=False)] + [n for n, _ in instance.named_buffers(recurse=False)]
    if own:
        return None, "", f"has its own parameters/buffers ({', '.join(own)})"
    return fused, act_attr, ""


def _reference(instance, x, fused: bool, gate_first: bool, act):
    if fused:
        a, b = instance.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = (a, b) if gate_first else (b, a)
    else:
        gate, up = instance.gate_proj(x), instance.up_proj(x)
    return instance.down_proj(act(gate) * up)


def _probe_instance(target, cls, instance) -> Verdict:
    fused, act_attr, reason = _structure(instance)
    if reason:
        return Verdict(target, None, reason)
    state = _probe.instance_state(instance)
    kind = activation_kind(getattr(instance, act_attr))
    if kind is None:
        act = getattr(instance, act_attr)
        return Verdict(target, None, f"activation {type(act).__name__} is not SiLU, GELU-tanh or GELU-erf")
    hint = KINDS[kind][0]
    gen = _probe.generator(0)
    instance.double()
    for p in instance.parameters():
        p.copy_(_probe.randn(tuple(p.shape), gen, torch.float64, scale=0.3))
    first = instance.gate_up_proj if fused else instance.gate_proj
    x = _probe.randn((2, 3, first.in_features), gen, torch.float64)
    try:
        out = cls.forward(instance, x)
    except Exception as exc:  # noqa: BLE001
        return Verdict(target, None, f"probe failed ({_probe.describe_exc(exc)})")
    matches = []
    for gate_first in ((True, False) if fused else (True,)):
        for act_kind, act in ACT_REFERENCES.items():
            ref = _reference(instance, x, fused, gate_first, act)
            if _probe.rel_err(out, ref) <= PROBE_TOL:
                matches.append(Variant(act_kind, fused, gate_first, act_attr, state))
    if len(matches) == 1:
        if matches[0].kind != kind:  # the forward does not use its activation attribute as probed
            return Verdict(target, None, f"forward computes {matches[0].kind} but {act_attr} is {kind}", hint)
        return Verdict(target, matches[0], "", hint)
    if not matches:
        return Verdict(target, None, "matches no gated-MLP formula down(act(gate(x)) * up(x))", hint)
    return Verdict(target, None, "ambiguous: matches " + "; ".join(v.describe() for v in matches), hint)


# --- the patched forward ------------------------------------------------------------------------


# Gate and down projection as one node (fused_kernels.glu_linear) where down_proj allows it.
# benchmarks/bench_e2e.py's "ours_keep_input" peer turns it off to measure the difference.
FUSE_DOWN_PROJ = True


def _fusable_down_proj(down, gate: torch.Tensor) -> bool:
    """Whether `down` may be replaced by a call of F.linear with its weight: a plain nn.Linear
    (_probe.plain_linear: no forward of its own, no hooks that would be skipped, global ones
    included), plain tensors of gate's dtype (no DTensor), and no autocast (which would recast the
    weight inside the Linear)."""
    return _probe.plain_linear(down) and weights_fit(down, gate)


def _unobserved(mlp, fused: bool) -> bool:
    """Whether the projections' outputs are private to this forward: no forward hooks on them (a hook
    could keep the output), so the backward may write gradients over them."""
    from torch.nn.modules import module as _module

    if _module._global_forward_hooks:
        return False
    names = ("gate_up_proj",) if fused else ("gate_proj", "up_proj")
    return all(not getattr(mlp, n)._forward_hooks for n in names)


def make_forward(original_forward: Callable, variant: Variant, kernels_on: frozenset, input_name: str, session):
    fused, gate_first, act_attr, state = variant.fused, variant.gate_first, variant.act_attr, variant.state

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if not isinstance(x, torch.Tensor) or len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            # other arguments, or an instance built differently from the probed one (extra modules)
            return original_forward(self, *args, **kwargs)
        kind = activation_kind(getattr(self, act_attr, None))
        if kind is None or KINDS[kind][0] not in kernels_on:
            return original_forward(self, *args, **kwargs)
        limit = _tiled.limit_of(session)
        if _tiled.wanted(self, x, limit):
            return _tiled.run(self, x, lambda piece: body(self, piece, kind), limit)
        return body(self, x, kind)

    def body(self, x, kind):
        """The MLP on x (whole, or one chunk of a tiled call)."""
        fk = kernels()
        if not fk.triton_can_run(x):
            fallback(session, KINDS[kind][0], f"{type(self).__name__} got {x.device.type} tensors")
            return original_forward(self, x)
        if fused:
            a, b = self.gate_up_proj(x).chunk(2, dim=-1)
            gate, up = (a, b) if gate_first else (b, a)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype != up.dtype or gate.dtype not in _FLOAT_DTYPES or gate.shape != up.shape:
            # float64 or mixed dtypes: the kernel does not take them; this is the probed formula
            return self.down_proj(getattr(self, act_attr)(gate) * up)
        down = self.down_proj
        if FUSE_DOWN_PROJ and _fusable_down_proj(down, gate):
            # One node for the gate and the down projection: the product is recomputed in the
            # backward instead of being kept alive by the Linear (tokens × intermediate per layer).
            return fk.glu_linear(gate, up, down.weight, down.bias, activation=GLU_LINEAR_ACTIVATION[kind],
                                 temporaries=_unobserved(self, fused))
        return down(gated(kind, gate, up))

    return _probe.dressed_forward(forward, original_forward, variant.describe())


# --- the rule -----------------------------------------------------------------------------------


class _Rule(Rule):
    name = "glu_mlp"
    kernels = ("swiglu", "geglu")

    def candidates(self, module: ModuleType) -> list[Candidate]:
        # An expert container with transformers' default gate is the moe_gate rule's.
        return [Candidate(c.__name__, c) for c in _probe.defined_classes(module)
                if looks_like_glu_mlp(c) and not moe_gate.handles(c)]

    def prove(self, candidate: Candidate, module: ModuleType) -> _Verdict:
        return detect(candidate.key, module)

    def swaps(self, candidate: Candidate, verdict: _Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        kernels_on = frozenset(k for k in self.kernels if enabled(k))
        return [Swap(cls, "forward", lambda: make_forward(cls.forward, verdict.variant, kernels_on,
                                                          input_name(cls.forward, "hidden_state"), session))]


RULE = _Rule()
_verdicts = RULE.verdicts
