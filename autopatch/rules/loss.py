"""The loss rule: `*ForCausalLM` classes whose loss is transformers' ForCausalLMLoss, and the
multimodal heads AutoModelForImageTextToText builds (`*ForConditionalGeneration` of Qwen2-VL, Gemma 3,
LLaVA, ...) whose forward has the same lm_head -> logits -> self.loss_function structure.

Kernels:
  cross_entropy               the class gets a `loss_function` property that returns
                              `fused_causal_lm_loss` (ForCausalLMLoss through fused_kernels.cross_entropy)
                              wherever transformers would have returned ForCausalLMLoss: per class,
                              never process-wide, never torch.nn.functional rebound. A loss set by the
                              user (`model.loss_function = f`) or another `config.loss_type` is kept.
  fused_linear_cross_entropy  the class's forward is wrapped so that in training with labels the
                              lm_head + loss run as fused_kernels.fused_linear_cross_entropy without
                              full logits (see autopatch.rules._causal_lm_loss for the mechanism;
                              the logits slot holds a LazyLogits or None). Only for forwards whose logits
                              transformations are all in the LOGIT_STEPS table
                              (autopatch.rules._causal_lm_source) and whose lm_head is built as nn.Linear.
With both on: the fused linear CE in training with labels, the fused CE wherever logits exist anyway.

A multimodal head is taken on the same proof as a causal LM: its forward is analysed the same way
(autopatch.rules._causal_lm_source), and the fused loss computes what the ForCausalLMLoss it calls
would, from the same arguments (labels with -100 on image and pad tokens, num_items_in_batch,
shift_labels, logits_to_keep through the sliced hidden states; the `vocab_size` it passes, e.g.
`config.text_config.vocab_size`, is the lm_head's out_features). Heads that fail the analysis
(Q-Former heads without lm_head, encoder-decoders computing their own loss, logits post-processing
outside LOGIT_STEPS) are left alone with the reason.

A module whose *ForCausalLM forward computes its own loss with `CrossEntropyLoss()` (imported from
torch.nn: Bart, Marian, Pegasus, ... decoders) gets that global rebound to a torch.nn.CrossEntropyLoss
subclass running fused_kernels.cross_entropy (kernel cross_entropy; autopatch.rules._torch_ce).

Detection is structural only: the numbers are those of the reference loss by construction (same
targets, same reduction); the tests compare patched and unpatched models per architecture.
"""

from __future__ import annotations

import functools
import re
from types import ModuleType

from autopatch import patching
from autopatch.report import Record
from autopatch.rules import _causal_lm_loss as runtime
from autopatch.rules._causal_lm_source import analyse_forward, lm_head_built_as_linear
from autopatch.rules._kernels import import_problem

CE = "cross_entropy"
FLCE = "fused_linear_cross_entropy"

# class -> LossPatch; the class's properties and forward read it, so a later call can switch more on
_patches: dict[type, runtime.LossPatch] = {}


class _LossRule:
    name = "loss"
    kernels = (CE, FLCE)

    def patch_module(self, module: ModuleType, enabled) -> list[Record]:
        records: list[Record] = []
        try:
            classes = _causal_lm_classes(module)
        except Exception as exc:  # never raise out of a rule
            return [Record(kernel=self.name, module=module.__name__, target="*", patched=False,
                           reason=f"could not list *ForCausalLM classes: {type(exc).__name__}: {exc}")]
        for cls in classes:
            for kernel in self.kernels:
                try:
                    if enabled(kernel):
                        records.append(_patch_class(module, cls, kernel))
                except Exception as exc:
                    records.append(Record(kernel=kernel, module=module.__name__, target=cls.__name__,
                                          patched=False, reason=f"rule raised {type(exc).__name__}: {exc}"))
        try:
            if enabled(CE):
                # the torch-loss rebinding is for causal LMs only: a multimodal head computing its own
                # loss (BLIP, Pix2Struct, UDOP) keeps its module's CrossEntropyLoss
                causal = set(_causal_lm_classes(module, multimodal=False))
                records.extend(_patch_torch_loss(module, [c for c in classes if c in causal]))
        except Exception as exc:
            records.append(Record(kernel=CE, module=module.__name__, target=TORCH_LOSS, patched=False,
                                  reason=f"rule raised {type(exc).__name__}: {exc}"))
        return records


RULE = _LossRule()


TORCH_LOSS = "CrossEntropyLoss"  # the module global a causal LM computing its own loss instantiates


def _patch_torch_loss(module: ModuleType, classes: list[type]) -> list[Record]:
    """Modules whose *ForCausalLM forward computes its own loss with `CrossEntropyLoss()` imported from
    torch.nn: that global rebound to _torch_ce.FusedCrossEntropyLoss (its docstring). One record, or
    none for a module without such a class or without the import."""
    import torch

    from autopatch.rules._torch_ce import FusedCrossEntropyLoss

    own_loss = [cls for cls in classes if analyse_forward(_original_forward(cls)).computes_own_loss]
    current = vars(module).get(TORCH_LOSS)
    if not own_loss or (current is not torch.nn.CrossEntropyLoss and current is not FusedCrossEntropyLoss):
        return []
    variant = "torch.nn.CrossEntropyLoss -> fused_kernels.cross_entropy"
    if current is not FusedCrossEntropyLoss:
        problem = import_problem()
        if problem:
            return [Record(kernel=CE, module=module.__name__, target=TORCH_LOSS, patched=False, reason=problem)]
        patching.replace(module, TORCH_LOSS, FusedCrossEntropyLoss)
    return [Record(kernel=CE, module=module.__name__, target=TORCH_LOSS, patched=True, variant=variant)]


def _watch_runs() -> None:
    """A loss is patched: count optimizer steps and, at exit, say so if it never ran in a process that
    trained (autopatch.report.exit_verdict)."""
    from autopatch import report

    report.watch_training()
    report.check_at_exit()


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


def _patch_class(module: ModuleType, cls: type, kernel: str) -> Record:
    from transformers.loss.loss_utils import ForCausalLMLoss, LOSS_MAPPING

    def left_alone(target, reason):
        return Record(kernel=kernel, module=module.__name__, target=target, patched=False, reason=reason)

    loss_target = f"{cls.__name__}.loss_function"
    forward_target = f"{cls.__name__}.forward"
    target = loss_target if kernel == CE else forward_target

    loss_type = _resolved_loss_type(cls)
    if LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss:
        return left_alone(target, f"loss type {loss_type!r} is not transformers' ForCausalLMLoss")
    base = _base_loss_property(cls)
    if base is None:
        return left_alone(target, "the class defines its own loss_function")
    forward = _original_forward(cls)
    analysis = analyse_forward(forward)
    if kernel == CE and analysis.computes_own_loss:
        return left_alone(target, "forward does not call self.loss_function (it computes its own loss)")
    if kernel == FLCE:
        if not analysis.ok:
            return left_alone(target, analysis.reason)
        if not lm_head_built_as_linear(cls):
            return left_alone(target, "lm_head is not built as nn.Linear in __init__")
    problem = import_problem()
    if problem:
        return left_alone(target, problem)

    # a class restored by patching.restore_all() starts again from a fresh LossPatch
    patch = _patches.get(cls) if patching.is_patched(cls, "loss_function") else None
    if patch is None:
        patch = runtime.LossPatch(base_loss_property=base, transforms=analysis.transforms)
        _patches[cls] = patch
    patching.replace(cls, runtime.CALL_ATTR, None)
    patching.replace(cls, "loss_function", runtime.make_loss_function_property(patch))
    if kernel == CE:
        patch.cross_entropy = True
        _watch_runs()
        return Record(kernel=kernel, module=module.__name__, target=target, patched=True,
                      variant="ForCausalLMLoss -> fused_kernels.cross_entropy")
    patch.fused_linear = True
    _watch_runs()
    runtime.return_logits_mode()  # read the settings now, eagerly, not first inside a compiled forward
    runtime.flce_chunk_mb()
    patching.replace(cls, "lm_head", runtime.make_lm_head_property())
    patching.replace(cls, "forward", runtime.make_forward(forward, patch))
    return Record(kernel=kernel, module=module.__name__, target=target, patched=True,
                  variant=analysis.variant())
