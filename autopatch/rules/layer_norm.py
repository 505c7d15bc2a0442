"""LayerNorm -> fused_kernels.layer_norm (kernel "layer_norm").

Two kinds of target.

LayerNorm classes a modeling module defines (CohereLayerNorm, OlmoLayerNorm, subclasses of nn.LayerNorm
...): candidates are the classes named *LayerNorm* or whose forward calls layer_norm or takes a mean and a
variance, that are not RMSNorm classes. A candidate must take one input tensor, hold no submodules
(StableLmLayerNormPerHead holds nn.LayerNorm instances: those are covered below), hold at most a 1-D
`weight` and a 1-D `bias`, and keep its epsilon in `eps`, `variance_epsilon` or `epsilon`, or use a
constant (OlmoLayerNorm: F.layer_norm(..., eps=1e-5)), found by the probe among EPS_CONSTANTS. One instance
is built and its original forward run on rows of very different scales and non-zero means against

    y = (x − mean) / sqrt(var + eps) · w + b      in float64, rounded once to x.dtype

in float32 (1e-5), in bfloat16 (module and input: a forward that rounds in between misses the 3e-4 bound)
and with float32 parameters and a bfloat16 input (the autocast case; when the original disagrees there,
the patched forward runs the original code for such calls). An RMSNorm (T5LayerNorm) misses because the
probe's rows have non-zero means. Patch: the class's `forward` is replaced, as the rms_norm rule does, so
isinstance, state_dict keys, __init__ and extra_repr stay.

torch.nn.LayerNorm instances. nn.LayerNorm is torch's, used by every library in the process: it is not
patched process-wide. The instances a patched model owns are: the rule hooks `post_init` (which every
transformers model calls at the end of its __init__) on the modeling module's root PreTrainedModel
classes, and apply(model) calls `patch_instances(model)` on a model built earlier. Each instance whose type
is exactly nn.LayerNorm over one dimension has its `__class__` set to `FusedLayerNorm`, a subclass with no
state of its own and only `forward` (and the name shown by repr) overridden. Chosen over an instance-level
`forward` attribute because a bound method in the instance's __dict__ breaks pickling and deepcopy
expectations and is what accelerate's hooks treat as theirs; the subclass keeps isinstance(m,
nn.LayerNorm), the parameters, state_dict keys, extra_repr and pickling (by reference to this module).
`torch.nn.LayerNorm` itself is proved once per process by the same probe (affine or not, bias or not).

A patched forward calls the original code for tensors Triton cannot run on (one notice per process), for
dtypes the kernel does not take, under autocast (torch runs layer_norm in fp32 there and returns fp32),
and for shapes other than the one probed (a 2-D weight: Cohere's q/k norms).
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from autopatch import patching
from autopatch.rules import _probe
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict, input_name
from autopatch.session import current

KERNEL = "layer_norm"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
EPS_CONSTANTS = (1e-5, 1e-6, 1e-12, 1e-8)  # what a forward without an eps attribute may hard-code
FP32_TOL = 1e-5
BF16_TOL = 3e-4
_TORCH_TARGET = "torch.nn.LayerNorm instances"


@dataclasses.dataclass(frozen=True)
class Variant:
    weight: bool
    bias: bool
    eps_attr: str | None  # None: the forward uses the constant `eps`
    eps: float
    mixed_ok: bool
    state: tuple = ()

    def describe(self) -> str:
        parts = ["weight" if self.weight else "no weight", "bias" if self.bias else "no bias"]
        parts.append(f"eps from {self.eps_attr}" if self.eps_attr else f"eps={self.eps:g}")
        text = ", ".join(parts)
        if not self.mixed_ok:
            text += " (original code when parameter and input dtypes differ)"
        return text


def reference(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    d = x64 - mean
    y = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def looks_like_layer_norm(cls: type) -> bool:
    name = cls.__name__
    if "RMSNorm" in name or "RmsNorm" in name:
        return False
    if "LayerNorm" in name or "Layernorm" in name or issubclass(cls, nn.LayerNorm):
        return True
    text = _probe.source_text(vars(cls).get("forward"))
    return "F.layer_norm(" in text or "functional.layer_norm(" in text or ("mean(" in text and ".var(" in text)


def _build(cls: type, module: ModuleType):
    h, eps = _probe.HIDDEN, _probe.EPS
    attempts = [
        lambda: ((h,), {"eps": eps}),
        lambda: ((h, eps), {}),
        lambda: ((h,), {}),
        lambda: ((), {"hidden_size": h, "eps": eps}),
    ]
    return _probe.build_norm(cls, module, attempts)



def probe_instance(target: str, instance, forward) -> Verdict:
    """Which LayerNorm `forward` computes on `instance` (built on the CPU in float32), or why it is left
    alone. Call inside _probe.probing()."""
    if any(True for _ in instance.children()):
        return Verdict(target, None, "has submodules")
    if any(True for _ in instance.buffers()):
        return Verdict(target, None, "has buffers")
    params = dict(instance.named_parameters())
    if not set(params) <= {"weight", "bias"} or any(p.dim() != 1 for p in params.values()):
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        return Verdict(target, None, f"parameters {shapes} are not a 1-D weight and/or bias")
    sizes = {p.shape[0] for p in params.values()}
    if len(sizes) > 1:
        return Verdict(target, None, f"weight and bias sizes differ ({sorted(sizes)})")
    hidden = sizes.pop() if sizes else _probe.HIDDEN
    eps_attrs = [a for a in EPS_ATTRS if isinstance(getattr(instance, a, None), (float, int))
                 and not isinstance(getattr(instance, a), bool)]
    state = _probe.instance_state(instance)
    gen = _probe.generator(1)
    # rows of scales 0.003 .. 2 (eps matters for the small ones) and means 0.5 .. 3 (not an RMSNorm)
    rows = 15
    scale = torch.logspace(-2.5, 0.3, rows, dtype=torch.float64).reshape(3, 5, 1)
    shift = torch.linspace(0.5, 3.0, rows, dtype=torch.float64).reshape(3, 5, 1)
    x32 = (_probe.randn((3, 5, hidden), gen, torch.float64) * scale + shift * scale.sqrt()).float()
    weight = bias = None
    if "weight" in params:  # k/64: exact in bfloat16
        weight = torch.randint(-40, 41, (hidden,), generator=gen).float() / 64 + 0.25
        instance.weight.copy_(weight)
    if "bias" in params:
        bias = torch.randint(-32, 33, (hidden,), generator=gen).float() / 64
        instance.bias.copy_(bias)
    settings = [(a, _probe.EPS) for a in eps_attrs] or [(None, e) for e in EPS_CONSTANTS]
    matches = []
    first_error = ""
    for eps_attr, eps in settings:
        for other in eps_attrs:  # the chosen attribute carries the probe's eps, any other a different one
            setattr(instance, other, eps if other == eps_attr else 1e-3)
        instance.float()
        out32, err = _probe.run_forward(forward, instance, x32)
        if err:
            return Verdict(target, None, f"probe failed in float32 ({err})")
        ref32 = reference(x32, weight, bias, eps)
        if out32.dtype != ref32.dtype or _probe.rel_err(out32, ref32) > FP32_TOL:
            continue
        instance.to(torch.bfloat16)
        x16 = x32.to(torch.bfloat16)
        out16, err16 = _probe.run_forward(forward, instance, x16)
        instance.float()
        if err16:
            first_error = first_error or f"probe failed in bfloat16 ({err16})"
            continue
        w16 = None if weight is None else weight.to(torch.bfloat16)
        b16 = None if bias is None else bias.to(torch.bfloat16)
        ref16 = reference(x16, w16, b16, eps)
        if out16.dtype != ref16.dtype or _probe.rel_err(out16, ref16) > BF16_TOL:
            first_error = first_error or "rounds in between in bfloat16 (not one final rounding)"
            continue
        out_mixed, err_mixed = _probe.run_forward(forward, instance, x16)
        ref_mixed = reference(x16, weight, bias, eps)
        mixed_ok = (not err_mixed and out_mixed.dtype == ref_mixed.dtype
                    and _probe.rel_err(out_mixed, ref_mixed) <= BF16_TOL)
        matches.append(Variant(weight is not None, bias is not None, eps_attr, eps, mixed_ok, state))
    if len(matches) == 1:
        return Verdict(target, matches[0])
    if not matches:
        return Verdict(target, None, first_error or "matches no LayerNorm formula (mean, centred variance, eps)")
    return Verdict(target, None, "ambiguous: matches " + "; ".join(v.describe() for v in matches))


def detect(cls: type, module: ModuleType) -> Verdict:
    target = cls.__name__
    extra = _probe.forward_extra_args(cls)
    if extra:
        return Verdict(target, None, extra)
    forward = patching.original(cls, "forward") if patching.is_patched(cls, "forward") else cls.forward
    instance, why = _build(cls, module)
    if instance is None:
        return Verdict(target, None, why)
    return probe_instance(target, instance, forward)


# --- the fused call shared by both kinds of target ------------------------------------------


def _fused_or_none(norm, x, weight, bias, eps, mixed_ok: bool, session):
    """fused_kernels.layer_norm(x, weight, bias, eps), or None where the original code must run."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        return None
    for p in (weight, bias):
        if p is not None and (p.dtype not in _FLOAT_DTYPES or tuple(p.shape) != (x.shape[-1],)):
            return None
        if p is not None and p.dtype != x.dtype and not mixed_ok:
            return None
    if torch.is_autocast_enabled(x.device.type):
        return None  # torch runs layer_norm in fp32 under autocast and returns fp32
    fk = kernels()
    if not fk.triton_can_run(x, *(p for p in (weight, bias) if p is not None)):
        fallback(session, KERNEL, f"{type(norm).__name__} got {x.device.type} tensors")
        return None
    return fk.layer_norm(x, weight, bias, eps)


def make_forward(original_forward: Callable, variant: Variant, input_name: str, session):
    """A forward for a modeling module's LayerNorm class: the kernel where Triton runs, else the original."""
    eps_attr, eps_const, state = variant.eps_attr, variant.eps, variant.state

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            return original_forward(self, *args, **kwargs)
        weight = getattr(self, "weight", None) if variant.weight else None
        bias = getattr(self, "bias", None) if variant.bias else None
        if (variant.weight and weight is None) or (variant.bias and bias is None):
            return original_forward(self, *args, **kwargs)
        eps = getattr(self, eps_attr) if eps_attr is not None else eps_const
        out = _fused_or_none(self, x, weight, bias, eps, variant.mixed_ok, session)
        return original_forward(self, *args, **kwargs) if out is None else out

    return _probe.dressed_forward(forward, original_forward, variant.describe())


class FusedLayerNorm(nn.LayerNorm):
    """An nn.LayerNorm instance whose forward runs fused_kernels.layer_norm (set as `__class__` of the
    instances of a patched model; no state of its own, so isinstance, parameters and state_dict stay).
    `session`: the Session of the latest patch that set instances to this class (where its fallbacks
    are recorded); a class attribute, so that instances stay picklable."""

    session = None

    def forward(self, input):  # noqa: A002 - nn.LayerNorm's parameter name
        if len(self.normalized_shape) == 1:
            session = FusedLayerNorm.session or current()
            out = _fused_or_none(self, input, self.weight, self.bias, self.eps, _torch_mixed_ok(), session)
            if out is not None:
                return out
        return super().forward(input)

    def _get_name(self):
        return "LayerNorm"  # repr reads as the module the user built


# --- torch.nn.LayerNorm: proved once per process -------------------------------------------

_torch_verdict: list[str] = []  # ["" when proved, else the reason]
_torch_mixed: list[bool] = []  # whether nn.LayerNorm matched with float32 parameters and a bfloat16 input


def _torch_mixed_ok() -> bool:
    if not _torch_verdict:
        torch_layer_norm_problem()
    return bool(_torch_mixed and _torch_mixed[0])


def torch_layer_norm_problem() -> str:
    """"" when nn.LayerNorm matches the reference in every configuration FusedLayerNorm serves."""
    if not _torch_verdict:
        _probe.sealed(_prove_torch_layer_norm)
    return _torch_verdict[0]


def _prove_torch_layer_norm() -> None:
    reasons, mixed = [], []
    for affine, bias in ((True, True), (True, False), (False, False)):
        ln = nn.LayerNorm(_probe.HIDDEN, eps=_probe.EPS, elementwise_affine=affine, bias=bias)
        verdict = probe_instance("nn.LayerNorm", ln.float().requires_grad_(False), nn.LayerNorm.forward)
        if verdict.variant is None or verdict.variant.eps_attr != "eps":
            reasons.append(f"elementwise_affine={affine} bias={bias}: {verdict.reason or 'eps not read'}")
        else:
            mixed.append(verdict.variant.mixed_ok)
    _torch_mixed.append(bool(mixed) and all(mixed))
    _torch_verdict.append("; ".join(reasons))


def patch_instances(model, session=None) -> int:
    """Set FusedLayerNorm as the class of every nn.LayerNorm (exactly) over one dimension in `model`;
    returns how many were set (instances already set count too). `session`: where their fallbacks are
    recorded (default: the process's)."""
    if session is not None:
        FusedLayerNorm.session = session
    count = 0
    for m in _submodules(model):
        if type(m) is FusedLayerNorm:
            count += 1
        elif type(m) is nn.LayerNorm and len(m.normalized_shape) == 1 and "forward" not in vars(m):
            m.__class__ = FusedLayerNorm
            count += 1
    return count


def _submodules(model):
    """model.modules(), or nothing for an object without it."""
    modules_fn = getattr(model, "modules", None)
    return modules_fn() if callable(modules_fn) else ()


def _post_init_hook(original_post_init, session):
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        try:
            patch_instances(self, session)
        except Exception:  # noqa: BLE001 - a failed swap leaves the originals running
            pass
        return result

    post_init.__name__ = "post_init"
    post_init.__qualname__ = getattr(original_post_init, "__qualname__", "post_init")
    post_init.__doc__ = getattr(original_post_init, "__doc__", None)
    post_init.__wrapped__ = original_post_init
    return post_init


def _root_model_classes(module: ModuleType) -> list[type]:
    """The PreTrainedModel subclasses of `module` none of whose bases is defined there too."""
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        return []
    classes = [c for c in _probe.defined_classes(module) if issubclass(c, PreTrainedModel)]
    own = set(classes)
    return [c for c in classes if not any(b in own for b in c.__mro__[1:])]


def _uses_torch_layer_norm(module: ModuleType) -> bool:
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return "LayerNorm(" in source and ("nn.LayerNorm" in source or "import LayerNorm" in source
                                       or "LayerNorm," in source)


# --- the rule --------------------------------------------------------------------------------


class _Rule(Rule):
    """Two kinds of candidate: the LayerNorm classes of the module (their forward swapped), and the
    module's root model classes (their post_init swapped, which sets the nn.LayerNorm instances of
    each model built to FusedLayerNorm), one candidate for them all."""

    name = "layer_norm"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        found = [Candidate(c.__name__, c) for c in _probe.defined_classes(module)
                 if looks_like_layer_norm(c) and not _is_model_class(c)]
        roots = _root_model_classes(module)
        if roots and _uses_torch_layer_norm(module):
            target = f"{_TORCH_TARGET} ({', '.join(c.__name__ for c in roots)} models)"
            found.append(Candidate(target, ("post_init", module.__name__), tuple(roots)))
        return found

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        if isinstance(candidate.key, type):
            return detect(candidate.key, module)
        problem = torch_layer_norm_problem()
        if problem:
            return Verdict(candidate.target, None, f"nn.LayerNorm matches no LayerNorm formula here ({problem})")
        return Verdict(candidate.target, POST_INIT_VARIANT)

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        if isinstance(candidate.key, type):
            cls = candidate.key
            return [Swap(cls, "forward",
                         lambda: make_forward(cls.forward, verdict.variant, input_name(cls.forward), session))]
        return [Swap(cls, "post_init", lambda c=cls: _post_init_hook(c.post_init, session)) for cls in candidate.subject]


POST_INIT_VARIANT = "instances set to FusedLayerNorm at post_init"


def _is_model_class(cls: type) -> bool:
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        return False
    return issubclass(cls, PreTrainedModel)


RULE = _Rule()
_verdicts = RULE.verdicts


def unpatch_instances(model) -> int:
    """Set nn.LayerNorm back as the class of the model's FusedLayerNorm instances; returns how many."""
    count = 0
    for m in _submodules(model):
        if type(m) is FusedLayerNorm:
            m.__class__ = nn.LayerNorm
            count += 1
    return count
