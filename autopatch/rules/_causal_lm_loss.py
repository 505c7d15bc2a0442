"""The causal-LM loss at run time: transformers' ForCausalLMLoss through fused_kernels.cross_entropy,
and the `*ForCausalLM` forward in training through fused_kernels.fused_linear_cross_entropy.

How the fused linear cross entropy gets into an unmodified forward (one mechanism for every
architecture; no forward is copied):

  - the class's `forward` is wrapped. In training, with labels, with grad enabled (and the lm_head a
    plain nn.Linear on tensors Triton can run on), the wrapper makes a `FusedLinearLossCall`, stores it
    on the model as `_autopatch_flce_call` for the length of the call, and runs the original forward;
  - the class gets a `lm_head` property. Normally it returns the real module (`_modules["lm_head"]`,
    what nn.Module.__getattr__ would return). While a call is active it returns a stand-in that records
    the hidden states it is given and returns a [..., 0]-wide tensor, so the original code's logits
    transformations (softcap, scaling) run on nothing;
  - the class gets a `loss_function` property. While a call is active it returns the call's loss, which
    computes fused_linear_cross_entropy from the recorded hidden states, lm_head weight and bias, the
    labels and the loss kwargs (num_items_in_batch, ignore_index, shift_labels), with the softcap and
    logit scale the source analysis found. Everything the original forward does after its loss call —
    adding router_aux_loss_coef * aux_loss in MoE models, building the output — still runs;
  - otherwise `loss_function` returns what transformers would (a user-set loss included), with
    ForCausalLMLoss replaced by `fused_causal_lm_loss` when the cross_entropy kernel is on.

What the fused case returns in the logits slot (a tuple output keeps every position), by
AUTOPATCH_RETURN_LOGITS:
  - auto (default): a LazyLogits, a tensor of the logits' shape and dtype with no storage. The full
    logits are what the fused kernel avoids materialising, and most training loops never read them;
    a loop that does (TRL's older SFTTrainer for its metrics, a custom loss) gets them computed on the
    first read: lm_head over the kept final hidden states, the logits transformations, with a graph
    when grad is on, so a loss built on them trains as on the plain model's. Reading metadata
    (shape, dtype, device, size(), dim()) computes nothing. So what is actually read decides, not
    which library is imported;
  - true: the real logits computed at once (no graph; the loss and its gradients come from the fused
    kernel);
  - false: None.
Side outputs of the same pass, as attributes of a ModelOutput (not fields: to_tuple() and the
layout stay the model's): `token_loss` (float32, the labels' shape, each target's loss, 0 where
ignored; free) and `is_top1` (bool, whether the target is the most likely token, False where
ignored; one more read of each logits chunk, skipped with AUTOPATCH_RETURN_LOGITS=false), so token
accuracy and per-token losses need no [tokens, vocab] tensor. Position i scores labels[i + 1] (the
shifted targets), as ForCausalLMLoss does. Eager only: under torch.compile the slot holds None (or
the real logits with true) and there are no side outputs.
Eval, no labels, or no grad: the original forward runs untouched and returns the logits.

Nothing here swaps attributes of instances except `_autopatch_flce_call`, a plain Python attribute set
and cleared around the call, which torch.compile(fullgraph=True) traces as a side effect.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers

import torch
from torch import nn

from autopatch import report
from autopatch.rules import _probe
from autopatch.rules._kernels import kernels
from autopatch.rules._causal_lm_source import Transform, resolve_attribute

CALL_ATTR = "_autopatch_flce_call"
# what the kernels take (fused_kernels._utils.FLOAT_DTYPES); float64 models keep the original loss
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _original_causal_lm_loss():
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


def fused_causal_lm_loss(
    logits,
    labels,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    **kwargs,
):
    """transformers.loss.loss_utils.ForCausalLMLoss computed by fused_kernels.cross_entropy.

    Same arguments, same result: the kernel reads the logits in their own dtype and accumulates in
    fp32 (what ForCausalLMLoss's `logits.float()` buys, without the fp32 copy). One deliberate
    difference: a batch whose every target is ignored gives 0 (the kernel's convention), where
    ForCausalLMLoss's mean gives NaN."""
    fk = kernels()
    usable = logits.dtype in KERNEL_DTYPES
    if not usable:
        _notice_once("cross_entropy", f"logits of dtype {logits.dtype}; transformers' ForCausalLMLoss runs instead")
    elif not fk.triton_can_run(logits):
        usable = False
        if not torch.compiler.is_compiling():
            report.fallback_notice("cross_entropy", f"logits on {logits.device.type}")
    if not usable:
        return _original_causal_lm_loss()(
            logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
        )
    flat_logits = logits.reshape(-1, vocab_size)
    target = shifted_targets(labels, shift_labels, ignore_index).to(logits.device)
    return reduce_like_fixed_cross_entropy(
        lambda reduction: fk.cross_entropy(flat_logits, target, ignore_index=ignore_index, reduction=reduction),
        num_items_in_batch,
    )


@dataclasses.dataclass
class LossPatch:
    """What is switched on for one patched class (read at call time, so a later patch_module call
    that turns a kernel on takes effect)."""

    base_loss_property: property  # the loss_function property the class had (PreTrainedModel's)
    cross_entropy: bool = False
    fused_linear: bool = False
    transforms: tuple[Transform, ...] = ()


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not torch.is_tensor(value)


def logit_transform_values(model, transforms):
    """(logit_scale, softcap) for this model from the analysed transforms, or None when some value
    is not a plain number (then the fused path does not apply)."""
    scale = 1.0
    softcap = None
    for t in transforms:
        value = resolve_attribute(model, t.attribute, t.optional)
        if t.kind.endswith("_if_set") and value is None:
            continue
        if not _number(value):
            return None
        if t.kind in ("scale_mul", "scale_mul_if_set"):
            scale = scale * float(value)
        elif t.kind == "scale_div":
            scale = scale / float(value)
        else:
            softcap = float(value)
    return scale, softcap


class LMHeadStandIn:
    """What `self.lm_head` is during a fused call: records its input, returns a [..., 0] tensor.
    Attribute reads (weight.dtype in some forwards) go to the real module."""

    def __init__(self, call, lm_head):
        self._call = call
        self._lm_head = lm_head

    @property
    def weight(self):
        return self._lm_head.weight

    @property
    def bias(self):
        return self._lm_head.bias

    @property
    def in_features(self):
        return self._lm_head.in_features

    @property
    def out_features(self):
        return self._lm_head.out_features

    def __call__(self, hidden_states):
        self._call.hidden_states = hidden_states
        if self._call.logits_mode == "true":
            # the real logits, without a graph: the loss comes from the fused kernel all the same
            with torch.no_grad():
                return self._lm_head(hidden_states)
        return hidden_states.new_empty((*hidden_states.shape[:-1], 0))


class FusedLinearLossCall:
    """One forward call of a patched model that computes its loss with fused_linear_cross_entropy."""

    def __init__(self, lm_head, logit_scale, softcap, logits_mode="false", chunk_mb=None):
        self.lm_head = lm_head
        self.logit_scale = logit_scale
        self.softcap = softcap
        # AUTOPATCH_RETURN_LOGITS: "true" real no-grad logits, "auto" a LazyLogits, "false" None
        self.logits_mode = logits_mode
        self.stats = None  # the kernel's side outputs (eager calls)
        self.target_shape = None
        self.through_module = False  # ZeRO-3: the loss runs inside a call of lm_head (its hooks gather it)
        self.chunk_mb = chunk_mb  # FUSED_KERNELS_FLCE_CHUNK_MB (None: the kernel's default)
        self.hidden_states = None
        self.stand_in_logits = None
        self.lm_head_stand_in = LMHeadStandIn(self, lm_head)

    def loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        # `logits` is the stand-in after the forward's own transformations: remembered so that the
        # output can drop it. `vocab_size` is the lm_head's out_features; the weight carries it.
        self.stand_in_logits = logits
        hidden = self.hidden_states
        if hidden is None:
            raise RuntimeError("autopatch fused linear cross entropy: the forward called its loss before self.lm_head")
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
        if hidden.shape[0] != target.shape[0]:
            # what nn.functional.cross_entropy says in the original forward
            raise ValueError(
                f"Expected input batch_size ({hidden.shape[0]}) to match target batch_size ({target.shape[0]})."
            )
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            # nn.Linear under autocast runs in the autocast dtype; the custom op is not autocast-aware
            hidden = hidden.to(torch.get_autocast_dtype(device_type))
        elif hidden.dtype != self.lm_head.weight.dtype:
            raise RuntimeError(
                f"mat1 and mat2 must have the same dtype, but got {hidden.dtype} and {self.lm_head.weight.dtype}"
            )
        if self.through_module:
            # ZeRO-3: the loss runs as lm_head's forward, so DeepSpeed's hooks gather its parameters
            return run_through_module(self.lm_head, hidden, lambda h: self._fused_loss(
                h, target, labels, shift_labels, ignore_index, num_items_in_batch))
        return self._fused_loss(hidden, target, labels, shift_labels, ignore_index, num_items_in_batch)

    def _fused_loss(self, hidden, target, labels, shift_labels, ignore_index, num_items_in_batch):
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if weight.dtype != hidden.dtype:  # autocast
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        fk = kernels()
        stats = None
        if not torch.compiler.is_compiling():
            stats = {"token_loss": None} if self.logits_mode == "false" else {"token_loss": None, "is_top1": None}
            self.stats = stats
            self.target_shape = (labels if shift_labels is None else shift_labels).shape
        return reduce_like_fixed_cross_entropy(
            lambda reduction: fk.fused_linear_cross_entropy(
                hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction,
                softcap=self.softcap, logit_scale=self.logit_scale, chunk_mb=self.chunk_mb, stats=stats,
            ),
            num_items_in_batch,
        )

    def close(self) -> None:
        """Drop what the call holds. The call and its stand-in refer to each other, a cycle that only
        Python's full collections free: left holding the final hidden states, each finished step
        would keep them (and their autograd history: the last norm's output, 128 MiB for a Llama-8B
        batch of 16k tokens) alive until the next full collection, raising every later peak."""
        self.hidden_states = None
        self.stand_in_logits = None
        self.lm_head_stand_in = None
        self.stats = None

    def _lazy_logits(self, stand_in):
        """The LazyLogits for this call's output, or None where it cannot be made (compiling)."""
        hidden = self.hidden_states
        if hidden is None or torch.compiler.is_compiling():
            return None
        lm_head, scale, softcap = self.lm_head, self.logit_scale, self.softcap
        device_type = hidden.device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

        def compute():
            # what lm_head and the forward's transformations give, in the autocast state of the call
            with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
                z = lm_head(hidden)
            if scale != 1.0:
                z = z * scale
            if softcap is not None:
                z = torch.tanh(z / softcap) * softcap
            return z.to(stand_in.dtype)

        shape = (*stand_in.shape[:-1], lm_head.out_features)
        return LazyLogits(shape, stand_in.dtype, stand_in.device, compute)

    def finish_output(self, output):
        """The forward's output with the stand-in logits replaced (AUTOPATCH_RETURN_LOGITS: None, a
        LazyLogits, or kept when real) and the side outputs attached. A tuple keeps its length: every
        later element stays at the position the plain model gives it."""
        stand_in = self.stand_in_logits
        if stand_in is None:
            return output
        if self.logits_mode != "true":
            replacement = self._lazy_logits(stand_in) if self.logits_mode == "auto" else None
            if isinstance(output, tuple):
                return tuple(replacement if x is stand_in else x for x in output)
            # the replacement keeps the logits' place among the fields (to_tuple() order); None drops out
            fields = {k: replacement if v is stand_in else v for k, v in output.items()
                      if v is not stand_in or replacement is not None}
            output = type(output)(**fields)
        if self.stats is not None and not isinstance(output, tuple):
            for key in ("token_loss", "is_top1"):
                value = self.stats.get(key)
                # plain attributes: ModelOutput keeps them out of its keys, so to_tuple() is unchanged
                object.__setattr__(output, key, None if value is None else value.reshape(self.target_shape))
        return output



def _labels_position(forward) -> int | None:
    """Index of `labels` in the positional arguments after self, or None."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "labels" not in positional:
        return None
    return positional.index("labels") - 1  # drop self


def make_forward(original_forward, patch: LossPatch):
    """The class's new forward: the original, with the fused linear CE in training with labels."""
    labels_at = _labels_position(original_forward)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        if "labels" in kwargs:
            labels = kwargs["labels"]
        elif labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        else:
            labels = None
        call = None
        if labels is not None and self.training and torch.is_grad_enabled():
            if not torch.compiler.is_compiling():
                report.count_training_call()
            if patch.fused_linear:
                call = _start_fused_call(self, patch)
        if call is None:
            return original_forward(self, *args, **kwargs)
        setattr(self, CALL_ATTR, call)
        try:
            output = original_forward(self, *args, **kwargs)
            return call.finish_output(output)
        finally:
            setattr(self, CALL_ATTR, None)
            call.close()

    forward.__autopatch_original__ = original_forward
    _WRAPPER_CODES.add(forward.__code__)
    return forward


# --------------------------------------------------------------------------- callers that pass the patch over
# TRL 1.16's trainers never call the patched forward in training: `add_fused_lm_head` replaces the
# instance's forward by one that runs the backbone and TRL's own chunked head over
# `self.get_output_embeddings()` (and distillation projects through `get_output_embeddings()` itself).
# The lm_head property sees that read: in training, with grad, outside a patched forward call. The
# first few such reads per class look up the stack for the first caller that is not torch,
# transformers, accelerate, peft or autopatch, and report it (report.note_bypass).
_WRAPPER_CODES: set = set()
_SKIPPED_CALLERS = ("torch", "transformers", "accelerate", "peft", "autopatch", "deepspeed")
_LOOKS_PER_CLASS = 4
_looks: dict[type, int] = {}
report._on_reset.append(_looks.clear)
# modules of TRL whose head is certain to pass ours over on every call -> what to say
_TRL_HEADS = {
    "trl.trainer.utils": "TRL's own fused LM head computed the loss (trl add_fused_lm_head: the trainer calls "
                         "model(..., fused_lm_head=True), which runs the backbone and TRL's chunked head, not the "
                         "model's forward)",
}


def _outside_caller():
    """(module, function) of the first frame above the lm_head read that is not one of
    _SKIPPED_CALLERS, or None when the read comes from a patched forward (its own code)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _WRAPPER_CODES:
            return None
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] not in _SKIPPED_CALLERS:
            return module, frame.f_code.co_name
        frame = frame.f_back
    return None


def _look_for_bypass(model) -> None:
    cls = type(model)
    seen = _looks.get(cls, 0)
    if seen >= _LOOKS_PER_CLASS:
        return
    _looks[cls] = seen + 1
    caller = _outside_caller()
    if caller is None:
        return
    module, function = caller
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    if module in _TRL_HEADS:
        why, certain = _TRL_HEADS[module], True
    elif module.partition(".")[0] == "trl":
        why, certain = (f"TRL's own head computed the loss ({module}.{function} projects the hidden states "
                        "through get_output_embeddings() itself)"), True
    else:
        why, certain = f"{module}.{function} read lm_head in training outside the model's forward", False
    _looks[cls] = _LOOKS_PER_CLASS  # one report per class
    report.note_bypass("fused_linear_cross_entropy", cls.__name__, why, model_type, certain=certain)


def _start_fused_call(model, patch: LossPatch):
    """A FusedLinearLossCall when the fused path applies to this call, else None (the original
    forward runs, with the fused CE if that kernel is on)."""
    if patch.base_loss_property.fget(model) is not _original_causal_lm_loss():
        return None  # a user-set loss_function or a config loss_type other than ForCausalLM
    lm_head = model._modules.get("lm_head")
    through_module = zero3_partitioned(lm_head)
    if through_module:
        if not zero3_can_gather(lm_head, model):
            return None  # said once: the model's own head (its hooks gather it) and loss run
    elif not _probe.plain_linear(lm_head):
        _notice_once(
            "fused_linear_cross_entropy",
            f"{type(model).__name__}.lm_head is not a plain nn.Linear here (a subclass, hooks, accelerate "
            "or FSDP wrapping); lm_head and the loss run as the model defines them", model,
        )
        return None
    if lm_head.weight.dtype not in KERNEL_DTYPES:
        _notice_once(
            "fused_linear_cross_entropy",
            f"lm_head weight of dtype {lm_head.weight.dtype}; lm_head and the loss run as the model defines them",
            model,
        )
        return None
    if not kernels().triton_can_run(lm_head.weight):
        if not torch.compiler.is_compiling():
            report.fallback_notice("fused_linear_cross_entropy", f"lm_head weight on {lm_head.weight.device.type}")
        return None
    values = logit_transform_values(model, patch.transforms)
    if values is None:
        _notice_once(
            "fused_linear_cross_entropy",
            f"{type(model).__name__}: a logits scale or softcap is not a plain number; lm_head and the loss "
            "run as the model defines them", model,
        )
        return None
    call = FusedLinearLossCall(lm_head, logit_scale=values[0], softcap=values[1], logits_mode=return_logits_mode(),
                               chunk_mb=flce_chunk_mb())
    call.through_module = through_module
    return call


# --------------------------------------------------------------------------- DeepSpeed ZeRO-3
# Under ZeRO-3 every parameter is partitioned: outside its module's forward, `lm_head.weight` is an
# empty tensor (ds_status NOT_AVAILABLE; the full size in ds_numel), gathered by the hooks DeepSpeed
# puts on the module only while the module itself runs. A fused loss that read lm_head.weight inside
# the model's forward without calling lm_head would read that empty tensor. So the fused loss runs as
# lm_head's forward for one call (an instance `forward` set and removed around `lm_head(hidden)`):
# DeepSpeed's pre-forward hook gathers the weight and bias, the kernel computes the loss and every
# gradient with them, the post-forward hook releases them and hooks the loss so that the backward
# gathers them again before the gradients are accumulated, exactly as for the model's own lm_head
# call (DeepSpeed's gradient hooks then reduce-scatter the full-shape gradient). Its prefetch trace
# sees lm_head called where the model calls it. Where that cannot be done (hooks that are not
# DeepSpeed's, no DeepSpeed hook at all, an lm_head subclass), the model's own lm_head and loss run,
# with one notice: never a loss over an empty weight.


def zero3_partitioned(lm_head) -> bool:
    """Whether lm_head's weight is a ZeRO-3 partitioned parameter (the attributes DeepSpeed sets)."""
    weight = getattr(lm_head, "weight", None)
    return all(hasattr(weight, name) for name in ("ds_id", "ds_status", "ds_numel"))


def zero3_can_gather(lm_head, model=None) -> bool:
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
    _notice_once(
        "fused_linear_cross_entropy",
        f"lm_head is a ZeRO-3 partitioned parameter but {why}; lm_head and the loss run as the model defines them",
        model,
    )
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


_mode_read: list[str] = []


def return_logits_mode() -> str:
    """AUTOPATCH_RETURN_LOGITS ("auto", "true" or "false"): from the settings the import hooks loaded,
    else read once from the environment (autopatch.apply without the hooks)."""
    from autopatch import hooks

    settings = hooks.active_settings()
    if settings is not None:
        return settings.return_logits
    if not _mode_read:
        from autopatch.config import load_settings

        _mode_read.append(load_settings().return_logits)
    return _mode_read[0]


_chunk_read: list = []


def flce_chunk_mb():
    """FUSED_KERNELS_FLCE_CHUNK_MB (MiB, or None for the kernel's default): from the settings the import
    hooks loaded, else read once from the environment (autopatch.apply without the hooks)."""
    from autopatch import hooks

    settings = hooks.active_settings()
    if settings is not None:
        return settings.flce_chunk_mb
    if not _chunk_read:
        from autopatch.config import load_settings

        _chunk_read.append(load_settings().flce_chunk_mb)
    return _chunk_read[0]


def keep_logits() -> bool:
    """Whether a fused training call returns the real logits at once (AUTOPATCH_RETURN_LOGITS=true).
    auto returns a LazyLogits instead (see the module docstring)."""
    return return_logits_mode() == "true"


class LazyLogits(torch.Tensor):
    """The logits of a fused training call, computed only when read.

    A tensor subclass with the logits' shape, dtype and device but no storage. Metadata reads (shape,
    dtype, device, size(), dim(), requires_grad) and repr() compute nothing; any other use (an op, a
    method, indexing) computes the real logits once (lm_head over the call's final hidden states,
    then the forward's scale and softcap; with a graph when grad is enabled, so a loss built on them
    back-propagates as on the plain model's), says so once per process on stderr, and runs on them.
    `materialize()` gives them as a plain tensor. Holding a LazyLogits keeps the final hidden states
    (and their graph) alive, as the plain model's logits would keep theirs."""

    @staticmethod
    def __new__(cls, shape, dtype, device, compute):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t._compute = compute
        t._value = None
        return t

    def materialize(self) -> torch.Tensor:
        if self._value is None:
            _notice_once(
                "fused_linear_cross_entropy",
                "a fused training call's logits were read, so they were computed (tokens x vocab memory); "
                "outputs.token_loss and outputs.is_top1 give per-token losses and top-1 without them, "
                "AUTOPATCH_RETURN_LOGITS=false returns None instead",
            )
            self._value = self._compute()
            self._compute = None
        return self._value

    def __repr__(self, *, tensor_contents=None):
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, computed={self._value is not None})"

    def _lazy_cast(self, dtype):
        """A LazyLogits of another dtype over the same computation (accelerate's mixed-precision wrapper
        calls .float() on every bf16 tensor of an output; that alone must not compute the logits)."""
        if dtype == self.dtype:
            return self
        return LazyLogits(self.shape, dtype, self.device, lambda: self.materialize().to(dtype))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LAZY_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.detach and len(args) == 1 and not kwargs and args[0]._value is None:
            # DeepSpeed ZeRO-3 passes every output tensor of a module through an autograd function
            # whose forward is `outputs.detach()`; that alone must not compute the logits (it would
            # run lm_head inside DeepSpeed's hook)
            parent = args[0]
            return LazyLogits(parent.shape, parent.dtype, parent.device, lambda: parent.materialize().detach())
        if func in _LAZY_CASTS and isinstance(args[0], LazyLogits) and args[0]._value is None:
            dtype = _cast_dtype(func, args[1:], kwargs)
            if dtype is not None:
                return args[0]._lazy_cast(dtype)
        from torch.utils._pytree import tree_map

        def real(x):
            return x.materialize() if isinstance(x, LazyLogits) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs))


    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only by code below torch functions (C++ callers); __torch_function__ handles Python's
        from torch.utils._pytree import tree_map

        def real(x):
            return x.materialize().detach() if isinstance(x, LazyLogits) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))


_LAZY_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
               torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64, torch.Tensor.to: None}


def _cast_dtype(func, args, kwargs):
    """The dtype a cast asks for, or None when it does more than change the dtype (a device, a copy,
    a memory format: then the logits are computed)."""
    fixed = _LAZY_CASTS[func]
    if fixed is not None:
        return fixed if not args and not kwargs else None
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype):
        return args[0]
    if not args and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    return None


_LAZY_METADATA = {torch.Tensor.size, torch.Tensor.dim} | {
    getattr(torch.Tensor, name).__get__
    for name in ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf", "grad_fn",
                 "is_sparse", "is_quantized", "is_meta", "is_nested")
}


_noticed: set[str] = set()


def _notice_once(kernel: str, detail: str, model=None) -> None:
    """One stderr line per distinct reason a fused loss did not apply for reasons other than where
    Triton runs (report.fallback_notice covers those). Skipped while torch.compile traces: printing
    would break the graph. With `model` (a fused call that falls back), the reason is also the exit
    check's answer if the fused loss never runs (report.note_bypass)."""
    if torch.compiler.is_compiling() or detail in _noticed:
        return
    _noticed.add(detail)
    if model is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
        report.note_bypass(kernel, type(model).__name__, f"the patched forward fell back: {detail}", model_type,
                           fallback=True)
    report.say(f"autopatch: {kernel}: {detail}")


def make_lm_head_property():
    """`lm_head` as nn.Module.__getattr__ would find it (in _modules, or a plain attribute such as
    None), except during a fused call. Assigning a module still goes to _modules, since
    nn.Module.__setattr__ handles modules before any descriptor; anything else is stored as a plain
    attribute, as nn.Module would."""

    def lm_head(self):
        call = getattr(self, CALL_ATTR)
        if call is not None:
            return call.lm_head_stand_in
        if (not torch.compiler.is_compiling() and self.training and torch.is_grad_enabled()
                and _looks.get(type(self), 0) < _LOOKS_PER_CLASS):
            _look_for_bypass(self)
        modules = self.__dict__.get("_modules")
        if modules is not None and "lm_head" in modules:
            return modules["lm_head"]
        if "lm_head" in self.__dict__:
            return self.__dict__["lm_head"]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute 'lm_head'")

    def set_lm_head(self, value):
        self.__dict__["lm_head"] = value

    def del_lm_head(self):
        self.__dict__.pop("lm_head", None)

    return property(lm_head, set_lm_head, del_lm_head,
                    doc="lm_head, or the fused-loss stand-in during a fused training call (autopatch)")


def make_loss_function_property(patch: LossPatch):
    base = patch.base_loss_property

    def loss_function(self):
        call = getattr(self, CALL_ATTR)
        if call is not None:
            return call.loss
        resolved = base.fget(self)
        if patch.cross_entropy and resolved is _original_causal_lm_loss():
            return fused_causal_lm_loss
        return resolved

    def set_loss_function(self, value):
        base.fset(self, value)

    return property(loss_function, set_loss_function, doc=base.__doc__)
