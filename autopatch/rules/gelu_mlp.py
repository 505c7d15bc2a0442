"""Plain (non-gated) GELU MLPs -> fused_kernels.gelu_linear (kernel "gelu_mlp").

Detection. Candidates are the classes a modeling module defines whose __init__ names one of the
projection pairs below (fc1/fc2: CLIP, SigLIP, ViT, Phi; dense_h_to_4h/dense_4h_to_h: GPT-NeoX; c_fc/c_proj
and linear_fc1/linear_fc2: other families) and no gate projection. One instance is built from a tiny config of the module's own
config class; it must hold exactly the two projections as plain nn.Linear modules and the activation
(in `act_fn` / `activation_fn` / `act`), nothing else, and its forward must mention no dropout. Its
forward is run in float64 on random weights against

    second(act(first(x)))        act in {gelu_tanh, gelu_erf, gelu_quick (x·σ(1.702x))}

and exactly one must match, the activation the instance holds (a GELU put in its place when the tiny
config chose another one). At run time the activation is read
from each instance (as the GLU rule does); another activation, a disabled kernel, other arguments or an
instance built differently from the probed one run the original forward.

Patch. `forward` calls the instance's first projection (so LoRA wrappers keep working) and then
fused_kernels.gelu_linear with the second one's weight and bias when that is a plain nn.Linear of the
activations' dtype (no hooks, no autocast): gelu(h) is recomputed in the backward instead of being kept
(tokens × intermediate per layer). Otherwise the second projection runs on fused_kernels.gelu(h).
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from autopatch import patching
from autopatch.report import Record, fallback_notice
from autopatch.rules import _probe, glu_mlp
from autopatch.rules._kernels import import_problem, kernels

KERNEL = "gelu_mlp"
PAIRS = (("fc1", "fc2"), ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("linear_fc1", "linear_fc2"))
GATES = ("gate_proj", "gate_up_proj", "gate")
REFERENCES = {
    "gelu_tanh": glu_mlp._gelu_tanh,
    "gelu_erf": glu_mlp._gelu_erf,
    "gelu_quick": lambda t: t * torch.sigmoid(1.702 * t),
}
APPROXIMATE = {"gelu_tanh": "tanh", "gelu_erf": "none", "gelu_quick": "quick"}


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str
    first: str
    second: str
    act_attr: str
    state: tuple = ()

    def describe(self) -> str:
        return f"{self.second}({self.act_attr}({self.first}(x))), {self.act_attr} a GELU (tanh, erf, quick) at run time"


def pair_of(cls: type):
    """The projection pair cls's __init__ names (and no gate), or None."""
    source = _probe.init_source(cls)
    if any(g in source for g in GATES) or "attn" in source or "attention" in source:
        return None  # a gated MLP (the GLU rule's), or a whole layer that holds an MLP's projections
    return next((pair for pair in PAIRS if all(f"self.{name}" in source for name in pair)), None)


def detect(cls: type, module: ModuleType):
    """(Variant, "") when cls is a plain GELU MLP the probe proves, else (None, reason)."""
    pair = pair_of(cls)
    extra = _probe.forward_extra_args(cls)
    if extra:
        return None, extra
    try:
        forward_source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        forward_source = ""
    if "dropout" in forward_source:
        return None, "its forward applies dropout"
    with _probe.probing():
        instance, why = _probe.build_mlp(cls, module)
        if instance is None:
            return None, why
        first, second = (getattr(instance, name, None) for name in pair)
        for name, proj in zip(pair, (first, second)):
            if type(proj) is not nn.Linear:
                return None, f"{name} is {type(proj).__name__}, not a plain nn.Linear"
        act_attr = next((a for a in glu_mlp.ACT_ATTRS if getattr(instance, a, None) is not None), "")
        if not act_attr:
            return None, f"no activation attribute ({', '.join(glu_mlp.ACT_ATTRS)})"
        extra_children = [n for n, _ in instance.named_children() if n not in pair and n != act_attr]
        if extra_children:
            return None, f"has other submodules ({', '.join(extra_children)})"
        own = [n for n, _ in instance.named_parameters(recurse=False)] + [n for n, _ in instance.named_buffers(recurse=False)]
        if own:
            return None, f"has its own parameters/buffers ({', '.join(own)})"
        kind = glu_mlp.activation_kind(getattr(instance, act_attr), REFERENCES)
        if kind is None:
            # The tiny config chose another activation (Qwen2-VL's vision MLP built from the text config's
            # silu): prove the formula with a GELU in its place; each instance's own is read at run time.
            try:
                setattr(instance, act_attr, nn.GELU(approximate="tanh"))
            except Exception as exc:  # noqa: BLE001
                return None, f"activation {act_attr} cannot be probed ({_probe.describe_exc(exc)})"
            kind = "gelu_tanh"
        state = _probe.instance_state(instance)
        gen = _probe.generator(0)
        instance.double()
        for p in instance.parameters():
            p.copy_(_probe.randn(tuple(p.shape), gen, torch.float64, scale=0.3))
        x = _probe.randn((2, 3, first.in_features), gen, torch.float64)
        try:
            out = cls.forward(instance, x)
        except Exception as exc:  # noqa: BLE001
            return None, f"probe failed ({_probe.describe_exc(exc)})"
        matches = [k for k, act in REFERENCES.items()
                   if isinstance(out, torch.Tensor) and _probe.rel_err(out, second(act(first(x)))) <= glu_mlp.PROBE_TOL]
        if matches != [kind]:
            return None, (f"matches no formula {pair[1]}(gelu({pair[0]}(x)))" if not matches else
                          f"forward computes {', '.join(matches)} but {act_attr} is {kind}")
        return Variant(kind, pair[0], pair[1], act_attr, state), ""


def make_forward(original_forward: Callable, variant: Variant, input_name: str):
    first_name, second_name, act_attr, state = variant.first, variant.second, variant.act_attr, variant.state

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if not isinstance(x, torch.Tensor) or len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            return original_forward(self, *args, **kwargs)
        kind = glu_mlp.activation_kind(getattr(self, act_attr, None), REFERENCES)
        if kind is None:
            return original_forward(self, *args, **kwargs)
        fk = kernels()
        if not fk.triton_can_run(x):
            fallback_notice(KERNEL, f"{type(self).__name__} got {x.device.type} tensors")
            return original_forward(self, *args, **kwargs)
        h = getattr(self, first_name)(x)
        if h.dtype not in glu_mlp._FLOAT_DTYPES:
            return original_forward(self, *args, **kwargs)
        second = getattr(self, second_name)
        if glu_mlp._fusable_down_proj(second, h):
            return fk.gelu_linear(h, second.weight, second.bias, APPROXIMATE[kind])
        return second(fk.gelu(h, APPROXIMATE[kind]))

    return _probe.dressed_forward(forward, original_forward, variant.describe())


_verdicts: dict[type, tuple] = {}  # class -> (Variant or None, reason): probed once, the patch is idempotent


class _Rule:
    name = "gelu_mlp"
    kernels = (KERNEL,)

    def patch_module(self, module: ModuleType, enabled: Callable[[str], bool]) -> list[Record]:
        try:
            classes = [c for c in _probe.defined_classes(module) if pair_of(c) is not None]
        except Exception as exc:  # noqa: BLE001 - never raise into an import
            return [Record(KERNEL, module.__name__, "*", False, reason=_probe.describe_exc(exc))]
        records = []
        for cls in classes:
            try:
                records.append(self._patch_class(cls, module, enabled))
            except Exception as exc:  # noqa: BLE001
                records.append(Record(KERNEL, module.__name__, cls.__name__, False,
                                      reason=f"rule error: {_probe.describe_exc(exc)}"))
        return records

    def _patch_class(self, cls, module, enabled) -> Record:
        if cls not in _verdicts:
            _verdicts[cls] = detect(cls, module)
        variant, why = _verdicts[cls]
        if variant is None:
            return Record(KERNEL, module.__name__, cls.__name__, False, reason=why)
        record = lambda patched, reason="": Record(  # noqa: E731
            KERNEL, module.__name__, cls.__name__, patched, variant.describe(), reason)
        if patching.is_patched(cls, "forward"):
            return record(True)
        if not enabled(KERNEL):
            return record(False, f"kernel {KERNEL} disabled")
        problem = import_problem()
        if problem:
            return record(False, problem)
        params = _probe.positional_params(cls.forward) or []
        input_name = params[0].name if params else "hidden_states"
        patching.replace(cls, "forward", make_forward(cls.forward, variant, input_name))
        return record(True)


RULE = _Rule()
