"""The state of autopatch in one process: a leaf module, importing nothing else of the runtime.

A `Session` holds what autopatch decided and what it saw happen:
  - `settings`: the validated autopatch.config.Settings it was started with (None for a session
    that apply() created without start-up having run);
  - `records`: every patch and every refusal (`Record`), in order;
  - run counters: the calls a rule counted itself (`count_call`) and those where its patched code
    chose the original (`count_original`), the training calls and optimizer steps, per kernel the
    first time a patched component had to run the original code (`note_fallback`) and what passed a
    patch over (`note_bypass`);
  - `replaced`: our forwards that something else replaced after we patched them (Liger, Hub
    `kernels.kernelize`, a user's monkeypatch), with what replaced them (`note_replaced`);
  - `built`: the modeling modules whose classes a built model uses (strict mode and the exit check
    judge those, not every module a library happened to import);
  - `meta["hub_kernels"]`: per Hub layer name and class, what runs (autopatch.hub, autopatch.hub_layers);
  - `strict`, and `exit_status` (what the process should end with, once decided).

Start-up (autopatch.hooks) and apply() make the one process session through `begin()` / `current()`
and pass it to the rules; patched forwards keep the session they were made with. Rendering (the
stderr line, JSON, doctor's table) is autopatch.report's; printing a notice is `say()` here, so that
a rule's run-time notice needs nothing else of the runtime.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref


@dataclasses.dataclass(frozen=True)
class Record:
    """One verdict of a rule on one target."""

    kernel: str  # kernel name, e.g. "rms_norm"
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    target: str  # e.g. "LlamaRMSNorm" or "apply_rotary_pos_emb" or "LlamaForCausalLM.forward"
    patched: bool
    variant: str = ""  # detected variant when patched, e.g. "offset=1 casting=gemma"
    reason: str = ""  # why it was left alone, when not patched
    # how often the kernel's patched path ran in this process (per kernel, not per target): filled in
    # by applied() and the JSON report; None where nothing is counted or for a record not patched.
    # Not part of equality.
    runs: int | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if out["runs"] is None:
            del out["runs"]  # not filled in: the JSON report gives the counts per kernel ("runs")
        return out


class StrictModeError(RuntimeError):
    """AUTOPATCH_STRICT is on and autopatch could not do what was asked: an enabled kernel's
    candidate was left alone in a model that was built, a patched component had to run the original
    code, or something replaced a patched forward."""


def say(line: str) -> None:
    """Print one notice line on stderr, on a line of its own. While a tqdm progress bar is on screen
    (a training loop's, usually on stderr too), a plain print would land in the middle of the bar's
    line: tqdm.write clears the bars, prints the line and draws them again below it."""
    std = sys.modules.get("tqdm.std")
    bar_class = getattr(std, "tqdm", None)
    if bar_class is not None and getattr(bar_class, "_instances", None):
        try:
            bar_class.write(line, file=sys.stderr)
            sys.stderr.flush()
            return
        except Exception:  # noqa: BLE001 - tqdm's own trouble: print plainly
            pass
    print(line, file=sys.stderr, flush=True)


class Session:
    """What autopatch decided and saw in this process (see the module docstring)."""

    def __init__(self, settings=None, *, strict: bool | None = None):
        self.settings = settings
        self.strict = bool(getattr(settings, "strict", False)) if strict is None else bool(strict)
        self.lock = threading.RLock()
        self.records: list[Record] = []
        self.calls: dict[str, int] = {}
        self.originals: dict[str, int] = {}  # kernel -> calls its patched code gave to the original
        self.trained = {"optimizer_steps": 0, "training_calls": 0}
        self.bypassed: dict[str, dict] = {}
        self.fallbacks: dict[str, str] = {}  # kernel -> the first fallback's detail
        self.replaced: dict[tuple[str, str], str] = {}  # (kernel, class) -> what runs instead
        self.built: dict[str, list[str]] = {}  # modeling module -> model classes built from it
        self.pending: dict[str, str] = {}  # modeling module -> its stderr line, said when a model is built
        # the models built while the session held (the audit's exit pass) -> the training mode last audited
        self.models = weakref.WeakKeyDictionary()
        self.installed: set[str] = set()  # what start-up installed for this session (exit check, hooks)
        self.said: set[str] = set()  # one-time notices already said (replacements, a Liger conflict)
        self.meta: dict = {}
        self.exit_status: int | None = None
        self._on_reset: list = []

    # ------------------------------------------------------------------ records
    def add(self, records) -> None:
        with self.lock:
            self.records.extend(records)

    def all_records(self) -> list[Record]:
        with self.lock:
            return list(self.records)

    def clear(self) -> None:
        with self.lock:
            self.records.clear()

    # ------------------------------------------------------------------ what ran
    def count_call(self, kernel: str, n: int = 1) -> None:
        """A patched path ran `n` times (for components whose fused path is not one kernel launch,
        or whose launches carry another op's name)."""
        with self.lock:
            self.calls[kernel] = self.calls.get(kernel, 0) + n

    def count_original(self, kernel: str, n: int = 1) -> None:
        """A patched component chose the original code for `n` calls (a per-call check, as lora_input's:
        the exit check says so when these outnumber count_call's)."""
        with self.lock:
            self.originals[kernel] = self.originals.get(kernel, 0) + n

    def count_training_call(self) -> None:
        """A patched model was called in training mode with labels (grad enabled)."""
        with self.lock:
            self.trained["training_calls"] += 1

    def count_optimizer_step(self) -> None:
        with self.lock:
            self.trained["optimizer_steps"] += 1

    def note_fallback(self, kernel: str, detail: str) -> bool:
        """A patched component is about to run the original code (`detail`: why). Raises
        StrictModeError in strict mode; otherwise returns True the first time per kernel (the caller
        says one notice)."""
        with self.lock:
            first = kernel not in self.fallbacks
            if first:
                self.fallbacks[kernel] = detail
        if self.strict:
            raise StrictModeError(
                f"autopatch (AUTOPATCH_STRICT): {kernel}: {detail}; the original code would run instead. "
                "Run on CUDA tensors or with TRITON_INTERPRET=1, turn the kernel off, or unset AUTOPATCH_STRICT."
            )
        return first

    def note_bypass(self, kernel: str, target: str, why: str, model_type: str = "", *, certain: bool = False,
                    fallback: bool = False) -> dict:
        """The component a patch replaced was passed over (`why`: who and how), kept for the exit
        check: per kernel the strongest seen, a `certain` bypass (on every call) before a `fallback`
        (the patched code itself chose the original) before anything else, the first of each.
        In strict mode a `certain` bypass raises StrictModeError naming the override. Returns the kept
        entry."""
        rank = 2 if certain else 1 if fallback else 0
        with self.lock:
            if kernel not in self.bypassed or rank > self.bypassed[kernel]["rank"]:
                self.bypassed[kernel] = {"why": why, "target": target, "model_type": model_type,
                                         "certain": certain, "rank": rank}
            kept = self.bypassed[kernel]
            if certain and self.strict:
                kept["raised"] = True  # said by the exception: the exit check stays quiet
        if certain and self.strict:
            where = (f"AUTOPATCH_MODELS__{model_type}__{kernel.upper()}=false" if model_type
                     else f"AUTOPATCH_{kernel.upper()}=false")
            raise StrictModeError(
                f"AUTOPATCH_STRICT: {kernel} is patched on {target} but the patched code was passed over: {why}. "
                f"To train this way, turn the kernel off for this model ({where}, or {kernel}=False in "
                "autopatch.apply), or unset AUTOPATCH_STRICT.")
        return kept

    def note_model(self, model, mode=None) -> bool:
        """A model was built or audited in training mode `mode` (kept by a weak reference for the exit
        audit); True the first time for that model and mode."""
        with self.lock:
            try:
                if model in self.models and self.models[model] == mode:
                    return False
                self.models[model] = mode
            except TypeError:  # not weak-referenceable or not hashable: nothing to keep
                return True
            return True

    def say_once(self, key: str, line: str) -> bool:
        """say(line) unless a line under `key` was said already in this session; True if said."""
        with self.lock:
            if key in self.said:
                return False
            self.said.add(key)
        say(line)
        return True

    def note_replaced(self, kernel: str, target: str, by: str) -> bool:
        """Our patched forward of `target` (a class name) was replaced after we patched it; `by` says
        what runs instead. True the first time for that (kernel, target)."""
        with self.lock:
            key = (kernel, target)
            first = key not in self.replaced
            if first:
                self.replaced[key] = by
            return first

    def note_built(self, model_class: str, modules) -> list[str]:
        """A model of class `model_class` was built from classes of these modeling modules; returns
        the modules seen for the first time."""
        new = []
        with self.lock:
            for module in modules:
                classes = self.built.setdefault(module, [])
                if not classes:
                    new.append(module)
                if model_class not in classes:
                    classes.append(model_class)
        return new

    def reset_runs(self) -> None:
        """Forget the counted calls, training, fallbacks, bypasses and replacements (tests)."""
        with self.lock:
            self.calls.clear()
            self.originals.clear()
            self.bypassed.clear()
            self.fallbacks.clear()
            self.replaced.clear()
            self.said.clear()
            self.trained.update(optimizer_steps=0, training_calls=0)
            callbacks = list(self._on_reset)
        for callback in callbacks:
            callback()

    def on_reset(self, callback) -> None:
        """Call `callback()` on reset_runs (a rule's own per-class look-ups)."""
        with self.lock:
            self._on_reset.append(callback)


_current: Session | None = None
_current_lock = threading.Lock()


def current() -> Session:
    """The process's session; a plain one (no settings, not strict) when nothing began one yet."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Session()
        return _current


def begin(settings) -> Session:
    """Make the process's session hold `settings` (start-up, apply()): the records and counters of a
    session already begun are kept, its settings and strict policy updated. Returns it."""
    session = current()
    with session.lock:
        session.settings = settings
        session.strict = bool(getattr(settings, "strict", False))
    return session


def started() -> Session | None:
    """The process's session if one was made, else None (never makes one)."""
    return _current
