"""Coverage matrix: every transformers causal-LM architecture, patched where it matches, verified.

For each causal LM that `AutoModelForCausalLM` can build in the installed transformers (the classes of
its mapping, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: GPT2LMHeadModel and the like too, no list typed by
hand) this builds a tiny random model (autopatch.tiny_models), runs it unpatched, patches
the modules it uses with every rule on (autopatch.rules.patch_module, and the model's nn.LayerNorm
instances as apply() does), runs it again on the same
inputs and compares. Each component kind gets one verdict:

  verified      patched, its kernel ran, and loss, eval logits and every gradient match
  not used      patched, but the model never called it (e.g. a class the model does not build)
  left alone    the rule refused, with its reason
  none          no candidate of that kind in the model's modules
  MISMATCH      patched and the numbers differ: always a bug (fix the rule or make it refuse)
  could not build / error   the tiny model or the run failed (with the error)

Run on the CPU with TRITON_INTERPRET=1 (set here before triton is imported):
    python dev/coverage_matrix.py                      # all architectures
    python dev/coverage_matrix.py llama gemma2 qwen3   # by model directory or class name
    python dev/coverage_matrix.py --json docs/coverage.json --markdown docs/coverage.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

KINDS = ("rms_norm", "layer_norm", "rope", "glu", "loss")
KIND_OF_KERNEL = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "rope": "rope",
    "swiglu": "glu",
    "geglu": "glu",
    "cross_entropy": "loss",
    "fused_linear_cross_entropy": "loss",
}
# Launch-counter prefixes (fused_kernels.launch_counts keys) that prove a kind's kernel ran.
LAUNCH_PREFIX = {
    "rms_norm": ("rms_norm",),
    "layer_norm": ("layer_norm",),
    "rope": ("rope",),
    "glu": ("swiglu", "geglu"),
    "loss": ("cross_entropy", "fused_linear_cross_entropy"),
}
TOL = 1e-5  # fp32 relative (DESIGN.md)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """‖a − b‖ / max(‖b‖, floor); NaN/inf in `a` gives inf."""
    a = a.detach().double()
    b = b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return (a - b).norm().item() / max(b.norm().item(), floor)


def _run(model, inputs):
    """Loss and every parameter gradient in training mode, logits in eval mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # any dropout left in a model draws the same masks in every run
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    loss = out.loss.detach().clone()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], use_cache=False).logits.detach().clone()
    model.train()
    return loss, logits, grads


def _errors(ref, got) -> dict[str, float]:
    """Relative error of every compared quantity (loss, eval logits, each gradient)."""
    loss_r, logits_r, grads_r = ref
    loss_g, logits_g, grads_g = got
    if set(grads_r) != set(grads_g):
        return {"gradient sets differ": float("inf")}
    # Some gradients are zero in exact arithmetic (e.g. a key-projection bias: softmax ignores a
    # constant shift) and hold only rounding noise; measure those against the whole gradient's size.
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads_r.values())).item() if grads_r else 0.0
    errs = {"loss": _rel(loss_g, loss_r), "logits": _rel(logits_g, logits_r)}
    for name in grads_r:
        errs[f"grad {name}"] = _rel(grads_g[name], grads_r[name], floor=1e-3 * total)
    return errs


def _compare(ref, got, ref64=None) -> tuple[bool, str]:
    """Patched (`got`) against unpatched fp32 (`ref`) within TOL. Where a quantity misses TOL and a
    float64 run of the unpatched model is given, it still passes when the patched fp32 value is as
    close to float64 as the original fp32 code is (within 2x + TOL): ill-conditioned parameters
    (routers, differential-attention lambdas) amplify any fp32 rounding, ours and the original's alike."""
    errs = _errors(ref, got)
    worst = max(errs, key=errs.get)
    if errs[worst] <= TOL:
        return True, f"worst {worst} rel err {errs[worst]:.2e}"
    if ref64 is None:
        return False, f"worst {worst} rel err {errs[worst]:.2e}"
    ours64 = _errors(ref64, got)
    theirs64 = _errors(ref64, ref)
    bad = [k for k, e in errs.items() if e > TOL and not ours64.get(k, float("inf")) <= 2 * theirs64.get(k, 0.0) + TOL]
    if bad:
        k = max(bad, key=errs.get)
        return False, (f"{k} rel err {errs[k]:.2e}; vs float64: ours {ours64.get(k, float('inf')):.2e}, "
                       f"original fp32 {theirs64.get(k, 0.0):.2e}")
    return True, (f"worst {worst} rel err {errs[worst]:.2e} vs fp32 original; vs float64 ours "
                  f"{ours64[worst]:.2e}, original fp32 {theirs64[worst]:.2e}")


def _launched(before: dict, after: dict, kind: str) -> bool:
    return any(
        after.get(k, 0) > before.get(k, 0)
        for k in after
        if k.startswith(LAUNCH_PREFIX[kind])
    )


def _patch(model, kinds: set[str]):
    from autopatch import rules
    from autopatch._api import modules_of

    def enabled(kernel: str) -> bool:
        return KIND_OF_KERNEL.get(kernel) in kinds

    records = []
    for module in modules_of(model):
        records.extend(rules.patch_module(module, enabled))
    if "layer_norm" in kinds and any(r.kernel == "layer_norm" and r.patched and r.target.startswith("torch.nn.")
                                     for r in records):
        from autopatch.rules import layer_norm

        layer_norm.patch_instances(model)  # the model was built before its modules were patched
    return records


def _restore(model) -> None:
    from autopatch import patching
    from autopatch.rules import layer_norm

    patching.restore_all()
    layer_norm.unpatch_instances(model)


def check_architecture(arch) -> dict:
    import fused_kernels
    from autopatch import patching
    from autopatch.tiny_models import build_tiny, smoke_inputs

    row = {"arch": arch.class_name, "model_dir": arch.model_dir, "module": arch.module_name}
    t0 = time.time()
    try:
        model = build_tiny(arch)
    except Exception as exc:  # noqa: BLE001
        row["status"] = "could not build"
        row["error"] = str(exc)[:300]
        return row
    inputs = smoke_inputs(model)
    try:
        ref = _run(model, inputs)
        try:  # the unpatched model in float64: the yardstick for ill-conditioned parameters
            ref64 = _run(copy.deepcopy(model).double(), inputs)
        except Exception:  # noqa: BLE001 - some architectures do not run in float64
            ref64 = None
        before = fused_kernels.launch_counts()
        records = _patch(model, set(KINDS))
        got = _run(model, inputs)
        after = fused_kernels.launch_counts()
        ok, detail = _compare(ref, got, ref64)
        row["status"] = "ok" if ok else "mismatch"
        row["detail"] = detail
        mismatched: set[str] = set()
        if not ok:  # find which kinds are to blame: patch one kind at a time
            for kind in KINDS:
                _restore(model)
                _patch(model, {kind})
                if not _compare(ref, _run(model, inputs), ref64)[0]:
                    mismatched.add(kind)
        for kind in KINDS:
            mine = [r for r in records if KIND_OF_KERNEL.get(r.kernel, r.kernel) == kind]
            patched = [r for r in mine if r.patched]
            if patched:
                targets = sorted({f"{r.target} ({r.variant})" if r.variant else r.target for r in patched})
                if kind in mismatched or (not ok and not mismatched):
                    verdict = "MISMATCH"
                elif _launched(before, after, kind):
                    verdict = "verified"
                else:
                    verdict = "not used"
                row[kind] = {"verdict": verdict, "targets": targets}
            elif mine:
                reasons = sorted({f"{r.target}: {r.reason}" for r in mine})
                row[kind] = {"verdict": "left alone", "targets": reasons}
            else:
                row[kind] = {"verdict": "none", "targets": []}
    except Exception as exc:  # noqa: BLE001
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        _restore(model)
        row["seconds"] = round(time.time() - t0, 2)
    return row


def causal_lm_architectures() -> list:
    """Every class AutoModelForCausalLM can build (its mapping), once each, with the modeling module that
    defines it (found by reading the model directory's sources)."""
    import re

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from autopatch.tiny_models import Architecture

    root = os.path.dirname(transformers.models.__file__)
    found, seen = [], set()
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        model_dir = model_type_to_module_name(model_type)
        folder = os.path.join(root, model_dir)
        if not os.path.isdir(folder):
            continue
        for class_name in [names] if isinstance(names, str) else names:
            for fname in sorted(os.listdir(folder)):
                if not (fname.startswith("modeling_") and fname.endswith(".py")):
                    continue
                with open(os.path.join(folder, fname), encoding="utf-8") as f:
                    if not re.search(rf"^class {re.escape(class_name)}\(", f.read(), re.M):
                        continue
                key = (model_dir, class_name)
                if key not in seen:
                    seen.add(key)
                    found.append(Architecture(model_dir, f"transformers.models.{model_dir}.{fname[:-3]}", class_name))
                break
    return sorted(found, key=lambda a: (a.model_dir, a.class_name))


def select(archs, names):
    if not names:
        return archs
    wanted = {n.lower() for n in names}
    return [a for a in archs if a.model_dir.lower() in wanted or a.class_name.lower() in wanted]


def summarise(rows) -> dict:
    summary = {"architectures": len(rows), "built": sum(r["status"] != "could not build" for r in rows)}
    for kind in KINDS:
        summary[f"{kind}_verified"] = sum(r.get(kind, {}).get("verdict") == "verified" for r in rows)
    summary["mismatch"] = sum(any(r.get(k, {}).get("verdict") == "MISMATCH" for k in KINDS) for r in rows)
    summary["errors"] = sum(r["status"] == "error" for r in rows)
    return summary


def markdown(rows, summary, versions) -> str:
    def cell(row, kind):
        if row["status"] in ("could not build", "error"):
            return "–"
        entry = row.get(kind, {})
        verdict = entry.get("verdict", "?")
        targets = "; ".join(entry.get("targets", []))[:120].replace("|", "/")
        mark = {"verified": "✅", "MISMATCH": "❌ MISMATCH", "not used": "◻ not used",
                "left alone": "➖ left alone", "none": "·"}.get(verdict, verdict)
        return f"{mark} {targets}".strip()

    lines = [
        "# Coverage matrix",
        "",
        f"Generated by `python dev/coverage_matrix.py` on {versions['date']} with transformers "
        f"{versions['transformers']}, torch {versions['torch']}, triton {versions['triton']} "
        "(CPU, Triton interpreter). ✅ = patched, kernel ran, loss / eval logits / every gradient match the "
        "unpatched model within 1e-5 relative (fp32); ➖ = the rule refused (reason); ◻ = patched but not "
        "called by this model; · = no candidate; ❌ = patched and different (a bug).",
        "",
        f"**Summary:** {summary['architectures']} architectures, {summary['built']} build tiny; verified: "
        f"rms_norm {summary['rms_norm_verified']}, layer_norm {summary['layer_norm_verified']}, rope {summary['rope_verified']}, glu {summary['glu_verified']}, "
        f"loss {summary['loss_verified']}; MISMATCH rows: {summary['mismatch']}; run errors: {summary['errors']}.",
        "",
        "| architecture | rms_norm | layer_norm | rope | glu (swiglu/geglu) | loss (CE / fused linear CE) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "could not build":
            lines.append(f"| {row['arch']} | could not build: {row['error'][:100].replace('|', '/')} | | | | |")
            continue
        if row["status"] == "error":
            lines.append(f"| {row['arch']} | run error: {row['error'][:100].replace('|', '/')} | | | | |")
            continue
        lines.append("| " + " | ".join([row["arch"]] + [cell(row, k) for k in KINDS]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="model directories (llama) or class names; none = all")
    parser.add_argument("--json", default=None, help="write rows + summary as JSON here")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")
    parser.add_argument("--quiet", action="store_true", help="no per-architecture lines")
    parser.add_argument("--memory-gib", type=float, default=12.0,
                        help="address-space cap, so an architecture whose 'tiny' model is not tiny fails "
                             "with an error instead of the machine's OOM killer ending the whole run")
    args = parser.parse_args(argv)
    try:
        import resource

        cap = int(args.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (ImportError, ValueError, OSError):  # not on this platform: run uncapped
        pass

    import transformers
    import triton

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    archs = select(causal_lm_architectures(), args.names)
    if not archs:
        print(f"no architecture matches {args.names}", file=sys.stderr)
        return 2
    rows = []
    for arch in archs:
        with contextlib.redirect_stderr(io.StringIO()):
            row = check_architecture(arch)
        rows.append(row)
        if not args.quiet:
            verdicts = " ".join(f"{k}={row.get(k, {}).get('verdict', '-')}" for k in KINDS)
            print(f"{row['arch']:<40} {row['status']:<16} {verdicts} {row.get('detail', row.get('error', ''))[:80]}",
                  flush=True)
    summary = summarise(rows)
    versions = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "summary": summary, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, summary, versions))
    return 1 if summary["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
