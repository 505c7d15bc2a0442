"""Callers that pass the patched forward over.

TRL 1.16's trainers never call the patched forward in training: `add_fused_lm_head` replaces the
instance's forward by one that runs the backbone and TRL's own chunked head over
`self.get_output_embeddings()` (and distillation projects through `get_output_embeddings()` itself).
The lm_head property sees that read: in training, with grad, outside a patched forward call. The
first few such reads per class look up the stack for the first caller that is not torch,
transformers, accelerate, peft or autopatch, and report it (Session.note_bypass).
"""

from __future__ import annotations

import sys
import threading
import weakref

WRAPPER_CODES: set = set()  # the code objects of the patched forwards (autopatch.rules._flce_call.make_forward)
_SKIPPED_CALLERS = ("torch", "transformers", "accelerate", "peft", "autopatch", "deepspeed")
LOOKS_PER_CLASS = 4
_looks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Session -> {class: lm_head reads looked at}
_looks_lock = threading.Lock()
# modules of TRL whose head is certain to pass ours over on every call -> what to say
_TRL_HEADS = {
    "trl.trainer.utils": "TRL's own fused LM head computed the loss (trl add_fused_lm_head: the trainer calls "
                         "model(..., fused_lm_head=True), which runs the backbone and TRL's chunked head, not the "
                         "model's forward)",
}


def looks(session) -> dict:
    """The session's lm_head reads looked at so far per class (forgotten on Session.reset_runs)."""
    with _looks_lock:
        found = _looks.get(session)
        if found is None:
            found = _looks[session] = {}
            session.on_reset(found.clear)
    return found


def wants_look(session, cls) -> bool:
    return looks(session).get(cls, 0) < LOOKS_PER_CLASS


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
    """An lm_head read of a patched model in training, outside a fused call: if the reader is outside
    the model's forward, say who passed the patched forward over (Session.note_bypass)."""
    cls = type(model)
    seen_by_class = looks(session)
    seen = seen_by_class.get(cls, 0)
    if seen >= LOOKS_PER_CLASS:
        return
    seen_by_class[cls] = seen + 1
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
    seen_by_class[cls] = LOOKS_PER_CLASS  # one report per class
    session.note_bypass("fused_linear_cross_entropy", cls.__name__, why, model_type, certain=certain)
