from __future__ import annotations

import dataclasses
import functools
import re
from types import ModuleType

import torch

from autopatch import patching
from autopatch.rules import _flce_call, _loss_ce, _torch_ce
from autopatch.rules._causal_lm_source import analyse_forward, lm_head_built_as_linear
from autopatch.rules._template import Candidate, Rule, Swap, Verdict

CE = "cross_entropy"
FLCE = "fused_linear_cross_entropy"
TORCH_LOSS = "CrossEntropyLoss"  # the module global a causal LM computing its own loss instantiates
CE_VARIANT = "ForCausalLMLoss -> fused_kernels.cross_entropy"
TORCH_LOSS_VARIANT = "torch.nn.CrossEntropyLoss -> fused_kernels.cross_entropy"

# class -> LossPatch; the class's properties and forward read it, so a later call can switch more on
_patches: dict[type, _loss_ce.LossPatch] = {}


@dataclasses.dataclass(frozen=True)
class LossVariant:
    """What the source analysis proved for one class and kernel."""

    text: str
    base: property  # the loss_function property the class inherits (PreTrainedModel's)
    forward: object  # the class's own forward (unpatched)
    transforms: tuple = ()

    def describe(self) -> str:
        return self.text


class _LossRule(Rule):
    """Candidates per causal-LM class: its loss_function (cross_entropy) and its forward
    (fused_linear_cross_entropy), each recorded only when its kernel is on; and a module's
    CrossEntropyLoss global where a causal LM computes its own loss with it (cross_entropy)."""

    name = "loss"
    kernels = (CE, FLCE)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        classes = _causal_lm_classes(module)
        found = []
        for cls in classes:
            found.append(Candidate(f"{cls.__name__}.loss_function", (cls, CE), cls, kernel=CE))
            found.append(Candidate(f"{cls.__name__}.forward", (cls, FLCE), cls, kernel=FLCE))
        # the torch-loss rebinding is for causal LMs only: a multimodal head computing its own loss
        # (BLIP, Pix2Struct, UDOP) keeps its module's CrossEntropyLoss
        causal = set(_causal_lm_classes(module, multimodal=False))
        if _computes_own_loss(module, [c for c in classes if c in causal]):
            found.append(Candidate(TORCH_LOSS, (module.__name__, TORCH_LOSS), module, kernel=CE))
        return found

    def wants(self, candidate: Candidate, enabled) -> bool:
        return enabled(candidate.kernel)

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        if candidate.target == TORCH_LOSS:
            return Verdict(candidate.target, LossVariant(TORCH_LOSS_VARIANT, None, None))
        return _prove_class(candidate.subject, candidate.kernel, candidate.target)

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        if candidate.target == TORCH_LOSS:
            return [Swap(candidate.subject, TORCH_LOSS, lambda: _torch_ce.installed(session))]
        cls, variant = candidate.subject, verdict.variant
        patch = _patch_for(cls, variant, session)
        swaps = [Swap(cls, _loss_ce.CALL_ATTR, lambda: None),
                 Swap(cls, "loss_function", lambda: _loss_ce.make_loss_function_property(patch))]
        if candidate.kernel == FLCE:
            swaps += [Swap(cls, "lm_head", lambda: _flce_call.make_lm_head_property(session)),
                      Swap(cls, "forward", lambda: _flce_call.make_forward(variant.forward, patch))]
        return swaps

    def patched(self, candidate: Candidate, verdict: Verdict) -> None:
        patch = _patches.get(candidate.subject) if candidate.target != TORCH_LOSS else None
        if patch is not None:
            if candidate.kernel == CE:
                patch.cross_entropy = True
            else:
                patch.fused_linear = True


RULE = _LossRule()


def _patch_for(cls, variant: LossVariant, session) -> _loss_ce.LossPatch:
    """The class's LossPatch: the one its patched properties read, or a new one (a class restored by
    patching.restore_all() starts again from a fresh LossPatch)."""
    patch = _patches.get(cls) if patching.is_patched(cls, "loss_function") else None
    if patch is None:
        patch = _loss_ce.LossPatch(base_loss_property=variant.base, session=session, transforms=variant.transforms)
        _patches[cls] = patch
    return patch


def _computes_own_loss(module: ModuleType, classes: list[type]) -> bool:
    """Whether a causal LM of `module` computes its own loss with `CrossEntropyLoss()` imported from
    torch.nn (that global is then rebound to _torch_ce.FusedCrossEntropyLoss, its docstring)."""
    if not any(analyse_forward(_original_forward(cls)).computes_own_loss for cls in classes):
        return False
    current = vars(module).get(TORCH_LOSS)
    return current is torch.nn.CrossEntropyLoss or current is _torch_ce.FusedCrossEntropyLoss


def _causal_lm_classes(module: ModuleType, multimodal: bool = True) -> list[type]:
    """*ForCausalLM classes, the causal LMs AutoModelForCausalLM builds under other names
    (GPT2LMHeadModel, OpenAIGPTLMHeadModel, ...) and, with `multimodal`, the heads
    AutoModelForImageTextToText builds (Qwen2VLForConditionalGeneration, LlavaForConditionalGeneration,
    ...), defined in `module`."""
    from transformers.modeling_utils import PreTrainedModel

    causal = _auto_head_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if multimodal:
        causal = causal | _auto_head_names("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
    return [
        obj for name, obj in sorted(vars(module).items())
        if isinstance(obj, type)
        and (name.endswith("ForCausalLM") or name in causal)
        and obj.__module__ == module.__name__
        and issubclass(obj, PreTrainedModel)
    ]


@functools.lru_cache(maxsize=None)
def _auto_head_names(mapping: str) -> frozenset:
    """The class names of one of transformers' auto mappings (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ...);
    empty when this transformers has no such mapping (then the *ForCausalLM names alone)."""
    try:
        from transformers.models.auto import modeling_auto

        table = getattr(modeling_auto, mapping)
    except Exception:  # noqa: BLE001 - an older layout
        return frozenset()
    names = set()
    for value in table.values():
        names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def _resolved_loss_type(cls) -> str | None:
    """The LOSS_MAPPING key PreTrainedModel.__init__ picks from the class name (before any
    config.loss_type override, which the property checks at call time)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    name = cls.__name__
    if name in LOSS_MAPPING:
        return name
    found = re.findall(f"({'|'.join(LOSS_MAPPING)})", name)
    # no match (GPT2LMHeadModel): PreTrainedModel.loss_function falls back to ForCausalLMLoss
    return found[0] if found else "ForCausalLM"


def _base_loss_property(cls):
    """The loss_function attribute the class inherits (PreTrainedModel's property), or None when it
    defines its own or the inherited one is not a property."""
    if "loss_function" in vars(cls) and not patching.is_patched(cls, "loss_function"):
        return None
    for klass in cls.__mro__[1:]:
        if "loss_function" in vars(klass) and not patching.is_patched(klass, "loss_function"):
            value = vars(klass)["loss_function"]
            return value if isinstance(value, property) else None
    return None


def _original_forward(cls):
    forward = vars(cls).get("forward", None) or cls.forward
    return getattr(forward, "__autopatch_original__", forward)


def _prove_class(cls: type, kernel: str, target: str) -> Verdict:
    """The structural proof for one class and kernel (the module docstring)."""
    from transformers.loss.loss_utils import ForCausalLMLoss, LOSS_MAPPING

    loss_type = _resolved_loss_type(cls)
    if LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss:
        return Verdict(target, None, f"loss type {loss_type!r} is not transformers' ForCausalLMLoss")
    base = _base_loss_property(cls)
    if base is None:
        return Verdict(target, None, "the class defines its own loss_function")
    forward = _original_forward(cls)
    analysis = analyse_forward(forward)
    if kernel == CE:
        if analysis.computes_own_loss:
            return Verdict(target, None, "forward does not call self.loss_function (it computes its own loss)")
        return Verdict(target, LossVariant(CE_VARIANT, base, forward, analysis.transforms))
    if not analysis.ok:
        return Verdict(target, None, analysis.reason)
    if not lm_head_built_as_linear(cls):
        return Verdict(target, None, "lm_head is not built as nn.Linear in __init__")
    return Verdict(target, LossVariant(analysis.variant(), base, forward, analysis.transforms))
