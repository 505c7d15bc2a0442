"""The rms_norm rule (autopatch.rules.rms_norm) on real transformers modeling modules: the verdicts
(patched with the detected variant, or left alone with the reason), then the patched class against
its original forward on random inputs — forward and gradients, fp32 at 1e-5 and bf16 at 1e-2 — with
the kernels counted, plus classes built to look like RMSNorm that must be refused."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from helpers import assert_close, check_class_verdict, everything, modeling, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
from autopatch import patching, report  # noqa: E402
from autopatch.rules import rms_norm  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = rms_norm.RULE


pytestmark = pytest.mark.usefixtures("restore_patches")


# (model, class, variant when patched / None, reason fragment when left alone)
CASES = [
    ("llama", "LlamaRMSNorm", "offset=0 casting=llama", None),
    ("qwen3", "Qwen3RMSNorm", "offset=0 casting=llama", None),
    ("mistral", "MistralRMSNorm", "offset=0 casting=llama", None),
    ("phi3", "Phi3RMSNorm", "offset=0 casting=llama", None),
    ("gemma", "GemmaRMSNorm", "offset=1 casting=gemma", None),
    ("gemma2", "Gemma2RMSNorm", "offset=1 casting=gemma", None),
    ("gemma3", "Gemma3RMSNorm", "offset=1 casting=gemma", None),
    ("gpt_oss", "GptOssRMSNorm", "offset=0 casting=gemma", None),
    ("olmo2", "Olmo2RMSNorm", "offset=0 casting=gemma", None),
    ("t5", "T5LayerNorm", "offset=0 casting=llama (original code when weight and input dtypes differ)", None),
    ("falcon_mamba", "FalconMambaWeightlessRMSNorm", "weightless", None),
    ("qwen3_next", "Qwen3NextRMSNormGated", None, "forward takes extra arguments (gate"),
    ("cohere", "CohereLayerNorm", None, "matches no RMSNorm formula"),
    ("deepseek_v4", "DeepseekV4UnweightedRMSNorm", None, "matches no RMSNorm formula"),
]


@pytest.mark.parametrize("model,cls_name,variant,reason", CASES, ids=[c[1] for c in CASES])
def test_verdicts_on_real_modules(model, cls_name, variant, reason):
    check_class_verdict(RULE, model, cls_name, variant, reason, kernel="rms_norm")


def _make(cls, hidden, gen, weight_dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        norm = cls(hidden, eps=1e-5)
    if getattr(norm, "weight", None) is not None and isinstance(norm.weight, nn.Parameter):
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5)
    return norm.to(weight_dtype)


def _run(norm, forward, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    for p in norm.parameters():
        p.grad = None
    y = forward(norm, x)
    y.backward(grad_out)
    grads = [x.grad] + [p.grad for p in norm.parameters()]
    return y, grads


# (model, class, shape of x: leading dims then hidden); qwen3's per-head q/k norm runs on (b, s, h, d)
NUMERIC = [
    ("llama", "LlamaRMSNorm", (2, 5, 64)),
    ("qwen3", "Qwen3RMSNorm", (2, 5, 4, 16)),
    ("gemma", "GemmaRMSNorm", (3, 7, 48)),
    ("gpt_oss", "GptOssRMSNorm", (2, 5, 64)),
    ("t5", "T5LayerNorm", (2, 5, 40)),
    ("falcon_mamba", "FalconMambaWeightlessRMSNorm", (2, 5, 64)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model,cls_name,shape", NUMERIC, ids=[c[1] for c in NUMERIC])
def test_patched_matches_original(model, cls_name, shape, dtype):
    module = modeling(model)
    cls = getattr(module, cls_name)
    assert verdict_of(RULE.patch_module(module, current(), everything), cls_name).patched
    original = patching.original(cls, "forward")
    gen = torch.Generator().manual_seed(7)
    norm = _make(cls, shape[-1], gen, weight_dtype=dtype)
    x = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(dtype)
    grad_out = torch.randn(*shape, generator=gen).to(dtype)

    before = fused_kernels.launch_counts()
    y, grads = _run(norm, cls.forward, x, grad_out)
    after = fused_kernels.launch_counts()
    assert after.get("rms_norm_fwd", 0) > before.get("rms_norm_fwd", 0), "the fused forward did not run"
    assert after.get("rms_norm_bwd", 0) > before.get("rms_norm_bwd", 0), "the fused backward did not run"

    y_ref, grads_ref = _run(norm, original, x, grad_out)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert_close(y, y_ref, dtype, f"{cls_name} forward")
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        assert_close(g, g_ref, dtype, f"{cls_name} gradient {i}")


def test_mixed_dtypes_follow_the_probe():
    """fp32 weight with bf16 input (autocast): Llama promotes to fp32 through the kernel; T5's norm
    (which casts to the weight's dtype instead) runs its own code."""
    llama, t5 = modeling("llama"), modeling("t5")
    RULE.patch_module(llama, current(), everything)
    RULE.patch_module(t5, current(), everything)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 32, generator=gen).to(torch.bfloat16)
    for cls, launches in ((llama.LlamaRMSNorm, True), (t5.T5LayerNorm, False)):
        norm = _make(cls, 32, gen)
        before = fused_kernels.launch_counts().get("rms_norm_fwd", 0)
        with torch.no_grad():
            y = norm(x)
            y_ref = patching.original(cls, "forward")(norm, x)
        assert (fused_kernels.launch_counts().get("rms_norm_fwd", 0) > before) == launches
        assert y.dtype == y_ref.dtype
        assert_close(y, y_ref, torch.bfloat16, cls.__name__)


@pytest.mark.parametrize("model,cls_name,kwargs", [
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", {"group_size": 8}),  # normalises groups of 8 channels
    ("gemma4", "Gemma4RMSNorm", {"with_scale": False}),  # no weight attribute at all
])
def test_instances_built_differently_run_the_original(model, cls_name, kwargs):
    """The probe saw the default constructor; an instance whose switches differ is not what was
    proven equal, so it runs its own code. The default-built instance still takes the kernel."""
    module = modeling(model)
    cls = getattr(module, cls_name)
    assert verdict_of(RULE.patch_module(module, current(), everything), cls_name).patched
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 32, generator=gen)
    for extra, launches in ((kwargs, False), ({}, True)):
        norm = cls(32, eps=1e-5, **extra)
        if getattr(norm, "weight", None) is not None:
            with torch.no_grad():
                norm.weight.copy_(torch.randn(32, generator=gen) * 0.5)
        before = fused_kernels.launch_counts().get("rms_norm_fwd", 0)
        with torch.no_grad():
            y = norm(x)
        assert (fused_kernels.launch_counts().get("rms_norm_fwd", 0) > before) == launches, extra
        with torch.no_grad():
            assert_close(y, patching.original(cls, "forward")(norm, x), torch.float32, f"{cls_name} {extra}")


def test_probing_leaves_the_global_rng_alone():
    module = modeling("gemma2")
    rms_norm._verdicts.pop(module.Gemma2RMSNorm, None)  # force a fresh probe
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    RULE.patch_module(module, current(), everything)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_num_threads() == threads


def test_disabled_kernel_is_reported_not_patched():
    module = modeling("mistral")
    before = module.MistralRMSNorm.forward
    record = verdict_of(RULE.patch_module(module, current(), lambda k: False), "MistralRMSNorm")
    assert not record.patched and "disabled" in record.reason and record.variant == "offset=0 casting=llama"
    assert module.MistralRMSNorm.forward is before


def test_falls_back_where_triton_cannot_run(monkeypatch, capsys):
    module = modeling("llama")
    RULE.patch_module(module, current(), everything)
    norm = _make(module.LlamaRMSNorm, 32, torch.Generator().manual_seed(5))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(6))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    current().reset_runs()  # the fallback notices are once per session
    before = fused_kernels.launch_counts().get("rms_norm_fwd", 0)
    with torch.no_grad():
        y = norm(x)
        y2 = norm(x)
    assert fused_kernels.launch_counts().get("rms_norm_fwd", 0) == before
    ref = patching.original(module.LlamaRMSNorm, "forward")(norm, x)
    assert torch.equal(y, ref) and torch.equal(y2, ref)
    assert capsys.readouterr().err.count("autopatch: rms_norm:") == 1


# --- look-alikes that must be refused ------------------------------------------------------------


class _Base(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps


class FakeGoodRMSNorm(_Base):
    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class FakeWrongDimRMSNorm(_Base):  # normalises over the sequence, not the hidden size
    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-2, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)


class FakeScaledRMSNorm(_Base):  # an extra sqrt(hidden) scale
    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * h.shape[-1] ** 0.5
        return self.weight * h.to(hidden_states.dtype)


class FakeEpsOutsideRMSNorm(_Base):  # x / (rms + eps): eps in another place
    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)
        return self.weight * h.to(hidden_states.dtype)


class FakeFixedEpsRMSNorm(_Base):  # ignores its eps attribute
    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(hidden_states.dtype)


def test_look_alikes_are_left_alone():
    fake = types.ModuleType("fake_modeling_rmsnorm")
    classes = [FakeGoodRMSNorm, FakeWrongDimRMSNorm, FakeScaledRMSNorm, FakeEpsOutsideRMSNorm, FakeFixedEpsRMSNorm]
    for cls in classes:
        cls.__module__ = fake.__name__
        setattr(fake, cls.__name__, cls)
    records = {r.target: r for r in RULE.patch_module(fake, current(), everything)}
    assert set(records) == {c.__name__ for c in classes}
    assert records["FakeGoodRMSNorm"].patched and records["FakeGoodRMSNorm"].variant == "offset=0 casting=llama"
    for cls in classes[1:]:
        r = records[cls.__name__]
        assert not r.patched and "matches no RMSNorm formula" in r.reason, r
        assert "forward" not in vars(cls) or vars(cls)["forward"].__qualname__.startswith(cls.__name__)


def test_never_raises():
    fake = types.ModuleType("fake_modeling_broken")

    class BrokenRMSNorm(nn.Module):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("cannot build me")

        def forward(self, x):
            return x

    BrokenRMSNorm.__module__ = fake.__name__
    fake.BrokenRMSNorm = BrokenRMSNorm
    (record,) = RULE.patch_module(fake, current(), everything)
    assert not record.patched and "could not build" in record.reason
