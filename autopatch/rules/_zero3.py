"""DeepSpeed ZeRO-3 and the fused linear cross entropy.

Under ZeRO-3 every parameter is partitioned: outside its module's forward, `lm_head.weight` is an
empty tensor (ds_status NOT_AVAILABLE; the full size in ds_numel), gathered by the hooks DeepSpeed
puts on the module only while the module itself runs. A fused loss that read lm_head.weight inside
the model's forward without calling lm_head would read that empty tensor. So the fused loss runs as
lm_head's forward for one call (an instance `forward` set and removed around `lm_head(hidden)`):
DeepSpeed's pre-forward hook gathers the weight and bias, the kernel computes the loss and every
gradient with them, the post-forward hook releases them and hooks the loss so that the backward
gathers them again before the gradients are accumulated, exactly as for the model's own lm_head
call (DeepSpeed's gradient hooks then reduce-scatter the full-shape gradient). Its prefetch trace
sees lm_head called where the model calls it. Where that cannot be done (hooks that are not
DeepSpeed's, no DeepSpeed hook at all, an lm_head subclass), the model's own lm_head and loss run,
with one notice: never a loss over an empty weight.
"""

from __future__ import annotations

from torch import nn

from autopatch.rules._kernels import notice


def zero3_partitioned(lm_head) -> bool:
    """Whether lm_head's weight is a ZeRO-3 partitioned parameter (the attributes DeepSpeed sets)."""
    weight = getattr(lm_head, "weight", None)
    return all(hasattr(weight, name) for name in ("ds_id", "ds_status", "ds_numel"))


def zero3_can_gather(lm_head, session, model=None) -> bool:
    """Whether the fused loss can run inside a call of this ZeRO-3 lm_head: a plain nn.Linear whose
    hooks are all DeepSpeed's, with a pre-forward one (the gather). Otherwise one notice, False."""
    pre = list(lm_head._forward_pre_hooks.values())
    hooks = pre + list(lm_head._forward_hooks.values())
    why = None
    if not (type(lm_head) is nn.Linear and "forward" not in lm_head.__dict__):
        why = "is not a plain nn.Linear"
    elif not any(_from_deepspeed(h) for h in pre):
        why = "has no DeepSpeed hook to gather it"
    elif not all(_from_deepspeed(h) for h in hooks):
        why = "has hooks that are not DeepSpeed's"
    if why is None:
        return True
    notice(session, "fused_linear_cross_entropy",
           f"lm_head is a ZeRO-3 partitioned parameter but {why}; lm_head and the loss run as the model defines them",
           model)
    return False


def _from_deepspeed(hook) -> bool:
    return (getattr(hook, "__module__", None) or "").startswith("deepspeed")


def run_through_module(lm_head, hidden, loss_fn):
    """loss_fn(hidden) computed as lm_head's forward for one call, inside its hooks."""
    lm_head.forward = loss_fn  # an instance attribute: nn.Module.__call__ runs it between the hooks
    try:
        return lm_head(hidden)
    finally:
        del lm_head.forward
