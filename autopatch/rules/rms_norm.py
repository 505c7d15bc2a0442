"""RMSNorm classes -> fused_kernels.rms_norm (kernel "rms_norm").

Detection. Candidates are the classes a modeling module defines whose name says RMSNorm/RmsNorm or
whose forward computes a mean of squares and an rsqrt. A candidate must take one input tensor
(gated norms `forward(x, gate)` and the like are left alone), hold either one 1-D `weight` parameter
or none, and keep its epsilon in `variance_epsilon`, `eps` or `epsilon`. One instance is built and
its forward is run on random rows against the reference formulas

    y = x / sqrt(mean(x^2) + eps)                 (in float64)
    llama casting:  out = (offset + w) * y.to(x.dtype)          out dtype = promote(x, w)
    gemma casting:  out = (y * (offset + w)).to(x.dtype)       out dtype = x.dtype
    weightless:     out = y.to(x.dtype)

for offset in {0, 1}, three times: float32 (tells offsets and weightless apart; the castings agree
there), bfloat16 module and input (tells the castings apart: llama rounds twice), float32 weight with
bfloat16 input (the autocast case: tells whether the original promotes). The probe's eps is set large
and its weights lie on a grid of k/64 so that `offset + w` is exact in bfloat16 whatever order the
original adds it in. Exactly one candidate must match float32 and bfloat16; if it misses the mixed
probe, the patched forward runs the original code whenever weight and input dtypes differ.

Patch. The class's `forward` is replaced by one that reads the weight and eps from the instance
(attribute names found here) and calls fused_kernels.rms_norm(x, weight, eps, offset, casting_mode);
any number of leading dims works, so per-head q/k norms (Qwen3) need nothing special. Tensors Triton
cannot run on go to the original forward, with one notice per process.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from autopatch.rules import _probe
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict, class_candidates, input_name

KERNEL = "rms_norm"
# What the patched norms keep for the backward (fused_kernels.rms_norm's `keep`): "output" frees the
# input whenever the next layer keeps the output anyway. benchmarks/bench_e2e.py's "ours_keep_input" peer
# sets "input" to measure the difference.
KEEP = "output"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes
EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")

# Tolerances of the probe (relative L2 error of the original against a candidate).
FP32_TOL = 1e-5
# In bfloat16 a right candidate differs only where float32 and float64 internals round differently
# (~1e-5 here); the wrong casting rounds twice and differs by ~1e-3.
BF16_TOL = 3e-4


@dataclasses.dataclass(frozen=True)
class Variant:
    offset: float
    casting: str  # "llama" | "gemma"
    weight_attr: str | None  # None: a weightless norm
    eps_attr: str
    mixed_ok: bool  # the original matches with a float32 weight and a bfloat16 input
    state: tuple = ()  # the probed instance's switches (_probe.instance_state); others run the original

    def describe(self) -> str:
        if self.weight_attr is None:
            text = "weightless"
        else:
            text = f"offset={self.offset:g} casting={self.casting}"
        if not self.mixed_ok:
            text += " (original code when weight and input dtypes differ)"
        return text


def looks_like_rms_norm(cls: type) -> bool:
    name = cls.__name__
    if "RMSNorm" in name or "RmsNorm" in name:
        return True
    text = _probe.source_text(vars(cls).get("forward"), vars(cls).get("_norm"))
    return "rsqrt" in text and ("pow(2)" in text or "square(" in text or "**2" in text) and "mean(" in text


def reference(x: torch.Tensor, weight, eps: float, offset: float, casting: str) -> torch.Tensor:
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    w = offset + weight.double()
    if casting == "llama":
        return (w * y.to(x.dtype).double()).to(torch.promote_types(x.dtype, weight.dtype))
    return (y * w).to(x.dtype)


def _candidates(weighted: bool):
    if not weighted:
        return [(0.0, "llama")]
    return [(offset, casting) for offset in (0.0, 1.0) for casting in ("llama", "gemma")]


def _build(cls: type, module: ModuleType):
    attempts = [
        lambda: ((_probe.HIDDEN,), {"eps": _probe.EPS}),
        lambda: ((_probe.HIDDEN, _probe.EPS), {}),
        lambda: ((_probe.HIDDEN,), {}),
        lambda: ((), {"eps": _probe.EPS}),
    ]
    return _probe.build_norm(cls, module, attempts)



def detect(cls: type, module: ModuleType) -> Verdict:
    """Which (offset, casting) variant `cls` computes, or why it is left alone. Pure torch, CPU; call
    inside _probe.probing() (the template does)."""
    target = cls.__name__
    extra = _probe.forward_extra_args(cls)
    if extra:
        return Verdict(target, None, extra)
    instance, why = _build(cls, module)
    if instance is None:
        return Verdict(target, None, why)
    return _probe_instance(target, cls, instance)


def _probe_instance(target: str, cls: type, instance) -> Verdict:
    if any(True for _ in instance.children()):
        return Verdict(target, None, "has submodules")
    state = _probe.instance_state(instance)
    gen = _probe.generator(0)
    for name, buf in instance.named_buffers():
        # a buffer the forward reads (a fixed scale) must show up in the numbers: fill it randomly
        if not buf.dtype.is_floating_point:
            return Verdict(target, None, f"has a non-float buffer {name!r}")
        buf.copy_(_probe.randn(tuple(buf.shape), gen, torch.float64).to(buf.dtype))
    params = dict(instance.named_parameters())
    weight_attr = None
    if params:
        if set(params) != {"weight"} or params["weight"].dim() != 1:
            shapes = {k: tuple(v.shape) for k, v in params.items()}
            return Verdict(target, None, f"parameters {shapes} are not one 1-D weight")
        weight_attr = "weight"
    hidden = params["weight"].shape[0] if params else _probe.HIDDEN
    eps_attrs = [a for a in EPS_ATTRS if isinstance(getattr(instance, a, None), (float, int))
                 and not isinstance(getattr(instance, a), bool)]
    if not eps_attrs:
        return Verdict(target, None, f"no epsilon attribute ({', '.join(EPS_ATTRS)})")

    rows = 15
    scale = torch.linspace(0.25, 2.0, rows, dtype=torch.float64).reshape(3, 5, 1)
    x32 = (_probe.randn((3, 5, hidden), gen, torch.float64) * scale).float()
    weight = None
    if weight_attr is not None:
        # k/64 with |k| <= 24: exact in bfloat16, and so is 1 + k/64
        weight = torch.randint(-24, 25, (hidden,), generator=gen).float() / 64
        instance.weight.copy_(weight)

    forward = cls.forward
    matches = []
    first_error = ""
    for eps_attr in eps_attrs:
        # the chosen attribute carries the probe's eps; any other eps-named attribute a different one
        for other in eps_attrs:
            setattr(instance, other, _probe.EPS if other == eps_attr else 1e-3)
        instance.float()
        out32, err = _probe.run_forward(forward, instance, x32)
        if err:
            return Verdict(target, None, f"probe failed in float32 ({err})")
        instance.to(torch.bfloat16)
        x16 = x32.to(torch.bfloat16)
        out16, err16 = _probe.run_forward(forward, instance, x16)
        instance.float()
        out_mixed, err_mixed = _probe.run_forward(forward, instance, x16)
        for offset, casting in _candidates(weight is not None):
            ref32 = reference(x32, weight, _probe.EPS, offset, casting)
            if _probe.rel_err(out32, ref32) > FP32_TOL or out32.dtype != ref32.dtype:
                continue
            if err16:
                first_error = first_error or f"probe failed in bfloat16 ({err16})"
                continue
            w16 = weight.to(torch.bfloat16) if weight is not None else None
            ref16 = reference(x16, w16, _probe.EPS, offset, casting)
            if out16.dtype != ref16.dtype or _probe.rel_err(out16, ref16) > BF16_TOL:
                continue
            ref_mixed = reference(x16, weight, _probe.EPS, offset, casting)
            mixed_ok = (
                not err_mixed
                and out_mixed.dtype == ref_mixed.dtype
                and _probe.rel_err(out_mixed, ref_mixed) <= BF16_TOL
            )
            matches.append(Variant(offset, casting, weight_attr, eps_attr, mixed_ok, state))
    if len(matches) == 1:
        return Verdict(target, matches[0])
    if not matches:
        return Verdict(target, None, first_error or "matches no RMSNorm formula (offset 0/1, llama/gemma casting)")
    return Verdict(target, None, "ambiguous: matches " + "; ".join(v.describe() for v in matches))


# --- the patched forward ---------------------------------------------------------------------


def make_forward(original_forward: Callable, variant: Variant, input_name: str, session):
    """A forward for the class: the fused kernel where Triton runs, the original code elsewhere."""
    offset, casting = variant.offset, variant.casting
    weight_attr, eps_attr, mixed_ok, state = variant.weight_attr, variant.eps_attr, variant.mixed_ok, variant.state

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.get(input_name)
        if not isinstance(x, torch.Tensor) or len(args) + len(kwargs) != 1 or not _probe.same_state(self, state):
            # other arguments, or an instance built differently (group_size, with_scale=False, a bias)
            return original_forward(self, *args, **kwargs)
        weight = getattr(self, weight_attr, None) if weight_attr is not None else None
        if weight_attr is not None and weight is None:  # built without a scale: not what we probed
            return original_forward(self, *args, **kwargs)
        if (
            x.dtype not in _FLOAT_DTYPES
            or x.dim() == 0
            or x.shape[-1] == 0
            or (weight is not None and (weight.dtype not in _FLOAT_DTYPES or tuple(weight.shape) != (x.shape[-1],)))
        ):  # float64, or shapes the original broadcasts some other way: its own code decides
            return original_forward(self, *args, **kwargs)
        fk = kernels()
        if not fk.triton_can_run(x, *(() if weight is None else (weight,))):
            fallback(session, KERNEL, f"{type(self).__name__} got {x.device.type} tensors")
            return original_forward(self, *args, **kwargs)
        if weight is not None and weight.dtype != x.dtype:
            if not mixed_ok:
                return original_forward(self, *args, **kwargs)
            out_dtype = torch.promote_types(x.dtype, weight.dtype) if casting == "llama" else x.dtype
        else:
            out_dtype = x.dtype
        # keep="output": the backward works from y, which the next layer keeps anyway, so that x (a
        # residual-stream activation) is freed after the forward
        out = fk.rms_norm(x, weight, getattr(self, eps_attr), offset, casting, keep=KEEP)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    return _probe.dressed_forward(forward, original_forward, variant.describe())


# --- the rule --------------------------------------------------------------------------------


class _Rule(Rule):
    name = "rms_norm"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        return class_candidates(module, looks_like_rms_norm)

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        return detect(candidate.key, module)

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        return [Swap(cls, "forward", lambda: make_forward(cls.forward, verdict.variant, input_name(cls.forward), session))]


RULE = _Rule()
_verdicts = RULE.verdicts
