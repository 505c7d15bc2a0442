"""What the gated-MLP and MoE rules share: the activation kinds the fused gate kernels serve (SiLU ->
swiglu, GELU tanh / erf -> geglu), an activation's kind found by running it on a fixed grid (cached by
its type and settings: the same class runs SiLU in one checkpoint and GELU in another, so patched
forwards read it per instance at run time), the fused gate call, and transformers' default MoE expert
gate (the moe_gate rule's candidates, which the glu_mlp rule leaves to it)."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from autopatch import patching
from autopatch.rules import _probe
from autopatch.rules._kernels import kernels

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels take
PROBE_TOL = 1e-6  # float64 grid: gelu tanh vs erf differ by ~1e-4 there

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


def gated(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up through the fused kernel of activation kind `kind` (a KINDS key)."""
    fk = kernels()
    kernel, kernel_kwargs = KINDS[kind]
    return fk.swiglu(gate, up) if kernel == "swiglu" else fk.geglu(gate, up, **kernel_kwargs)


GLU_LINEAR_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu_erf": "gelu"}


def weights_fit(module, x: torch.Tensor) -> bool:
    """Whether `module`'s weight and bias may go straight into a kernel call on `x`: plain tensors (no
    DTensor) of x's dtype and device, and no autocast (which would recast them inside the module)."""
    weight, bias = module.weight, module.bias
    if weight.dtype != x.dtype or weight.device != x.device or hasattr(weight, "device_mesh"):
        return False
    if bias is not None and (bias.dtype != x.dtype or hasattr(bias, "device_mesh")):
        return False
    return not torch.is_autocast_enabled(x.device.type)


# --- transformers' MoE expert gate --------------------------------------------------------------

GATE_METHOD = "_apply_gate"


def default_gate():
    """transformers' shared expert gate function, or None where this transformers has none."""
    try:
        from transformers.integrations import moe
    except Exception:  # noqa: BLE001 - older transformers, or an import problem: no candidates
        return None
    return getattr(moe, "_default_apply_gate", None)


def handles(cls: type) -> bool:
    """Whether `cls`'s own _apply_gate is transformers' default gate (or was, before the moe_gate rule
    patched it)."""
    gate_fn = default_gate()
    if gate_fn is None:
        return False
    if patching.is_patched(cls, GATE_METHOD):
        return patching.original(cls, GATE_METHOD) is gate_fn
    return vars(cls).get(GATE_METHOD) is gate_fn


def default_activation_kernel(cls: type, module) -> str:
    """The kernel (swiglu / geglu) of the activation the instances of `cls` built from its
    architecture's default config hold, or "" when it cannot be told or is neither: what a MoE experts
    record is labelled with (the kernel that runs for the architecture's checkpoints). Read from the
    config attribute its __init__ names in `ACT2FN[config.<name>]` (an experts class often cannot be
    built from a default config: no experts there), else from an instance built from a tiny config.
    Call inside _probe.probing()."""
    configs = _probe.probe_configs(cls, module)
    names = re.findall(r"ACT2FN\[\s*config\.(\w+)\s*\]", _probe.init_source(cls))
    if names:
        try:
            from transformers.activations import ACT2FN
        except Exception:  # noqa: BLE001 - no activation table: build an instance instead
            ACT2FN = None
        for config in configs if ACT2FN is not None else ():
            value = getattr(config, names[0], None)
            if isinstance(value, str) and value in ACT2FN:
                kind = activation_kind(ACT2FN[value])
                return KINDS[kind][0] if kind else ""
    for config in configs:
        instance, _ = _probe.try_build(cls, [lambda c=config: ((c,), {})])
        if instance is not None:
            kind = activation_kind(getattr(instance, "act_fn", None))
            return KINDS[kind][0] if kind else ""
    return ""
