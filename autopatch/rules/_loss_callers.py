"""Callers that pass the patched forward over.

TRL 1.16's trainers never call the patched forward in training: `add_fused_lm_head` replaces the
instance's forward by one that runs the backbone and TRL's own chunked head over
`self.get_output_embeddings()` (and distillation projects through `get_output_embeddings()` itself).
The lm_head property sees that read: in training, with grad, outside a patched forward call. Such a
read looks up the stack for the first caller that is not torch, transformers, accelerate, peft or
autopatch.

Most reads of lm_head compute nothing: weight tying when a model is built (in training mode, from a
config or in from_pretrained), get_output_embeddings() in peft's wrapping (target_modules="all-linear",
modules_to_save), get_submodule, a user's check or log line. A read alone therefore proves nothing,
and the bypass is reported (Session.note_bypass) only where training went on without our forward:
  - a read from inside TRL's fused head (_TRL_HEADS) is that head computing the loss: said at once;
  - any other outside read is a suspect. It is said only when a later outside read finds that an
    optimizer step passed since the suspect while the patched forward of that class was not called
    in training with labels and the fused kernel did not run (so the loss of that step was computed
    elsewhere). A patched forward called in training with labels in between (our fused loss ran, or
    a fallback said why not), or a launch of the fused kernel (the count a compiled forward, which
    counts no calls, still keeps), clears the suspect: what was read was not the loss's way.
So a loop that takes logits from lm_head itself over two optimizer steps is named; a harmless read
before or during training whose loss goes through the patched forward never is.

Cost: a stack walk (a few frames) per looked-at read, at most WALKS_PER_STEP per class per optimizer
step; none once a bypass is said.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref

from autopatch.names import FORWARD_OPS
from autopatch.report import launch_counts

WRAPPER_CODES: set = set()  # the code objects of the patched forwards (autopatch.rules._flce_call.make_forward)
_SKIPPED_CALLERS = ("torch", "transformers", "accelerate", "peft", "autopatch", "deepspeed")
WALKS_PER_STEP = 8  # stack walks per class per optimizer step (the reads of one step are alike)
_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Session -> {class: ClassWatch}
_watches_lock = threading.Lock()
# modules of TRL whose head is certain to pass ours over on every call -> what to say
_TRL_HEADS = {
    "trl.trainer.utils": "TRL's own fused LM head computed the loss (trl add_fused_lm_head: the trainer calls "
                         "model(..., fused_lm_head=True), which runs the backbone and TRL's chunked head, not the "
                         "model's forward)",
}


@dataclasses.dataclass
class Suspect:
    """An outside read of lm_head in training not yet shown to pass the patched forward over."""

    step: int  # the session's optimizer steps at the read
    losses: tuple  # loss_marks() at the read


@dataclasses.dataclass
class ClassWatch:
    """What the lm_head reads of one patched class showed in one session."""

    training_calls: int = 0  # patched forward called in training with labels, grad on
    suspect: Suspect | None = None
    walk_step: int = -1  # the optimizer step of the last stack walk
    walks: int = 0  # stack walks in that step
    settled: bool = False  # the bypass was said: nothing more to look at


def watches(session) -> dict:
    """The session's ClassWatch per patched class (forgotten on Session.reset_runs)."""
    with _watches_lock:
        found = _watches.get(session)
        if found is None:
            found = _watches[session] = {}
            session.on_reset(found.clear)
    return found


def _watch(session, cls) -> ClassWatch:
    found = watches(session)
    watch = found.get(cls)
    if watch is None:
        watch = found[cls] = ClassWatch()
    return watch


def _optimizer_steps(session) -> int:
    return session.trained["optimizer_steps"]


def _fused_launches() -> int:
    launched = launch_counts()
    return sum(launched.get(op, 0) for op in FORWARD_OPS["fused_linear_cross_entropy"])


def loss_marks(watch) -> tuple:
    """What changes whenever a loss goes through the patched forward: the class's training calls
    (eager) and the fused kernel's forward launches in the process (eager or compiled)."""
    return watch.training_calls, _fused_launches()


def note_training_call(session, cls) -> None:
    """The patched forward of `cls` was called in training with labels and grad on: the loss goes
    through it (fused, or the original after a fallback that says why), so no read so far passed it over."""
    _watch(session, cls).training_calls += 1


def wants_look(session, cls) -> bool:
    """Whether an lm_head read of `cls` in training, outside a fused call, is worth a stack walk."""
    watch = _watch(session, cls)
    if watch.settled:
        return False
    step = _optimizer_steps(session)
    return watch.walk_step != step or watch.walks < WALKS_PER_STEP


def _outside_caller():
    """(module, function) of the first frame above the lm_head read that is not one of
    _SKIPPED_CALLERS, or None when the read comes from a patched forward (its own code)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in WRAPPER_CODES:
            return None
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] not in _SKIPPED_CALLERS:
            return module, frame.f_code.co_name
        frame = frame.f_back
    return None


def look_for_bypass(model, session) -> None:
    """An lm_head read of a patched model in training, outside a fused call (see the module docstring):
    keep an outside reader as a suspect, and say the bypass (Session.note_bypass) once an optimizer
    step went by without the patched forward computing a loss."""
    cls = type(model)
    watch = _watch(session, cls)
    step = _optimizer_steps(session)
    if watch.walk_step != step:
        watch.walk_step, watch.walks = step, 0
    watch.walks += 1
    caller = _outside_caller()
    if caller is None:
        return
    module, function = caller
    if module in _TRL_HEADS:
        _say(model, session, watch, _TRL_HEADS[module], certain=True)
        return
    suspect, losses = watch.suspect, loss_marks(watch)
    if suspect is None or suspect.losses != losses:
        watch.suspect = Suspect(step, losses)
        return
    if step == suspect.step:
        return  # no optimizer step since: nothing shows yet that the loss went elsewhere
    if module.partition(".")[0] == "trl":
        why, certain = (f"TRL's own head computed the loss ({module}.{function} projects the hidden states "
                        "through get_output_embeddings() itself)"), True
    else:
        why, certain = (f"{module}.{function} read lm_head in training outside the model's forward, and "
                        "an optimizer step passed without the model's forward being called with labels"), False
    _say(model, session, watch, why, certain=certain)


def _say(model, session, watch: ClassWatch, why: str, certain: bool) -> None:
    watch.settled = True  # one report per class
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    session.note_bypass("fused_linear_cross_entropy", type(model).__name__, why, model_type, certain=certain)
