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
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from autopatch import patching
from autopatch.report import Record, fallback_notice
from autopatch.rules import _probe
from autopatch.rules._kernels import import_problem, kernels

ACT_ATTRS = ("act_fn", "activation_fn", "act")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels take
PROBE_TOL = 1e-6  # float64 probe; gelu tanh vs erf differ by ~1e-4 here, a wrong layout by O(1)

# activation kind -> (kernel name, keyword arguments of the kernel call)
KINDS = {
    "silu": ("swiglu", {}),
    "gelu_tanh": ("geglu", {"approximate": "tanh"}),
    "gelu_erf": ("geglu", {"approximate": "none"}),
}


def _gelu_tanh(t):
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t.pow(3))))


def _gelu_erf(t):
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))


ACT_REFERENCES = {"silu": lambda t: t * torch.sigmoid(t), "gelu_tanh": _gelu_tanh, "gelu_erf": _gelu_erf}


# --- activations --------------------------------------------------------------------------------

_act_kinds: dict[object, str | None] = {}


def _act_key(act):
    """What decides an activation's behaviour: a plain function is itself; a module is its type and
    its simple settings (nn.GELU's `approximate`, a clipped GELU's min/max, ...)."""
    if isinstance(act, nn.Module):
        settings = tuple(sorted(
            (k, v) for k, v in vars(act).items()
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str, type(None)))
        ))
        return (type(act), settings)
    return act


def classify_activation(act, references: dict | None = None) -> str | None:
    """'silu' | 'gelu_tanh' | 'gelu_erf' | None (the keys of `references`, ACT_REFERENCES by default), by
    running `act` on a fixed float64 grid (wide enough that a clipped GELU shows its clip)."""
    references = ACT_REFERENCES if references is None else references
    if isinstance(act, nn.Module) and (any(True for _ in act.parameters()) or any(True for _ in act.buffers())):
        return None
    if not callable(act):
        return None
    t = torch.cat((torch.linspace(-6.0, 6.0, 97, dtype=torch.float64, device="cpu"),
                   torch.tensor([-30.0, -15.0, 15.0, 30.0], dtype=torch.float64, device="cpu")))
    try:
        with torch.no_grad(), _probe.quiet():
            out = act(t.clone())
    except Exception:  # noqa: BLE001 - not an elementwise activation we know
        return None
    found = [kind for kind, ref in references.items() if _probe.rel_err(out, ref(t)) <= PROBE_TOL]
    return found[0] if len(found) == 1 else None


def activation_kind(act, references: dict | None = None) -> str | None:
    """classify_activation, cached by the activation's type and settings (per reference set)."""
    try:
        key = (_act_key(act), id(references))
        hash(key)
    except Exception:  # noqa: BLE001 - unhashable settings: classify every time
        return classify_activation(act, references)
    if key not in _act_kinds:
        _act_kinds[key] = classify_activation(act, references)
    return _act_kinds[key]


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


@dataclasses.dataclass(frozen=True)
class Verdict:
    target: str
    variant: Variant | None
    reason: str = ""
    kernel: str = "swiglu"  # the kernel a refusal is recorded under: the one its activation would use


def looks_like_glu_mlp(cls: type) -> bool:
    """Its __init__, or one it inherits and extends, mentions the gated-MLP projections."""
    source = _probe.init_source(cls)
    return "down_proj" in source and ("gate_up_proj" in source or ("gate_proj" in source and "up_proj" in source))


def detect(cls: type, module: ModuleType) -> Verdict:
    target = cls.__name__
    extra = _probe.forward_extra_args(cls)
    with _probe.probing():
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


def gated(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up through the fused kernel of activation kind `kind` (a KINDS key)."""
    fk = kernels()
    kernel, kernel_kwargs = KINDS[kind]
    return fk.swiglu(gate, up) if kernel == "swiglu" else fk.geglu(gate, up, **kernel_kwargs)


GLU_LINEAR_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu_erf": "gelu"}
# Gate and down projection as one node (fused_kernels.glu_linear) where down_proj allows it.
# benchmarks/bench_e2e.py's "ours_keep_input" peer turns it off to measure the difference.
FUSE_DOWN_PROJ = True


def _fusable_down_proj(down, gate: torch.Tensor) -> bool:
    """Whether `down` may be replaced by a call of F.linear with its weight: a plain nn.Linear
    (_probe.plain_linear: no forward of its own, no hooks that would be skipped, global ones
    included), plain tensors of gate's dtype (no DTensor), and no autocast (which would recast the
    weight inside the Linear)."""
    return _probe.plain_linear(down) and weights_fit(down, gate)


def weights_fit(module, x: torch.Tensor) -> bool:
    """Whether `module`'s weight and bias may go straight into a kernel call on `x`: plain tensors (no
    DTensor) of x's dtype and device, and no autocast (which would recast them inside the module)."""
    weight, bias = module.weight, module.bias
    if weight.dtype != x.dtype or weight.device != x.device or hasattr(weight, "device_mesh"):
        return False
    if bias is not None and (bias.dtype != x.dtype or hasattr(bias, "device_mesh")):
        return False
    return not torch.is_autocast_enabled(x.device.type)


def _unobserved(mlp, fused: bool) -> bool:
    """Whether the projections' outputs are private to this forward: no forward hooks on them (a hook
    could keep the output), so the backward may write gradients over them."""
    from torch.nn.modules import module as _module

    if _module._global_forward_hooks:
        return False
    names = ("gate_up_proj",) if fused else ("gate_proj", "up_proj")
    return all(not getattr(mlp, n)._forward_hooks for n in names)


def make_forward(original_forward: Callable, variant: Variant, kernels_on: frozenset, input_name: str):
    fused, gate_first, act_attr, state = variant.fused, variant.gate_first, variant.act_attr, variant.state

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if not isinstance(x, torch.Tensor) or len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            # other arguments, or an instance built differently from the probed one (extra modules)
            return original_forward(self, *args, **kwargs)
        kind = activation_kind(getattr(self, act_attr, None))
        if kind is None or KINDS[kind][0] not in kernels_on:
            return original_forward(self, *args, **kwargs)
        fk = kernels()
        if not fk.triton_can_run(x):
            fallback_notice(KINDS[kind][0], f"{type(self).__name__} got {x.device.type} tensors")
            return original_forward(self, *args, **kwargs)
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

_verdicts: dict[type, Verdict] = {}


class _Rule:
    name = "glu_mlp"
    kernels = ("swiglu", "geglu")

    def patch_module(self, module: ModuleType, enabled: Callable[[str], bool]) -> list[Record]:
        from autopatch.rules import moe_gate  # (imports this module: not at the top)

        try:
            # An expert container with transformers' default gate is the moe_gate rule's.
            classes = [c for c in _probe.defined_classes(module) if looks_like_glu_mlp(c) and not moe_gate.handles(c)]
        except Exception as exc:  # noqa: BLE001
            return [Record("swiglu", module.__name__, "*", False, reason=_probe.describe_exc(exc))]
        records = []
        for cls in classes:
            try:
                records.append(self._patch_class(cls, module, enabled))
            except Exception as exc:  # noqa: BLE001 - never raise into an import
                records.append(Record("swiglu", module.__name__, cls.__name__, False,
                                      reason=f"rule error: {_probe.describe_exc(exc)}"))
        return records

    def _patch_class(self, cls, module, enabled) -> Record:
        verdict = _verdicts.get(cls)
        if verdict is None:
            verdict = _verdicts[cls] = detect(cls, module)
        if verdict.variant is None:
            return Record(verdict.kernel, module.__name__, verdict.target, False, reason=verdict.reason)
        variant = verdict.variant
        record = lambda patched, reason="": Record(  # noqa: E731
            variant.kernel, module.__name__, verdict.target, patched, variant.describe(), reason)
        if patching.is_patched(cls, "forward"):
            return record(True)
        if not enabled(variant.kernel):
            return record(False, f"kernel {variant.kernel} disabled")
        problem = import_problem()
        if problem:
            return record(False, problem)
        kernels_on = frozenset(k for k in self.kernels if enabled(k))
        original = cls.forward
        params = _probe.positional_params(original) or []
        input_name = params[0].name if params else "hidden_state"
        patching.replace(cls, "forward", make_forward(original, variant, kernels_on, input_name))
        return record(True)


RULE = _Rule()
