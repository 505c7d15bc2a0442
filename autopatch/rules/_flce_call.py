"""The fused linear cross entropy call: the `*ForCausalLM` forward in training through
fused_kernels.fused_linear_cross_entropy (the loss swap itself, ForCausalLMLoss through
fused_kernels.cross_entropy, is autopatch.rules._loss_ce's).

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
AUTOPATCH_RETURN_LOGITS (the session's settings.return_logits):
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

import functools
import inspect
import numbers

import torch

from autopatch.rules._causal_lm_source import resolve_attribute
from autopatch.rules._kernels import fallback, kernels, notice
from autopatch.rules._lazy_logits import LazyLogits
from autopatch.rules._loss_callers import WRAPPER_CODES, look_for_bypass, note_training_call, wants_look
from autopatch.rules._loss_ce import (
    CALL_ATTR, KERNEL_DTYPES, LossPatch, original_causal_lm_loss, reduce_like_fixed_cross_entropy, shifted_targets,
)
from autopatch.rules._probe import plain_linear
from autopatch.rules._zero3 import run_through_module, zero3_can_gather, zero3_partitioned

FLCE = "fused_linear_cross_entropy"


def return_logits_mode(session) -> str:
    """AUTOPATCH_RETURN_LOGITS ("auto", "true" or "false") from the session's settings ("auto" without)."""
    return getattr(session.settings, "return_logits", None) or "auto"


def flce_chunk_mb(session):
    """FUSED_KERNELS_FLCE_CHUNK_MB (MiB) from the session's settings; None: the kernel's default."""
    return getattr(session.settings, "flce_chunk_mb", None)


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

    def __init__(self, lm_head, logit_scale, softcap, logits_mode="false", chunk_mb=None, session=None):
        self.session = session  # where the lazy logits' notice goes
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
        lm_head, scale, softcap, session = self.lm_head, self.logit_scale, self.softcap, self.session
        device_type = hidden.device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

        def compute():
            if session is not None:
                notice(session, FLCE,
                       "a fused training call's logits were read, so they were computed (tokens x vocab memory); "
                       "outputs.token_loss and outputs.is_top1 give per-token losses and top-1 without them, "
                       "AUTOPATCH_RETURN_LOGITS=false returns None instead")
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
                patch.session.count_training_call()
                note_training_call(patch.session, type(self))  # lm_head reads so far did not pass it over
            if patch.fused_linear:
                call = start_fused_call(self, patch)
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
    WRAPPER_CODES.add(forward.__code__)
    return forward


def start_fused_call(model, patch: LossPatch):
    """A FusedLinearLossCall when the fused path applies to this call, else None (the original
    forward runs, with the fused CE if that kernel is on)."""
    session = patch.session
    if patch.base_loss_property.fget(model) is not original_causal_lm_loss():
        return None  # a user-set loss_function or a config loss_type other than ForCausalLM
    lm_head = model._modules.get("lm_head")
    through_module = zero3_partitioned(lm_head)
    if through_module:
        if not zero3_can_gather(lm_head, session, model):
            return None  # said once: the model's own head (its hooks gather it) and loss run
    elif not plain_linear(lm_head):
        notice(session, FLCE,
               f"{type(model).__name__}.lm_head is not a plain nn.Linear here (a subclass, hooks, accelerate "
               "or FSDP wrapping); lm_head and the loss run as the model defines them", model)
        return None
    if lm_head.weight.dtype not in KERNEL_DTYPES:
        notice(session, FLCE,
               f"lm_head weight of dtype {lm_head.weight.dtype}; lm_head and the loss run as the model defines them",
               model)
        return None
    if not kernels().triton_can_run(lm_head.weight):
        if not torch.compiler.is_compiling():
            fallback(session, FLCE, f"lm_head weight on {lm_head.weight.device.type}")
        return None
    values = logit_transform_values(model, patch.transforms)
    if values is None:
        notice(session, FLCE,
               f"{type(model).__name__}: a logits scale or softcap is not a plain number; lm_head and the loss "
               "run as the model defines them", model)
        return None
    call = FusedLinearLossCall(lm_head, logit_scale=values[0], softcap=values[1],
                               logits_mode=return_logits_mode(session), chunk_mb=flce_chunk_mb(session),
                               session=session)
    call.through_module = through_module
    return call


def make_lm_head_property(session):
    """`lm_head` as nn.Module.__getattr__ would find it (in _modules, or a plain attribute such as
    None), except during a fused call. Assigning a module still goes to _modules, since
    nn.Module.__setattr__ handles modules before any descriptor; anything else is stored as a plain
    attribute, as nn.Module would."""

    def lm_head(self):
        call = getattr(self, CALL_ATTR)
        if call is not None:
            return call.lm_head_stand_in
        if (not torch.compiler.is_compiling() and self.training and torch.is_grad_enabled()
                and wants_look(session, type(self))):
            look_for_bypass(self, session)
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
