"""The loss rule on image-text-to-text heads (Qwen2-VL, Gemma 3, LLaVA, PaliGemma): tiny models built
from tiny vision and text configs, synthetic pixel inputs of each model's form (Qwen2-VL's flattened
patches with image_grid_thw, square images for SigLIP and CLIP towers) and image placeholder tokens
in input_ids (the builders are dev/coverage_matrix.py's TINY_VLMS). Patched vs unpatched in fp32: the
loss and every parameter gradient, vision tower included, within 1e-5 relative; the fused linear CE
launched in training; eval logits identical."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import assert_close, launches, modeling, verdict_of

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "coverage_matrix", Path(__file__).resolve().parents[1] / "dev" / "coverage_matrix.py")
coverage_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_matrix)

from autopatch import patching  # noqa: E402
from autopatch.rules._lazy_logits import LazyLogits  # noqa: E402
from autopatch.rules import loss as loss_rule  # noqa: E402
from autopatch.session import current  # noqa: E402

FP32 = torch.float32
IMAGE = 90  # the image placeholder id of every tiny model (dev/coverage_matrix.py's TINY_VLMS)
BATCH = 2
FLCE = "fused_linear_cross_entropy"


pytestmark = pytest.mark.usefixtures("restore_patches")


def _launches(fk, prefix: str) -> int:
    return launches(prefix)


MODELS = coverage_matrix.TINY_VLMS  # name -> () -> (model dir, class, config, inputs)
# the models tested here (the matrix runs them all), with what each forward does to the logits, as
# the rule's record says
VARIANTS = {"qwen2_vl": "plain lm_head", "gemma3": "plain lm_head", "llava": "plain lm_head",
            "paligemma": "softcap_if_set(config.get_text_config().final_logit_softcapping)",
            "idefics3": "plain lm_head"}


def _build(name):
    module_name, cls_name, cfg, inputs = MODELS[name]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(modeling(module_name), cls_name)(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)  # O(1)-sized logits
    return modeling(module_name), cls_name, model, inputs


def _labels(ids):
    """Labels as a VLM collator makes them: the prompt, the image placeholders and their delimiters
    ignored (-100), the rest the text tokens."""
    labels = ids.clone()
    labels[ids >= IMAGE] = -100  # placeholders and their delimiters (ids 90-93)
    labels[:, :2] = -100
    labels[1, -1] = -100
    return labels


def _scenarios(inputs):
    ids = inputs["input_ids"]
    labels = _labels(ids)
    keep = 4
    g = torch.Generator().manual_seed(2)
    shift = torch.randint(0, 80, (BATCH, keep), generator=g)
    shift[0, 1] = -100
    return {
        "labels": dict(inputs, labels=labels),
        # loss normalised by num_items_in_batch (gradient accumulation)
        "num_items_in_batch": dict(inputs, labels=labels,
                                   num_items_in_batch=torch.tensor(int((labels != -100).sum()) + 5)),
        # caller-shifted targets for the last `keep` positions only (logits_to_keep)
        "shift_labels+logits_to_keep": dict(inputs, labels=labels, shift_labels=shift, logits_to_keep=keep),
    }


def _train_step(model, kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _no_full_logits(x) -> bool:
    return x is None or (isinstance(x, LazyLogits) and x._value is None)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vlm_patched_matches_original(name, kernels):
    module, cls_name, model, inputs = _build(name)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (name in ("gemma3", "paligemma")), "tied embeddings are covered by gemma3 and paligemma"
    scenarios = _scenarios(inputs)
    refs = {key: _train_step(model, kw) for key, kw in scenarios.items()}
    vision = [n for n in refs["labels"][1] if "visual" in n or "vision" in n]
    assert vision, f"{name}: the vision tower gets gradients in the reference step"
    model.eval()
    with torch.no_grad():
        ref_eval = model(**scenarios["labels"])
        ref_eval_nolabels = model(**inputs)

    records = loss_rule.RULE.patch_module(module, current(), lambda kernel: True)
    for kernel, target in ((FLCE, f"{cls_name}.forward"), ("cross_entropy", f"{cls_name}.loss_function")):
        record = verdict_of([r for r in records if r.kernel == kernel], target)
        assert record.patched, record
    assert VARIANTS[name] in verdict_of(records, f"{cls_name}.forward").variant

    for key, kw in scenarios.items():
        before = _launches(kernels, FLCE)
        out, grads = _train_step(model, kw)
        ref_out, ref_grads = refs[key]
        assert _launches(kernels, FLCE) > before, f"{name} {key}: the fused linear CE did not run"
        assert _no_full_logits(out.logits), f"{name} {key}: full logits in the fused training path"
        assert torch.isfinite(ref_out.loss) and ref_out.loss > 0
        assert_close(out.loss, ref_out.loss, FP32, f"{name} {key} loss")
        assert grads.keys() == ref_grads.keys()
        for pname, ref_grad in ref_grads.items():
            if pname.startswith(("model.vision_tower.", "model.vision_model.")) and pname.endswith("k_proj.bias"):
                # a tower without rotary embeddings (CLIP, SigLIP): softmax is invariant to the key bias
                # (it adds the same q.b to every score of a row), so its gradient is 0 in exact
                # arithmetic, rounding noise in both runs, nothing to compare
                assert grads[pname].abs().max() < 1e-6 and ref_grad.abs().max() < 1e-6, pname
                continue
            assert_close(grads[pname], ref_grad, FP32, f"{name} {key} grad {pname}")

    model.eval()
    before = _launches(kernels, "cross_entropy")
    with torch.no_grad():
        out_eval = model(**scenarios["labels"])
        out_eval_nolabels = model(**inputs)
    assert _launches(kernels, "cross_entropy") > before, f"{name}: the fused cross entropy did not run in eval"
    assert torch.equal(out_eval.logits, ref_eval.logits)
    assert torch.equal(out_eval_nolabels.logits, ref_eval_nolabels.logits)
    assert out_eval_nolabels.loss is None
    assert_close(out_eval.loss, ref_eval.loss, FP32, f"{name} eval loss")


def test_multimodal_heads_without_the_structure_are_left_alone():
    """A Q-Former head that never calls self.lm_head (BLIP-2) and an encoder-decoder computing its own
    loss (Pix2Struct) keep their forward, each with the reason; the torch loss of their modules is not
    rebound (that rebinding is for causal LMs computing their own loss)."""
    for module_name, cls_name, reason in (
        ("blip_2", "Blip2ForConditionalGeneration", "self.lm_head 0 times"),
        ("pix2struct", "Pix2StructForConditionalGeneration", "self.loss_function 0 times"),
    ):
        module = modeling(module_name)
        cls = getattr(module, cls_name)
        forward = cls.forward
        torch_loss = vars(module).get(loss_rule.TORCH_LOSS)
        records = loss_rule.RULE.patch_module(module, current(), lambda kernel: True)
        record = verdict_of([r for r in records if r.kernel == FLCE], f"{cls_name}.forward")
        assert not record.patched and reason in record.reason, record
        assert cls.forward is forward
        assert vars(module).get(loss_rule.TORCH_LOSS) is torch_loss
        assert not any(r.target == loss_rule.TORCH_LOSS for r in records)


def test_every_image_text_to_text_head_is_considered():
    """Each class of transformers' image-text-to-text mapping that its modeling module defines gets a
    record from the loss rule (patched, or left alone with a reason)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as mapping

    checked = 0
    for model_type, cls_name in sorted(mapping.items())[:: max(1, len(mapping) // 12)]:
        key = model_type.replace("-", "_")
        try:
            module = importlib.import_module(f"transformers.models.{key}.modeling_{key}")
        except ImportError:
            continue
        if vars(module).get(cls_name) is None or vars(module)[cls_name].__module__ != module.__name__:
            continue
        records = [r for r in loss_rule.RULE.patch_module(module, current(), lambda kernel: kernel == FLCE)
                   if r.target == f"{cls_name}.forward"]
        assert len(records) == 1, (cls_name, records)
        assert records[0].patched or records[0].reason, records[0]
        checked += 1
        patching.restore_all()
    assert checked >= 6, checked
