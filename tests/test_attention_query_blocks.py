"""Causal attention in query blocks (masked_attention rule, AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS): with no
mask, queries [s, e) attend over keys [0, e) under a lower-right causal mask, one SDPA call per block.
On the CPU: the output and the gradients of q, k and v equal transformers' sdpa_attention_forward in
float64 and float32 (GQA 4/2, odd lengths, batch 2); each call's queries, keys and mask; a tiny Llama
(eager attention vs sdpa patched under the setting) loss and every gradient, also under non-reentrant
gradient checkpointing; the calls left to transformers; the probe catches a wrong alignment. On the GPU:
bf16 at 65536 tokens, 32/8 heads, d 128, blocks of 8192: within bf16 tolerance of a float32 reference,
and the peak of forward + backward lower than the one call's by at least 0.75 × T·heads·d·4 (flash's
float32 dq accumulator)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from helpers import everything, modeling, rel_err, verdict_of

transformers = pytest.importorskip("transformers")

from autopatch import report  # noqa: E402
from autopatch.config import ConfigError, load_settings  # noqa: E402
from autopatch.rules import masked_attention as rule  # noqa: E402
from autopatch.session import current  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_patches")
KERNEL = "masked_attention"


def _module(groups=2, is_causal=True):
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, is_causal
    return module


def _qkv(dtype, batch=2, heads=4, kv_heads=2, tokens=37, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, tokens, dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(batch, tokens, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, grad


def _run(fn, q, k, v, grad, **kwargs):
    out, weights = fn(_module(), q, k, v, None, dropout=0.0, scaling=kwargs.pop("scaling", 0.4), **kwargs)
    assert weights is None
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


class _Calls(torch.overrides.TorchFunctionMode):
    """Every torch SDPA call made while active: (queries, keys, the mask, is_causal, enable_gqa). A torch
    function mode, not a replaced torch.nn.functional attribute: CausalBias recognises SDPA by identity, and
    the calls SDPA makes inside a CausalBias's dispatch (the mode is off there) are not counted."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query, key = args[0], args[1]
            self.calls.append((query.shape[-2], key.shape[-2], kwargs.get("attn_mask"), kwargs.get("is_causal", False),
                               kwargs.get("enable_gqa", False)))
        return func(*args, **kwargs)


def test_setting_from_the_environment():
    assert load_settings({}).attention_query_block_tokens is None
    assert load_settings({"AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS": "0"}).attention_query_block_tokens is None
    settings = load_settings({"AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS": "8192"})
    assert settings.attention_query_block_tokens == 8192
    assert settings.summary()["attention_query_block_tokens"] == 8192
    assert rule.causal_block_of(types.SimpleNamespace(settings=settings)) == 8192
    assert rule.causal_block_of(types.SimpleNamespace(settings=load_settings({}))) is None
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(ConfigError, match="AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS"):
            load_settings({"AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS": bad})


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tokens, block", [(37, 8), (29, 6)])
def test_same_output_and_gradients_as_transformers_sdpa(dtype, tol, tokens, block):
    """GQA (4 query heads over 2 key heads), batch 2, lengths that are no multiple of the block: the output
    and the gradients of q, k and v as sdpa_attention_forward's one causal call gives them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, grad = _qkv(dtype, tokens=tokens)
    ref = _run(sdpa_attention_forward, q, k, v, grad)
    blocked = _run(rule.masked_attention(sdpa_attention_forward, False, False, causal_block=block), q, k, v, grad)
    for name, a, r in zip(("out", "dq", "dk", "dv"), blocked, ref):
        assert a.shape == r.shape and a.dtype == r.dtype and (name != "out" or a.is_contiguous()), name
        assert torch.isfinite(a).all() and r.abs().max() > 0.1, name
        assert rel_err(a, r) <= tol, (name, rel_err(a, r))
        torch.testing.assert_close(a, r, rtol=tol, atol=tol, msg=name)


def test_each_block_sees_its_queries_and_the_keys_up_to_its_end(monkeypatch):
    """37 queries in blocks of 8: five SDPA calls, queries ≤ 8, keys = the block's end (8, 16, 24, 32,
    37); the first is plain is_causal, the others a lower-right causal mask (e − s, e); enable_gqa as
    transformers passes it. transformers' own path: one call over all 37 keys. The backward adds none."""
    from torch.nn.attention.bias import CausalBias, CausalVariant
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, grad = _qkv(torch.float32)
    with _Calls() as seen:
        _run(sdpa_attention_forward, q, k, v, grad)
    assert [c[:2] for c in seen.calls] == [(37, 37)] and seen.calls[0][3] is True
    with _Calls() as seen:
        _run(rule.masked_attention(sdpa_attention_forward, False, False, causal_block=8), q, k, v, grad)
    assert len(seen.calls) == math.ceil(37 / 8) == 5
    ends = [8, 16, 24, 32, 37]
    for (queries, keys, mask, is_causal, gqa), end, start in zip(seen.calls, ends, [0] + ends):
        assert queries == end - start <= 8 and keys == end and gqa is True
        if start == 0:
            assert mask is None and is_causal is True
        else:
            assert isinstance(mask, CausalBias) and is_causal is False
            assert (mask.variant, mask.seq_len_q, mask.seq_len_kv) == (CausalVariant.LOWER_RIGHT, end - start, end)
    assert rule.causal_blocks(37, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 37)]


@pytest.mark.parametrize("case", ["off", "short", "dropout", "mask", "not causal", "more keys", "no grad",
                                  "compiling", "softcap", "position_bias"])
def test_calls_left_to_transformers(case, monkeypatch):
    """One call, over all keys: the setting off, 2·N queries or fewer, dropout, a mask (the mask's own
    plan then decides), is_causal False, more keys than queries (a cache's prefill), no autograd,
    torch.compile tracing, softcap, position_bias."""
    calls = []

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append(key.shape[2])
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    q, k, v, _ = _qkv(torch.float32, tokens=32)
    mask, kwargs, module, block = None, {}, _module(), 8
    if case == "off":
        block = None
        monkeypatch.setattr(current(), "settings", types.SimpleNamespace(attention_query_block_tokens=None))
    elif case == "short":
        block = 16
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    elif case == "mask":
        mask = torch.ones(2, 1, 32, 32, dtype=torch.bool).tril()
        monkeypatch.setattr(rule, "QUERY_BLOCK", 64)  # too few queries for the mask's blocks
    elif case == "not causal":
        module = _module(is_causal=False)
    elif case == "more keys":
        q = q[:, :, 8:].detach().requires_grad_()
    elif case == "no grad":
        q, k, v = q.detach(), k.detach(), v.detach()
    elif case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif case == "softcap":
        kwargs["softcap"] = 30.0
    elif case == "position_bias":
        kwargs["position_bias"] = torch.zeros(1, 4, 32, 32)
    attention = rule.masked_attention(sdpa, check_owner=False, count=False, causal_block=block)
    attention(module, q, k, v, mask, **kwargs)
    assert calls == [32]


def _llama(attn):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_llama_same_loss_and_gradients(checkpointing, monkeypatch):
    """A tiny Llama (GQA 4/2), 2 × 29 tokens, no padding (causal, no mask): the sdpa model patched with
    blocks of 8 queries against the eager-attention model, also under HF's non-reentrant gradient
    checkpointing: loss and every gradient within 1e-5, the blocks counted as the toggle's runs."""
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(4))
    loss0, grads0 = _step(_llama("eager"), ids)
    model = _llama("sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    records = rule.RULE.patch_module(modeling("llama"), current(), everything)
    assert verdict_of(records, "LlamaAttention.forward").patched, records
    monkeypatch.setattr(current(), "settings", types.SimpleNamespace(attention_query_block_tokens=8))
    current().clear()
    current().reset_runs()
    current().add(records)
    with _Calls() as seen:
        loss1, grads1 = _step(model, ids)
    # the forward's calls (the checkpoint's recompute runs outside the torch function mode, but is counted)
    assert [c[1] for c in seen.calls] == [8, 16, 24, 29] * 2
    assert report.runs()[KERNEL]["calls"] == 2 * (2 if checkpointing else 1)
    assert torch.isfinite(loss1) and loss1.item() == pytest.approx(loss0.item(), rel=1e-6, abs=0)
    assert grads1.keys() == grads0.keys() and len(grads0) == len(list(model.parameters()))
    for n in grads0:
        assert grads0[n].abs().max() > 0, n
        assert rel_err(grads1[n], grads0[n]) < 1e-5, (n, rel_err(grads1[n], grads0[n]))
    # the setting off: the one call again
    monkeypatch.setattr(current(), "settings", types.SimpleNamespace(attention_query_block_tokens=None))
    with _Calls() as seen:
        _step(model, ids)
    assert {c[1] for c in seen.calls} == {29}


def test_an_unpatched_model_gets_one_call(monkeypatch):
    """The registry's wrapper acts only for patched modeling modules: gemma3 patched, llama not."""
    assert any(r.patched for r in rule.RULE.patch_module(modeling("gemma3"), current(), everything))
    monkeypatch.setattr(current(), "settings", types.SimpleNamespace(attention_query_block_tokens=8))
    with _Calls() as seen:
        _step(_llama("sdpa"), torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(4)))
    assert {c[1] for c in seen.calls} == {29}


def test_the_probe_catches_a_wrong_alignment(monkeypatch):
    """Upper-left instead of lower-right causal masks (each block's queries see too few keys): the rule's
    probe says so and the rule is not applied."""
    import torch.nn.attention.bias as bias

    rule._numbers_agree.cache_clear()
    monkeypatch.setattr(bias, "causal_lower_right", bias.causal_upper_left)
    try:
        assert "causal attention in query blocks differs" in rule._numbers_agree()
        module = modeling("llama")
        verdict = rule.RULE.prove(rule.RULE.candidates(module)[0], module)
        assert verdict.variant is None and "causal attention in query blocks differs" in verdict.reason, verdict
    finally:
        rule._numbers_agree.cache_clear()
    monkeypatch.undo()
    assert rule._numbers_agree() is None


@pytest.mark.gpu
def test_gpu_bf16_65536_tokens_blocks_of_8192_lower_peak():
    """bf16, batch 1, 32 query heads over 8 key heads, d 128, 65536 tokens, blocks of 8192, flash attention
    only. Numbers: output, dq, dk, dv of the blocked call within 1e-2 (norm-wise) of a float32 reference
    (memory-efficient attention over the repeated keys) and as close as the one bf16 call. Memory: the peak
    of forward + backward, as a model sees it (the output is consumed, not kept: o_proj's backward ends
    before the attention's), at least 0.75 × T·heads·d·4 below the one call's (flash's float32 dq
    accumulator is 1 GiB here). Expected by the module docstring's count, U = T·heads·d·2 = 0.5 GiB,
    K = U/4: one call U (saved output) + U (the output's gradient) + 5U + 2K = 3.75 GiB above the inputs;
    blocks at most 7/8·U + U + 2.25U + 3.75K = 2.53 GiB (at the second block run): about 1.2 GiB less."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    T, H, HKV, D, N = 65536, 32, 8, 128, 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, HKV, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    grad = torch.randn(1, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    module = _module(groups=H // HKV)
    scale = D ** -0.5
    blocked_fn = rule.masked_attention(sdpa_attention_forward, check_owner=False, count=False, causal_block=N)

    def numbers(fn, *tensors):
        out, _ = fn(module, *tensors, None, dropout=0.0, scaling=scale)
        return [t.float() for t in (out, *torch.autograd.grad(out, tensors, grad.to(out.dtype)))]

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = (fn(module, q, k, v, None, dropout=0.0, scaling=scale)[0] * grad).sum()  # the output is not kept
        torch.autograd.grad(loss, (q, k, v))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def reference(q32, k32, v32):  # float32, no GQA in memory-efficient attention: the keys repeated
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q32, repeat_kv(k32, H // HKV), repeat_kv(v32, H // HKV), is_causal=True, scale=scale)
        out = out.transpose(1, 2)
        return [out, *torch.autograd.grad(out, (q32, k32, v32), grad.float())]

    ref = reference(*(t.detach().float().requires_grad_() for t in (q, k, v)))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        plain = numbers(sdpa_attention_forward, q, k, v)
        blocked = numbers(blocked_fn, q, k, v)
        errors = {}
        for name, r, a, b in zip(("out", "dq", "dk", "dv"), ref, plain, blocked):
            errors[name] = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        del ref, plain, blocked
        plain_peak, blocked_peak = peak(sdpa_attention_forward), peak(blocked_fn)
    for name, (err_plain, err_blocked) in errors.items():
        assert err_blocked < 1e-2 and err_blocked < 2 * err_plain + 1e-3, (name, errors)
    accumulator = T * H * D * 4
    gib = 2**30
    assert plain_peak - blocked_peak >= 0.75 * accumulator, (
        f"one call {plain_peak / gib:.3f} GiB, blocks {blocked_peak / gib:.3f} GiB: "
        f"{(plain_peak - blocked_peak) / gib:.3f} GiB less, want ≥ {0.75 * accumulator / gib:.3f}; errors {errors}")
