"""The gelu_mlp rule (autopatch.rules.gelu_mlp): plain MLPs second(gelu(first(x))) run
fused_kernels.gelu_linear; the rest is left alone with the reason. Whole tiny models, patched against
unpatched: loss, eval logits and every gradient at fp32 1e-5, with the kernel counted."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, everything, modeling, train_and_eval, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
from autopatch import patching, tiny_models  # noqa: E402
from autopatch.rules import gelu_mlp  # noqa: E402

RULE = gelu_mlp.RULE
ARCHS = {a.class_name: a for a in tiny_models.causal_lm_architectures()}

pytestmark = pytest.mark.usefixtures("restore_patches")


@pytest.mark.parametrize("arch,mlp,launches", [
    ("PhiForCausalLM", "PhiMLP", True),  # gelu_new (tanh)
    ("GPTNeoXForCausalLM", "GPTNeoXMLP", True),  # erf GELU
    ("PersimmonForCausalLM", "PersimmonMLP", False),  # the same structure with relu²: the original runs
])
def test_patched_model_matches(arch, mlp, launches):
    model = tiny_models.build_tiny(ARCHS[arch])
    inputs = tiny_models.smoke_inputs(model)
    ref = train_and_eval(model, inputs)
    module = modeling(ARCHS[arch].module_name.split(".")[-2])
    record = verdict_of(RULE.patch_module(module, everything), mlp)
    assert record.patched and record.kernel == "gelu_mlp", record
    assert verdict_of(RULE.patch_module(module, everything), mlp) == record  # idempotent
    before = fused_kernels.launch_counts().get("gelu_bwd", 0)
    got = train_and_eval(model, inputs)
    ran = fused_kernels.launch_counts().get("gelu_bwd", 0) - before
    assert (ran > 0) == launches, ran
    assert_close(got[0], ref[0], torch.float32, "loss")
    assert_close(got[1], ref[1], torch.float32, "eval logits")
    assert set(got[2]) == set(ref[2])
    for name, grad in ref[2].items():
        assert_close(got[2][name], grad, torch.float32, f"grad {name}")


@pytest.mark.parametrize("model_dir,target,reason", [
    ("starcoder2", "Starcoder2MLP", "dropout"),
    ("falcon", "FalconMLP", "not a plain nn.Linear"),
    ("bloom", "BloomMLP", "extra arguments"),
])
def test_left_alone_with_the_reason(model_dir, target, reason):
    module = modeling(model_dir)
    record = verdict_of(RULE.patch_module(module, everything), target)
    assert not record.patched and reason in record.reason, record
    assert not patching.is_patched(getattr(module, target), "forward")


def test_disabled_kernel_is_recorded():
    record = verdict_of(RULE.patch_module(modeling("phi"), lambda k: k != "gelu_mlp"), "PhiMLP")
    assert not record.patched and "disabled" in record.reason


def test_clip_quick_gelu_instance():
    """CLIP's MLP with quick_gelu: patched module, the instance's own activation decides the kernel."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip import modeling_clip

    assert verdict_of(RULE.patch_module(modeling_clip, everything), "CLIPMLP").patched
    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, hidden_act="quick_gelu")
    mlp = modeling_clip.CLIPMLP(cfg)
    x = torch.randn(2, 5, 32, requires_grad=True)
    before = fused_kernels.launch_counts().get("gelu_fwd", 0)
    out = mlp(x)
    assert fused_kernels.launch_counts().get("gelu_fwd", 0) > before
    ref = patching.original(modeling_clip.CLIPMLP, "forward")(mlp, x)
    assert_close(out, ref, torch.float32, "out")
    (g1,) = torch.autograd.grad(out.sum(), x)
    (g2,) = torch.autograd.grad(ref.sum(), x)
    assert_close(g1, g2, torch.float32, "grad")
