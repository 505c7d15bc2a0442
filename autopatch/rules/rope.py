"""Module-level `apply_rotary_pos_emb` (and DeepSeek's `apply_rotary_pos_emb_interleave`) ->
fused_kernels.rope (kernel "rope").

Detection. The function must be defined in the modeling module (behind a Hub-kernel function layer or
not: with the `kernels` package installed the global is a `Func` module instance holding it,
`_probe.hub_function`) and take (q, k, cos, sin), or one
tensor, (x, cos, sin) as Gemma 3n / Gemma 4 do or (tensor, sin, cos) as GPT-J / CodeGen do (called
once for q and once for k), followed only by optional `position_ids` and `unsqueeze_dim`; without
`unsqueeze_dim` the probe finds the one head layout the function takes. It is run in float64 on random
q, k, cos, sin — cos/sin of full head size, half size and quarter size, both head layouts — and compared with the
reference rotations below; a size the original rejects (raises) is simply not a size it takes. A
shorter cos is not always partial rotary (gpt_oss takes half-size cos/sin for a full rotation), so
the numbers decide, not the shape. Exactly one variant must match on every size the original takes:

    half            x*cos + rotate_half(x)*sin on the first cos.shape[-1] channels, the rest pass
    half-size cos   cos/sin cover half the head: cos -> cat(cos, cos), then "half" (gpt_oss)
    half sin=-sin   "half" turning the other way: sin -> -sin (NanoChat's rotate_half)
    interleaved     pairs (x[2i], x[2i+1]) rotated by cos/sin taken element by element (Cohere)
    interleaved half-size cos   one cos/sin per pair: cos -> cos.repeat_interleave(2), then
                    "interleaved" (openai_privacy_filter)
    glm             cos -> cos[..., :r/2].repeat_interleave(2), then "interleaved" on r channels (GLM)
    de-interleaved  x -> cat(x[..., 0::2], x[..., 1::2]) and cos -> cat(c, c) with c = cos[..., :r/2],
                    then "half": pairs (2i, 2i+1) rotated and written out in half layout (DeepSeek-V3's
                    apply_rotary_pos_emb_interleave)

The variant's pre-processing of cos/sin (and of q/k for the last one) and the kernel's `interleaved`
flag are the data in _VARIANTS. The sizes that matched are kept: at run time a size class the probe did not see goes to
the original function (which then behaves exactly as it always did).

Patch. The module global is rebound to a wrapper with the same parameters calling fused_kernels.rope
(a one-tensor function: x as q, and a k of no heads); tensors Triton cannot run on go to the original,
with one notice.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import ModuleType
from typing import Callable

import torch

from autopatch import patching
from autopatch.rules import _probe
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict as RuleVerdict

KERNEL = "rope"
TARGETS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
PROBE_TOL = 1e-5  # a right variant agrees to float32 rounding (some originals compute in .float()), a wrong one is off by O(1)
OPTIONAL_PARAMS = ("position_ids", "unsqueeze_dim")


# --- reference rotations (float64) and the variants as data -----------------------------------


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate(x, cos, sin, rotate):
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError("rotary size must be even and at most the head size")
    head, rest = x[..., :r], x[..., r:]
    return torch.cat((head * cos + rotate(head) * sin, rest), dim=-1)


def _same(cos, sin, d):
    return cos, sin


def _half_size(cos, sin, d):
    if 2 * cos.shape[-1] != d:
        raise ValueError("half-size cos/sin must cover exactly half the head")
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _negated_sin(cos, sin, d):
    return cos, -sin


def _pair_size(cos, sin, d):
    if 2 * cos.shape[-1] != d:
        raise ValueError("per-pair cos/sin must cover exactly half the head")
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def _first_half_twice(cos, sin, d):
    h = cos.shape[-1] // 2
    return torch.cat((cos[..., :h], cos[..., :h]), dim=-1), torch.cat((sin[..., :h], sin[..., :h]), dim=-1)


def _deinterleave(x):
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pair members into the two halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _glm(cos, sin, d):
    r = cos.shape[-1]
    return cos[..., : r // 2].repeat_interleave(2, dim=-1), sin[..., : r // 2].repeat_interleave(2, dim=-1)


@dataclasses.dataclass(frozen=True)
class _VariantSpec:
    name: str
    prepare: Callable  # (cos, sin, head_dim) -> (cos, sin) as the kernel wants them
    interleaved: bool
    deinterleave_input: bool = False  # q, k -> _deinterleave(q, k) first (whole head; full-size cos only)


_VARIANTS = (
    _VariantSpec("half", _same, False),
    _VariantSpec("half-size cos", _half_size, False),
    _VariantSpec("half sin=-sin", _negated_sin, False),
    _VariantSpec("interleaved", _same, True),
    _VariantSpec("interleaved half-size cos", _pair_size, True),
    _VariantSpec("glm", _glm, True),
    _VariantSpec("de-interleaved", _first_half_twice, False, deinterleave_input=True),
)


def reference(spec: _VariantSpec, q, k, cos, sin, unsqueeze_dim=1):
    if spec.deinterleave_input:
        if cos.shape[-1] != q.shape[-1]:
            raise ValueError("de-interleaving covers the whole head")
        q, k = _deinterleave(q), _deinterleave(k)
    cos, sin = spec.prepare(cos, sin, q.shape[-1])
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotate = _rotate_pairs if spec.interleaved else _rotate_half
    return _rotate(q, cos, sin, rotate), _rotate(k, cos, sin, rotate)


def size_class(rotary: int, head_dim: int) -> str:
    if rotary == head_dim:
        return "full"
    if 2 * rotary == head_dim:
        return "half"
    return "partial" if rotary < head_dim else "longer"


# --- detection ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    variant: _VariantSpec | None
    sizes: frozenset = frozenset()  # size classes of cos the original takes and the variant matched
    reason: str = ""
    rest_params: tuple = ()  # names after the leading parameters (form), in order
    defaults: tuple = ()  # ((name, default), ...)
    # when cos/sin have another dtype than q/k (fp32 tables, bf16 q under autocast): "promote" (the
    # original returns torch's promoted dtype, Llama), "keep" (it returns q's dtype, Cohere), or
    # "original" (something else: such calls run the original function)
    mixed: str = "original"
    form: str = "q, k, cos, sin"  # the leading parameters (_FORMS)
    layout: int = 1  # the head layout (an unsqueeze_dim) of a function without an unsqueeze_dim parameter

    @property
    def single(self) -> bool:
        """The function takes one tensor and returns it rotated."""
        return _FORMS[self.form][0]

    def describe(self) -> str:
        if self.variant is None:
            return ""
        name = self.variant.name
        if name == "half":
            name = "half rot=full" if self.sizes == {"full"} else "half partial"
        return name + (", one tensor" if self.single else "")


# The leading parameters a rotary function may take -> (one tensor?, whether sin comes before cos).
_FORMS = {
    "q, k, cos, sin": (False, False),
    "x, cos, sin": (True, False),  # Gemma 3n / Gemma 4
    "tensor, sin, cos": (True, True),  # GPT-J / CodeGen
}


def _signature(fn) -> tuple[str, tuple, tuple, str]:
    """(reason, rest_params, defaults, form): reason is '' when the parameters are one of _FORMS plus
    optional position_ids / unsqueeze_dim."""
    params = _probe.positional_params(fn)
    if params is None:
        return "no readable signature", (), (), ""
    names = [p.name for p in params]
    form = next((f for f in _FORMS if names[:len(f.split(", "))] == f.split(", ")), "")
    if not form:
        expected = " or ".join(f"({f}, ...)" for f in _FORMS)
        return f"parameters ({', '.join(names)}) are not {expected}", (), (), ""
    rest = params[len(form.split(", ")):]
    for p in rest:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"takes {'*' if p.kind == p.VAR_POSITIONAL else '**'}{p.name}", (), (), ""
        if p.name not in OPTIONAL_PARAMS or p.default is inspect.Parameter.empty:
            return f"takes an extra parameter {p.name!r}", (), (), ""
    return "", tuple(p.name for p in rest), tuple((p.name, p.default) for p in rest), form


def _probe_calls():
    """(rotary size, unsqueeze_dim) of every probe: cos/sin covering all, half and a quarter of the
    head, in both head layouts. q: 3 heads, k: 1 head (GQA), head size 16, batch 2, 5 positions,
    cos/sin (batch, seq, rotary): a function without an unsqueeze_dim parameter runs in one layout
    only (the other does not broadcast)."""
    return [(rotary, unsqueeze_dim) for rotary in (16, 8, 4) for unsqueeze_dim in (1, 2)]


def _inputs(gen, rotary, unsqueeze_dim, pass_unsqueeze_dim: bool):
    b, s, d = 2, 5, _probe.HEAD_DIM
    if unsqueeze_dim == 1:
        q_shape, k_shape = (b, 3, s, d), (b, 1, s, d)
    else:
        q_shape, k_shape = (b, s, 3, d), (b, s, 1, d)
    q = _probe.randn(q_shape, gen, torch.float64)
    k = _probe.randn(k_shape, gen, torch.float64)
    # cos/sin random (not a real cos table): every element must be used the way the formula says
    cos = _probe.randn((b, s, rotary), gen, torch.float64)
    sin = _probe.randn((b, s, rotary), gen, torch.float64)
    kwargs = {}
    if unsqueeze_dim != 1 and pass_unsqueeze_dim:
        kwargs["unsqueeze_dim"] = unsqueeze_dim
    return q, k, cos, sin, kwargs


def _outputs(out, single: bool):
    """The function's result as a tuple of tensors: (q_out, k_out), or (x_out,) when single; None when it
    is something else."""
    if single:
        return (out,) if isinstance(out, torch.Tensor) else None
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    return None


def _call(fn, form: str, q, k, cos, sin, **kwargs):
    """fn on the probe's tensors in its form's order (q alone for a one-tensor form), its result as
    _outputs gives it."""
    single, sin_first = _FORMS[form]
    if not single:
        return _outputs(fn(q, k, cos, sin, **kwargs), False)
    return _outputs(fn(q, sin, cos, **kwargs) if sin_first else fn(q, cos, sin, **kwargs), True)


def detect(fn) -> Verdict:
    reason, rest, defaults, form = _signature(fn)
    if reason:
        return Verdict(None, reason=reason)
    single = _FORMS[form][0]
    layouts = set()  # the head layouts it ran in
    gen = _probe.generator(0)
    taken: dict[str, list] = {}  # size class -> [(inputs, outputs), ...]
    errors = []
    for rotary, unsqueeze_dim in _probe_calls():
        q, k, cos, sin, kwargs = _inputs(gen, rotary, unsqueeze_dim, "unsqueeze_dim" in rest)
        try:
            out = _call(fn, form, q, k, cos, sin, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a size it does not take
            errors.append(_probe.describe_exc(exc))
            continue
        if out is None:
            return Verdict(None, reason="does not return a tensor" if single else "does not return (q, k)")
        if "position_ids" in rest:
            kw = dict(kwargs, position_ids=torch.arange(5).expand(2, 5) + 3)
            try:
                with_pos = _call(fn, form, q, k, cos, sin, **kw)
            except Exception as exc:  # noqa: BLE001
                return Verdict(None, reason=f"fails when given position_ids ({_probe.describe_exc(exc)})")
            if with_pos is None or any(_probe.rel_err(a, b) > PROBE_TOL for a, b in zip(with_pos, out)):
                return Verdict(None, reason="uses position_ids")
        key = size_class(rotary, q.shape[-1])
        taken.setdefault(key, []).append(((q, k, cos, sin, unsqueeze_dim), out))
        layouts.add(unsqueeze_dim)
    if not taken:
        return Verdict(None, reason=f"probe failed at every size ({errors[0] if errors else '?'})")
    if "unsqueeze_dim" not in rest and len(layouts) > 1:
        return Verdict(None, reason="runs in both head layouts without an unsqueeze_dim to tell them apart")
    matches = []
    for spec in _VARIANTS:
        if all(_matches(spec, args, out) for cases in taken.values() for args, out in cases):
            matches.append(spec)
    mixed = _mixed_dtype_behaviour(fn, form, rest, next(iter(taken.values()))[0]) if len(matches) == 1 else ""
    sizes = frozenset(taken)
    if len(matches) == 1:
        return Verdict(matches[0], sizes, "", rest, defaults, mixed, form, min(layouts))
    if not matches:
        return Verdict(None, sizes, "matches no rotary variant (" + ", ".join(s.name for s in _VARIANTS) + ")")
    return Verdict(None, sizes, "ambiguous: matches " + ", ".join(s.name for s in matches))


def _mixed_dtype_behaviour(fn, form: str, rest: tuple, case) -> str:
    """Run the original with float32 q/k and float64 cos/sin and see what dtype comes back."""
    (q, k, cos, sin, unsqueeze_dim), _ = case
    kwargs = {"unsqueeze_dim": unsqueeze_dim} if unsqueeze_dim != 1 and "unsqueeze_dim" in rest else {}
    try:
        out = _call(fn, form, q.float(), k.float(), cos, sin, **kwargs)
    except Exception:  # noqa: BLE001
        return "original"
    if out is None:
        return "original"
    dtypes = {t.dtype for t in out}
    if dtypes == {torch.float64}:
        return "promote"
    if dtypes == {torch.float32}:
        return "keep"
    return "original"


def _matches(spec, args, out) -> bool:
    """Whether the outputs (q_out, k_out), or (x_out,) of a one-tensor function given q, are the variant's."""
    q, k, cos, sin, unsqueeze_dim = args
    try:
        refs = reference(spec, q, k, cos, sin, unsqueeze_dim)
    except Exception:  # noqa: BLE001 - the variant is not defined at this size
        return False
    return all(_probe.rel_err(o, r) <= PROBE_TOL for o, r in zip(out, refs))


# --- the wrapper --------------------------------------------------------------------------------


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_takes(q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether these arguments are a call the probe vouched for and the kernel accepts; anything else
    (float64, other ranks, a head layout we did not probe) runs the original function."""
    if not all(isinstance(t, torch.Tensor) and t.dtype in _FLOAT_DTYPES for t in (q, k, cos, sin)):
        return False
    # cos/sin (batch, seq, rot) as probed; a 2-D cos would broadcast against heads in HF's maths
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    if q.shape[-1] != k.shape[-1] or cos.shape != sin.shape or cos.shape[-1] > q.shape[-1]:
        return False
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    if k.shape[0] != q.shape[0] or k.shape[seq_dim] != q.shape[seq_dim]:
        return False
    return cos.shape[1] in (1, q.shape[seq_dim]) and cos.shape[0] in (1, q.shape[0])


def _unsqueeze_dim(verdict: Verdict, args: tuple, kwargs: dict):
    """unsqueeze_dim of a call whose extra arguments are among the probed rest_params, else None; a
    function without the parameter has the one layout the probe found."""
    rest_params = verdict.rest_params
    if len(args) > len(rest_params) or any(name not in rest_params for name in kwargs):
        return None
    values = dict(verdict.defaults)
    values.update(zip(rest_params, args))
    values.update(kwargs)
    return values.get("unsqueeze_dim", verdict.layout)


def _through_kernel(verdict: Verdict, name: str, q, k, cos, sin, unsqueeze_dim, session):
    """(q_out, k_out) from fused_kernels.rope for a call the probe vouched for, or None where the original
    function must run instead."""
    spec, mixed = verdict.variant, verdict.mixed
    if torch.is_grad_enabled() and (getattr(cos, "requires_grad", False) or getattr(sin, "requires_grad", False)):
        return None  # cos/sin made from a trainable parameter (Mistral Large 4's rotary alpha): the kernel gives them no gradient
    if not _kernel_takes(q, k, cos, sin, unsqueeze_dim) or size_class(cos.shape[-1], q.shape[-1]) not in verdict.sizes:
        return None
    if (cos.dtype != q.dtype or cos.dtype != k.dtype) and (mixed == "original" or q.dtype != k.dtype):
        return None
    fk = kernels()
    if not fk.triton_can_run(q, k, cos, sin):
        fallback(session, KERNEL, f"{name} got {q.device.type} tensors")
        return None
    if mixed == "promote" and cos.dtype != q.dtype:
        # the original computes, and returns, in torch's promoted dtype (bf16 q, fp32 cos -> fp32)
        q = q.to(torch.promote_types(q.dtype, cos.dtype))
        k = k.to(torch.promote_types(k.dtype, cos.dtype))
    if spec.deinterleave_input:
        if cos.shape[-1] != q.shape[-1]:
            return None
        q, k = _deinterleave(q), _deinterleave(k)
    cos, sin = spec.prepare(cos, sin, q.shape[-1])
    return fk.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=spec.interleaved)


def _one_tensor(verdict: Verdict, name: str, x, cos, sin, args, kwargs, session):
    """x rotated by the kernel (as q, with a k of no heads), or None where the original must run."""
    unsqueeze_dim = _unsqueeze_dim(verdict, args, kwargs)
    if unsqueeze_dim not in (1, 2) or not isinstance(x, torch.Tensor) or x.dim() != 4:
        return None
    out = _through_kernel(verdict, name, x, x.narrow(unsqueeze_dim, 0, 0), cos, sin, unsqueeze_dim, session)
    return None if out is None else out[0]


_UNSET = object()  # an argument the caller left out (to call the original exactly as it was called)


def make_wrapper(original: Callable, verdict: Verdict, session):
    name = original.__name__
    if verdict.form == "x, cos, sin":
        @functools.wraps(original)
        def apply_rotary_pos_emb(x, cos, sin, *args, **kwargs):
            out = _one_tensor(verdict, name, x, cos, sin, args, kwargs, session)
            return original(x, cos, sin, *args, **kwargs) if out is None else out
    elif verdict.form == "tensor, sin, cos":
        @functools.wraps(original)
        def apply_rotary_pos_emb(tensor, sin, cos, *args, **kwargs):
            out = _one_tensor(verdict, name, tensor, cos, sin, args, kwargs, session)
            return original(tensor, sin, cos, *args, **kwargs) if out is None else out
    else:
        @functools.wraps(original)
        def apply_rotary_pos_emb(q, k=_UNSET, cos=_UNSET, sin=_UNSET, *args, **kwargs):
            # Calls the probe did not vouch for go to the original, called as they were: Qwen4-Exp's
            # `(q, k=None, cos=None, sin=None)` also rotates q alone, k left out or None.
            if any(t is _UNSET for t in (k, cos, sin)):  # left out, so not positional: *args is empty
                return original(q, **{key: v for key, v in (("k", k), ("cos", cos), ("sin", sin)) if v is not _UNSET},
                                **kwargs)
            if k is None or cos is None or sin is None:
                return original(q, k, cos, sin, *args, **kwargs)
            unsqueeze_dim = _unsqueeze_dim(verdict, args, kwargs)
            out = None if unsqueeze_dim is None else _through_kernel(verdict, name, q, k, cos, sin, unsqueeze_dim,
                                                                         session)
            return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    apply_rotary_pos_emb._autopatch_variant = verdict.describe()
    return apply_rotary_pos_emb


# --- the rule -----------------------------------------------------------------------------------


class _Rule(Rule):
    """Candidates: the module's own rotary functions (TARGETS), the verdict cached per function."""

    name = "rope"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        found = []
        for target in TARGETS:
            if patching.is_patched(module, target):
                fn = _probe.hub_function(patching.original(module, target))
            else:
                fn = _probe.module_function(module, target)
            if fn is not None:  # else nothing of ours to look at (absent, or imported from another module)
                found.append(Candidate(target, fn, (module, target)))
        return found

    def prove(self, candidate: Candidate, module: ModuleType) -> RuleVerdict:
        verdict = detect(candidate.key)
        return RuleVerdict(candidate.target, verdict if verdict.variant is not None else None, verdict.reason)

    def swaps(self, candidate: Candidate, verdict: RuleVerdict, session, enabled) -> list[Swap]:
        module, target = candidate.subject
        return [Swap(module, target, lambda: make_wrapper(candidate.key, verdict.variant, session))]


RULE = _Rule()


_verdicts = RULE.verdicts  # function -> the template Verdict (its variant: this module's Verdict)
