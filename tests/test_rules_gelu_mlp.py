"""The gelu_mlp rule (autopatch.rules.gelu_mlp): plain MLPs second(gelu(first(x))) run
fused_kernels.gelu_linear; the rest is left alone with the reason. Whole tiny models, patched against
unpatched: loss, eval logits and every gradient at fp32 1e-5, with the kernel counted."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, everything, modeling, train_and_eval, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
import tiny_models  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.rules import gelu_mlp  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = gelu_mlp.RULE
ARCHS = {a.class_name: a for a in tiny_models.causal_lm_architectures()}
ARCHS.setdefault("GPT2LMHeadModel", tiny_models.Architecture("gpt2", "transformers.models.gpt2.modeling_gpt2",
                                                             "GPT2LMHeadModel"))

pytestmark = pytest.mark.usefixtures("restore_patches")


def _with_dropout(model, p: float = 0.2) -> int:
    """Every MLP dropout of the model at probability p (module or float attribute); how many."""
    count = 0
    for m in model.modules():
        if type(getattr(m, "dropout", None)) is torch.nn.Dropout and hasattr(m, "c_proj"):
            m.dropout.p = p
            count += 1
        if isinstance(getattr(m, "residual_dropout", None), float):
            m.residual_dropout = p
            count += 1
    return count


@pytest.mark.parametrize("arch,mlp,launches", [
    ("PhiForCausalLM", "PhiMLP", True),  # gelu_new (tanh)
    ("GPTNeoXForCausalLM", "GPTNeoXMLP", True),  # erf GELU
    ("PersimmonForCausalLM", "PersimmonMLP", False),  # the same structure with relu²: the original runs
    ("GPT2LMHeadModel", "GPT2MLP", True),  # Conv1D projections, a dropout module after c_proj
    ("Starcoder2ForCausalLM", "Starcoder2MLP", True),  # F.dropout(p=self.residual_dropout) after c_proj
])
def test_patched_model_matches(arch, mlp, launches):
    model = tiny_models.build_tiny(ARCHS[arch])
    if arch in ("GPT2LMHeadModel", "Starcoder2ForCausalLM"):
        assert _with_dropout(model) > 0  # training draws masks: the same seed must give the same ones
    inputs = tiny_models.smoke_inputs(model)
    torch.manual_seed(0)
    ref = train_and_eval(model, inputs)
    module = modeling(ARCHS[arch].module_name.split(".")[-2])
    record = verdict_of(RULE.patch_module(module, current(), everything), mlp)
    assert record.patched and record.kernel == "gelu_mlp", record
    assert verdict_of(RULE.patch_module(module, current(), everything), mlp) == record  # idempotent
    before = fused_kernels.launch_counts().get("gelu_bwd", 0)
    torch.manual_seed(0)
    got = train_and_eval(model, inputs)
    ran = fused_kernels.launch_counts().get("gelu_bwd", 0) - before
    assert (ran > 0) == launches, ran
    assert_close(got[0], ref[0], torch.float32, "loss")
    assert_close(got[1], ref[1], torch.float32, "eval logits")
    assert set(got[2]) == set(ref[2])
    for name, grad in ref[2].items():
        assert_close(got[2][name], grad, torch.float32, f"grad {name}")


@pytest.mark.parametrize("model_dir,target,reason", [
    ("falcon", "FalconMLP", "not a plain nn.Linear"),
    ("bloom", "BloomMLP", "extra arguments"),
])
def test_left_alone_with_the_reason(model_dir, target, reason):
    module = modeling(model_dir)
    record = verdict_of(RULE.patch_module(module, current(), everything), target)
    assert not record.patched and reason in record.reason, record
    assert not patching.is_patched(getattr(module, target), "forward")


def test_disabled_kernel_is_recorded():
    record = verdict_of(RULE.patch_module(modeling("phi"), current(), lambda k: k != "gelu_mlp"), "PhiMLP")
    assert not record.patched and "disabled" in record.reason


def test_clip_quick_gelu_instance():
    """CLIP's MLP with quick_gelu: patched module, the instance's own activation decides the kernel."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip import modeling_clip

    assert verdict_of(RULE.patch_module(modeling_clip, current(), everything), "CLIPMLP").patched
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


def test_a_dropout_before_the_second_projection_is_left_alone():
    """The seeded training-mode probe tells a dropout after the second projection (patched) from one
    before it (another mask: left alone)."""
    import types

    module = types.ModuleType("transformers_modules.fake_org.modeling_fake_mlp")

    def make(dropout_last: bool):
        class FakeMLP(torch.nn.Module):
            def __init__(self, hidden, intermediate):
                super().__init__()
                self.fc1 = torch.nn.Linear(hidden, intermediate)
                self.fc2 = torch.nn.Linear(intermediate, hidden)
                self.act = torch.nn.GELU()
                self.dropout = torch.nn.Dropout(0.1)

            def forward(self, x):
                if dropout_last:
                    return self.dropout(self.fc2(self.act(self.fc1(x))))
                return self.fc2(self.dropout(self.act(self.fc1(x))))

        FakeMLP.__module__ = module.__name__
        return FakeMLP

    for last in (True, False):
        module.FakeMLP = make(last)
        gelu_mlp._verdicts.pop(module.FakeMLP, None)
        record = verdict_of(RULE.patch_module(module, current(), everything), "FakeMLP")
        if last:
            assert record.patched and record.variant.startswith("dropout(fc2("), record
        else:
            assert not record.patched and "not the last step" in record.reason, record
