"""Plain (non-gated) GELU MLPs -> fused_kernels.gelu_linear (kernel "gelu_mlp").

Detection. Candidates are the classes a modeling module defines whose __init__ names one of the
projection pairs below (fc1/fc2: CLIP, SigLIP, ViT, Phi; dense_h_to_4h/dense_4h_to_h: GPT-NeoX; c_fc/c_proj
and linear_fc1/linear_fc2: other families) and no gate projection. One instance is built from a tiny config of the module's own
config class; it must hold exactly the two projections as plain nn.Linear modules and the activation
(in `act_fn` / `activation_fn` / `act`), nothing else, and its forward must mention no dropout. Its
forward is run in float64 on random weights against

    second(act(first(x)))        act in {gelu_tanh, gelu_erf, gelu_quick (x·σ(1.702x))}

and exactly one must match, the activation the instance holds (a GELU put in its place when the tiny
config chose another one). A dropout must be the last step: in training mode at p = 0.5, the forward
must equal dropout(second(act(first(x)))) drawn from the same seed. At run time the activation is read
from each instance (as the GLU rule does); another activation, a disabled kernel, other arguments or an
instance built differently from the probed one run the original forward.

Patch. `forward` calls the instance's first projection (so LoRA wrappers keep working) and then
fused_kernels.gelu_linear with the second one's weight and bias when that is a plain nn.Linear or Conv1D
(weight transposed, a view) of the activations' dtype (no hooks, no autocast): gelu(h) is recomputed in
the backward instead of being kept (tokens × intermediate per layer). Otherwise the second projection
runs on fused_kernels.gelu(h). The instance's own dropout follows, the same call as the original's.

Tiled. Above AUTOPATCH_TILED_MLP_TOKENS tokens in training, second(act(first(x))) runs over chunks of
the tokens and is recomputed in the backward (autopatch.rules._tiled); the dropout, if any, then draws
its one mask over the whole output, as untiled.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from autopatch.rules import _gated, _probe, _tiled, glu_mlp
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict, input_name

KERNEL = "gelu_mlp"
PAIRS = (("fc1", "fc2"), ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("linear_fc1", "linear_fc2"))
GATES = ("gate_proj", "gate_up_proj", "gate")
REFERENCES = {
    "gelu_tanh": _gated._gelu_tanh,
    "gelu_erf": _gated._gelu_erf,
    "gelu_quick": lambda t: t * torch.sigmoid(1.702 * t),
}
APPROXIMATE = {"gelu_tanh": "tanh", "gelu_erf": "none", "gelu_quick": "quick"}
# A dropout after the second projection, as GPT-2 (a child module) and StarCoder2 (a float attribute read
# by F.dropout) apply it: proven in training mode with a seeded probe, applied again after the kernel.
DROPOUT_MODULES = ("dropout",)
DROPOUT_FLOATS = ("residual_dropout",)


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str
    first: str
    second: str
    act_attr: str
    state: tuple = ()
    dropout: tuple = ()  # ("module", name) or ("float", name): a dropout after the second projection

    def describe(self) -> str:
        text = f"{self.second}({self.act_attr}({self.first}(x)))"
        if self.dropout:
            text = f"{self.dropout[1]}({text})"
        return f"{text}, {self.act_attr} a GELU (tanh, erf, quick) at run time"


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001
        return None
    return Conv1D


def _projection_ok(proj) -> bool:
    """An nn.Linear, or transformers' Conv1D (GPT-2: x @ weight + bias, weight (in, out)), exactly."""
    return type(proj) is nn.Linear or (_conv1d_type() is not None and type(proj) is _conv1d_type())


def _in_features(proj) -> int:
    return proj.in_features if isinstance(proj, nn.Linear) else proj.weight.shape[0]


def _dropped(y, dropout: tuple, instance):
    """y through the instance's own trailing dropout (the same call, so the same random mask)."""
    if not dropout:
        return y
    kind, name = dropout
    if kind == "module":
        return getattr(instance, name)(y)
    return nn.functional.dropout(y, p=getattr(instance, name), training=instance.training)


def pair_of(cls: type):
    """The projection pair cls's __init__ names (and no gate), or None."""
    source = _probe.init_source(cls)
    if any(g in source for g in GATES) or "attn" in source or "attention" in source:
        return None  # a gated MLP (the GLU rule's), or a whole layer that holds an MLP's projections
    return next((pair for pair in PAIRS if all(f"self.{name}" in source for name in pair)), None)


def detect(cls: type, module: ModuleType):
    """(Variant, "") when cls is a plain GELU MLP the probe proves, else (None, reason). Call inside
    _probe.probing() (the template does)."""
    pair = pair_of(cls)
    extra = _probe.forward_extra_args(cls)
    if extra:
        return None, extra
    forward_source = _probe.source_text(cls.forward)
    instance, why = _probe.build_mlp(cls, module)
    if instance is None:
        return None, why
    first, second = (getattr(instance, name, None) for name in pair)
    for name, proj in zip(pair, (first, second)):
        if not _projection_ok(proj):
            return None, f"{name} is {type(proj).__name__}, not a plain nn.Linear or Conv1D"
    act_attr = next((a for a in glu_mlp.ACT_ATTRS if getattr(instance, a, None) is not None), "")
    if not act_attr:
        return None, f"no activation attribute ({', '.join(glu_mlp.ACT_ATTRS)})"
    dropout = next((("module", n) for n in DROPOUT_MODULES if type(getattr(instance, n, None)) is nn.Dropout),
                   next((("float", n) for n in DROPOUT_FLOATS
                         if isinstance(getattr(instance, n, None), (int, float)) and n in forward_source), ()))
    if "dropout" in forward_source and not dropout:
        return None, "its forward applies a dropout this rule does not know"
    extra_children = [n for n, _ in instance.named_children()
                      if n not in pair and n != act_attr and (not dropout or n != dropout[1])]
    if extra_children:
        return None, f"has other submodules ({', '.join(extra_children)})"
    own = [n for n, _ in instance.named_parameters(recurse=False)] + [n for n, _ in instance.named_buffers(recurse=False)]
    if own:
        return None, f"has its own parameters/buffers ({', '.join(own)})"
    kind = _gated.activation_kind(getattr(instance, act_attr), REFERENCES)
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
    x = _probe.randn((2, 3, _in_features(first)), gen, torch.float64)
    instance.eval()  # the formula first, dropout off
    try:
        out = cls.forward(instance, x)
    except Exception as exc:  # noqa: BLE001
        return None, f"probe failed ({_probe.describe_exc(exc)})"
    matches = [k for k, act in REFERENCES.items()
               if isinstance(out, torch.Tensor) and _probe.rel_err(out, second(act(first(x)))) <= _gated.PROBE_TOL]
    if matches != [kind]:
        return None, (f"matches no formula {pair[1]}(gelu({pair[0]}(x)))" if not matches else
                      f"forward computes {', '.join(matches)} but {act_attr} is {kind}")
    if dropout:
        why = _probe_trailing_dropout(cls, instance, x, dropout, lambda t: second(getattr(instance, act_attr)(first(t))))
        if why:
            return None, why
    return Variant(kind, pair[0], pair[1], act_attr, state, dropout), ""


def _probe_trailing_dropout(cls, instance, x, dropout, formula) -> str:
    """'' when, in training mode with the dropout at p = 0.5, the forward equals dropout(formula(x)) drawn
    from the same seed (a dropout anywhere else draws another mask); else why not."""
    kind, name = dropout
    if kind == "module":
        getattr(instance, name).p = 0.5
    else:
        setattr(instance, name, 0.5)
    instance.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        out = cls.forward(instance, x)
        torch.manual_seed(1234)
        want = _dropped(formula(x), dropout, instance)
    if _probe.rel_err(out, want) > _gated.PROBE_TOL:
        return f"its dropout ({name}) is not the last step after the second projection"
    return ""


def _fusable_conv1d(module, h: torch.Tensor) -> bool:
    """A Conv1D called as Conv1D.forward (no hooks, no forward of its own) whose weights fit h."""
    conv = _conv1d_type()
    return conv is not None and type(module) is conv and _probe.plain_call(module, conv) and _gated.weights_fit(module, h)


def make_forward(original_forward: Callable, variant: Variant, input_name: str, session):
    first_name, second_name, act_attr, state = variant.first, variant.second, variant.act_attr, variant.state
    dropout = variant.dropout

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if not isinstance(x, torch.Tensor) or len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            return original_forward(self, *args, **kwargs)
        kind = _gated.activation_kind(getattr(self, act_attr, None), REFERENCES)
        if kind is None:
            return original_forward(self, *args, **kwargs)
        fk = kernels()
        if not fk.triton_can_run(x):
            fallback(session, KERNEL, f"{type(self).__name__} got {x.device.type} tensors")
            return original_forward(self, *args, **kwargs)
        limit = _tiled.limit_of(session)
        if _tiled.wanted(self, x, limit):
            # the chunks compute the formula; the dropout draws one mask over the whole output, as untiled
            return _dropped(_tiled.run(self, x, lambda piece: formula(self, piece, kind), limit), dropout, self)
        h = getattr(self, first_name)(x)
        if h.dtype not in _gated.FLOAT_DTYPES:
            return original_forward(self, *args, **kwargs)
        return _dropped(projected(self, h, kind), dropout, self)

    def formula(self, x, kind):
        """second(act(first(x))) on x (one chunk of a tiled call), without the dropout."""
        h = getattr(self, first_name)(x)
        if h.dtype not in _gated.FLOAT_DTYPES:
            return getattr(self, second_name)(getattr(self, act_attr)(h))
        return projected(self, h, kind)

    def projected(self, h, kind):
        fk = kernels()
        second = getattr(self, second_name)
        if glu_mlp._fusable_down_proj(second, h):
            y = fk.gelu_linear(h, second.weight, second.bias, APPROXIMATE[kind])
        elif _fusable_conv1d(second, h):  # x @ weight + bias, weight (in, out): the same as linear with weight.t()
            y = fk.gelu_linear(h, second.weight.t(), second.bias, APPROXIMATE[kind])
        else:
            y = second(fk.gelu(h, APPROXIMATE[kind]))
        return y

    return _probe.dressed_forward(forward, original_forward, variant.describe())


class _Rule(Rule):
    name = "gelu_mlp"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        return [Candidate(c.__name__, c) for c in _probe.defined_classes(module) if pair_of(c) is not None]

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        variant, why = detect(candidate.key, module)
        return Verdict(candidate.target, variant, why)

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        return [Swap(cls, "forward", lambda: make_forward(cls.forward, verdict.variant, input_name(cls.forward), session))]


RULE = _Rule()
_verdicts = RULE.verdicts
