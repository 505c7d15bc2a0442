"""What was patched, what was left alone and why. Every rule reports here; `autopatch.applied()`,
`AUTOPATCH_REPORT=path.json` and `python -m autopatch doctor` read it."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Record:
    kernel: str  # kernel name, e.g. "rms_norm"
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    target: str  # e.g. "LlamaRMSNorm" or "apply_rotary_pos_emb" or "LlamaForCausalLM.forward"
    patched: bool
    variant: str = ""  # detected variant when patched, e.g. "offset=1 casting=gemma"
    reason: str = ""  # why it was left alone, when not patched

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    }


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
