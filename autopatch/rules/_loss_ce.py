"""The loss swap: a patched causal LM's `loss_function` property, and transformers' ForCausalLMLoss
computed by fused_kernels.cross_entropy.

The property returns what transformers would (a loss set by the user, another config.loss_type),
with ForCausalLMLoss replaced by the fused cross entropy when the cross_entropy kernel is on; while a
fused linear cross entropy call is active on the model (`CALL_ATTR`, autopatch.rules._flce_call) it
returns that call's loss instead.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopatch.rules._causal_lm_source import Transform
from autopatch.rules._kernels import fallback, kernels, notice

CALL_ATTR = "_autopatch_flce_call"  # the model's fused linear loss call while one runs, else None
# what the kernels take (fused_kernels._utils.FLOAT_DTYPES); float64 models keep the original loss
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def original_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def shifted_targets(labels, shift_labels, ignore_index):
    """ForCausalLMLoss's targets: labels shifted left by one, the last position ignored (unless
    the caller passes `shift_labels`), flattened."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    return shift_labels.reshape(-1)


def reduce_like_fixed_cross_entropy(loss_fn, num_items_in_batch):
    """transformers' fixed_cross_entropy: mean over non-ignored tokens, or, with num_items_in_batch,
    the sum divided by it (moved to the loss's device when a tensor; an int is used as is)."""
    if num_items_in_batch is None:
        return loss_fn("mean")
    loss = loss_fn("sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def make_fused_causal_lm_loss(session):
    """transformers.loss.loss_utils.ForCausalLMLoss computed by fused_kernels.cross_entropy, reporting
    its fallbacks to `session`."""

    def fused_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                             shift_labels=None, **kwargs):
        """transformers.loss.loss_utils.ForCausalLMLoss computed by fused_kernels.cross_entropy.

        Same arguments, same result: the kernel reads the logits in their own dtype and accumulates in
        fp32 (what ForCausalLMLoss's `logits.float()` buys, without the fp32 copy). One deliberate
        difference: a batch whose every target is ignored gives 0 (the kernel's convention), where
        ForCausalLMLoss's mean gives NaN."""
        fk = kernels()
        usable = logits.dtype in KERNEL_DTYPES
        if not usable:
            notice(session, "cross_entropy", f"logits of dtype {logits.dtype}; transformers' ForCausalLMLoss runs instead")
        elif not fk.triton_can_run(logits):
            usable = False
            if not torch.compiler.is_compiling():
                fallback(session, "cross_entropy", f"logits on {logits.device.type}")
        if not usable:
            return original_causal_lm_loss()(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        flat_logits = logits.reshape(-1, vocab_size)
        target = shifted_targets(labels, shift_labels, ignore_index).to(logits.device)
        return reduce_like_fixed_cross_entropy(
            lambda reduction: fk.cross_entropy(flat_logits, target, ignore_index=ignore_index, reduction=reduction),
            num_items_in_batch,
        )

    return fused_causal_lm_loss


@dataclasses.dataclass
class LossPatch:
    """What is switched on for one patched class (read at call time, so a later patch_module call
    that turns a kernel on takes effect)."""

    base_loss_property: property  # the loss_function property the class had (PreTrainedModel's)
    session: object  # where the patched code reports (autopatch.session.Session)
    cross_entropy: bool = False
    fused_linear: bool = False
    transforms: tuple[Transform, ...] = ()


def make_loss_function_property(patch: LossPatch):
    base = patch.base_loss_property
    fused = make_fused_causal_lm_loss(patch.session)

    def loss_function(self):
        call = getattr(self, CALL_ATTR)
        if call is not None:
            return call.loss
        resolved = base.fget(self)
        if patch.cross_entropy and resolved is original_causal_lm_loss():
            return fused
        return resolved

    def set_loss_function(self, value):
        base.fset(self, value)

    return property(loss_function, set_loss_function, doc=base.__doc__)
