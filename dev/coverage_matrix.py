"""Coverage matrix: every transformers causal-LM architecture, patched where it matches, verified.

For each causal LM that `AutoModelForCausalLM` can build in the installed transformers (the classes of
its mapping, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: GPT2LMHeadModel and the like too, no list typed by
hand) this builds a tiny random model (tests/tiny_models.py), runs it unpatched, patches
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
    python dev/coverage_matrix.py --vlm --json docs/coverage_vlm.json --markdown docs/coverage.md
The last one is the image-text-to-text table (the loss rule over MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
each head built tiny by TINY_VLMS or the generic builder, plus a multimodal RoPE column), written after
the causal-LM table of the same file; `--vlm qwen3_vl llava_next` checks a few heads.
    python dev/coverage_matrix.py --vision-attention --markdown docs/coverage.md
The vision towers' windowed attention (the vision_attention rule over every modeling module with the
cu_seqlens split loop, and its heads built tiny with SDPA attention), written as the file's last section.
    python dev/coverage_matrix.py --masked-attention --markdown docs/coverage.md
SDPA under a padding mask in blocks of 4 queries (the masked_attention rule alone) over every causal LM
that builds tiny under SDPA, patched vs unpatched: its own section.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from autopatch import session  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # tiny_models

KINDS = ("rms_norm", "layer_norm", "rope", "glu", "gelu_mlp", "experts", "loss")
KIND_OF_KERNEL = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "rope": "rope",
    "swiglu": "glu",
    "geglu": "glu",
    "gelu_mlp": "gelu_mlp",
    "cross_entropy": "loss",
    "fused_linear_cross_entropy": "loss",
}
# Launch-counter prefixes (fused_kernels.launch_counts keys) that prove a kind's kernel ran.
LAUNCH_PREFIX = {
    "rms_norm": ("rms_norm",),
    "layer_norm": ("layer_norm",),
    "rope": ("rope",),
    "glu": ("swiglu", "geglu"),
    "gelu_mlp": ("gelu",),
    "experts": ("moe_experts",),
    "loss": ("cross_entropy", "fused_linear_cross_entropy"),
}
EXPERTS_RULE = "moe_experts"  # governed by swiglu/geglu like the GLU rules, shown in a column of its own


def kind_of(record) -> str:
    """The column a record belongs to: the experts rule's records (autopatch.rules.moe_experts) under
    "experts", every other by its kernel."""
    from autopatch.rules import moe_experts

    return "experts" if moe_experts.is_experts_record(record) else KIND_OF_KERNEL.get(record.kernel, record.kernel)


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

    glu_kernels = {k for k, kind in KIND_OF_KERNEL.items() if kind == "glu"}

    def enabled(kernel: str) -> bool:
        return KIND_OF_KERNEL.get(kernel) in kinds or ("experts" in kinds and kernel in glu_kernels)

    skip = frozenset() if "experts" in kinds else frozenset({EXPERTS_RULE})
    records = []
    for module in modules_of(model):
        records.extend(rules.patch_module(module, session.current(), enabled, skip=skip))
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
    from tiny_models import build_tiny, smoke_inputs

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
        check = _every_rule(model, inputs, ref, _run)
        ok, records, before, after = check["ok"], check["records"], check["before"], check["after"]
        row["status"] = "ok" if ok else "mismatch"
        row["detail"] = check["detail"]
        mismatched = set(check["blamed"])
        for kind in KINDS:
            mine = [r for r in records if kind_of(r) == kind]
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


def _every_rule(model, inputs, ref, run, inputs64=None) -> dict:
    """Every rule on over the model's modules (its nn.LayerNorm instances too), run with `run` and compared
    with the unpatched `ref`, a float64 run of the unpatched model as the yardstick for ill-conditioned
    parameters where it runs in float64 (on `inputs64`, default `inputs`); where the numbers differ, the
    kinds to blame, patched one at a time. {"ok", "detail", "records", "before", "after", "blamed"}."""
    import fused_kernels

    try:
        ref64 = run(copy.deepcopy(model).double(), inputs if inputs64 is None else inputs64)
    except Exception:  # noqa: BLE001 - some architectures do not run in float64
        ref64 = None
    before = fused_kernels.launch_counts()
    records = _patch(model, set(KINDS))
    got = run(model, inputs)
    after = fused_kernels.launch_counts()
    ok, detail = _compare(ref, got, ref64)
    blamed = []
    if not ok:
        for kind in KINDS:
            _restore(model)
            _patch(model, {kind})
            if not _compare(ref, run(model, inputs), ref64)[0]:
                blamed.append(kind)
    return {"ok": ok, "detail": detail, "records": records, "before": before, "after": after, "blamed": blamed}


def causal_lm_architectures() -> list:
    """Every class AutoModelForCausalLM can build (its mapping), once each, with the modeling module that
    defines it (found by reading the model directory's sources)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return _mapping_architectures(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _mapping_architectures(mapping) -> list:
    """The classes of one of transformers' auto mappings, once each, with the modeling module that
    defines each (found by reading the model directory's sources)."""
    import re

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from tiny_models import Architecture

    root = os.path.dirname(transformers.models.__file__)
    found, seen = [], set()
    for model_type, names in mapping.items():
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
        f"gelu_mlp {summary['gelu_mlp_verified']}, experts {summary['experts_verified']}, loss {summary['loss_verified']}; MISMATCH rows: {summary['mismatch']}; run errors: {summary['errors']}.",
        "",
        "| architecture | rms_norm | layer_norm | rope | glu (swiglu/geglu) | GELU MLP | MoE experts | loss (CE / fused linear CE) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "could not build":
            lines.append(f"| {row['arch']} | could not build: {row['error'][:100].replace('|', '/')} | | | | | | |")
            continue
        if row["status"] == "error":
            lines.append(f"| {row['arch']} | run error: {row['error'][:100].replace('|', '/')} | | | | | | |")
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
    parser.add_argument("--vlm", action="store_true",
                        help="the image-text-to-text table (the loss rule) instead of the causal-LM one; "
                             "--markdown then appends it to the file")
    parser.add_argument("--vision-attention", action="store_true",
                        help="the vision towers' windowed attention table (the vision_attention rule); "
                             "--markdown then replaces or appends its section")
    parser.add_argument("--masked-attention", action="store_true",
                        help="SDPA under a padding mask in query blocks (the masked_attention rule) over every "
                             "causal LM; --markdown then replaces or appends its section")
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
    if args.vlm:
        return main_vlm(args)
    if args.vision_attention:
        return main_vision_attention(args)
    if args.masked_attention:
        return main_masked_attention(args)
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


# --------------------------------------------------------------------------- image-text-to-text heads
# The second table: every class of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, the loss rule's verdict
# from structure (autopatch.rules.loss), what the rope rule does with the module's rotary functions,
# and, for every head that builds tiny, the numbers: patched vs unpatched loss, every gradient (vision
# tower included) and eval logits, fp32 at 1e-5. Six families have a hand-written builder (TINY_VLMS,
# the loss-rule tests' models, with the extra scenarios there); every other head goes through the
# generic builder further down. A hand-written builder gives tiny vision and text configs and synthetic
# inputs of the model's form: Qwen2-VL's flattened patches with image_grid_thw, square images for
# SigLIP / CLIP towers, placeholder ids in input_ids (IMAGE 90, delimiters 91-93; text tokens are
# drawn below 80).
VOCAB = 96
IMAGE, START, END = 90, 91, 92
BATCH = 2


def _transformers():
    import transformers

    return transformers


def _text_ids(seq, g):
    return torch.randint(0, 80, (BATCH, seq), generator=g)


def _qwen_vl_text():
    """The text model of both Qwen-VL builders: multimodal RoPE over (time, height, width) sections."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
                bos_token_id=None, eos_token_id=None)


def _qwen_vl_inputs():
    """Per image a 1 x 4 x 4 patch grid: 16 flattened patches of 3 * 2 * 2 * 2 values, 4 tokens after the
    merge, between the vision start and end tokens."""
    g = torch.Generator().manual_seed(1)
    ids = _text_ids(12, g)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = START, IMAGE, END
    return dict(input_ids=ids, pixel_values=torch.randn(BATCH * 16, 24, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]] * BATCH), mm_token_type_ids=(ids == IMAGE).int())


def _qwen2_vl():
    cfg = _transformers().Qwen2VLConfig(
        text_config=_qwen_vl_text(),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=93, vision_start_token_id=START, vision_end_token_id=END)
    return "qwen2_vl", "Qwen2VLForConditionalGeneration", cfg, _qwen_vl_inputs()


def _gemma3():
    cfg = _transformers().Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         sliding_window=4),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=2),
        mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END)
    g = torch.Generator().manual_seed(1)
    ids = _text_ids(12, g)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = START, IMAGE, END
    inputs = dict(input_ids=ids, pixel_values=torch.randn(BATCH, 3, 8, 8, generator=g),
                  token_type_ids=(ids == IMAGE).long())
    return "gemma3", "Gemma3ForConditionalGeneration", cfg, inputs


def _llava():
    cfg = _transformers().LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=24,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2,
                           projection_dim=16),
        image_token_index=IMAGE, vision_feature_layer=-1)
    g = torch.Generator().manual_seed(1)
    ids = _text_ids(20, g)
    ids[:, 2:18] = IMAGE  # 4 x 4 patches, the CLS token dropped ("default" feature selection)
    return "llava", "LlavaForConditionalGeneration", cfg, dict(input_ids=ids,
                                                               pixel_values=torch.randn(BATCH, 3, 8, 8, generator=g))


def _paligemma():
    # a Gemma 2 text model: the final-logit softcap, read as
    # getattr(self.config.get_text_config(), "final_logit_softcapping", None)
    cfg = _transformers().PaliGemmaConfig(
        text_config=dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, final_logit_softcapping=3.0, sliding_window=4),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4, projection_dim=32),
        image_token_index=IMAGE, projection_dim=32, hidden_size=32)
    g = torch.Generator().manual_seed(1)
    ids = _text_ids(10, g)
    ids[:, :4] = IMAGE  # 2 x 2 patches, then the prefix, then the suffix (token_type_ids 1)
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, 6:] = 1
    return "paligemma", "PaliGemmaForConditionalGeneration", cfg, dict(
        input_ids=ids, pixel_values=torch.randn(BATCH, 3, 8, 8, generator=g), token_type_ids=token_type_ids)


def _qwen2_5_vl():
    # windowed attention in the tower (window_size 4, block 1 with full attention)
    cfg = _transformers().Qwen2_5_VLConfig(
        text_config=_qwen_vl_text(),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=4,
                           out_hidden_size=32, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=93, vision_start_token_id=START, vision_end_token_id=END)
    return "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", cfg, _qwen_vl_inputs()


def _idefics3():
    # pixel_values [batch, images, 3, H, W]; 16 patches per image, 4 tokens after the pixel shuffle
    cfg = _transformers().Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=2),
        image_token_id=IMAGE, scale_factor=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 80, (BATCH, 12), generator=g)
    ids[:, 3:7] = IMAGE
    inputs = dict(input_ids=ids, pixel_values=torch.randn(BATCH, 1, 3, 8, 8, generator=g))
    return "idefics3", "Idefics3ForConditionalGeneration", cfg, inputs


TINY_VLMS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3, "llava": _llava,
             "paligemma": _paligemma, "idefics3": _idefics3}


def build_tiny_vlm(model_dir, attn: str = "eager"):
    """(model, inputs) of a TINY_VLMS entry, fp32, eager attention (or `attn`), O(1)-sized logits."""
    import importlib

    _, class_name, cfg, inputs = TINY_VLMS[model_dir]()
    cfg._attn_implementation = attn  # the setter sets the sub-configs too
    torch.manual_seed(0)
    module = importlib.import_module(f"transformers.models.{model_dir}.modeling_{model_dir}")
    model = getattr(module, class_name)(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    labels = inputs["input_ids"].clone()
    labels[labels >= IMAGE] = -100  # image placeholders and delimiters are not targets
    labels[:, :2] = -100
    return model, dict(inputs, labels=labels)


# --- the generic tiny builder: every other head, from its own config class ----------------------
# The config class's defaults shrunk (tests/tiny_models.py's SHRINK, 2 text layers), every vision
# sub-config shrunk further (VISION_SHRINK: 16 x 16 images of 4 x 4 patches), special token ids moved
# to the top of the tiny vocabulary (above the text ids), per-family quirks as data (VLM_OVERRIDES).
# The inputs take the first of PIXEL_FORMS whose forward and backward run; the number of image
# placeholders is what the model's own image path produces: the features its get_placeholder_mask
# receives on a first forward with none (else the count its "tokens: N, features: M" check states).
GENERIC_VOCAB = 256
TEXT_TOKENS = 200  # text ids are drawn from [3, 200); remapped special ids live in [200, 256)
GENERIC_LAYERS = 2
VISION_SHRINK = {
    "image_size": 16, "patch_size": 4, "depth": 2, "num_heads": 4, "num_hidden_layers": 2, "num_layers": 2,
    "hidden_size": 64, "embed_dim": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "out_hidden_size": 64, "projection_dim": 64, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "window_size": 8, "fullatt_block_indexes": [1], "deepstack_visual_indexes": [1],
    "num_position_embeddings": 16, "head_dim": 16, "num_key_value_heads": 4,
    "text_hidden_size": 64, "codebook_dim": 64,  # widths that must equal the text model's / the encoder's
}
ID_NAME = re.compile(r".*(token_id|token_index|patch_id)$")
KEPT_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")
# model_type (of the top config) -> {field: value} over the shrunk kwargs; a dict merges into a
# sub-config's kwargs
_GLM_MROPE = {"text_config": {"rope_parameters": {"mrope_section": [8, 12, 12]}}}  # the modeling code's default
VLM_OVERRIDES: dict[str, dict] = {
    "glm4v": _GLM_MROPE, "glm46v": _GLM_MROPE, "glm4v_moe": _GLM_MROPE, "glm_ocr": _GLM_MROPE,
    "vipllava": {"vision_feature_layers": [-2, -1]},  # the default taps layers 20, -11, -8 of a 24-layer tower
    # HunYuan-VL's multimodal RoPE needs the sections, which the default leaves out
    "hunyuan_vl": {"text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}}},
    # the vision adapter takes the pixel-shuffled features (hidden / ratio^2 = 256) and 4096-wide projections
    "llama4": {"vision_config": {"intermediate_size": 256, "projector_input_dim": 64, "projector_output_dim": 64,
                                 "vision_output_dim": 64}},
    "fuyu": {"patch_size": 4, "image_size": 16},  # the decoder embeds 30 x 30 patches itself
    # layer indices of the full-size defaults, cut to the 2 tiny layers (the tower's output width follows)
    "mllama": {"text_config": {"cross_attention_layers": [1]},
               "vision_config": {"intermediate_layers_indices": [0, 1], "num_global_layers": 1, "vision_output_dim": 192}},
    "deepseek_vl_hybrid": {"high_res_vision_config": {"global_attn_indexes": [1]}},
    "granite4_vision": {"deepstack_layer_map": [[0, 0], [1, 1]], "spatial_target_layers": [0, 1, 0, 1],
                        "downsample_rate": "1/2"},
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},  # default: layers 24 and 18 of the tower
    "nemotron_h_omni": {"vision_config": {"video_temporal_patch_size": 2}},
    "aria": {"projector_patch_to_query_dict": {16: 4}},  # 4 x 4 patches -> 4 queries (the default knows 35^2, 70^2)
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0}},  # its DSA attention layers take no RoPE
    "kimi_k25": {"projection_hidden_size": 64},  # the projector's width, 1152 (the tower's full width)
    "gemma4_unified": {"vision_config": {"mm_embed_dim": 64, "output_proj_dims": 64, "mm_posemb_size": 16,
                                         "pooling_kernel_size": 1}},
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [22, 22, 20]}}},
    "qwen2_5_omni_thinker": {"text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}}},
    "step3p7": {"text_config": {"sliding_window": 16}},  # sliding layers with no default window
    "paddleocr_vl": {"text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}}},
}
PIXEL_FORMS = ("image", "images", "grid", "patches", "flat", "tiles", "siglip2", "positions", "rows", "mllama")


def _vision_subconfigs(default) -> list[str]:
    return [k for k, v in vars(default).items()
            if k.endswith("_config") and k != "text_config" and hasattr(v, "to_dict")]


def _vision_config(config):
    """The vision tower's sub-config (a name with "vision" first), None when there is none."""
    names = sorted(_vision_subconfigs(config), key=lambda k: "vision" not in k)
    return getattr(config, names[0]) if names else None


def _generic_kwargs(config_cls) -> dict:
    from tiny_models import _shrunk_kwargs

    default = config_cls()
    kwargs = _shrunk_kwargs(config_cls, GENERIC_LAYERS)
    for name, cls in getattr(config_cls, "sub_configs", {}).items():
        if "vision" in name and getattr(default, name, None) is None and isinstance(cls, type):
            kwargs[name] = _shrunk_kwargs(cls, GENERIC_LAYERS)  # a tower the default leaves out (Gemma 4)
            setattr(default, name, cls())
    for name in _vision_subconfigs(default):
        fields = getattr(default, name).to_dict()
        sub = dict(kwargs.get(name, {}))
        for key, value in VISION_SHRINK.items():
            if key in fields and (fields[key] is not None or key == "head_dim"):
                if isinstance(fields[key], (list, tuple)) and isinstance(value, int) and len(fields[key]) == 2:
                    value = [value, value]  # (height, width) sizes
                sub[key] = value
        kwargs[name] = sub
    if "image_grid_pinpoints" in vars(default):  # LLaVA-NeXT's any-resolution tiles: one tile, one image size
        kwargs["image_grid_pinpoints"] = [[VISION_SHRINK["image_size"]] * 2]
    for name, value in VLM_OVERRIDES.get(getattr(config_cls, "model_type", ""), {}).items():
        kwargs[name] = {**kwargs.get(name, {}), **value} if isinstance(value, dict) else value
    for name, sub in kwargs.items():  # some __post_init__ read a sub-config dict's model_type
        model_type = getattr(getattr(default, name, None), "model_type", None)
        if isinstance(sub, dict) and name.endswith("_config") and model_type:
            sub.setdefault("model_type", model_type)
    _fit_mrope(kwargs, default)
    if isinstance(kwargs.get("text_config"), dict) and hasattr(default, "text_config"):
        _fit_mrope(kwargs["text_config"], default.text_config)
    return kwargs


def _fit_mrope(kwargs: dict, default) -> None:
    """Multimodal RoPE sections (time, height, width) must sum to half the rotary size: the default
    ones, sized for a full model's heads, scaled down to the tiny heads in the same proportions."""
    for field in ("rope_parameters", "rope_scaling"):
        rope = {**(getattr(default, field, None) or {}), **kwargs.get(field, {})}
        if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), (list, tuple)):
            continue
        heads = kwargs.get("num_attention_heads", getattr(default, "num_attention_heads", 4)) or 4
        rotary = kwargs.get("qk_rope_head_dim") or kwargs.get("head_dim") or kwargs.get("hidden_size", 64) // heads
        rotary = int(rotary * rope.get("partial_rotary_factor", 1.0))
        sections = list(rope["mrope_section"])
        half, total = rotary // 2, sum(sections)
        fitted = [max(1, round(s * half / total)) for s in sections]
        fitted[0] += half - sum(fitted)  # rounding's remainder, if any
        kwargs[field] = {**rope, "mrope_section": fitted}


def _remap_ids(config) -> dict[str, int]:
    """Special token ids (top config and text config; pad / bos / eos are 0-2 already) at the top of
    the tiny vocabulary, above the text ids, distinct ids staying distinct. Returns the top config's id fields."""
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", GENERIC_VOCAB)
    moved: dict[int, int] = {}
    if "image_token_id" in vars(config) and config.image_token_id is None:  # MiniCPM-V: no default id
        config.image_token_id = vocab - 1 - 16
    for cfg in {id(config): config, id(text): text}.values():
        for key, value in list(cfg.to_dict().items()):
            if (ID_NAME.match(key) and isinstance(value, int) and not isinstance(value, bool)
                    and key not in KEPT_IDS and value >= 3):  # out of the text ids' range
                if value not in moved:
                    moved[value] = vocab - 1 - len(moved)
                with contextlib.suppress(Exception):
                    setattr(cfg, key, moved[value])
    return {k: v for k, v in config.to_dict().items()
            if ID_NAME.match(k) and isinstance(v, int) and not isinstance(v, bool)}


def _image_id(ids: dict[str, int]):
    for key in ("image_token_id", "image_token_index", "image_pad_token_id", "image_patch_id", "img_context_token_id",
                "image_context_token_id", "media_placeholder_token_id"):
        if key in ids:
            return ids[key]
    image = [v for k, v in ids.items() if "image" in k and "start" not in k and "end" not in k]
    return image[0] if image else None


def _delimiters(ids: dict[str, int]):
    start = end = None
    for key, value in ids.items():
        if any(s in key for s in ("vision_start", "boi_", "image_start", "im_start", "start_image")):
            start = value if start is None else start
        if any(s in key for s in ("vision_end", "eoi_", "image_end", "im_end", "end_image")):
            end = value if end is None else end
    return start, end


def _pixels(form: str, vision, g):
    """Pixel inputs of one form for BATCH images, and the extra fields that form needs."""
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    size = getattr(vision, "image_size", 16)
    size = size[0] if isinstance(size, (list, tuple)) else size
    size = size if isinstance(size, int) and size <= 64 else 16
    if form == "image":
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)}
    if form == "tiles":  # LLaVA-NeXT: the base image and one tile, with the image's size
        return {"pixel_values": torch.randn(BATCH, 2, channels, size, size, generator=g),
                "image_sizes": torch.tensor([[size, size]] * BATCH)}
    if form == "images":
        return {"pixel_values": torch.randn(BATCH, 1, channels, size, size, generator=g)}
    patch = getattr(vision, "patch_size", 4)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    temporal = getattr(vision, "temporal_patch_size", 1) or 1
    side = 4  # a 1 x 4 x 4 patch grid per image
    if form == "grid":
        return {"pixel_values": torch.randn(BATCH * side * side, channels * temporal * patch * patch, generator=g),
                "image_grid_thw": torch.tensor([[1, side, side]] * BATCH)}
    if form == "flat":  # a grid of flattened patches without the temporal axis, [n, C * p * p]
        return {"pixel_values": torch.randn(BATCH * side * side, channels * patch * patch, generator=g),
                "image_grid_thw": torch.tensor([[1, side, side]] * BATCH)}
    if form == "siglip2":  # NaFlex SigLIP 2: [B, patches, C * p * p], the grid and a patch mask per image
        return {"pixel_values": torch.randn(BATCH, side * side, channels * patch * patch, generator=g),
                "spatial_shapes": torch.tensor([[side, side]] * BATCH),
                "pixel_attention_mask": torch.ones(BATCH, side * side, dtype=torch.long)}
    if form == "positions":  # Gemma 4: [B, patches, C * p * p] and each patch's (x, y) in image_position_ids
        yx = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
        return {"pixel_values": torch.randn(BATCH, side * side, channels * patch * patch, generator=g),
                "image_position_ids": yx.flip(-1).expand(BATCH, -1, -1).clone()}
    if form == "rows":  # [B, patches, C * p * p]
        return {"pixel_values": torch.randn(BATCH, side * side, channels * patch * patch, generator=g)}
    if form == "mllama":  # one image of max_num_tiles tiles, aspect ratio 1 (1 x 1 tiles used)
        tiles = getattr(vision, "max_num_tiles", 1)
        mask = torch.zeros(BATCH, 1, tiles, dtype=torch.long)
        mask[:, :, 0] = 1
        return {"pixel_values": torch.randn(BATCH, 1, tiles, channels, size, size, generator=g),
                "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long), "aspect_ratio_mask": mask}
    if form == "patches":  # a grid without the temporal axis, patches [n, C, p, p]
        return {"pixel_values": torch.randn(BATCH * side * side, channels, patch, patch, generator=g),
                "image_grid_thw": torch.tensor([[1, side, side]] * BATCH)}
    raise ValueError(f"unknown pixel form {form!r}")


def _place(ids, per_image: int, image: int, start, end):
    """`per_image` placeholders per sample after 2 text tokens, with the delimiters around them."""
    pos = 2
    if start is not None:
        ids[:, pos] = start
        pos += 1
    ids[:, pos:pos + per_image] = image
    pos += per_image
    if end is not None:
        ids[:, pos] = end
    return ids


def _feature_count(model, inputs):
    """How many image features the model's own image path produces for `inputs` (in all): the
    tensor its get_placeholder_mask receives (numel / hidden size), else the count its "tokens: N,
    features: M" error states; None when the forward runs without complaint or says neither."""
    seen: list[int] = []
    wrapped = []
    for m in model.modules():
        original = getattr(type(m), "get_placeholder_mask", None)
        if original is None:
            continue

        def spy(*args, _original=original.__get__(m), **kwargs):
            names = ("input_ids", "inputs_embeds", "image_features")
            bound = dict(zip(names, args)) | kwargs
            feats, embeds = bound.get("image_features"), bound.get("inputs_embeds")
            if isinstance(feats, (list, tuple)):
                feats = torch.cat([f.reshape(-1, embeds.shape[-1]) for f in feats]) if feats else None
            if feats is not None and embeds is not None:
                seen.append(feats.numel() // embeds.shape[-1])
            return _original(*args, **kwargs)

        m.get_placeholder_mask = spy
        wrapped.append(m)
    try:
        model(**inputs)
        error = None
    except Exception as exc:  # noqa: BLE001
        error = exc
    finally:
        for m in wrapped:
            del m.get_placeholder_mask
    if seen:
        return seen[0]
    found = re.search(r"tokens:\s*(\d+),\s*features:?\s*(\d+)", str(error)) if error else None
    if found:
        return int(found.group(2))
    if error is not None:
        raise error
    return None


def _generic_inputs(model, form: str, ids_cfg: dict[str, int], per_image: int | None):
    import inspect

    config = model.config
    params = inspect.signature(type(model).forward).parameters
    image = _image_id(ids_cfg)
    if image is None:
        raise ValueError("no image placeholder id in the config")
    start, end = _delimiters(ids_cfg)
    vision = _vision_config(config)
    g = torch.Generator().manual_seed(1)
    n = per_image or 0
    seq = n + 8
    ids = torch.randint(3, TEXT_TOKENS, (BATCH, seq), generator=g)
    ids = _place(ids, n, image, start, end)
    inputs = dict(input_ids=ids, **_pixels(form, vision or config, g), use_cache=False)
    if "pixel_values" not in params and "image_patches" in params:  # Fuyu: patches straight into the decoder
        inputs["image_patches"] = inputs.pop("pixel_values")
    if "mm_token_type_ids" in params:
        inputs["mm_token_type_ids"] = (ids == image).int()
    if "token_type_ids" in params:
        inputs["token_type_ids"] = (ids == image).long()
    if "cross_attention_mask" in params and "aspect_ratio_mask" in inputs:  # Mllama: every token sees the image
        inputs["cross_attention_mask"] = inputs["aspect_ratio_mask"][:, None].expand(-1, seq, -1, -1).clone()
    if "high_res_pixel_values" in params:  # DeepSeek-VL hybrid: the same image for the high-resolution tower
        high = getattr(config, "high_res_vision_config", None)
        inputs["high_res_pixel_values"] = torch.randn(BATCH, 3, *[getattr(high, "image_size", 16)] * 2, generator=g)
    if "target_sizes" in params:  # MiniCPM-V: each image's patch grid
        inputs["target_sizes"] = torch.tensor([[4, 4]] * BATCH)
    if "image_merge_sizes" in params:  # VideoLLaMA 3: the merge size of each image
        merge = getattr(vision, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", 1) or 1
        inputs["image_merge_sizes"] = torch.tensor([merge] * BATCH)
    if "image_sizes" in params and "image_sizes" not in inputs:
        side = inputs["pixel_values"].shape[-1]
        inputs["image_sizes"] = torch.tensor([[side, side]] * BATCH)
    labels = ids.clone()
    labels[ids >= TEXT_TOKENS] = -100
    labels[:, :2] = -100
    return dict(inputs, labels=labels)


def build_generic_vlm(arch, attn: str = "eager"):
    """(model, inputs) of any head from its config class, eager attention (or `attn`): the first pixel
    form whose forward and backward run, with the placeholder count the model's image path gives. Raises
    RuntimeError with every form's error when none does."""
    import importlib
    import inspect

    from tiny_models import build_tiny, smoke_inputs

    module = importlib.import_module(arch.module_name)
    model_cls = getattr(module, arch.class_name)
    if not {"pixel_values", "image_patches"} & set(inspect.signature(model_cls.forward).parameters):
        # a head whose forward takes no pixel_values (Mistral 4's text-only causal LM; Evolla's proteins and
        # Kosmos-2.5's flattened patches are left out): the causal-LM table's builder and inputs
        model = build_tiny(arch)
        inputs = smoke_inputs(model)
        labels = inputs["labels"].clone()
        labels[:, :2] = -100
        return model, dict(inputs, labels=labels)
    config_cls = model_cls.config_class
    config = config_cls(**_generic_kwargs(config_cls))
    ids_cfg = _remap_ids(config)
    config._attn_implementation = attn
    for sub in _vision_subconfigs(config) + ["text_config"]:
        with contextlib.suppress(Exception):
            getattr(config, sub)._attn_implementation = attn
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head is not None:
            head.weight.normal_(0.0, 0.3)  # O(1)-sized logits
    errors = []
    for form in PIXEL_FORMS:
        try:
            total = _feature_count(model, _generic_inputs(model, form, ids_cfg, None))
            if total == 0:
                raise ValueError("the image path produced no features for the placeholders")
            # None: the model counts no placeholders (cross-attention, Mllama): one, as its processor writes
            per_image = 1 if total is None else total // BATCH
            inputs = _generic_inputs(model, form, ids_cfg, per_image)
            model.train()
            out = model(**inputs)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
            if not torch.isfinite(out.loss):
                raise ValueError(f"loss {out.loss.item()}")
            return model, inputs
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{form}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    raise RuntimeError("no pixel form runs; " + " | ".join(errors))


def _run_vlm(model, inputs):
    """Loss and every parameter gradient in training mode, logits in eval mode (pixels included)."""
    loss, _, grads = _run(model, inputs)
    model.eval()
    with torch.no_grad():
        eval_inputs = {k: v for k, v in inputs.items() if k != "labels"} | {"use_cache": False}
        logits = model(**eval_inputs).logits.detach().clone()
    model.train()
    return loss, logits, grads


def build_vlm(arch, attn: str = "eager"):
    """(model, inputs, which builder) of any image-text-to-text head: TINY_VLMS where it has an entry,
    else the generic builder."""
    if arch.model_dir in TINY_VLMS:
        return (*build_tiny_vlm(arch.model_dir, attn), "TINY_VLMS")
    model, inputs = build_generic_vlm(arch, attn)
    text_only = not set(inputs) - {"input_ids", "labels", "use_cache"}
    return model, inputs, "generic, text only (the head takes no pixel_values)" if text_only else "generic"


def image_text_to_text_architectures() -> list:
    """Every class AutoModelForImageTextToText can build, with the modeling module that defines it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return _mapping_architectures(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def check_vlm_loss(arch) -> dict:
    """The loss rule on one image-text-to-text head: its records, the RoPE column, and the numbers
    where the head builds tiny (TINY_VLMS, else the generic builder)."""
    import importlib

    import fused_kernels
    from autopatch import patching
    from autopatch.rules import loss

    row = {"arch": arch.class_name, "model_dir": arch.model_dir, "module": arch.module_name}
    try:
        module = importlib.import_module(arch.module_name)
        row["rope"] = rope_column(module, getattr(getattr(module, arch.class_name), "config_class", None))
        model = inputs = ref = None
        try:
            with torch.random.fork_rng(devices=[]):
                model, inputs, row["builder"] = build_vlm(arch)
        except (Exception, _TooSlow) as exc:  # noqa: BLE001
            row["build_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        if model is not None:
            ref = _run_vlm(model, inputs)
            row["vision_grads"] = sum(1 for n in ref[2] if _is_vision(n))
        records = [r for r in loss.RULE.patch_module(module, session.current(), lambda kernel: True)
                   if r.target in (f"{arch.class_name}.forward", f"{arch.class_name}.loss_function")]
        flce = [r for r in records if r.kernel == "fused_linear_cross_entropy"]
        ce = [r for r in records if r.kernel == "cross_entropy"]
        row["fused_linear"] = _record_text(flce)
        row["cross_entropy"] = _record_text(ce)
        patched = any(r.patched for r in flce)
        row["structure"] = "patched" if patched else "left alone"
        if model is None:
            row["numbers"] = "could not build"
        else:
            before = fused_kernels.launch_counts()
            got = _run_vlm(model, inputs)
            after = fused_kernels.launch_counts()
            ok, detail = _compare(ref, got)
            fused_ran = any(after[k] > before.get(k, 0) for k in after if k.startswith("fused_linear_cross_entropy"))
            if not ok:
                row["numbers"] = "MISMATCH"
            elif not patched:
                row["numbers"] = "unchanged"  # left alone: the same forward, the same numbers
            else:
                row["numbers"] = "verified" if fused_ran else "not used"
            row["detail"] = detail
            if ok:
                patching.restore_all()
                try:
                    row["all_kernels"] = _check_every_kernel(model, inputs, ref)
                except (Exception, _TooSlow) as exc:  # noqa: BLE001 - the loss verdict above stands
                    row["all_kernels"] = {"verdict": "error", "detail": f"{type(exc).__name__}: {str(exc)[:200]}",
                                          "ran": []}
    except (Exception, _TooSlow) as exc:  # noqa: BLE001
        row["structure"] = row.get("structure", "error")
        row["numbers"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if model is not None:
            _restore(model)
        patching.restore_all()
    return row


def _check_every_kernel(model, inputs, ref) -> dict:
    """Every rule over every module of the head (vision tower and text model included; the model's
    nn.LayerNorm instances too), patched vs unpatched: the verdict, the kinds whose kernels ran, and
    where the numbers differ the kinds to blame."""
    inputs64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in inputs.items()}
    check = _every_rule(model, inputs, ref, _run_vlm, inputs64)
    out = {"verdict": "verified" if check["ok"] else "MISMATCH", "detail": check["detail"],
           "ran": [kind for kind in KINDS if _launched(check["before"], check["after"], kind)],
           "patched": sorted({f"{kind_of(r)}:{r.target}" for r in check["records"] if r.patched})}
    if not check["ok"]:
        out["blamed"] = check["blamed"]
    return out


# --- the multimodal RoPE column ------------------------------------------------------------------
# What the head's modeling module does with rotary embeddings, and what the rope rule
# (autopatch.rules.rope) does with it: multimodal sections (time / height / width) folded into cos and
# sin by a rotary-embedding class, then applied by the standard apply_rotary_pos_emb (patched by the
# rope rule where its probe proves the variant), versus functions of the module's own that the rule
# does not read (vision 2-D rotary, multimodal rotary applied in a function of its own).
ROTARY_FN = re.compile(r"^apply_\w*(rotary|rope)\w*$")


def rope_column(module, config_cls=None) -> dict:
    import inspect

    from autopatch.rules import _probe, rope

    name = module.__name__
    own = {n: f for n in vars(module) if ROTARY_FN.match(n) for f in [_probe.module_function(module, n)] if f}
    sections = sorted(n for n, c in vars(module).items()
                      if inspect.isclass(c) and c.__module__ == name and "mrope_section" in _source(c))
    parts, verdicts = [], []
    if sections:
        parts.append(f"multimodal sections folded into cos/sin in {', '.join(sections)}")
    for fn_name, fn in sorted(own.items()):
        if fn_name in rope.TARGETS:
            verdict = rope.RULE.verdict(rope.Candidate(fn_name, fn, (module, fn_name)), module)
            if verdict.variant is not None:
                parts.append(f"{fn_name}: patched by the rope rule ({verdict.variant.describe()})")
                verdicts.append("patched")
            else:
                parts.append(f"{fn_name}: left alone by the rope rule ({verdict.reason})")
                verdicts.append("left alone")
        else:
            callers = [n for n, c in vars(module).items()
                       if inspect.isclass(c) and c.__module__ == name and f"{fn_name}(" in _source(c)]
            vision = "vision" in fn_name or bool(callers) and all(
                any(k in c for k in ("Vision", "Visual", "Vit")) for c in callers)
            multimodal = not vision and any(k in fn_name for k in ("multimodal", "mrope", "multidim"))
            why = ("vision rotary, called by " + ", ".join(sorted(callers)) if vision and callers else
                   "vision 2-D rotary" if vision else
                   "multimodal rotary of its own" if multimodal else "another rotary form")
            parts.append(f"{fn_name}: left alone ({why}; the rope rule reads only {' / '.join(rope.TARGETS)})")
            verdicts.append("own multimodal" if multimodal else "own function")
    if not set(own) & set(rope.TARGETS):
        text_type = None
        with contextlib.suppress(Exception):
            text_type = config_cls().get_text_config().model_type
        parts.append(f"no text rotary function here; the text model ({text_type or '?'}) is in its own module "
                     "(causal-LM table)")
    if "own multimodal" in verdicts:
        kind = "own mrope function"
    elif sections:
        kind = "mrope via standard" if "patched" in verdicts else "mrope, not patched"
    elif "patched" in verdicts:
        kind = "standard"
    elif not set(own) & set(rope.TARGETS):
        kind = "elsewhere"
    else:
        kind = "not patched"
    return {"kind": kind, "text": "; ".join(parts)}


def _source(obj) -> str:
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _is_vision(name: str) -> bool:
    return any(k in name for k in ("vision", "visual", "image_encoder", "image_tower", "vit", "siglip", "clip",
                                   "patch_embed", "vqmodel"))


def _record_text(records) -> str:
    return "; ".join(r.variant if r.patched else f"left alone: {r.reason}" for r in records) or "no record"


def vlm_summary(rows) -> dict:
    built = [r for r in rows if r.get("numbers") not in ("could not build", "error")]
    verified = sum(r.get("numbers") == "verified" for r in rows)
    return {
        "heads": len(rows),
        "built": len(built),
        "fused_loss_by_structure": sum(r.get("structure") == "patched" for r in rows),
        "fused_and_verified": verified,
        "verified_share_of_built": round(verified / len(built), 3) if built else 0.0,
        "left_alone_unchanged": sum(r.get("numbers") == "unchanged" for r in rows),
        "not_used": sum(r.get("numbers") == "not used" for r in rows),
        "mismatch": sum(r.get("numbers") == "MISMATCH" for r in rows),
        "every_kernel_verified": sum(r.get("all_kernels", {}).get("verdict") == "verified" for r in rows),
        "every_kernel_mismatch": sum(r.get("all_kernels", {}).get("verdict") == "MISMATCH" for r in rows),
        **{f"every_kernel_{kind}_ran": sum(kind in r.get("all_kernels", {}).get("ran", []) for r in rows)
           for kind in KINDS},
        "could_not_build": sum(r.get("numbers") == "could not build" for r in rows),
        "errors": sum(r.get("numbers") == "error" for r in rows),
    }


VLM_HEADING = "## Image-text-to-text heads (the loss rule)"
ROPE_MARK = {"mrope via standard": "✅ mrope sections in cos/sin, standard apply", "standard": "✅ standard",
             "elsewhere": "· text model elsewhere", "own mrope function": "➖ own mrope function",
             "mrope, not patched": "➖ mrope, apply left alone", "not patched": "➖ left alone"}


def _cell(text: str, width: int = 160) -> str:
    return text[:width].replace("|", "/").replace("\n", " ")


def vlm_markdown(rows, summary) -> str:
    lines = [
        VLM_HEADING,
        "",
        "Every class of transformers' MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES. *Structure*: the loss "
        "rule's verdict on the class (fused linear CE in training with labels; the fused CE where logits "
        "exist), from the forward's source. *Numbers*: each head built tiny (TINY_VLMS for six families, "
        "else the generic builder: the config class's defaults shrunk, vision 16 x 16 images of 4 x 4 "
        "patches, special ids remapped, per-family quirks as data in VLM_OVERRIDES; synthetic pixels of "
        "the form the tower takes, as many placeholders as the model's own image path produces), patched "
        "vs unpatched loss, every gradient (vision tower included: the count of vision parameters with a "
        "gradient is given) and eval logits within 1e-5 relative (fp32), the fused linear CE launched in "
        "training; *unchanged* = left alone by the rule, same numbers. *Multimodal RoPE*: the modeling "
        "module's rotary functions and what autopatch.rules.rope does with each (no kernel for a "
        "function the rule does not read). *Every kernel*: the same head with every rule on, over every "
        "module it uses (vision tower, projector and text model; nn.LayerNorm instances included), against "
        "the unpatched numbers at the same bound, and the kinds whose kernels ran.",
        "",
        f"**Summary:** {summary['heads']} heads, {summary['built']} build tiny; fused loss by structure "
        f"{summary['fused_loss_by_structure']}; fused and numbers-verified {summary['fused_and_verified']} "
        f"({100 * summary['verified_share_of_built']:.0f} % of those that build); left alone and unchanged "
        f"{summary['left_alone_unchanged']}; not used {summary['not_used']}; MISMATCH {summary['mismatch']}; "
        f"could not build {summary['could_not_build']}; run errors {summary['errors']}. Every kernel on: "
        f"verified {summary['every_kernel_verified']}, MISMATCH {summary['every_kernel_mismatch']}; kernels "
        "seen running in that many heads: "
        + ", ".join(f"{kind} {summary[f'every_kernel_{kind}_ran']}" for kind in KINDS) + ".",
        "",
        "| head | structure (fused linear CE) | numbers | every kernel | multimodal RoPE |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        text = _cell(row.get("fused_linear", row.get("error", "")), 140)
        mark = "✅" if row.get("structure") == "patched" else "➖"
        numbers = row.get("numbers", "")
        if numbers == "verified":
            numbers = f"✅ verified ({row.get('vision_grads', 0)} vision grads, {row.get('builder')})"
        elif numbers == "MISMATCH":
            numbers = f"❌ MISMATCH {_cell(row.get('detail', ''), 100)}"
        elif numbers == "unchanged":
            numbers = "➖ unchanged"
        elif numbers == "could not build":
            numbers = f"could not build: {_cell(row.get('build_error', ''), 140)}"
        elif numbers == "error":
            numbers = f"run error: {_cell(row.get('error', ''), 140)}"
        rope_entry = row.get("rope", {})
        rope_text = f"{ROPE_MARK.get(rope_entry.get('kind'), rope_entry.get('kind', ''))}: {_cell(rope_entry.get('text', ''), 200)}"
        every = row.get("all_kernels")
        if every is None:
            every_text = "–"
        elif every["verdict"] == "error":
            every_text = f"run error: {_cell(every['detail'], 100)}"
        elif every["verdict"] == "verified":
            every_text = f"✅ {', '.join(every['ran']) or 'none ran'}"
        else:
            every_text = f"❌ MISMATCH ({', '.join(every.get('blamed', [])) or '?'}) {_cell(every['detail'], 80)}"
        lines.append(f"| {row['arch']} | {mark} {text} | {numbers} | {every_text} | {rope_text} |")
    return "\n".join(lines) + "\n"


VLM_SECONDS = 90  # per head (two checks); a tiny model takes seconds, one that takes longer is not tiny: an error row


class _TooSlow(BaseException):  # not an Exception: the builders' retries must not swallow it
    pass


def _with_deadline(fn, *args):
    import signal

    def expire(*_):
        raise _TooSlow(f"took more than {VLM_SECONDS} s on the CPU (the tiny model is not tiny)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(VLM_SECONDS)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- vision towers' windowed attention (autopatch.rules.vision_attention) ---------------------------
# Every modeling module whose attention class has the cu_seqlens split loop under SDPA: the rule's
# verdict per class; for each image-text-to-text head defined in such a module that builds tiny (SDPA
# attention), the vision_attention rule alone patched vs unpatched: loss, every gradient and eval
# logits within 1e-5 relative (fp32), and whether the batched window attention ran.
VISION_HEADING = "## Vision towers' windowed attention (vision_attention)"


def _modeling_modules() -> list[str]:
    import transformers

    root = os.path.dirname(transformers.models.__file__)
    return sorted(f"transformers.models.{d}.{f[:-3]}" for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                  for f in os.listdir(os.path.join(root, d)) if f.startswith("modeling_") and f.endswith(".py"))


def check_vision_attention(names) -> list[dict]:
    import importlib

    from autopatch import patching, report
    from autopatch.rules import vision_attention

    heads = {}
    for arch in image_text_to_text_architectures():
        heads.setdefault(arch.module_name, []).append(arch)
    rows = []
    for module_name in _modeling_modules():
        if names and module_name.split(".")[2] not in names:
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - an optional dependency missing: not a model we can build
            continue
        records = vision_attention.RULE.patch_module(module, session.current(), lambda kernel: True)
        patching.restore_all()
        if not records:
            continue
        row = {"module": module_name, "classes": [{"target": r.target, "patched": r.patched, "reason": r.reason}
                                                  for r in records], "heads": []}
        for arch in heads.get(module_name, []) if any(r.patched for r in records) else []:
            head = {"arch": arch.class_name}
            try:
                with torch.random.fork_rng(devices=[]), contextlib.redirect_stderr(io.StringIO()):
                    model, inputs, _ = build_vlm(arch, attn="sdpa")
            except (Exception, _TooSlow) as exc:  # noqa: BLE001
                head["numbers"] = f"could not build: {type(exc).__name__}: {str(exc)[:160]}"
                row["heads"].append(head)
                continue
            try:
                ref = _with_deadline(_run_vlm, model, inputs)
                session.current().reset_runs()
                session.current().add(vision_attention.RULE.patch_module(module, session.current(), lambda kernel: True))
                got = _with_deadline(_run_vlm, model, inputs)
                ok, detail = _compare(ref, got)
                ran = report.runs().get(vision_attention.KERNEL, {}).get("calls") or 0
                head["numbers"] = ("verified" if ran else "not used") if ok else "MISMATCH"
                head["detail"] = f"{detail}; {ran} batched window calls"
            except (Exception, _TooSlow) as exc:  # noqa: BLE001
                head["numbers"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
            finally:
                patching.restore_all()
                session.current().clear()
            row["heads"].append(head)
        rows.append(row)
    return rows


def vision_summary(rows) -> dict:
    classes = [c for r in rows for c in r["classes"]]
    heads = [h for r in rows for h in r["heads"]]
    return {"modules": len(rows), "classes": len(classes), "patched": sum(c["patched"] for c in classes),
            "heads": len(heads), "verified": sum(h["numbers"] == "verified" for h in heads),
            "mismatch": sum(h["numbers"] == "MISMATCH" for h in heads),
            "could_not_build": sum(h["numbers"].startswith("could not build") for h in heads)}


def vision_markdown(rows, summary) -> str:
    lines = [
        VISION_HEADING,
        "",
        "Every modeling module with an attention class that splits q, k and v at `cu_seqlens` and calls the "
        "attention once per window under SDPA. *Structure*: the rule's verdict on each class (both branches "
        "over the same tensors and arguments, from the syntax tree). *Numbers*: each image-text-to-text head "
        "of a patched module built tiny with SDPA attention, the vision_attention rule alone patched vs "
        "unpatched: loss, every gradient and eval logits within 1e-5 relative (fp32), and how many batched "
        "window calls ran.",
        "",
        f"**Summary:** {summary['modules']} modules, {summary['classes']} attention classes, {summary['patched']} "
        f"patched; {summary['heads']} heads of patched modules, {summary['verified']} verified, MISMATCH "
        f"{summary['mismatch']}, could not build {summary['could_not_build']}.",
        "",
        "| module | attention class | structure | heads: numbers |",
        "|---|---|---|---|",
    ]
    for row in rows:
        heads = "; ".join(f"{h['arch']}: {_cell(h['numbers'], 90)}" + (f" ({_cell(h['detail'], 90)})" if "detail" in h else "")
                          for h in row["heads"]) or "–"
        for c in row["classes"]:
            verdict = "✅ patched" if c["patched"] else f"➖ left alone: {_cell(c['reason'])}"
            lines.append(f"| {row['module'].split('.')[2]} | {c['target']} | {verdict} | {heads} |")
    return "\n".join(lines) + "\n"


def _write_section(path: str, heading: str, text: str, then: str | None = None) -> None:
    """Replace the section `heading` of the Markdown file, from it to the section `then` (kept) or to the
    end, or add it at the end (before `then` where that exists)."""
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    later = old.split(then, 1)[1] if then and then in old else None
    head = old.split(heading)[0]
    if then:
        head = head.split(then)[0]
    with open(path, "w", encoding="utf-8") as f:
        f.write((head.rstrip("\n") + "\n\n" if head.strip() else "") + text
                + (f"\n{then}{later}" if later is not None else ""))


def _finish_section(args, rows, summary, heading: str, markdown_of) -> int:
    """A section's run ends alike: the summary printed, JSON and the Markdown section written where asked;
    exit 1 on any MISMATCH."""
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    if args.markdown:
        _write_section(args.markdown, heading, markdown_of(rows, summary))
    return 1 if summary["mismatch"] else 0


def main_vision_attention(args) -> int:
    rows = check_vision_attention({n.lower() for n in args.names})
    summary = vision_summary(rows)
    if not args.quiet:
        for row in rows:
            for c in row["classes"]:
                print(f"{row['module']:<60} {c['target']:<40} {'patched' if c['patched'] else c['reason'][:60]}")
            for h in row["heads"]:
                print(f"    {h['arch']:<50} {h['numbers'][:80]}")
    return _finish_section(args, rows, summary, VISION_HEADING, vision_markdown)


# --- SDPA under a boolean mask (autopatch.rules.masked_attention) ------------------------------------
# Every causal LM that builds tiny and runs under SDPA, on a batch with right padding (one row's last
# 5 of 16 tokens; transformers then builds a [2, 1, 16, 16] bool mask), the masked_attention rule alone
# patched in blocks of 4 queries vs unpatched: loss, eval logits and every gradient within 1e-5
# relative (fp32; or as close to a float64 run as the original fp32, as in the first table), and
# whether the blocked attention ran.
MASKED_HEADING = "## SDPA under a boolean mask (masked_attention)"
MASKED_BLOCK = 4


def _padded_inputs(model) -> dict:
    from tiny_models import smoke_inputs

    inputs = smoke_inputs(model, seq=16)
    if inputs["input_ids"].dim() != 2 or inputs["labels"].shape != inputs["input_ids"].shape:
        raise ValueError("not a [batch, seq] token-id model")
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, -5:] = 0
    return dict(inputs, attention_mask=mask, labels=inputs["labels"].masked_fill(mask == 0, -100))


def check_masked_attention(arch) -> dict:
    from autopatch import report
    from autopatch._api import modules_of
    from autopatch.rules import masked_attention
    from tiny_models import build_tiny

    row = {"arch": arch.class_name, "model_dir": arch.model_dir}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model = build_tiny(arch)
            model.set_attn_implementation("sdpa")
            inputs = _padded_inputs(model)
    except Exception as exc:  # noqa: BLE001
        row["verdict"] = f"could not build under sdpa: {type(exc).__name__}: {str(exc)[:140]}"
        return row
    saved = masked_attention.QUERY_BLOCK
    masked_attention.QUERY_BLOCK = MASKED_BLOCK
    try:
        ref = _run(model, inputs)
        try:  # the yardstick where rounding is amplified (as in the first table)
            ref64 = _run(copy.deepcopy(model).double(), inputs)
        except Exception:  # noqa: BLE001 - some architectures do not run in float64
            ref64 = None
        records = [r for m in modules_of(model) for r in masked_attention.RULE.patch_module(m, session.current(), lambda kernel: True)]
        session.current().reset_runs()
        session.current().add(records)
        got = _run(model, inputs)
        ran = report.runs().get(masked_attention.KERNEL, {}).get("calls") or 0
        ok, detail = _compare(ref, got, ref64)
        if not records:
            row["verdict"] = "none"
        elif not any(r.patched for r in records):
            row["verdict"] = "left alone: " + "; ".join(sorted({r.reason for r in records}))
        else:
            row["verdict"] = ("verified" if ran else "not used") if ok else "MISMATCH"
        row["detail"] = f"{detail}; {ran} blocked calls"
    except Exception as exc:  # noqa: BLE001
        row["verdict"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
    finally:
        masked_attention.QUERY_BLOCK = saved
        _restore(model)
        session.current().clear()
    return row


def masked_summary(rows) -> dict:
    verdicts = [r["verdict"] for r in rows]
    return {"architectures": len(rows), "verified": verdicts.count("verified"), "not used": verdicts.count("not used"),
            "mismatch": verdicts.count("MISMATCH"),
            "could_not_build": sum(v.startswith("could not build") for v in verdicts),
            "left_alone": sum(v.startswith("left alone") for v in verdicts),
            "none": verdicts.count("none"), "error": sum(v.startswith("error") for v in verdicts)}


def masked_markdown(rows, summary) -> str:
    lines = [
        MASKED_HEADING,
        "",
        "Every causal LM of the first table that builds tiny and runs under SDPA, on a batch with right padding "
        "(one row's last 5 of 16 tokens: transformers builds a [2, 1, 16, 16] boolean mask), the "
        f"masked_attention rule alone patched, in blocks of {MASKED_BLOCK} queries, vs unpatched: loss, eval "
        "logits and every gradient within 1e-5 relative (fp32), or as close to a float64 run as the original "
        "fp32 code (as in the first table). *not used*: patched, but no SDPA call got a "
        "boolean mask whose blocks skip keys (the model builds its own float mask, or attends another way).",
        "",
        f"**Summary:** {summary['architectures']} architectures: verified {summary['verified']}, not used "
        f"{summary['not used']}, left alone {summary['left_alone']}, no attention through transformers' "
        f"registry (*none*) {summary['none']}, could not build under sdpa "
        f"{summary['could_not_build']}, error {summary['error']}, MISMATCH {summary['mismatch']}.",
        "",
        "| model | class | verdict | detail |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model_dir']} | {r['arch']} | {_cell(r['verdict'], 120)} | "
                     f"{_cell(r.get('detail', ''), 170)} |")
    return "\n".join(lines) + "\n"


def main_masked_attention(args) -> int:
    rows = []
    for arch in select(causal_lm_architectures(), args.names):
        row = check_masked_attention(arch)
        rows.append(row)
        if not args.quiet:
            print(f"{row['arch']:<50} {row['verdict'][:70]}  {row.get('detail', '')[:60]}", flush=True)
    summary = masked_summary(rows)
    return _finish_section(args, rows, summary, MASKED_HEADING, masked_markdown)


def main_vlm(args) -> int:
    rows = []
    for arch in select(image_text_to_text_architectures(), args.names):
        t0 = time.time()
        with contextlib.redirect_stderr(io.StringIO()):
            row = _with_deadline(check_vlm_loss, arch)
        row["seconds"] = round(time.time() - t0, 2)
        rows.append(row)
        if not args.quiet:
            print(f"{row['arch']:<45} {row.get('structure', ''):<11} {row.get('numbers', ''):<16} "
                  f"{row.get('fused_linear', row.get('error', ''))[:90]}", flush=True)
    summary = vlm_summary(rows)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    if args.markdown:
        # the table goes after the causal-LM one, replacing an earlier image-text-to-text table; the
        # vision-attention section stays last
        _write_section(args.markdown, VLM_HEADING, vlm_markdown(rows, summary), then=VISION_HEADING)
    return 1 if summary["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
