"""What was patched, what was left alone and why. Every rule reports here; `autopatch.applied()`,
`AUTOPATCH_REPORT=path.json` and `python -m autopatch doctor` read it."""

from __future__ import annotations

import dataclasses
import sys
import threading


@dataclasses.dataclass(frozen=True)
class Record:
    kernel: str  # kernel name, e.g. "rms_norm"
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    target: str  # e.g. "LlamaRMSNorm" or "apply_rotary_pos_emb" or "LlamaForCausalLM.forward"
    patched: bool
    variant: str = ""  # detected variant when patched, e.g. "offset=1 casting=gemma"
    reason: str = ""  # why it was left alone, when not patched
    # how often the kernel's patched path ran in this process (forward launches plus calls the rules
    # count; per kernel, not per target): filled in by applied() and the JSON report, None where
    # nothing is counted (causal_mask) or for a record not patched. Not part of equality.
    runs: int | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if out["runs"] is None:
            del out["runs"]  # not filled in: the JSON report gives the counts per kernel ("runs")
        return out


_records: list[Record] = []
_lock = threading.Lock()


def add(records) -> None:
    with _lock:
        _records.extend(records)


def records() -> list[Record]:
    with _lock:
        return list(_records)


def clear() -> None:
    with _lock:
        _records.clear()


# --------------------------------------------------------------------------- what ran
# A patch says what *would* run; these say what did. The kernels count their launches
# (fused_kernels.launch_counts(), by op: "rms_norm_fwd", "swiglu_bwd", ...); a rule whose fused path
# is not one launch may count its own calls (count_call). Whether the process trained comes from a
# global optimizer-step hook and from the patched causal-LM forwards called in training with labels.
UNCOUNTED = frozenset({"causal_mask"})  # not a kernel: nothing launches, nothing to count
LOSS_KERNELS = ("fused_linear_cross_entropy", "cross_entropy")
_calls: dict[str, int] = {}
_trained = {"optimizer_steps": 0, "training_calls": 0}
_bypassed: dict[str, dict] = {}  # kernel -> {"why", "target", "model_type"}: the first bypass seen
_watching = []  # the optimizer hook's handle, once registered
_exit_check = []  # registered once


def count_call(kernel: str, n: int = 1) -> None:
    """A rule's fused path ran `n` times (for components whose fused path is not one kernel launch)."""
    with _lock:
        _calls[kernel] = _calls.get(kernel, 0) + n


def count_training_call() -> None:
    """A patched model was called in training mode with labels (grad enabled)."""
    _trained["training_calls"] += 1


def _launch_counts() -> dict[str, int]:
    fused = sys.modules.get("fused_kernels")  # never import the kernels just to report
    counts = getattr(fused, "launch_counts", None)
    return dict(counts()) if callable(counts) else {}


def runs() -> dict[str, dict]:
    """Per patched kernel: {"calls": forward launches + counted calls (None where nothing is counted),
    "launches": {op: count}}."""
    launches = _launch_counts()
    with _lock:
        kernels = list(dict.fromkeys(r.kernel for r in _records if r.patched))
        calls = dict(_calls)
    out = {}
    for kernel in kernels:
        ops = {op: n for op, n in launches.items() if op.startswith(kernel + "_")}
        counted = None if kernel in UNCOUNTED and kernel not in calls else ops.get(kernel + "_fwd", 0) + calls.get(kernel, 0)
        out[kernel] = {"calls": counted, "launches": ops}
    return out


def records_with_runs() -> list[Record]:
    """records() with `runs` filled in for the patched ones (applied())."""
    return _with_runs(records())


def reset_runs() -> None:
    """Forget the counted calls, training and bypasses (tests; the kernels' launch counts are theirs:
    fused_kernels.reset_launch_counts())."""
    with _lock:
        _calls.clear()
        _bypassed.clear()
        _trained.update(optimizer_steps=0, training_calls=0)
        callbacks = list(_on_reset)
    for callback in callbacks:
        callback()


_on_reset: list = []  # what the rules forget with reset_runs (their own per-class look-ups)


def trained() -> dict:
    """{"optimizer_steps": n, "training_calls": n} so far in this process."""
    return dict(_trained)


def watch_training() -> None:
    """Count optimizer steps (any torch.optim optimizer, through torch's global post-step hook), so
    the exit check knows whether this process trained. Idempotent; never raises."""
    with _lock:
        if _watching:
            return
        _watching.append(None)
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def stepped(optimizer, args, kwargs):
            _trained["optimizer_steps"] += 1

        _watching[0] = register_optimizer_step_post_hook(stepped)
    except Exception:
        pass  # an old torch without the global hook: training calls still count


def note_bypass(kernel: str, target: str, why: str, model_type: str = "", *, certain: bool = False,
                fallback: bool = False) -> None:
    """The component a patch replaced was passed over (`why`: who and how, e.g. TRL's own fused LM
    head), kept for the exit check: per kernel the strongest seen, a `certain` bypass (the caller is
    known to pass the patch over on every call) before a `fallback` (the patched code itself chose
    the original, e.g. a wrapped lm_head) before anything else (a read that may be harmless), the
    first of each. With `certain`, strict mode stops here, as it does for a kernel left alone:
    raises StrictModeError naming the override."""
    rank = 2 if certain else 1 if fallback else 0
    with _lock:
        if kernel not in _bypassed or rank > _bypassed[kernel]["rank"]:
            _bypassed[kernel] = {"why": why, "target": target, "model_type": model_type, "certain": certain,
                                 "rank": rank}
    if certain and _strict:
        with _lock:
            _bypassed[kernel]["raised"] = True  # said by the exception: the exit check stays quiet
        raise StrictModeError(_bypass_message(kernel, _bypassed[kernel], strict=True))


def bypassed() -> dict[str, str]:
    """kernel -> why it was passed over (the first bypass seen per kernel)."""
    with _lock:
        return {k: v["why"] for k, v in _bypassed.items()}


def run_state() -> dict:
    """What ran (runs()), whether the process trained (trained()) and what was bypassed (bypassed())."""
    return {"runs": runs(), "trained": trained(), "bypassed": bypassed()}


def _override(kernel: str, model_type: str) -> str:
    where = f"AUTOPATCH_MODELS__{model_type}__{kernel.upper()}=false" if model_type else f"AUTOPATCH_{kernel.upper()}=false"
    return f"turn the kernel off for this model ({where}, or {kernel}=False in autopatch.apply)"


def _bypass_message(kernel: str, info: dict, strict: bool) -> str:
    head = "AUTOPATCH_STRICT: " if strict else "autopatch: "
    target = f" on {info['target']}" if info.get("target") else ""
    line = f"{head}{kernel} is patched{target} but the patched code was passed over: {info['why']}"
    if strict:
        line += f". To train this way, {_override(kernel, info.get('model_type', ''))}, or unset AUTOPATCH_STRICT."
    return line


def exit_verdict(strict: bool | None = None) -> str | None:
    """The line the exit check says, or None: a patched loss kernel (fused_linear_cross_entropy,
    cross_entropy) that never ran in a process that trained, and why if known. `strict` (default:
    the current strict flag) words it as strict mode's failure."""
    strict = _strict if strict is None else strict
    state = runs()
    loss = [k for k in LOSS_KERNELS if k in state]
    steps, calls = _trained["optimizer_steps"], _trained["training_calls"]
    with _lock:
        known = {k: dict(v) for k, v in _bypassed.items()}
    if not loss or not (steps or calls or any(known.get(k, {}).get("certain") for k in loss)):
        return None
    if any(state[k]["calls"] for k in loss) or any(known.get(k, {}).get("raised") for k in loss):
        return None
    with _lock:
        targets = [r.target for r in _records if r.patched and r.kernel in loss]
    how = f"{steps} optimizer step{'s' * (steps != 1)}" if steps else f"{calls} training call{'s' * (calls != 1)}"
    names = ", ".join(loss)
    line = (f"patched loss {'kernels' if len(loss) > 1 else 'kernel'} {names} "
            f"({', '.join(dict.fromkeys(t.partition('.')[0] for t in targets))}) never ran in this process, which trained "
            f"({how})")
    why = next((known[k] for k in loss if k in known), None)
    if why is not None:
        line += f": {why['why']}"
    else:
        line += (": no patched model was called in training mode with labels (a caller that computes the loss "
                 "from the logits itself, or a model built outside the patched classes)")
    model_type = (why or {}).get("model_type", "")
    if strict:
        return (f"AUTOPATCH_STRICT: {line}. To train this way, {_override(loss[0], model_type)}, or unset "
                "AUTOPATCH_STRICT.")
    return f"autopatch: {line}"


def check_at_exit() -> None:
    """Register (once) the exit check: say exit_verdict() on stderr; in strict mode also write the
    JSON report now and end the process with exit code 2."""
    import atexit

    with _lock:
        if _exit_check:
            return
        _exit_check.append(True)
    atexit.register(_check_now)


STRICT_EXIT_CODE = 2


def _strict_at_exit() -> bool:
    """Strict mode as the process's settings say (what the hooks loaded, else the environment), not
    a flag some caller left set: ending a process with exit code 2 needs AUTOPATCH_STRICT itself."""
    try:
        from autopatch import hooks

        settings = hooks.active_settings()
        if settings is None:
            from autopatch.config import load_settings

            settings = load_settings()
        return bool(settings.strict)
    except Exception:
        return False


def _check_now() -> None:
    try:
        line = exit_verdict(strict=False)
        if line is None:
            return
        strict = _strict_at_exit()
        if strict:
            line = exit_verdict(strict=True)
    except Exception:
        return  # at exit: never raise
    say(line)
    if strict:
        from autopatch import hooks

        if _json_path is not None:
            _write_at_exit()
        hooks.exit_now(STRICT_EXIT_CODE)


# --------------------------------------------------------------------------- strict mode
class StrictModeError(RuntimeError):
    """AUTOPATCH_STRICT is on and autopatch could not do what was asked: an enabled kernel's
    candidate was left alone, or a patched component had to run the original code."""


_strict = False


def set_strict(on: bool) -> None:
    """Set from the loaded settings (hooks, apply). In strict mode fallback_notice raises."""
    global _strict
    _strict = bool(on)


def strict() -> bool:
    return _strict


def _strict_fallback(kernel: str, detail: str) -> None:
    if _strict:
        raise StrictModeError(
            f"autopatch (AUTOPATCH_STRICT): {kernel}: {detail}; the original code would run instead. "
            "Run on CUDA tensors or with TRITON_INTERPRET=1, turn the kernel off, or unset AUTOPATCH_STRICT."
        )


_fallback_noticed: set[str] = set()


def fallback_notice(kernel: str, detail: str) -> None:
    """A patched component met tensors Triton cannot run on and is about to call the original code.
    Say so once per process and kernel (stderr), so a CPU run without the interpreter is not a
    surprise. In strict mode (AUTOPATCH_STRICT) raise StrictModeError instead: callers call this
    before running the original code and let the exception propagate."""
    _strict_fallback(kernel, detail)
    with _lock:
        if kernel in _fallback_noticed:
            return
        _fallback_noticed.add(kernel)
    say(f"autopatch: {kernel}: {detail}; running the original code instead "
        "(Triton runs on CUDA tensors, or on the CPU with TRITON_INTERPRET=1)")


def refusals(records, enabled) -> list[Record]:
    """Records that strict mode treats as failures: a candidate left alone although its kernel is
    enabled (`enabled(kernel) -> bool`), or a rule that raised (its record's kernel is the rule's
    name, not a kernel name)."""
    from autopatch.names import KERNEL_NAMES

    out = []
    for r in records:
        if r.patched:
            continue
        if r.kernel not in KERNEL_NAMES or enabled(r.kernel):
            out.append(r)
    return out


def strict_refusal_message(where: str, refused, fix: str) -> str:
    """The error strict mode stops with when candidates were left alone: what, where, why, and the
    way out (`fix`, e.g. the per-model override that turns those kernels off)."""
    why = "; ".join(f"{r.kernel} left {r.target} alone: {r.reason or 'no reason given'}" for r in refused)
    return f"AUTOPATCH_STRICT: {where}: {why}. {fix}, or unset AUTOPATCH_STRICT."


def refused_kernels(refused) -> list[str]:
    """The kernel names of refusal records, each once, in order (a rule that raised names itself)."""
    return list(dict.fromkeys(r.kernel for r in refused))


# --------------------------------------------------------------------------- one stderr line
def say(line: str) -> None:
    """Print one notice line on stderr, on a line of its own. While a tqdm progress bar is on screen
    (a training loop's, usually on stderr too), a plain print would land in the middle of the bar's
    line: tqdm.write clears the bars, prints the line and draws them again below it."""
    import sys

    std = sys.modules.get("tqdm.std")
    bar_class = getattr(std, "tqdm", None)
    if bar_class is not None and getattr(bar_class, "_instances", None):
        try:
            bar_class.write(line, file=sys.stderr)
            sys.stderr.flush()
            return
        except Exception:
            pass  # tqdm's own trouble: print plainly
    print(line, file=sys.stderr, flush=True)


def _short_module(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _short_target(target: str) -> str:
    return target[: -len(".forward")] if target.endswith(".forward") else target


def summary_line(module: str, records, enabled=None) -> str | None:
    """`autopatch: modeling_llama: rms_norm (LlamaRMSNorm), rope, swiglu (LlamaMLP), ...` for one
    module, plus what an enabled kernel left alone; None when there is nothing to say."""
    patched: dict[str, list[str]] = {}
    for r in records:
        if r.patched:
            targets = patched.setdefault(r.kernel, [])
            target = _short_target(r.target)
            # module functions (apply_rotary_pos_emb) go without a name: the kernel says it all
            if target[:1].isupper() and target not in targets:
                targets.append(target)
    left = []
    if enabled is not None:
        for r in refusals(records, enabled):
            item = f"{r.kernel} ({_short_target(r.target)})"
            if item not in left:
                left.append(item)
    if not patched and not left:
        return None
    parts = [k + (f" ({', '.join(t)})" if t else "") for k, t in patched.items()]
    line = f"autopatch: {_short_module(module)}: " + (", ".join(parts) if parts else "nothing patched")
    if left:
        line += "; left alone: " + ", ".join(left) + " (why: python -m autopatch doctor, or AUTOPATCH_REPORT)"
    return line


# --------------------------------------------------------------------------- JSON at exit
_meta: dict = {}
_json_path: str | None = None


def set_meta(**meta) -> None:
    """Extra top-level fields of the JSON report (e.g. settings=Settings.summary())."""
    with _lock:
        _meta.update(meta)


def report_path(template: str) -> str:
    """AUTOPATCH_REPORT with {pid} expanded (one file per process when several write)."""
    import os

    return template.replace("{pid}", str(os.getpid()))


def as_json(records_list=None) -> dict:
    import os
    import sys

    from autopatch import __version__

    versions = {}
    for name in ("torch", "transformers", "triton"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    with _lock:
        meta = dict(_meta)
        recs = list(_records) if records_list is None else list(records_list)
    return {
        "autopatch": __version__,
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "versions": versions,
        **meta,
        "records": [r.as_dict() for r in recs],
        "runs": runs(),
        "trained": trained(),
        "bypassed": bypassed(),
    }


def _with_runs(recs) -> list[Record]:
    counts = {k: v["calls"] for k, v in runs().items()}
    return [dataclasses.replace(r, runs=counts.get(r.kernel)) if r.patched else r for r in recs]


def write_json(path: str) -> str:
    """Write the report now; returns the path written."""
    import json
    import os

    target = report_path(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(as_json(), fh, indent=2)
        fh.write("\n")
    os.replace(tmp, target)  # readers never see half a file
    return target


def write_at_exit(path: str) -> None:
    """Write the report when the interpreter exits (registered once; the last path wins)."""
    import atexit

    global _json_path
    with _lock:
        first = _json_path is None
        _json_path = path
    if first:
        atexit.register(_write_at_exit)


def _write_at_exit() -> None:
    import sys

    if _json_path is None:
        return
    try:
        write_json(_json_path)
    except Exception as exc:  # at exit: say it, never raise
        print(f"autopatch: could not write AUTOPATCH_REPORT {_json_path!r}: {exc}", file=sys.stderr)


# --------------------------------------------------------------------------- doctor's table
def format_table(records_list, kernels_on=None) -> str:
    """Records as a plain-text table, one block per module: kernel, target, verdict."""
    by_module: dict[str, list[Record]] = {}
    for r in records_list:
        by_module.setdefault(r.module, []).append(r)
    lines = []
    for module, recs in by_module.items():
        lines.append(module)
        kw = max(len("kernel"), *(len(r.kernel) for r in recs))
        tw = max(len("target"), *(len(r.target) for r in recs))
        lines.append(f"  {'kernel':<{kw}}  {'target':<{tw}}  result")
        for r in recs:
            if r.patched:
                verdict = "patched" + (f": {r.variant}" if r.variant else "")
            else:
                verdict = "left alone" + (f": {r.reason}" if r.reason else "")
            lines.append(f"  {r.kernel:<{kw}}  {r.target:<{tw}}  {verdict}")
        lines.append("")
    return "\n".join(lines)
