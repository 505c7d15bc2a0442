"""The layer_norm rule (autopatch.rules.layer_norm): verdicts on real modeling modules, then tiny models of
the LayerNorm families built patched and unpatched from the same seed — loss, logits and every gradient
within 1e-5 in fp32, with the kernel's launches counted — and the instance path of apply()."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from helpers import check_class_verdict, everything, modeling, rel_err, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
import tiny_models  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.rules import layer_norm  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = layer_norm.RULE


pytestmark = pytest.mark.usefixtures("restore_patches")


CLASS_CASES = [
    ("cohere", "CohereLayerNorm", "weight, no bias, eps from variance_epsilon", None),
    ("olmo", "OlmoLayerNorm", "no weight, no bias, eps=1e-05", None),
    ("t5", "T5LayerNorm", None, "matches no LayerNorm formula"),  # an RMSNorm
    ("stablelm", "StableLmLayerNormPerHead", None, "could not build"),  # holds nn.LayerNorm instances
]


@pytest.mark.parametrize("model,cls_name,variant,reason", CLASS_CASES, ids=[c[1] for c in CLASS_CASES])
def test_class_verdicts(model, cls_name, variant, reason):
    check_class_verdict(RULE, model, cls_name, variant, reason, kernel="layer_norm")


def test_torch_layer_norm_is_proved_and_not_patched_process_wide():
    assert layer_norm.torch_layer_norm_problem() == ""
    module = modeling("gpt2")
    records = RULE.patch_module(module, current(), everything)
    hook = [r for r in records if r.target.startswith("torch.nn.LayerNorm instances")]
    assert len(hook) == 1 and hook[0].patched, records
    assert nn.LayerNorm.forward is not layer_norm.FusedLayerNorm.forward
    assert type(nn.LayerNorm(8)) is nn.LayerNorm  # built outside a model: untouched


def test_disabled_kernel_hooks_nothing():
    module = modeling("gpt2")
    records = RULE.patch_module(module, current(), lambda k: False)
    assert all(not r.patched for r in records)
    assert not patching.is_patched(module.GPT2PreTrainedModel, "post_init")


# (architecture directory, class), all fp32
MODELS = [
    ("gpt_neox", "GPTNeoXForCausalLM"),
    ("phi", "PhiForCausalLM"),
    ("stablelm", "StableLmForCausalLM"),
    ("opt", "OPTForCausalLM"),
    ("gpt2", "GPT2LMHeadModel"),
    ("bloom", "BloomForCausalLM"),
    ("falcon", "FalconForCausalLM"),
    ("cohere", "CohereForCausalLM"),
]


def _arch(model_dir, cls_name):
    return tiny_models.Architecture(model_dir, f"transformers.models.{model_dir}.modeling_{model_dir}", cls_name)


def _step(model):
    model.train()
    out = model(**tiny_models.smoke_inputs(model))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def _assert_same(ref, got, what):
    (loss_r, logits_r, grads_r), (loss_g, logits_g, grads_g) = ref, got
    assert rel_err(loss_g, loss_r) <= 1e-5, f"{what}: loss {loss_g} vs {loss_r}"
    assert rel_err(logits_g, logits_r) <= 1e-5, f"{what}: logits"
    assert set(grads_g) == set(grads_r) and grads_r
    largest = max(g.double().norm().item() for g in grads_r.values())
    for name, g in grads_r.items():
        if g.double().norm().item() < 1e-7 * largest:
            # zero but for rounding (a key projection's bias: softmax ignores a per-row shift): the
            # difference is measured against the largest gradient
            err = (grads_g[name].double() - g.double()).norm().item()
            assert torch.isfinite(grads_g[name]).all() and err <= 1e-5 * largest, f"{what}: grad {name} off by {err:.2e}"
            continue
        assert rel_err(grads_g[name], g) <= 1e-5, f"{what}: grad {name} rel err {rel_err(grads_g[name], g):.2e}"


def _fused_count(model):
    return sum(type(m) is layer_norm.FusedLayerNorm for m in model.modules())


@pytest.mark.parametrize("model_dir,cls_name", MODELS, ids=[m[1] for m in MODELS])
def test_patched_model_matches_original(model_dir, cls_name):
    arch = _arch(model_dir, cls_name)
    ref = _step(tiny_models.build_tiny(arch))

    module = modeling(model_dir)
    records = RULE.patch_module(module, current(), everything)
    assert any(r.patched for r in records), records
    model = tiny_models.build_tiny(arch)  # same seed: same weights; post_init sets FusedLayerNorm
    uses_class = patching.is_patched(getattr(module, "CohereLayerNorm", object), "forward")
    assert _fused_count(model) > 0 or uses_class
    sd_keys = set(model.state_dict())
    before = fused_kernels.launch_counts()
    got = _step(model)
    after = fused_kernels.launch_counts()
    assert after.get("layer_norm_fwd", 0) > before.get("layer_norm_fwd", 0)
    assert after.get("layer_norm_bwd", 0) > before.get("layer_norm_bwd", 0)
    _assert_same(ref, got, cls_name)
    assert set(model.state_dict()) == sd_keys
    assert all(isinstance(m, nn.LayerNorm) for m in model.modules() if type(m) is layer_norm.FusedLayerNorm)


def test_apply_patches_the_instances_of_a_model_built_before():
    import autopatch

    arch = _arch("gpt2", "GPT2LMHeadModel")
    model = tiny_models.build_tiny(arch)
    ref = _step(model)
    model.zero_grad(set_to_none=True)
    assert _fused_count(model) == 0
    off = dict.fromkeys(("rope", "rms_norm", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy",
                         "causal_mask"), False)
    autopatch.apply(model, layer_norm=True, **off)
    n_norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert _fused_count(model) == n_norms > 0
    assert "LayerNorm(" in repr(model) and "FusedLayerNorm" not in repr(model)
    _assert_same(ref, _step(model), "apply")
    clone = pickle.loads(pickle.dumps(model))
    assert _fused_count(clone) == n_norms


def test_falls_back_where_triton_cannot_run(monkeypatch, capsys):
    from autopatch import report

    monkeypatch.setattr(fused_kernels, "triton_can_run", lambda *t: False)
    current().reset_runs()  # the fallback notices are once per session
    ln = nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 16)
    ref = ln(x)
    layer_norm.patch_instances(ln)
    assert type(ln) is layer_norm.FusedLayerNorm
    before = fused_kernels.launch_counts().get("layer_norm_fwd", 0)
    assert torch.equal(ln(x), ref) and torch.equal(ln(x), ref)
    assert fused_kernels.launch_counts().get("layer_norm_fwd", 0) == before
    err = capsys.readouterr().err
    assert err.count("layer_norm") == 1, err


def test_instance_runs_kernel_and_matches():
    ln = nn.LayerNorm(40, eps=1e-6, bias=False)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 40) * 3 + 1
    ref = ln(x)
    layer_norm.patch_instances(ln)
    before = fused_kernels.launch_counts().get("layer_norm_fwd", 0)
    out = ln(x)
    assert fused_kernels.launch_counts().get("layer_norm_fwd", 0) == before + 1
    assert rel_err(out, ref) <= 1e-5


def test_look_alikes_are_left_alone():
    class TwoStepLayerNorm(nn.Module):  # rounds to the input dtype between the steps
        def __init__(self, hidden_size, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.eps = eps

        def forward(self, hidden_states):
            h = nn.functional.layer_norm(hidden_states.float(), (hidden_states.shape[-1],), None, None, self.eps)
            return self.weight * h.to(hidden_states.dtype)

    class ScaledLayerNorm(nn.Module):  # an extra factor
        def __init__(self, hidden_size, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.eps = eps

        def forward(self, hidden_states):
            return 2 * nn.functional.layer_norm(hidden_states, (hidden_states.shape[-1],), self.weight, None, self.eps)

    import types

    fake = types.ModuleType("fake_modeling")
    for cls in (TwoStepLayerNorm, ScaledLayerNorm):
        cls.__module__ = fake.__name__
        setattr(fake, cls.__name__, cls)
    records = RULE.patch_module(fake, current(), everything)
    two = verdict_of(records, "TwoStepLayerNorm")
    scaled = verdict_of(records, "ScaledLayerNorm")
    assert not two.patched and "bfloat16" in two.reason, two
    assert not scaled.patched and "matches no LayerNorm formula" in scaled.reason, scaled
