"""What the process's Session does over its life: the start-up side of autopatch (autopatch.hooks
and autopatch.apply call here; autopatch.report only renders).

  begin(settings)       the session holds the settings (looked up once, by the caller); once per
                        process: torch's global optimizer-step hook (did this process train?) and the
                        exit check (audit the models built, say the exit verdict, write
                        AUTOPATCH_REPORT, end with exit code 2 in strict mode when something failed)
  patch_module(...)     the rules over one modeling module; its summary line waits for a model
  model_built(model)    from PreTrainedModel.post_init: say the waiting lines of the model's modules,
                        judge them in strict mode, audit the model (autopatch.audit), and audit it
                        again at train()/eval() and before its first training forward
  stop(message)         one line and exit code 2, from wherever the program cannot go on

Strict mode judges what was built and run: a modeling module that a library imported for its
constants (peft imports modeling_bloom) is never judged, only the modules a built model uses.
"""

from __future__ import annotations

import os
import sys

from autopatch import audit, offload, report
from autopatch import session as sessions
from autopatch.names import KERNEL_NAMES, NOT_PROVIDED, is_model_module
from autopatch.session import Record, Session, StrictModeError, say

EXIT_CODE = 2


# --------------------------------------------------------------------------- begin
def begin(settings, *, source: str = "FUSED_KERNELS") -> Session:
    """Make the process session hold `settings`; install (once) the training watch and the exit check;
    record the Liger keys asked for that have no kernel here. Returns the session."""
    session = sessions.begin(settings)
    note_not_provided(session, sorted(getattr(settings, "not_provided", ()) or ()), source)
    with session.lock:
        first = "exit" not in session.installed
        session.installed.add("exit")
    if first:
        import atexit

        atexit.register(at_exit, session)
        _say_strict_errors_in_one_line()
    watch_training(session)
    return session


def _say_strict_errors_in_one_line() -> None:
    """An uncaught StrictModeError (a patched component that had to fall back, a certain bypass) ends
    the program with its one line and exit code 2, not a traceback through autopatch's code; every
    other exception goes to the hook that was there."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if isinstance(value, StrictModeError):
            say(str(value))
            session = sessions.started()
            if session is not None:
                session.exit_status = EXIT_CODE
                write_report(session)
            exit_now(EXIT_CODE)
        previous(kind, value, traceback)

    sys.excepthook = excepthook


def note_not_provided(session: Session, kernels, source: str) -> list[Record]:
    """One Record per kernel key that is accepted but has no kernel here (Liger's relu_squared), added
    once per process and key; returns them."""
    out = []
    for kernel in kernels:
        record = Record(kernel=kernel, module="*", target=kernel, patched=False,
                        reason=f"not provided here: {NOT_PROVIDED[kernel]} (asked for by {source})")
        if record not in session.all_records():
            session.add([record])
        out.append(record)
    return out


def watch_training(session: Session, optimizer_module=None) -> bool:
    """Count optimizer steps (any torch.optim optimizer, through torch's global post-step hook), so
    the exit check knows whether this process trained. Once per session; never raises. Only where
    torch.optim is imported already (or given): importing torch costs a second, and
    `import transformers` does not import it; the hooks call this again when torch.optim is imported.
    Returns whether the hook is in place."""
    module = optimizer_module or sys.modules.get("torch.optim.optimizer")
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None:
        return False
    with session.lock:
        if "optimizer" in session.installed:
            return True
        session.installed.add("optimizer")
    try:
        register(lambda optimizer, args, kwargs: session.count_optimizer_step())
    except Exception:  # noqa: BLE001 - an old torch without the global hook: training calls still count
        return False
    return True


# --------------------------------------------------------------------------- one modeling module
def model_types_of(module) -> list[str]:
    """The model_type(s) of a modeling module: those of the config classes defined in its package's
    configuration_* modules (gemma3 -> gemma3, gemma3_text), else the package's folder name."""
    package = module.__name__.rpartition(".")[0]
    prefix = package + ".configuration_"
    types: list[str] = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == name:
                model_type = getattr(obj, "model_type", None)
                if isinstance(model_type, str) and model_type and model_type not in types:
                    types.append(model_type)
    return types or [package.rpartition(".")[2]]


def enabled_in(settings, module_name: str):
    """`enabled(kernel) -> bool` for a modeling module under `settings` (per-model overrides apply)."""
    module = sys.modules.get(module_name)
    types = model_types_of(module) if module is not None else [module_name.rpartition(".")[0].rpartition(".")[2]]

    def enabled(kernel: str) -> bool:
        return kernel in KERNEL_NAMES and settings.enabled_for(kernel, types)

    enabled.model_types = types
    return enabled


def run_rules(module, session: Session, enabled, skip=frozenset()) -> list[Record]:
    """autopatch.rules.patch_module(module, session, enabled, skip)."""
    from autopatch import rules

    return rules.patch_module(module, session, enabled, skip)


def patch_module(module, session: Session, *, announce: bool = False) -> list[Record]:
    """Run the rules over one modeling module with the kernels the session's settings enable for its
    model type(s) and record the result. Its summary line is said now with `announce`, else when a
    model using the module is built (model_built)."""
    enabled = enabled_in(session.settings, module.__name__)
    records = run_rules(module, session, enabled)
    session.add(records)
    line = report.summary_line(module.__name__, records, enabled)
    if line and announce:
        say(line)
    elif line:
        with session.lock:
            session.pending[module.__name__] = line
    return records


# --------------------------------------------------------------------------- a model is built
def modeling_module_names_of(model) -> list[str]:
    """The modeling modules (transformers.models.*.modeling_*, remote code's modeling_*) of the model's
    class, its bases and its submodules' classes, in first-seen order."""
    classes = list(type(model).__mro__)
    modules_fn = getattr(model, "modules", None)
    if callable(modules_fn):
        classes += [type(m) for m in modules_fn()]
    names: list[str] = []
    for cls in classes:
        name = getattr(cls, "__module__", None)
        if isinstance(name, str) and name not in names and is_model_module(name):
            names.append(name)
    return names


def say_pending_for(model, session: Session | None = None) -> list[str]:
    """Say the waiting summary lines of the modeling modules `model` uses; returns the lines said."""
    session = sessions.current() if session is None else session
    names = set(modeling_module_names_of(model))
    with session.lock:
        lines = [session.pending.pop(n) for n in list(session.pending) if n in names]
    for line in lines:
        say(line)
    return lines


def strict_refusals(session: Session, module_names) -> str | None:
    """Strict mode's message for enabled kernels left alone in these (built) modules, or None."""
    if not session.strict or session.settings is None:
        return None
    parts = []
    for name in module_names:
        enabled = enabled_in(session.settings, name)
        refused = report.refusals([r for r in session.all_records() if r.module == name], enabled)
        if refused:
            overrides = " ".join(report.override(k, enabled.model_types[0]) for k in report.refused_kernels(refused)
                                 if k in KERNEL_NAMES)
            fix = f"Turn those kernels off for this model ({overrides})" if overrides else "Report this"
            parts.append(report.strict_refusal_message(name, refused, fix))
    return " ".join(parts) or None


def model_built(model) -> None:
    """PreTrainedModel.post_init ran for `model`: say the waiting lines of its modules, judge them in
    strict mode (only modules a built model uses), audit it, and watch it for a later replacement."""
    session = sessions.started()
    if session is None or session.settings is None:
        return
    names = modeling_module_names_of(model)
    new = session.note_built(type(model).__name__, names)
    say_pending_for(model, session)
    message = strict_refusals(session, new)
    if message:
        stop(message, session)
    if _inside_another(model, "__init__"):
        return  # a base model built inside a bigger one: the outer model's post_init audits both
    session.note_model(model, getattr(model, "training", None))
    check_model(model, session)
    _watch_first_training_forward(model)
    offload.install(model, session, session.settings)


def _inside_another(model, method: str) -> bool:
    """Whether `model` is reached from another transformers model's `method` (LlamaModel built inside
    LlamaForCausalLM.__init__, or set to train by its train()): a frame up the stack runs that method
    of another PreTrainedModel. The outer model's own step covers the inner one, in one line."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == method:
            other = frame.f_locals.get("self")
            if other is not model and isinstance(other, base):
                return True
        frame = frame.f_back
    return False


def check_model(model, session: Session) -> list:
    """Audit `model` (autopatch.audit); in strict mode a replacement ends the program."""
    new = audit.audit_model(model, session)
    if new and session.strict:
        stop(None, session)
    return new


def model_mode_set(model) -> None:
    """model.train()/eval() ran (transformers re-kernelizes there): audit again when the mode changed."""
    session = sessions.started()
    if session is None or session.settings is None or _inside_another(model, "train"):
        return
    if session.note_model(model, getattr(model, "training", None)):
        check_model(model, session)


def _first_training_forward(module, args):
    """A forward pre-hook: before the first forward in training mode, audit once, then go."""
    if not module.training:
        return None
    import torch

    if torch.compiler.is_compiling():
        return None
    handle = vars(module).pop("_autopatch_first_forward", None)
    if handle is not None:
        handle.remove()
    session = sessions.started()
    if session is not None and session.settings is not None:
        try:
            check_model(module, session)
        except StrictModeError:
            raise
        except Exception:  # noqa: BLE001 - the user's forward comes first
            pass
    return None


def _watch_first_training_forward(model) -> None:
    register = getattr(model, "register_forward_pre_hook", None)
    if register is None or "_autopatch_first_forward" in vars(model):
        return
    try:
        vars(model)["_autopatch_first_forward"] = register(_first_training_forward)
    except Exception:  # noqa: BLE001
        pass


# --------------------------------------------------------------------------- at exit
def at_exit(session: Session) -> None:
    """The exit check: audit the models still alive, say the verdict, write AUTOPATCH_REPORT, and in
    strict mode end with exit code 2 when a loss kernel never ran or something replaced our code."""
    failed = False
    try:
        for model, _ in list(session.models.items()):
            if audit.audit_model(model, session) and session.strict:
                failed = True
        line = report.exit_verdict(session)
        if line is not None:
            say(line)
            failed = failed or session.strict
        mostly = report.mostly_original(session)  # said, never a strict failure
        if mostly is not None:
            say(mostly)
    except Exception:  # noqa: BLE001 - at exit: never raise
        pass
    write_report(session)
    if failed:
        session.exit_status = EXIT_CODE
        exit_now(EXIT_CODE)


def write_report(session: Session) -> None:
    path = getattr(session.settings, "report", None)
    if not path:
        return
    try:
        report.write_json(path, session)
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
        say(f"autopatch: could not write AUTOPATCH_REPORT {path!r}: {exc}")


# --------------------------------------------------------------------------- stopping
class Stopping(SystemExit):
    """Raised only where raising is the right stop (IPython); passes through our own guards."""


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and ipython.get_ipython() is not None
    except Exception:  # noqa: BLE001
        return False


def stop(message: str | None, session: Session | None = None) -> None:
    """Stop the program with one readable line (already said when `message` is None) and exit code 2.

    Raising would not do: transformers rewraps exceptions from a modeling import as a misleading
    ModuleNotFoundError, and a `try/except BaseException` or an import in a worker thread would
    swallow SystemExit. So the line goes to stderr, AUTOPATCH_REPORT is written, buffers are flushed
    and the process ends with os._exit (atexit handlers skipped on purpose). In IPython/Jupyter,
    where ending the kernel would hide the message, SystemExit is raised instead."""
    if message:
        say(message if message.startswith("autopatch") or message.startswith("AUTOPATCH") else f"autopatch: {message}")
    if session is not None:
        session.exit_status = EXIT_CODE
        write_report(session)
    if _in_ipython():
        say("autopatch: fix the setting, then restart the kernel")
        raise Stopping(EXIT_CODE)
    exit_now(EXIT_CODE)


def exit_now(code: int) -> None:
    """End the process at once with `code`, stdout and stderr flushed, atexit handlers skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
