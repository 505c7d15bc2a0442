"""The layers of autopatch's Hugging Face `kernels` layer repository (`python -m autopatch kernel-repo`).

transformers decorates components with a layer name (`@use_kernel_forward_from_hub("RMSNorm")` on a
norm class, `("rotary_pos_emb")` on `apply_rotary_pos_emb`); `kernels.kernelize` sets the `forward`
of each such instance to the forward of the layer class a repository provides under that name. The
repository autopatch writes (autopatch.hub) imports `layers` from here, so its layers are this code:

    RMSNorm, RMSNormZeroCentered   fused_kernels.rms_norm (kernel rms_norm)
    rotary_pos_emb                 fused_kernels.rope (kernel rope)

A layer name is generic: many classes carry it, and not all compute the same thing (a Gemma-style
`(1 + w)` norm, a norm with a bias). So each layer keeps autopatch's proof: on the first call for a
class (or rotary function) it takes the rule's verdict for it (autopatch.rules.rms_norm / rope, the
same probes FUSED_KERNELS runs) and runs the rule's patched forward for the variant proven, or the
module's own forward when the rule left it alone. Where the class is patched already (FUSED_KERNELS,
apply()), its forward is ours and runs as is.

kernels accepts a layer class only without an __init__ and with no members beyond `forward`,
`has_backward` and `can_torch_compile`; both flags are true here: the kernels have a backward and
are torch.library custom ops that torch.compile(fullgraph=True) traces without a graph break.
"""

from __future__ import annotations

import sys
import threading

import torch.nn as nn

from autopatch import patching
from autopatch.session import Record, current, say, started

# layer name -> the rule module's kernel name (what a user turns on or off)
KERNEL_OF = {"RMSNorm": "rms_norm", "RMSNormZeroCentered": "rms_norm", "rotary_pos_emb": "rope"}

_lock = threading.Lock()
# class (a norm class, or a rotary function's Func class) -> (the session it was resolved in, the callable
# that runs): a later session resolves again, so that its report records what runs
_resolved: dict = {}


def _verdict(rule_module, target: str, key, subject, module):
    """The rule's cached verdict for one candidate (proved the first time, in the probes' own state)."""
    from autopatch.rules._template import Candidate

    return rule_module.RULE.verdict(Candidate(target, key, subject), module)


def _note(layer: str, owner: str, module: str, kernel: str, runs: str, record: Record | None) -> None:
    session = current()
    with session.lock:  # the report's `hub_kernels`, beside what autopatch.hub records per kernelize
        session.meta.setdefault("hub_kernels", {})[f"{layer} {owner}"] = runs
    if record is not None and record not in session.all_records():
        session.add([record])


def _norm_forward(cls, layer: str):
    """What runs for a norm class under layer `layer`: the class's forward when the rule patched it
    (ours already) or left it alone (its own), else the rule's forward for the variant it proved."""
    own = cls.forward
    module = sys.modules.get(cls.__module__)
    if patching.is_patched(cls, "forward"):
        _note(layer, cls.__name__, cls.__module__, "rms_norm", "autopatch rms_norm (patched class)", None)
        return own
    try:
        from autopatch.rules import rms_norm
        from autopatch.rules._template import input_name

        verdict = _verdict(rms_norm, cls.__name__, cls, None, module)
    except Exception as exc:  # noqa: BLE001 - the layer must run whatever happens to the proof
        verdict, why = None, f"proof failed ({type(exc).__name__}: {exc})"
    else:
        why = verdict.reason
    if verdict is None or verdict.variant is None:
        _note(layer, cls.__name__, cls.__module__, "rms_norm", f"its own forward (left alone: {why})",
              Record("rms_norm", cls.__module__, cls.__name__, False, reason=f"Hub layer {layer}: {why}"))
        return own
    variant = verdict.variant
    forward = rms_norm.make_forward(own, variant, input_name(own), current())
    _note(layer, cls.__name__, cls.__module__, "rms_norm", "autopatch rms_norm (kernel repository)",
          Record("rms_norm", cls.__module__, cls.__name__, True, f"{variant.describe()} (Hub layer {layer})"))
    return forward


def _rope_function(func_layer):
    """What runs for a rotary Func layer (the module-level function transformers decorated)."""
    from autopatch.rules import _probe

    func_class = type(func_layer)
    plain = _probe.hub_function(func_layer)
    if plain is func_layer or not callable(plain):  # not a function layer we can read: its own forward
        return lambda *args, **kwargs: func_class.forward(func_layer, *args, **kwargs)
    name, module = plain.__name__, sys.modules.get(plain.__module__)
    if module is not None and patching.is_patched(module, name):
        _note("rotary_pos_emb", name, plain.__module__, "rope", "autopatch rope (patched function)", None)
        return patching.installed(module, name)
    try:
        from autopatch.rules import rope

        verdict = _verdict(rope, name, plain, (module, name), module)
    except Exception as exc:  # noqa: BLE001
        verdict, why = None, f"proof failed ({type(exc).__name__}: {exc})"
    else:
        why = verdict.reason
    if verdict is None or verdict.variant is None:
        _note("rotary_pos_emb", name, plain.__module__, "rope", f"its own function (left alone: {why})",
              Record("rope", plain.__module__, name, False, reason=f"Hub layer rotary_pos_emb: {why}"))
        return plain
    wrapper = rope.make_wrapper(plain, verdict.variant, current())
    _note("rotary_pos_emb", name, plain.__module__, "rope", "autopatch rope (kernel repository)",
          Record("rope", plain.__module__, name, True, f"{verdict.variant.describe()} (Hub layer rotary_pos_emb)"))
    return wrapper


def _resolve(key, make):
    found = _resolved.get(key)
    if found is None or found[0] is not started():  # a plain global read: no graph break under torch.compile
        forward = make()
        made = (started(), forward)  # read after make(), which begins a session where none was
        with _lock:
            found = _resolved.get(key)
            if found is None or found[0] is not made[0]:
                _resolved[key] = found = made
    return found[1]


def prepare(instance) -> None:
    """Resolve what runs for `instance`'s class now (autopatch.hub does it after each kernelize, so
    that a torch.compile trace finds it resolved)."""
    forward = getattr(vars(instance).get("forward"), "__func__", None)
    for layer in LAYERS.values():
        if forward is layer.forward:
            if layer is rotary_pos_emb:
                _resolve(type(instance), lambda: _rope_function(instance))
            else:
                cls = type(instance)
                _resolve(cls, lambda: _norm_forward(cls, layer.__name__))


def reset() -> None:
    """Forget what each class resolved to, and the current session's `hub_kernels` record (tests that
    patch and unpatch classes)."""
    with _lock:
        _resolved.clear()
    session = current()
    with session.lock:
        session.meta.pop("hub_kernels", None)


def ran() -> dict:
    """(layer name, class or function) -> what runs there, read from the current session's
    `hub_kernels` record (the report's): what our layers resolved, and what autopatch.hub decided at
    each kernelize."""
    session = current()
    with session.lock:
        record = dict(session.meta.get("hub_kernels", {}))
    return {tuple(key.split(" ", 1)): runs for key, runs in record.items()}


# --------------------------------------------------------------------------- the layer classes
class RMSNorm(nn.Module):
    """Hub layer "RMSNorm": fused_kernels.rms_norm for the classes the rms_norm rule proves."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        cls = type(self)
        return _resolve(cls, lambda: _norm_forward(cls, "RMSNorm"))(self, hidden_states)


class RMSNormZeroCentered(nn.Module):
    """Hub layer "RMSNormZeroCentered" (Qwen3.5's `x * (1 + w)` norms): the same proof decides."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        cls = type(self)
        return _resolve(cls, lambda: _norm_forward(cls, "RMSNormZeroCentered"))(self, hidden_states)


class rotary_pos_emb(nn.Module):  # noqa: N801 - the name transformers decorates with
    """Hub layer "rotary_pos_emb": fused_kernels.rope for the rotary functions the rope rule proves.
    `self` is the function's Func layer that kernelize gave this forward."""

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _resolve(type(self), lambda: _rope_function(self))(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


LAYERS = {"RMSNorm": RMSNorm, "RMSNormZeroCentered": RMSNormZeroCentered, "rotary_pos_emb": rotary_pos_emb}
# The layer names transformers' default mapping asks its repositories for, so that LOCAL_KERNELS=
# kernels-community/liger-kernels=<our repo>:kernels-community/rotary=<our repo> serves ours.
ALIASES = {"LigerRMSNorm": RMSNorm, "apply_rotary_transformers": rotary_pos_emb}


class _Layers:
    """The `layers` kernels reads a layer from (getattr(kernel.layers, name, None)). A name we do not
    provide gets kernels' own error; this says, on the line before, which ones we do."""

    def __init__(self):
        vars(self).update(LAYERS)
        vars(self).update(ALIASES)

    def __getattr__(self, name):
        if not name.startswith("_"):
            say(f"autopatch: the autopatch kernel repository has no layer {name!r}; it provides "
                f"{', '.join(LAYERS)} (and, for LOCAL_KERNELS over transformers' defaults, {', '.join(ALIASES)})")
        raise AttributeError(name)

    def __dir__(self):
        return [*LAYERS, *ALIASES]


layers = _Layers()


def _watch_kernelize() -> None:
    """Loaded by kernels (our repository in a mapping): put autopatch.hub's wrapper around kernelize
    if start-up did not (no autopatch variable set), for what our layers need from it: a mapping our
    repository serves for inference only serves training too, and our layers resolve before a
    torch.compile trace. It changes nothing for classes autopatch did not patch."""
    try:
        from autopatch import hub

        hub.install()
    except Exception as exc:  # noqa: BLE001 - loading the layers must not fail on this
        say(f"autopatch: internal error while watching Hub kernels ({type(exc).__name__}: {exc})")


_watch_kernelize()
