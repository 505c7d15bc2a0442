"""The glu_mlp rule (autopatch.rules.glu_mlp) on real transformers modeling modules: the verdicts
(swiglu / geglu tanh / geglu erf, fused gate_up_proj, or left alone with the reason), the patched MLP
against its original forward — forward and every gradient, fp32 at 1e-5 and bf16 at 1e-2 — with the
kernels counted, the activation read from each instance at run time, and look-alikes refused."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from helpers import assert_close, check_class_verdict, everything, modeling, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
from autopatch import patching, report  # noqa: E402
from autopatch.rules import glu_mlp  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = glu_mlp.RULE


pytestmark = pytest.mark.usefixtures("restore_patches")


CASES = [
    ("llama", "LlamaMLP", "swiglu", "swiglu", None),
    ("qwen3", "Qwen3MLP", "swiglu", "swiglu", None),
    ("mistral", "MistralMLP", "swiglu", "swiglu", None),
    ("phi3", "Phi3MLP", "swiglu", "swiglu fused gate_up_proj (gate, up)", None),
    ("gemma", "GemmaMLP", "geglu", "geglu approximate=tanh", None),
    ("gemma2", "Gemma2MLP", "geglu", "geglu approximate=tanh", None),
    ("gemma3", "Gemma3MLP", "geglu", "geglu approximate=tanh", None),
    ("pixtral", "PixtralMLP", "geglu", "geglu approximate=none", None),
    ("zamba", "ZambaMLP", "geglu", "geglu approximate=none", None),
    # expert containers with transformers' default gate belong to the moe_gate rule (no record here);
    # one with a gate of its own is left alone, with the reason
    ("gpt_oss", "GptOssExperts", None, None, "MoE expert container with a gate of its own"),
    ("bitnet", "BitNetMLP", None, None, "has other submodules (ffn_sub_norm)"),
    ("t5gemma", "T5GemmaMLP", None, None, "has other submodules (dropout)"),
    ("gemma4", "Gemma4VisionMLP", None, None, "not a plain nn.Linear"),
]


@pytest.mark.parametrize("model,cls_name,kernel,variant,reason", CASES, ids=[c[1] for c in CASES])
def test_verdicts_on_real_modules(model, cls_name, kernel, variant, reason):
    record = check_class_verdict(RULE, model, cls_name, variant, reason)
    if variant is not None:
        assert record.kernel == kernel, record


def _config(module, config_name, **extra):
    return getattr(module, config_name)(hidden_size=32, intermediate_size=48, **extra)


def _build(cls, config, gen, dtype):
    with torch.random.fork_rng(devices=[]):
        mlp = cls(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mlp.to(dtype)


def _run(mlp, forward, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    y = forward(mlp, x)
    y.backward(grad_out)
    return [y, x.grad] + [p.grad for p in mlp.parameters()]


# (model, class, config class, config extras, kernel op that must run)
NUMERIC = [
    ("llama", "LlamaMLP", "LlamaConfig", {}, "swiglu"),
    ("phi3", "Phi3MLP", "Phi3Config", {}, "swiglu"),
    ("gemma2", "Gemma2MLP", "Gemma2Config", {}, "geglu"),
    ("pixtral", "PixtralMLP", "PixtralVisionConfig", {}, "geglu"),
    # the activation comes from the instance, not the class: a Llama MLP configured with GELU-tanh
    ("llama", "LlamaMLP", "LlamaConfig", {"hidden_act": "gelu_pytorch_tanh"}, "geglu"),
    ("llama", "LlamaMLP", "LlamaConfig", {"mlp_bias": True}, "swiglu"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model,cls_name,config_name,extra,op", NUMERIC,
                         ids=[f"{c[1]}-{'-'.join(f'{k}={v}' for k, v in c[3].items())}" for c in NUMERIC])
def test_patched_matches_original(model, cls_name, config_name, extra, op, dtype):
    module = modeling(model)
    cls = getattr(module, cls_name)
    assert verdict_of(RULE.patch_module(module, current(), everything), cls_name).patched
    original = patching.original(cls, "forward")
    gen = torch.Generator().manual_seed(21)
    mlp = _build(cls, _config(module, config_name, **extra), gen, dtype)
    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    grad_out = torch.randn(2, 5, 32, generator=gen).to(dtype)

    before = fused_kernels.launch_counts()
    out = _run(mlp, cls.forward, x, grad_out)
    after = fused_kernels.launch_counts()
    assert after.get(f"{op}_fwd", 0) > before.get(f"{op}_fwd", 0), f"{op} forward did not run"
    assert after.get(f"{op}_bwd", 0) > before.get(f"{op}_bwd", 0), f"{op} backward did not run"
    # down_proj is a plain nn.Linear: gate and down projection ran as one node (glu_linear), whose
    # backward recomputes act(gate) * up instead of keeping it
    assert after.get(f"{op}_recompute", 0) > before.get(f"{op}_recompute", 0), "glu_linear was not used"
    ref = _run(mlp, original, x, grad_out)
    assert len(out) == len(ref)
    for i, (a, r) in enumerate(zip(out, ref)):
        assert a.dtype == r.dtype
        assert_close(a, r, dtype, f"{cls_name} output/grad {i}")


def test_other_activation_or_disabled_kernel_runs_the_original():
    """A Llama MLP built with ReLU has no fused kernel: the original forward runs. With geglu off,
    a GELU-tanh Llama MLP runs the original too; the SiLU one still uses swiglu."""
    module = modeling("llama")
    RULE.patch_module(module, current(), lambda k: k == "swiglu")
    cls = module.LlamaMLP
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=gen)
    for act, launches in (("relu", False), ("gelu_pytorch_tanh", False), ("silu", True)):
        mlp = _build(cls, _config(module, "LlamaConfig", hidden_act=act), gen, torch.float32)
        before = sum(fused_kernels.launch_counts().get(k, 0) for k in ("swiglu_fwd", "geglu_fwd"))
        with torch.no_grad():
            y = mlp(x)
        ran = sum(fused_kernels.launch_counts().get(k, 0) for k in ("swiglu_fwd", "geglu_fwd")) > before
        assert ran == launches, act
        with torch.no_grad():
            assert_close(y, patching.original(cls, "forward")(mlp, x), torch.float32, act)


def test_instance_with_other_submodules_runs_the_original():
    module = modeling("llama")
    RULE.patch_module(module, current(), everything)
    gen = torch.Generator().manual_seed(6)
    mlp = _build(module.LlamaMLP, _config(module, "LlamaConfig"), gen, torch.float32)
    mlp.dropout = nn.Dropout(0.0)  # not in the probed instance: its forward is not what was proven
    x = torch.randn(3, 32, generator=gen)
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    with torch.no_grad():
        y = mlp(x)
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) == before
    with torch.no_grad():
        assert torch.equal(y, patching.original(module.LlamaMLP, "forward")(mlp, x))


def test_disabled_kernels_are_reported_not_patched():
    llama, gemma = modeling("llama"), modeling("gemma")
    only_geglu = lambda k: k == "geglu"  # noqa: E731
    record = verdict_of(RULE.patch_module(llama, current(), only_geglu), "LlamaMLP")
    assert not record.patched and record.kernel == "swiglu" and "disabled" in record.reason
    assert not patching.is_patched(llama.LlamaMLP, "forward")
    record = verdict_of(RULE.patch_module(gemma, current(), only_geglu), "GemmaMLP")
    assert record.patched and record.kernel == "geglu"


def test_falls_back_where_triton_cannot_run(monkeypatch, capsys):
    module = modeling("mistral")
    RULE.patch_module(module, current(), everything)
    gen = torch.Generator().manual_seed(9)
    mlp = _build(module.MistralMLP, _config(module, "MistralConfig"), gen, torch.float32)
    x = torch.randn(4, 32, generator=gen)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    current().reset_runs()  # the fallback notices are once per session
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    with torch.no_grad():
        y, y2 = mlp(x), mlp(x)
        ref = patching.original(module.MistralMLP, "forward")(mlp, x)
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) == before
    assert torch.equal(y, ref) and torch.equal(y2, ref)
    assert capsys.readouterr().err.count("autopatch: swiglu:") == 1


def test_probing_leaves_the_global_rng_alone():
    module = modeling("qwen3")
    glu_mlp._verdicts.pop(module.Qwen3MLP, None)
    torch.manual_seed(4321)
    state = torch.get_rng_state()
    RULE.patch_module(module, current(), everything)
    assert torch.equal(torch.get_rng_state(), state)


# --- look-alikes ----------------------------------------------------------------------------------


class _Config:
    hidden_size = 32
    intermediate_size = 48


class FakeSwappedMLP(nn.Module):  # silu on the up projection: not swiglu(gate, up)
    def __init__(self, config=_Config()):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class FakeDropoutMLP(FakeSwappedMLP):  # dropout is identity in the probe, but not in training
    def __init__(self, config=_Config()):
        super().__init__(config)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class FakeUpFirstMLP(nn.Module):  # fused projection with up before gate: patched, in that order
    def __init__(self, config=_Config()):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation_fn = nn.GELU(approximate="tanh")

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


class FakeClippedMLP(FakeSwappedMLP):  # clamps the gated product
    def forward(self, x):
        return self.down_proj((self.act_fn(self.gate_proj(x)) * self.up_proj(x)).clamp(-0.05, 0.05))


def test_look_alikes():
    fake = types.ModuleType("fake_modeling_glu")
    classes = [FakeSwappedMLP, FakeDropoutMLP, FakeUpFirstMLP, FakeClippedMLP]
    for cls in classes:
        cls.__module__ = fake.__name__
        setattr(fake, cls.__name__, cls)
    records = {r.target: r for r in RULE.patch_module(fake, current(), everything)}
    assert "matches no gated-MLP formula" in records["FakeSwappedMLP"].reason
    assert "has other submodules (dropout)" in records["FakeDropoutMLP"].reason
    assert "matches no gated-MLP formula" in records["FakeClippedMLP"].reason
    assert not any(records[c].patched for c in ("FakeSwappedMLP", "FakeDropoutMLP", "FakeClippedMLP"))
    up_first = records["FakeUpFirstMLP"]
    assert up_first.patched and up_first.variant == "geglu approximate=tanh fused gate_up_proj (up, gate)"

    gen = torch.Generator().manual_seed(13)
    mlp = FakeUpFirstMLP()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(2, 3, 32, generator=gen)
    grad_out = torch.randn(2, 3, 32, generator=gen)
    before = fused_kernels.launch_counts().get("geglu_fwd", 0)
    out = _run(mlp, FakeUpFirstMLP.forward, x, grad_out)
    assert fused_kernels.launch_counts().get("geglu_fwd", 0) > before
    ref = _run(mlp, patching.original(FakeUpFirstMLP, "forward"), x, grad_out)
    for a, r in zip(out, ref):
        assert_close(a, r, torch.float32, "FakeUpFirstMLP")


def test_hooked_or_wrapped_down_proj_keeps_its_module_call():
    """A down_proj with a forward hook (FSDP units, activation probes) or of a Linear subclass (LoRA,
    quantized layers) is still called as a module: the hook runs, glu_linear does not."""
    module = modeling("llama")
    cls = module.LlamaMLP
    assert verdict_of(RULE.patch_module(module, current(), everything), "LlamaMLP").patched
    gen = torch.Generator().manual_seed(3)
    mlp = _build(cls, _config(module, "LlamaConfig"), gen, torch.float32)
    x = torch.randn(2, 3, 32, generator=gen)
    calls = []
    handle = mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    try:
        before = fused_kernels.launch_counts()
        mlp(x.requires_grad_(True)).sum().backward()
        after = fused_kernels.launch_counts()
    finally:
        handle.remove()
    assert calls == [torch.Size([2, 3, 32])]
    assert after.get("swiglu_fwd", 0) > before.get("swiglu_fwd", 0)
    assert after.get("swiglu_recompute", 0) == before.get("swiglu_recompute", 0)
    ref = _run(mlp, patching.original(cls, "forward"), x, torch.ones(2, 3, 32))
    out = _run(mlp, cls.forward, x, torch.ones(2, 3, 32))
    for a, r in zip(out, ref):
        assert_close(a, r, torch.float32, "hooked down_proj")
