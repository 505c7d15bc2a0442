"""The coverage matrix's CI subset: one architecture per quirk, patched vs unpatched on a tiny random
model (dev/coverage_matrix.py's check), asserting the kinds we expect to be verified and that no
row is a MISMATCH. The full matrix (docs/coverage.md) is `python dev/coverage_matrix.py`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import tensors_with_history

_spec = importlib.util.spec_from_file_location(
    "coverage_matrix", Path(__file__).resolve().parents[1] / "dev" / "coverage_matrix.py")
coverage_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_matrix)

# model dir -> (kinds that must be verified, the quirk it stands for)
SUBSET = {
    "llama": ({"rms_norm", "rope", "glu", "loss"}, "the standard decoder"),
    "gemma": ({"rms_norm", "rope", "glu", "loss"}, "offset-1 gemma-casting norm, GELU-tanh MLP, tied embeddings"),
    "gemma2": ({"rms_norm", "rope", "glu", "loss"}, "final-logit softcapping"),
    "qwen3": ({"rms_norm", "rope", "glu", "loss"}, "per-head q/k norms"),
    "cohere": ({"rope", "glu", "loss"}, "interleaved rotary, logit_scale; its LayerNorm is left alone"),
    "glm": ({"rms_norm", "rope", "glu", "loss"}, "GLM-style rotary, fused gate_up_proj"),
    "phi": ({"rope", "gelu_mlp", "loss"}, "partial rotary, lm_head bias, plain GELU MLP"),
    "phi3": ({"rms_norm", "rope", "glu", "loss"}, "fused gate_up_proj"),
    "granite": ({"rms_norm", "rope", "glu", "loss"}, "logits_scaling divide"),
    "mixtral": ({"rms_norm", "rope", "experts", "loss"}, "MoE experts fused, router aux loss"),
    "qwen2_moe": ({"rms_norm", "rope", "glu", "experts", "loss"}, "MoE with a dense shared-expert MLP"),
    "deepseek_v3": ({"rms_norm", "rope", "experts", "loss"}, "MLA, de-interleaved rotary, sigmoid group routing"),
    "gpt_oss": ({"rms_norm", "rope", "loss"}, "half-size cos/sin that is not partial rotary; its clamped-gate "
                                               "experts with biases left alone"),
    "gemma4": ({"rms_norm", "rope", "glu", "loss"}, "one-tensor rotary: q and k rotated in separate calls"),
    "gptj": ({"rope", "loss"}, "one-tensor rotary with sin before cos and no unsqueeze_dim"),
    "bart": ({"loss"}, "its own loss with torch.nn.CrossEntropyLoss, not self.loss_function"),
    "mamba2": ({"rms_norm", "loss"}, "tiny config: num_heads x head_dim must equal expand x hidden_size"),
    "gpt_neo": ({"loss"}, "tiny config: attention_types [[pattern, repeats]] must cover the layers"),
    "zamba": ({"glu", "loss"}, "GELU-erf gated MLP"),
    "falcon_mamba": ({"rms_norm", "loss"}, "weightless RMSNorm"),
    "ernie4_5": ({"rms_norm", "rope", "glu", "loss"}, "GLM-style rotary in another family"),
    "dbrx": ({"rope", "loss"}, "tiny config: attn_config needs rope_theta and clip_qkv (OVERRIDES)"),
    "lfm2_moe": ({"rms_norm", "rope", "glu", "loss"}, "tiny config: layer_types has no default (OVERRIDES)"),
    "cohere_compass": ({"rope", "glu", "loss"}, "tiny config: RoPE parameters per layer type (OVERRIDES)"),
    "xmod": ({"loss"}, "tiny config: a default language for the adapters (OVERRIDES)"),
    "git": ({"gelu_mlp", "loss"}, "inputs: pixel_values, the loss skips the image tokens (INPUT_LAYOUTS); "
                                   "its vision tower's GELU MLP"),
    "qwen4_exp": ({"rms_norm", "rope", "glu", "loss"}, "rope also called with q alone (k=None); indexer fields (OVERRIDES)"),
    "musicgen": ({"loss"}, "inputs: codebook ids (INPUT_LAYOUTS); own loss over several heads (torch CrossEntropyLoss)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", sorted(SUBSET))
def test_architecture_patched_and_verified(model_dir):
    expected, quirk = SUBSET[model_dir]
    from tiny_models import causal_lm_architectures

    archs = coverage_matrix.select(causal_lm_architectures(), [model_dir])
    assert archs, f"{model_dir} not found in this transformers"
    row = coverage_matrix.check_architecture(archs[0])
    assert row["status"] == "ok", f"{model_dir} ({quirk}): {row}"
    verdicts = {kind: row[kind]["verdict"] for kind in coverage_matrix.KINDS}
    assert "MISMATCH" not in verdicts.values(), f"{model_dir} ({quirk}): {row}"
    missing = {k for k in expected if verdicts[k] != "verified"}
    assert not missing, f"{model_dir} ({quirk}): {sorted(missing)} not verified: {row}"


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", sorted(SUBSET))
def test_no_autograd_graph_outlives_its_step(model_dir):
    """Every kernel on, two training steps with Python's cyclic collector off: no tensor with autograd
    history may be left. A reference cycle that holds activations frees them only at the next full
    collection, so every later step's peak carries them (the loss rule had one: 128 MiB per step at
    Llama-8B shapes)."""
    import gc

    import autopatch
    from autopatch import patching
    from autopatch.names import KERNEL_NAMES
    from tiny_models import build_tiny, causal_lm_architectures, smoke_inputs

    arch = coverage_matrix.select(causal_lm_architectures(), [model_dir])[0]
    model = build_tiny(arch).train()
    inputs = smoke_inputs(model)

    try:
        autopatch.apply(model, **{k: True for k in KERNEL_NAMES})
        gc.collect()
        before = tensors_with_history()
        gc.disable()
        try:
            for _ in range(2):
                model(**inputs).loss.backward()
                model.zero_grad(set_to_none=True)
            after = tensors_with_history()
        finally:
            gc.enable()
    finally:
        patching.restore_all()
    assert after == before, f"{model_dir}: {after - before} tensors with autograd history outlived their step"


# image-text-to-text heads that only the generic tiny builder covers -> (pixel form it must find,
# multimodal RoPE kind of the row, the quirk it stands for)
GENERIC_VLMS = {
    "Qwen3VLForConditionalGeneration": ("grid", "mrope via standard",
                                        "flattened patches + image_grid_thw, deepstack, mrope sections scaled"),
    "LlavaNextForConditionalGeneration": ("tiles", "elsewhere", "any-resolution tiles with image_sizes"),
    "InternVLForConditionalGeneration": ("image", "elsewhere", "pixel shuffle: placeholders counted by the model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("class_name", sorted(GENERIC_VLMS))
def test_generic_tiny_vlm_verified(class_name):
    """The generic builder makes the head tiny, finds its pixel form and placeholder count, and the
    loss rule's fused linear CE matches the unpatched model: loss, eval logits and every gradient,
    the vision tower's included."""
    form, rope_kind, quirk = GENERIC_VLMS[class_name]
    archs = coverage_matrix.select(coverage_matrix.image_text_to_text_architectures(), [class_name])
    assert archs, f"{class_name} not in this transformers' image-text-to-text mapping"
    model, inputs = coverage_matrix.build_generic_vlm(archs[0])
    ids = {k: v for k, v in model.config.to_dict().items() if coverage_matrix.ID_NAME.match(k)}
    image = coverage_matrix._image_id(ids)
    assert image is not None and image >= coverage_matrix.TEXT_TOKENS, ids
    assert int((inputs["input_ids"] == image).sum()) > 0, f"{class_name} ({quirk}): no image placeholders"
    assert (inputs["labels"][inputs["input_ids"] == image] == -100).all(), "image placeholders are not targets"
    form_keys = coverage_matrix._pixels(form, coverage_matrix._vision_config(model.config), torch.Generator())
    assert form_keys.keys() <= inputs.keys(), f"{class_name} ({quirk}): not the {form!r} form: {sorted(inputs)}"
    row = coverage_matrix.check_vlm_loss(archs[0])
    assert row["builder"] == "generic", row
    assert row["structure"] == "patched", row
    assert row["numbers"] == "verified", f"{class_name} ({quirk}): {row}"
    assert row["vision_grads"] > 0, f"{class_name} ({quirk}): the vision tower got no gradient: {row}"
    assert row["rope"]["kind"] == rope_kind, row["rope"]


def test_vision_attention_section_verifies_a_qwen_vl_and_a_glm_head():
    """The coverage matrix's vision_attention section on two families: the rule patches their vision
    attention, the tiny SDPA heads match the unpatched ones, and the batched window attention ran."""
    rows = {r["module"].split(".")[2]: r for r in coverage_matrix.check_vision_attention({"qwen2_5_vl", "glm4v"})}
    assert set(rows) == {"qwen2_5_vl", "glm4v"}, rows
    for row in rows.values():
        assert [c["patched"] for c in row["classes"]] == [True], row
        assert row["heads"] and all(h["numbers"] == "verified" for h in row["heads"]), row
    summary = coverage_matrix.vision_summary(list(rows.values()))
    assert summary["mismatch"] == 0 and summary["verified"] == 2
    assert "| qwen2_5_vl | Qwen2_5_VLVisionAttention.forward | ✅ patched |" in coverage_matrix.vision_markdown(
        list(rows.values()), summary)


def test_masked_attention_section_verifies_padded_batches():
    """The coverage matrix's masked_attention section on a standard decoder and one with sliding layers:
    the padded batch's blocked attention ran and loss, logits and every gradient match."""
    archs = coverage_matrix.select(coverage_matrix.causal_lm_architectures(), ["llama", "qwen2"])
    rows = [coverage_matrix.check_masked_attention(a) for a in archs]
    assert {r["model_dir"] for r in rows} == {"llama", "qwen2"}, rows
    assert all(r["verdict"] == "verified" for r in rows), rows
    assert all(int(r["detail"].rsplit("; ", 1)[1].split()[0]) > 0 for r in rows), rows
    summary = coverage_matrix.masked_summary(rows)
    assert summary["verified"] == 2 and summary["mismatch"] == 0
