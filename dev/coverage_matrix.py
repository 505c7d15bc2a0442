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
    python dev/coverage_matrix.py --vlm --json docs/coverage_vlm.json --markdown docs/coverage.md
The last one is the image-text-to-text table (the loss rule over MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
written after the causal-LM table of the same file.
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

KINDS = ("rms_norm", "layer_norm", "rope", "glu", "experts", "loss")
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
        records.extend(rules.patch_module(module, enabled, skip=skip))
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

    from autopatch.tiny_models import Architecture

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
        f"experts {summary['experts_verified']}, loss {summary['loss_verified']}; MISMATCH rows: {summary['mismatch']}; run errors: {summary['errors']}.",
        "",
        "| architecture | rms_norm | layer_norm | rope | glu (swiglu/geglu) | MoE experts | loss (CE / fused linear CE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "could not build":
            lines.append(f"| {row['arch']} | could not build: {row['error'][:100].replace('|', '/')} | | | | | |")
            continue
        if row["status"] == "error":
            lines.append(f"| {row['arch']} | run error: {row['error'][:100].replace('|', '/')} | | | | | |")
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
# from structure (autopatch.rules.loss), and, for the models with a tiny builder below, the numbers:
# patched vs unpatched loss, every gradient (vision tower included) and eval logits, fp32 at 1e-5.
# Each builder gives tiny vision and text configs and synthetic inputs of the model's form: Qwen2-VL's
# flattened patches with image_grid_thw, square images for SigLIP / CLIP towers, placeholder ids in
# input_ids (IMAGE 90, delimiters 91-93; text tokens are drawn below 80).
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


def build_tiny_vlm(model_dir):
    """(model, inputs) of a TINY_VLMS entry, fp32, eager attention, O(1)-sized logits."""
    import importlib

    _, class_name, cfg, inputs = TINY_VLMS[model_dir]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    module = importlib.import_module(f"transformers.models.{model_dir}.modeling_{model_dir}")
    model = getattr(module, class_name)(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    labels = inputs["input_ids"].clone()
    labels[labels >= IMAGE] = -100  # image placeholders and delimiters are not targets
    labels[:, :2] = -100
    return model, dict(inputs, labels=labels)


def _run_vlm(model, inputs):
    """Loss and every parameter gradient in training mode, logits in eval mode (pixels included)."""
    loss, _, grads = _run(model, inputs)
    model.eval()
    with torch.no_grad():
        eval_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        logits = model(**eval_inputs, use_cache=False).logits.detach().clone()
    model.train()
    return loss, logits, grads


def image_text_to_text_architectures() -> list:
    """Every class AutoModelForImageTextToText can build, with the modeling module that defines it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return _mapping_architectures(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def check_vlm_loss(arch) -> dict:
    """The loss rule on one image-text-to-text head: its records, and the numbers where TINY_VLMS
    builds the model."""
    import importlib

    import fused_kernels
    from autopatch import patching
    from autopatch.rules import loss

    row = {"arch": arch.class_name, "model_dir": arch.model_dir, "module": arch.module_name}
    try:
        module = importlib.import_module(arch.module_name)
        model = inputs = ref = None
        if arch.model_dir in TINY_VLMS:
            model, inputs = build_tiny_vlm(arch.model_dir)
            ref = _run_vlm(model, inputs)
        records = [r for r in loss.RULE.patch_module(module, lambda kernel: True)
                   if r.target in (f"{arch.class_name}.forward", f"{arch.class_name}.loss_function")]
        flce = [r for r in records if r.kernel == "fused_linear_cross_entropy"]
        ce = [r for r in records if r.kernel == "cross_entropy"]
        row["fused_linear"] = _record_text(flce)
        row["cross_entropy"] = _record_text(ce)
        patched = any(r.patched for r in flce)
        row["structure"] = "patched" if patched else "left alone"
        if model is None:
            row["numbers"] = "no tiny builder"
        else:
            before = fused_kernels.launch_counts()
            got = _run_vlm(model, inputs)
            after = fused_kernels.launch_counts()
            ok, detail = _compare(ref, got)
            fused_ran = any(after[k] > before.get(k, 0) for k in after if k.startswith("fused_linear_cross_entropy"))
            row["numbers"] = "MISMATCH" if not ok else ("verified" if fused_ran or not patched else "not used")
            row["detail"] = detail
    except Exception as exc:  # noqa: BLE001
        row["structure"] = row.get("structure", "error")
        row["numbers"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        patching.restore_all()
    return row


def _record_text(records) -> str:
    return "; ".join(r.variant if r.patched else f"left alone: {r.reason}" for r in records) or "no record"


def vlm_summary(rows) -> dict:
    return {
        "heads": len(rows),
        "fused_loss_by_structure": sum(r.get("structure") == "patched" for r in rows),
        "numbers_verified": sum(r.get("numbers") == "verified" for r in rows),
        "mismatch": sum(r.get("numbers") == "MISMATCH" for r in rows),
        "errors": sum(r.get("numbers") == "error" for r in rows),
    }


VLM_HEADING = "## Image-text-to-text heads (the loss rule)"


def vlm_markdown(rows, summary) -> str:
    lines = [
        VLM_HEADING,
        "",
        "Every class of transformers' MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES. *Structure*: the loss "
        "rule's verdict on the class (fused linear CE in training with labels; the fused CE where logits "
        "exist), from the forward's source. *Numbers*: for the models dev/coverage_matrix.py builds tiny "
        "(TINY_VLMS: tiny vision and text configs, synthetic pixels and placeholder tokens), patched vs "
        "unpatched loss, every gradient (vision tower included) and eval logits within 1e-5 relative (fp32), "
        "the fused kernel launched; other rows are proven from structure only.",
        "",
        f"**Summary:** {summary['heads']} heads; fused loss by structure {summary['fused_loss_by_structure']}; "
        f"numbers verified {summary['numbers_verified']}; MISMATCH {summary['mismatch']}; errors {summary['errors']}.",
        "",
        "| head | structure (fused linear CE) | numbers |",
        "|---|---|---|",
    ]
    for row in rows:
        text = row.get("fused_linear", row.get("error", ""))[:140].replace("|", "/").replace("\n", " ")
        mark = "✅" if row.get("structure") == "patched" else "➖"
        numbers = {"verified": "✅ verified", "MISMATCH": "❌ MISMATCH"}.get(row.get("numbers"), row.get("numbers", ""))
        lines.append(f"| {row['arch']} | {mark} {text} | {numbers} |")
    return "\n".join(lines) + "\n"


def main_vlm(args) -> int:
    rows = []
    for arch in select(image_text_to_text_architectures(), args.names):
        with contextlib.redirect_stderr(io.StringIO()):
            row = check_vlm_loss(arch)
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
        # the table goes after the causal-LM one, replacing an earlier image-text-to-text table
        try:
            with open(args.markdown, encoding="utf-8") as f:
                kept = f.read()
        except FileNotFoundError:
            kept = ""
        kept = kept.split(VLM_HEADING)[0].rstrip("\n")
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write((kept + "\n\n" if kept else "") + vlm_markdown(rows, summary))
    return 1 if summary["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
