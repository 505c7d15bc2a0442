"""Rendering what a Session holds: the stderr summary line of a modeling module, strict mode's
messages, the exit check's line, the lines that name a replaced forward or a Liger conflict, the JSON
report and doctor's table. Nothing here keeps state, installs a hook, reads a setting or ends the
process: each function reads the Session it is given (default: autopatch.session.current()) and
returns text or data. Start-up and the exit check (autopatch.runtime) decide when to say it."""

from __future__ import annotations

import dataclasses
import os
import sys

from autopatch.names import FORWARD_OPS, KERNEL_NAMES, LAUNCH_OPS, LOSS_KERNELS, UNCOUNTED
from autopatch.offload import offloader_of
from autopatch.session import Record, current


def _session(session):
    return current() if session is None else session


# --------------------------------------------------------------------------- what ran
def launch_counts() -> dict[str, int]:
    """fused_kernels.launch_counts() where the kernels are imported, else {} (never imported to look)."""
    fused = sys.modules.get("fused_kernels")
    counts = getattr(fused, "launch_counts", None)
    return dict(counts()) if callable(counts) else {}


def runs(session=None) -> dict[str, dict]:
    """Per patched kernel: {"calls": its forward launches (autopatch.names.FORWARD_OPS) plus the calls
    its rules counted (None where nothing is counted), "launches": {op: count}}, and "original_calls"
    where its patched code counted the calls it gave to the original (Session.count_original). An op
    several kernels launch (MoE experts) is credited to each of them that patched something."""
    session = _session(session)
    launches = launch_counts()
    with session.lock:
        kernels = list(dict.fromkeys(r.kernel for r in session.records if r.patched and r.kernel in KERNEL_NAMES))
        calls = dict(session.calls)
        originals = dict(session.originals)
    out = {}
    for kernel in kernels:
        ops = {op: launches[op] for op in LAUNCH_OPS[kernel] if launches.get(op)}
        if kernel in UNCOUNTED and kernel not in calls:
            counted = None
        else:
            counted = sum(launches.get(op, 0) for op in FORWARD_OPS[kernel]) + calls.get(kernel, 0)
        out[kernel] = {"calls": counted, "launches": ops}
        if kernel in originals:
            out[kernel]["original_calls"] = originals[kernel]
    return out


def offload_state(session=None) -> list[dict]:
    """Per model built under AUTOPATCH_OFFLOAD: its mode, whether offload stayed off and why (no CUDA
    device, too little host memory), and what its training forwards sent to the host. Read from each
    model's offloader (autopatch.offload), which start-up put on it; [] where there is none."""
    session = _session(session)
    with session.lock:
        models = list(session.models.keys())
    offloaders = [(model, offloader_of(model)) for model in models]
    return [{"model": type(model).__name__, "mode": off.mode, "off": off.off_reason, **off.stats}
            for model, off in offloaders if off is not None]


def records_with_runs(session=None) -> list[Record]:
    """The session's records with `runs` filled in for the patched ones (autopatch.applied())."""
    session = _session(session)
    counts = {k: v["calls"] for k, v in runs(session).items()}
    return [dataclasses.replace(r, runs=counts.get(r.kernel)) if r.patched else r for r in session.all_records()]


def bypassed(session=None) -> dict[str, str]:
    """kernel -> why its patched code was passed over (the strongest bypass seen per kernel)."""
    session = _session(session)
    with session.lock:
        return {k: v["why"] for k, v in session.bypassed.items()}


def replaced(session=None) -> list[dict]:
    """Our forwards something else replaced: [{"kernel", "target", "by"}]."""
    session = _session(session)
    with session.lock:
        return [{"kernel": k, "target": t, "by": by} for (k, t), by in session.replaced.items()]


# --------------------------------------------------------------------------- strict mode
def refusals(records, enabled) -> list[Record]:
    """Records that strict mode treats as failures: a candidate left alone although its kernel is
    enabled (`enabled(kernel) -> bool`), or a rule that raised (its record's kernel is the rule's
    name, not a kernel name)."""
    return [r for r in records if not r.patched and (r.kernel not in KERNEL_NAMES or enabled(r.kernel))]


def refused_kernels(refused) -> list[str]:
    """The kernel names of refusal records, each once, in order (a rule that raised names itself)."""
    return list(dict.fromkeys(r.kernel for r in refused))


def strict_refusal_message(where: str, refused, fix: str) -> str:
    """The error strict mode stops with when candidates were left alone: what, where, why, and the
    way out (`fix`, e.g. the per-model override that turns those kernels off)."""
    why = "; ".join(f"{r.kernel} left {r.target} alone: {r.reason or 'no reason given'}" for r in refused)
    return f"AUTOPATCH_STRICT: {where}: {why}. {fix}, or unset AUTOPATCH_STRICT."


def override(kernel: str, model_type: str = "") -> str:
    """The variable that turns `kernel` off (for one model type when given)."""
    if model_type:
        return f"AUTOPATCH_MODELS__{model_type}__{kernel.upper()}=false"
    return f"AUTOPATCH_{kernel.upper()}=false"


def fallback_cause(detail: str) -> str:
    """A fallback's detail said as its cause: tensors on the CPU while Triton's interpreter is off is
    "CPU tensors without TRITON_INTERPRET"."""
    if "cpu" in detail.lower() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"CPU tensors without TRITON_INTERPRET ({detail})"
    return detail


# --------------------------------------------------------------------------- replaced forwards, Liger
def _short_target(target: str) -> str:
    return target[: -len(".forward")] if target.endswith(".forward") else target


def is_liger(by: str) -> bool:
    return by.startswith("liger_kernel")


def replaced_line(kernel: str, target: str, by: str, strict: bool = False, model_type: str = "") -> str:
    """One line for one of our forwards replaced after we patched it: which class, what runs instead,
    and the variable that changes it (for the model type when given)."""
    head = "AUTOPATCH_STRICT: " if strict else "autopatch: "
    line = (f"{head}{kernel} on {_short_target(target)} was replaced after autopatch patched it: {by} runs "
            f"instead, so autopatch's {kernel} does not run there")
    if strict:
        return line + (f". Remove the replacement, turn the kernel off ({override(kernel, model_type)}), "
                       "or unset AUTOPATCH_STRICT.")
    return line + f" (to keep it and say so, {override(kernel, model_type)})"


def liger_line(items, strict: bool = False) -> str:
    """One line for the layers Liger-Kernel took over from autopatch: `items` are (kernel, target, by).
    Liger wins for those layers (its code runs there); autopatch's kernels run everywhere else."""
    head = "AUTOPATCH_STRICT: " if strict else "autopatch: "
    layers = ", ".join(f"{k} ({_short_target(t)})" for k, t, _ in items)
    kernels = list(dict.fromkeys(k for k, _, _ in items))
    off = " ".join(override(k) for k in kernels)
    line = (f"{head}Liger-Kernel and autopatch both patch this model: Liger's code runs for {layers}; "
            f"autopatch's for the rest. To use autopatch's everywhere, unset use_liger_kernel "
            f"(TrainingArguments) or drop the apply_liger_kernel_to_* call; to keep Liger's and say so, {off}")
    if strict:
        line += "; or unset AUTOPATCH_STRICT"
    return line


# --------------------------------------------------------------------------- the exit check
def _built_classes(session) -> dict[str, set[str]]:
    with session.lock:
        return {module: set(classes) for module, classes in session.built.items()}


def exit_verdict(session=None, strict: bool | None = None) -> str | None:
    """The line the exit check says, or None: a patched loss kernel (fused_linear_cross_entropy,
    cross_entropy) of a model that was BUILT which never ran in a process that trained, with the real
    cause when known (the original code ran because of a fallback, a caller passed it over, something
    replaced it). `strict` (default: the session's) words it as strict mode's failure."""
    session = _session(session)
    strict = session.strict if strict is None else strict
    state = runs(session)
    built = _built_classes(session)
    with session.lock:
        targets = {}
        for r in session.records:
            owner = r.target.partition(".")[0]
            if r.patched and r.kernel in LOSS_KERNELS and owner in built.get(r.module, ()):
                targets.setdefault(r.kernel, []).append(owner)
        steps, calls = session.trained["optimizer_steps"], session.trained["training_calls"]
        known = {k: dict(v) for k, v in session.bypassed.items()}
        fallbacks = dict(session.fallbacks)
        replaced_by = {k: (t, by) for (k, t), by in session.replaced.items()}
    loss = [k for k in LOSS_KERNELS if k in targets and k in state]
    if not loss or not (steps or calls or any(known.get(k, {}).get("certain") for k in loss)):
        return None
    if any(state[k]["calls"] for k in loss) or any(known.get(k, {}).get("raised") for k in loss):
        return None
    classes = ", ".join(dict.fromkeys(c for k in loss for c in targets[k]))
    how = f"{steps} optimizer step{'s' * (steps != 1)}" if steps else f"{calls} training call{'s' * (calls != 1)}"
    line = (f"patched loss {'kernels' if len(loss) > 1 else 'kernel'} {', '.join(loss)} ({classes}) never ran "
            f"in this process, which trained ({how})")
    fell_back = next((k for k in loss if k in fallbacks), None)
    swapped = next((k for k in loss if k in replaced_by), None)
    why = next((known[k] for k in loss if k in known), None)
    if fell_back is not None:
        line += f": the original code ran: {fallback_cause(fallbacks[fell_back])}"
    elif why is not None and why.get("certain"):  # a caller known to pass it over says it best (TRL's head)
        line += f": {why['why']}"
    elif swapped is not None:
        target, by = replaced_by[swapped]
        line += f": {by} replaced it on {_short_target(target)}"
    elif why is not None:
        line += f": {why['why']}"
    else:
        line += (": no patched model was called in training mode with labels (a caller that computes the loss "
                 "from the logits itself)")
    model_type = (why or {}).get("model_type", "")
    if strict:
        return (f"AUTOPATCH_STRICT: {line}. To train this way, turn the kernel off for this model "
                f"({override(loss[0], model_type)}, or {loss[0]}=False in autopatch.apply), or unset "
                "AUTOPATCH_STRICT.")
    return f"autopatch: {line}"


def mostly_original(session=None) -> str | None:
    """The exit check's line for patched kernels whose patched code gave most of its calls to the
    original (Session.count_original against the calls counted), with the first reason kept for each
    (Session.note_bypass); None when there are none. Not a strict-mode failure: a per-call choice of the
    patched code, as a fallback is."""
    session = _session(session)
    state = runs(session)
    with session.lock:
        why = {k: v["why"] for k, v in session.bypassed.items()}
    parts = []
    for kernel, counts in state.items():
        original, ours = counts.get("original_calls", 0), counts["calls"] or 0
        if original > ours:
            part = f"{kernel} ran the original code in {original} of {original + ours} calls"
            parts.append(part + (f" (the first reason: {why[kernel]})" if kernel in why else ""))
    if not parts:
        return None
    return "autopatch: " + "; ".join(parts)


# --------------------------------------------------------------------------- one stderr line per module
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
    line = f"autopatch: {module.rsplit('.', 1)[-1]}: " + (", ".join(parts) if parts else "nothing patched")
    if left:
        line += "; left alone: " + ", ".join(left) + " (why: python -m autopatch doctor, or AUTOPATCH_REPORT)"
    return line


# --------------------------------------------------------------------------- JSON
def report_path(template: str) -> str:
    """AUTOPATCH_REPORT with {pid} expanded (one file per process when several write)."""
    return template.replace("{pid}", str(os.getpid()))


def as_json(session=None) -> dict:
    from autopatch import __version__

    session = _session(session)
    versions = {}
    for name in ("torch", "transformers", "triton"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    with session.lock:
        meta = dict(session.meta)
        trained = dict(session.trained)
        built = {m: list(c) for m, c in session.built.items()}
        fallbacks = dict(session.fallbacks)
    settings = session.settings
    summary = getattr(settings, "summary", None)
    return {
        "autopatch": __version__,
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "versions": versions,
        **({"settings": summary()} if callable(summary) else {}),
        **meta,
        "records": [r.as_dict() for r in session.all_records()],
        "runs": runs(session),
        "trained": trained,
        "bypassed": bypassed(session),
        "fallbacks": fallbacks,
        "replaced": replaced(session),
        "built": built,
        "offload": offload_state(session),
    }


def write_json(path: str, session=None) -> str:
    """Write the session's report to `path` ({pid} expanded) now; returns the path written."""
    import json

    target = report_path(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(as_json(session), fh, indent=2)
        fh.write("\n")
    os.replace(tmp, target)  # readers never see half a file
    return target


# --------------------------------------------------------------------------- doctor's table
def format_table(records_list) -> str:
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

