"""The rope rule (autopatch.rules.rope) on real transformers modeling modules: the detected variant of
each module's `apply_rotary_pos_emb` (or why it is left alone), the rebound function against the
original on random q, k, cos, sin — forward and gradients, fp32 at 1e-5 and bf16 at 1e-2 — with the
kernels counted, and tiny one-layer models whose attention goes through the rebound global."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import assert_close, everything, modeling

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
from autopatch import patching, report  # noqa: E402
from autopatch.rules import rope  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = rope.RULE
TARGET = "apply_rotary_pos_emb"
INTERLEAVE = "apply_rotary_pos_emb_interleave"  # DeepSeek-V3's de-interleaving rotation


pytestmark = pytest.mark.usefixtures("restore_patches")


def record_for(records, target=TARGET):
    found = [r for r in records if r.target == target]
    assert len(found) == 1, f"expected one record for {target}, got {records}"
    return found[0]


CASES = [
    ("llama", TARGET, "half rot=full", None),
    ("qwen3", TARGET, "half rot=full", None),
    ("mistral", TARGET, "half rot=full", None),
    ("gemma3", TARGET, "half rot=full", None),
    ("stablelm", TARGET, "half rot=full", None),  # partial rotary happens in the caller: the function is standard
    ("phi3", TARGET, "half partial", None),
    ("gpt_neox", TARGET, "half partial", None),
    ("glm", TARGET, "glm", None),
    ("glm4", TARGET, "glm", None),
    ("cohere", TARGET, "interleaved", None),
    ("gpt_oss", TARGET, "half-size cos", None),
    ("nanochat", TARGET, "half sin=-sin", None),
    ("openai_privacy_filter", TARGET, "interleaved half-size cos", None),
    ("deepseek_v3", TARGET, "half rot=full", None),
    ("deepseek_v3", INTERLEAVE, "de-interleaved", None),
    ("mistral4", INTERLEAVE, "de-interleaved", None),
    ("gemma3n", TARGET, "half rot=full, one tensor", None),  # apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)
    ("gemma4", TARGET, "half rot=full, one tensor", None),
    ("deepseek_v4", TARGET, None, "matches no rotary variant"),  # one tensor, rotating its *trailing* channels
    ("dinov3_vit", TARGET, None, "takes **kwargs"),
    # apply_rotary_pos_emb(tensor, sin, cos): one tensor, sin first, (batch, seq, heads, head_dim) only
    ("codegen", TARGET, "interleaved half-size cos, one tensor", None),
    ("gptj", TARGET, "interleaved half-size cos, one tensor", None),
]


@pytest.mark.parametrize("model,target,variant,reason", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_verdicts_on_real_modules(model, target, variant, reason):
    module = modeling(model)
    before = getattr(module, target)
    records = RULE.patch_module(module, current(), everything)
    record = record_for(records, target)
    assert record.kernel == "rope" and record.module == module.__name__
    if variant is None:
        assert not record.patched and reason in record.reason, record
        assert getattr(module, target) is before
    else:
        assert record.patched and record.variant == variant, record
        patched = getattr(module, target)
        assert patched is not before and patching.original(module, target) is before
        assert RULE.patch_module(module, current(), everything) == records  # idempotent
        assert getattr(module, target) is patched


def _run(fn, q, k, cos, sin, grads, **kwargs):
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    q_out, k_out = fn(q, k, cos, sin, **kwargs)
    torch.autograd.backward((q_out, k_out), grads)
    return q_out, k_out, q.grad, k.grad


# (model, rotary size of cos, head layout); cos/sin are random, not a cos table: the kernel must
# use every element the way the original does
NUMERIC = [
    ("llama", 16, 1),
    ("llama", 16, 2),
    ("phi3", 8, 1),
    ("phi3", 6, 1),
    ("glm", 8, 1),
    ("glm4", 16, 1),
    ("cohere", 16, 1),
    ("gpt_oss", 8, 1),
    ("nanochat", 16, 1),
    ("openai_privacy_filter", 8, 1),
    ("deepseek_v3", 16, 1),  # through apply_rotary_pos_emb_interleave (below)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model,rotary,layout", NUMERIC, ids=[f"{m}-r{r}-u{u}" for m, r, u in NUMERIC])
def test_rebound_function_matches_original(model, rotary, layout, dtype):
    module = modeling(model)
    target = INTERLEAVE if model == "deepseek_v3" else TARGET
    assert record_for(RULE.patch_module(module, current(), everything), target).patched
    original = patching.original(module, target)
    gen = torch.Generator().manual_seed(11)
    b, s, d = 2, 6, 16
    q_shape, k_shape = ((b, 4, s, d), (b, 2, s, d)) if layout == 1 else ((b, s, 4, d), (b, s, 2, d))
    q = torch.randn(*q_shape, generator=gen).to(dtype)
    k = torch.randn(*k_shape, generator=gen).to(dtype)
    cos = torch.randn(b, s, rotary, generator=gen).to(dtype)
    sin = torch.randn(b, s, rotary, generator=gen).to(dtype)
    grads = (torch.randn(*q_shape, generator=gen).to(dtype), torch.randn(*k_shape, generator=gen).to(dtype))
    kwargs = {} if layout == 1 else {"unsqueeze_dim": 2}

    before = fused_kernels.launch_counts()
    out = _run(getattr(module, target), q, k, cos, sin, grads, **kwargs)
    after = fused_kernels.launch_counts()
    assert after.get("rope_fwd", 0) > before.get("rope_fwd", 0), "the fused forward did not run"
    assert after.get("rope_bwd", 0) > before.get("rope_bwd", 0), "the fused backward did not run"
    ref = _run(original, q, k, cos, sin, grads, **kwargs)
    for name, a, r in zip(("q_out", "k_out", "q.grad", "k.grad"), out, ref):
        assert a.dtype == r.dtype
        assert_close(a, r, dtype, f"{model} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", ["gemma3n", "gemma4"])
@pytest.mark.parametrize("layout", [1, 2])
def test_one_tensor_function_matches_original(model, layout, dtype):
    """Gemma 3n / 4 rotate q and k in separate calls, apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim),
    by position or by keyword: the kernel (x as q, a k of no heads) gives the original's output and
    gradient."""
    module = modeling(model)
    assert record_for(RULE.patch_module(module, current(), everything)).patched
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(5)
    shape = (2, 3, 6, 16) if layout == 1 else (2, 6, 3, 16)
    x = torch.randn(*shape, generator=gen).to(dtype)
    cos, sin = torch.randn(2, 6, 16, generator=gen).to(dtype), torch.randn(2, 6, 16, generator=gen).to(dtype)
    grad = torch.randn(*shape, generator=gen).to(dtype)
    calls = [lambda fn, x: fn(x, cos, sin, layout), lambda fn, x: fn(x=x, cos=cos, sin=sin, unsqueeze_dim=layout)]
    for how, call in zip(("positional", "keywords"), calls):
        results = []
        for fn in (getattr(module, TARGET), original):
            leaf = x.clone().requires_grad_(True)
            before = fused_kernels.launch_counts()
            out = call(fn, leaf)
            out.backward(grad)
            after = fused_kernels.launch_counts()
            results.append((out, leaf.grad, after.get("rope_fwd", 0) - before.get("rope_fwd", 0),
                            after.get("rope_bwd", 0) - before.get("rope_bwd", 0)))
        (out, dx, fwd, bwd), (ref, ref_dx, _, _) = results
        assert (fwd, bwd) == (1, 1), f"{how}: the kernel ran {fwd} / {bwd} times"
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert_close(out, ref, dtype, f"{model} {how} x_out")
        assert_close(dx, ref_dx, dtype, f"{model} {how} x.grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", ["gptj", "codegen"])
def test_sin_first_one_tensor_function_matches_original(model, dtype):
    """GPT-J / CodeGen: apply_rotary_pos_emb(tensor, sin, cos) with no unsqueeze_dim, on (batch, seq,
    heads, head_dim) tensors (the one layout the probe found it takes) and one cos/sin per channel pair;
    what the probe did not see goes to the original."""
    module = modeling(model)
    assert record_for(RULE.patch_module(module, current(), everything)).patched
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, 3, 16, generator=gen).to(dtype)
    sin, cos = torch.randn(2, 6, 8, generator=gen).to(dtype), torch.randn(2, 6, 8, generator=gen).to(dtype)
    grad = torch.randn(2, 6, 3, 16, generator=gen).to(dtype)
    results = []
    for fn in (getattr(module, TARGET), original):
        leaf = x.clone().requires_grad_(True)
        before = fused_kernels.launch_counts().get("rope_fwd", 0)
        out = fn(leaf, sin, cos)
        out.backward(grad)
        results.append((out, leaf.grad, fused_kernels.launch_counts().get("rope_fwd", 0) - before))
    (out, dx, launched), (ref, ref_dx, _) = results
    assert launched == 1
    assert_close(out, ref, dtype, f"{model} out")
    assert_close(dx, ref_dx, dtype, f"{model} grad")
    # a 3-D tensor (not what the probe saw) goes to the original, which refuses it as it always did
    flat = torch.randn(2, 6, 16, generator=gen)
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    with pytest.raises(RuntimeError, match="must match"):
        getattr(module, TARGET)(flat, sin.float(), cos.float())
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before


@pytest.mark.parametrize("model,out_dtype", [("llama", torch.float32), ("cohere", torch.bfloat16)])
def test_mixed_dtypes_follow_the_original(model, out_dtype):
    """bf16 q/k with fp32 cos/sin (autocast): Llama's maths promotes to fp32, Cohere's returns q's
    dtype; the patched function does the same, through the kernel."""
    module = modeling(model)
    RULE.patch_module(module, current(), everything)
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, 4, 5, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 5, 16, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    grads = (torch.randn(2, 4, 5, 16, generator=gen).to(out_dtype), torch.randn(2, 2, 5, 16, generator=gen).to(out_dtype))
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    out = _run(getattr(module, TARGET), q, k, cos, sin, grads)
    assert fused_kernels.launch_counts().get("rope_fwd", 0) > before
    ref = _run(original, q, k, cos, sin, grads)
    # outputs in the original's dtype; gradients of the bf16 leaves in bf16
    for name, a, r, tol_dtype in zip(("q_out", "k_out", "q.grad", "k.grad"), out, ref,
                                     (out_dtype, out_dtype, torch.bfloat16, torch.bfloat16)):
        assert a.dtype == r.dtype
        assert_close(a, r, tol_dtype, f"{model} {name}")
    assert out[0].dtype == out_dtype


def test_sizes_the_probe_did_not_see_run_the_original():
    """gpt_oss takes only half-size cos: a full-size cos goes to the original (which raises as it
    always did); float64 goes to the original too (the kernel does not take it)."""
    module = modeling("gpt_oss")
    RULE.patch_module(module, current(), everything)
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 1, 3, 16, generator=gen)
    full = torch.randn(1, 3, 16, generator=gen)
    with pytest.raises(RuntimeError):
        original(q, k, full, full)
    with pytest.raises(RuntimeError):
        getattr(module, TARGET)(q, k, full, full)
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    half = torch.randn(1, 3, 8, generator=gen, dtype=torch.float64)
    q64, k64 = q.double(), k.double()
    out = getattr(module, TARGET)(q64, k64, half, half)
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before
    for a, r in zip(out, original(q64, k64, half, half)):
        assert torch.equal(a, r)


def test_cos_and_sin_with_a_gradient_run_the_original():
    """cos/sin made from a trainable parameter (Mistral Large 4's rotary alpha): the kernel gives them no
    gradient, so the original runs and the parameter gets its gradient, the same as unpatched."""
    module = modeling("llama")
    RULE.patch_module(module, current(), everything)
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen)
    alpha = torch.tensor(1.3, requires_grad=True)
    angles = torch.randn(1, 3, 8, generator=gen)
    grads = []
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    for fn in (getattr(module, TARGET), original):
        qo, ko = fn(q, k, torch.cos(alpha * angles), torch.sin(alpha * angles))
        (qo.square().sum() + ko.sum()).backward()
        grads.append(alpha.grad.clone())
        alpha.grad = None
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before
    assert grads[0].abs() > 0 and torch.equal(grads[0], grads[1])


def test_falls_back_where_triton_cannot_run(monkeypatch, capsys):
    module = modeling("llama")
    RULE.patch_module(module, current(), everything)
    gen = torch.Generator().manual_seed(4)
    q, k, cos, sin = (torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 3, 8, generator=gen),
                      torch.randn(1, 3, 8, generator=gen), torch.randn(1, 3, 8, generator=gen))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    current().reset_runs()  # the fallback notices are once per session
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    out = module.apply_rotary_pos_emb(q, k, cos, sin)
    module.apply_rotary_pos_emb(q, k, cos, sin)
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before
    for a, r in zip(out, patching.original(module, TARGET)(q, k, cos, sin)):
        assert torch.equal(a, r)
    assert capsys.readouterr().err.count("autopatch: rope:") == 1


def test_probing_leaves_the_global_rng_alone():
    module = modeling("cohere")
    rope._verdicts.pop(patching.original(module, TARGET), None)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    RULE.patch_module(module, current(), everything)
    assert torch.equal(torch.get_rng_state(), state)


def test_disabled_kernel_is_reported_not_patched():
    module = modeling("mistral")
    before = module.apply_rotary_pos_emb
    record = record_for(RULE.patch_module(module, current(), lambda k: k != "rope"))
    assert not record.patched and "disabled" in record.reason and record.variant == "half rot=full"
    assert module.apply_rotary_pos_emb is before


def test_signature_and_keywords_are_kept():
    import inspect

    module = modeling("glm")
    RULE.patch_module(module, current(), everything)
    assert list(inspect.signature(module.apply_rotary_pos_emb).parameters) == ["q", "k", "cos", "sin", "unsqueeze_dim"]
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(3, 2, 4, 16, generator=gen), torch.randn(3, 2, 1, 16, generator=gen)  # (b, s, h, d)
    cos, sin = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    out = module.apply_rotary_pos_emb(q=q, k=k, cos=cos, sin=sin, unsqueeze_dim=2)
    ref = patching.original(module, TARGET)(q, k, cos, sin, 2)
    for a, r in zip(out, ref):
        assert_close(a, r, torch.float32, "keywords")


def test_look_alikes_are_left_alone():
    fake = types.ModuleType("fake_modeling_rope")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # rotates by 2*angle-ish: cos applied twice
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        h = q.shape[-1] // 2
        rot = lambda x: torch.cat((-x[..., h:], x[..., :h]), -1)  # noqa: E731
        return q * cos * cos + rot(q) * sin, k * cos * cos + rot(k) * sin

    apply_rotary_pos_emb.__module__ = fake.__name__
    fake.apply_rotary_pos_emb = apply_rotary_pos_emb
    (record,) = RULE.patch_module(fake, current(), everything)
    assert not record.patched and "matches no rotary variant" in record.reason
    assert fake.apply_rotary_pos_emb is apply_rotary_pos_emb

    other = types.ModuleType("fake_modeling_rope_positions")

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # noqa: F811
        if position_ids is not None:
            cos, sin = cos * 0.5, sin * 0.5
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        h = q.shape[-1] // 2
        rot = lambda x: torch.cat((-x[..., h:], x[..., :h]), -1)  # noqa: E731
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    apply_rotary_pos_emb.__module__ = other.__name__
    other.apply_rotary_pos_emb = apply_rotary_pos_emb
    (record,) = RULE.patch_module(other, current(), everything)
    assert not record.patched and record.reason == "uses position_ids"


def _standard_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    h = q.shape[-1] // 2
    rot = lambda x: torch.cat((-x[..., h:], x[..., :h]), -1)  # noqa: E731
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _hub_layer_of(fn):
    """fn as Hugging Face's `kernels` package wraps it (transformers' @use_kernel_forward_from_hub with
    the package installed): the real decorator where the package is there, else the same shape by hand
    (an instance of an nn.Module class `Func` whose forward calls fn from its closure)."""
    try:
        from kernels import use_kernel_forward_from_hub
    except ImportError:
        def make(func):
            class Func(torch.nn.Module):
                def forward(self, *args, **kwargs):
                    return func(*args, **kwargs)
            return Func()

        return make(fn)
    return use_kernel_forward_from_hub("rotary_pos_emb")(fn)


def test_function_behind_a_hub_kernel_layer_is_patched_and_restored():
    """transformers 5.25 (which requires `kernels`) makes apply_rotary_pos_emb a Func module instance
    taking (*args, **kwargs): the rule proves the function inside, rebinds the global to the kernel and
    restores the instance."""
    fake = types.ModuleType("fake_modeling_rope_hub")
    _standard_rope.__module__ = fake.__name__
    layer = _hub_layer_of(_standard_rope)
    assert isinstance(layer, torch.nn.Module)
    fake.apply_rotary_pos_emb = layer
    (record,) = RULE.patch_module(fake, current(), everything)
    assert record.patched and record.variant == "half rot=full", record
    assert fake.apply_rotary_pos_emb is not layer and patching.original(fake, TARGET) is layer
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 6, 16, generator=gen) for _ in range(2))
    cos, sin = (torch.randn(2, 6, 16, generator=gen) for _ in range(2))
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    out = fake.apply_rotary_pos_emb(q, k, cos, sin)
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before + 1
    for got, want in zip(out, layer(q, k, cos, sin)):
        assert_close(got, want, torch.float32, "apply_rotary_pos_emb behind a hub layer")
    patching.restore_all()
    assert fake.apply_rotary_pos_emb is layer


# --- through real attention: tiny one-layer models, only the rope rule applied --------------------

MODELS = [
    ("llama", "LlamaForCausalLM", {}),
    ("glm", "GlmForCausalLM", {}),
    ("cohere", "CohereForCausalLM", {}),
    ("phi3", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    ("gpt_oss", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # MLA attention with DeepSeek's interleaved rope layout (rope_interleave=True by default)
    ("deepseek_v3", "DeepseekV3ForCausalLM", {
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "head_dim": 8, "num_key_value_heads": 4}),
]


@pytest.mark.parametrize("model,causal_lm,extra", MODELS, ids=[m[0] for m in MODELS])
def test_tiny_model_through_patched_attention(model, causal_lm, extra):
    from transformers import AutoConfig

    module = modeling(model)
    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_hidden_layers=1, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = AutoConfig.for_model(model, **{**sizes, **extra})
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = getattr(module, causal_lm)(config).float()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))

    def step():
        net.zero_grad(set_to_none=True)
        out = net(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}

    logits_ref, grads_ref = step()
    records = RULE.patch_module(module, current(), everything)
    assert records and all(r.patched for r in records), records
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    logits, grads = step()
    assert fused_kernels.launch_counts().get("rope_fwd", 0) > before
    assert_close(logits, logits_ref, torch.float32, f"{model} logits")
    assert set(grads) == set(grads_ref)
    for name in grads:
        assert_close(grads[name], grads_ref[name], torch.float32, f"{model} grad {name}")


def test_q_only_calls_of_a_two_tensor_function_run_the_original():
    """Qwen4-Exp's apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1) also rotates q
    alone, called with keywords and no k. The probe vouched for q and k together: such a call goes to
    the original, exactly as called (one tensor back); q and k together still take the kernel."""
    module = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")  # transformers >= 5.2x
    assert record_for(RULE.patch_module(module, current(), everything), TARGET).patched
    original = patching.original(module, TARGET)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 1, 3, 16, generator=gen)
    cos, sin = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    out = module.apply_rotary_pos_emb(q.transpose(1, 2), cos=cos, sin=sin, unsqueeze_dim=2)
    assert torch.equal(out, original(q.transpose(1, 2), cos=cos, sin=sin, unsqueeze_dim=2))
    out = module.apply_rotary_pos_emb(q, None, cos, sin)
    assert torch.equal(out, original(q, None, cos, sin))
    out = module.apply_rotary_pos_emb(q.transpose(1, 2), None, cos, sin, 2)  # unsqueeze_dim by position
    assert torch.equal(out, original(q.transpose(1, 2), None, cos, sin, 2))
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before
    for a, r in zip(module.apply_rotary_pos_emb(q, k, cos, sin), original(q, k, cos, sin)):
        assert_close(a, r, torch.float32, "q and k")
    assert fused_kernels.launch_counts().get("rope_fwd", 0) > before
