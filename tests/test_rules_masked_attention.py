"""The masked_attention rule: SDPA under a boolean mask, one call per query block over the keys the block
can see. plan() on the masks the docs name (sliding window, causal with padding, bidirectional image
block; what stays one call); tiny Gemma 3 (sliding and global layers, an image-like bidirectional block)
and a padded Llama batch patched vs unpatched in fp32: loss, logits and every gradient within 1e-6, with
fewer keys per SDPA call; the probe catches a wrong plan; dropout and other callers untouched; the toggle
undone by apply(); bf16 on the GPU at a real length."""

from __future__ import annotations

import pytest
import torch

from helpers import everything, modeling, rel_err, train_and_eval, verdict_of

transformers = pytest.importorskip("transformers")

from autopatch import patching, report  # noqa: E402
from autopatch.rules import masked_attention as rule  # noqa: E402
from autopatch.session import current  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_patches")
KERNEL = "masked_attention"


def _causal(n, window=None):
    i = torch.arange(n)
    m = i[:, None] >= i[None, :]
    if window is not None:
        m &= i[:, None] - i[None, :] < window
    return m


def test_plan_sliding_window():
    """A 1024-token window over 4096 tokens in blocks of 1024 queries: block i sees keys
    [1024 i - 1023, 1024 i + 1023], aligned down to 64; 0.44 of the square. Blocks of 512: 0.33."""
    mask = _causal(4096, 1024).expand(2, 1, 4096, 4096)
    chunks = rule.plan(mask, 4096, 4096)
    assert chunks == [(0, 1024, 0, 1024), (1024, 2048, 0, 2048), (2048, 3072, 1024, 3072), (3072, 4096, 2048, 4096)]
    assert sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in chunks) / 4096**2 == pytest.approx(0.4375)
    chunks = rule.plan(mask, 4096, 4096, block=512)
    assert chunks[3] == (1536, 2048, 512, 2048) and chunks[-1] == (3584, 4096, 2560, 4096)
    assert sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in chunks) / 4096**2 == pytest.approx(0.328125)


def test_plan_causal_with_padding_and_an_image_block():
    """Causal with right padding in one row and a bidirectional block (the image) across the first block
    boundary in the other: block i sees keys [0, 1024 (i + 1)], the first widened to the image's end."""
    mask = _causal(4096).expand(2, 1, 4096, 4096).clone()
    mask[0, 0, 1000:1100, 1000:1100] = True
    mask[1, 0, :, 3900:] = False
    mask[1, 0, 3900:, 3900] = True  # padded queries still see one key, as transformers' masks keep them
    assert rule.plan(mask, 4096, 4096) == [(0, 1024, 0, 1152), (1024, 2048, 0, 2048), (2048, 3072, 0, 3072),
                                           (3072, 4096, 0, 4096)]


@pytest.mark.parametrize("case", ["full", "float", "short", "empty row", "3-d"])
def test_plan_keeps_one_call(case):
    n = 1024 if case == "short" else 4096
    mask = _causal(n).expand(1, 1, n, n).clone()
    if case == "full":
        mask[:] = True  # every key seen by every block
    elif case == "float":
        mask = torch.zeros(1, 1, n, n).masked_fill(~mask, float("-inf"))
    elif case == "empty row":
        mask[0, 0, 7] = False
    elif case == "3-d":
        mask = mask[0]
    assert rule.plan(mask, n, n) is None


def _gemma3_text():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return modeling("gemma3"), transformers.Gemma3ForCausalLM(cfg).float()


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return modeling("llama"), transformers.LlamaForCausalLM(cfg).float()


class _KeysSeen:
    """The key lengths and query x key areas of torch's SDPA calls."""

    def __init__(self, monkeypatch):
        self.keys, self.area = [], 0
        original = torch.nn.functional.scaled_dot_product_attention

        def seen(query, key, *args, **kwargs):
            self.keys.append(key.shape[-2])
            self.area += query.shape[-2] * key.shape[-2]
            return original(query, key, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", seen)


def _inputs(name):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (2, 48), generator=g)
    if name == "gemma3":  # a sliding window of 8 over 48 tokens: the mask is materialised
        return dict(input_ids=ids, labels=ids)
    if name == "llama packed":  # three documents a row (positions restart): a block-diagonal causal mask
        positions = torch.cat([torch.arange(20), torch.arange(12), torch.arange(16)]).expand(2, 48)
        return dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)  # no cache: packing read
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 40:] = 0  # right padding: transformers builds the [2, 1, 48, 48] mask
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("name", ["gemma3", "llama", "llama packed"])
def test_same_loss_logits_and_gradients_with_fewer_keys(name, monkeypatch):
    """Blocks of 8 queries: Gemma 3's sliding layers see 16 keys a block, its global layer and the padded
    Llama the causal part, packed documents their own document's keys; loss, eval logits and every
    gradient as transformers' one call gives them."""
    module, model = _gemma3_text() if name == "gemma3" else _llama()  # llama, llama packed
    inputs = _inputs(name)
    monkeypatch.setattr(rule, "QUERY_BLOCK", 8)
    seen = _KeysSeen(monkeypatch)

    def training_forward_area():
        seen.keys, seen.area = [], 0
        with torch.no_grad():
            model.train()
            model(**inputs)
        return list(seen.keys), seen.area

    loss0, logits0, grads0 = train_and_eval(model, inputs)
    keys0, area0 = training_forward_area()
    records = rule.RULE.patch_module(module, current(), everything)
    attention = f"{'Gemma3' if name == 'gemma3' else 'Llama'}Attention.forward"
    assert verdict_of(records, attention).patched, records
    current().clear()
    current().reset_runs()
    current().add(records)
    loss1, logits1, grads1 = train_and_eval(model, inputs)
    assert report.runs()[KERNEL]["calls"] > 0
    assert torch.isfinite(loss1) and loss1.item() == pytest.approx(loss0.item(), rel=1e-6, abs=0)
    torch.testing.assert_close(logits1, logits0, rtol=1e-6, atol=1e-6)
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7, msg=n)
    keys1, area1 = training_forward_area()
    assert min(keys0) == 48 and min(keys1) < 48 and area1 < 0.75 * area0


def test_gemma3_image_text_head_same_numbers(monkeypatch):
    """Gemma3ForConditionalGeneration (the coverage matrix's tiny head: a window of 4, an image of 4
    tokens at 3-6 attending both ways, across the first block boundary) in blocks of 4 queries: loss,
    logits and every gradient, vision tower included, as transformers' one call gives them."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "coverage_matrix", Path(__file__).resolve().parents[1] / "dev" / "coverage_matrix.py")
    coverage_matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage_matrix)
    model, inputs = coverage_matrix.build_tiny_vlm("gemma3", attn="sdpa")
    monkeypatch.setattr(rule, "QUERY_BLOCK", 4)
    seen = _KeysSeen(monkeypatch)
    loss0, logits0, grads0 = train_and_eval(model, inputs)
    assert min(seen.keys) == 12
    records = rule.RULE.patch_module(modeling("gemma3"), current(), everything)
    assert verdict_of(records, "Gemma3Attention.forward").patched, records
    seen.keys = []
    loss1, logits1, grads1 = train_and_eval(model, inputs)
    assert min(seen.keys) < 12  # the blocks ran
    assert torch.isfinite(loss1) and loss1.item() == pytest.approx(loss0.item(), rel=1e-6, abs=0)
    torch.testing.assert_close(logits1, logits0, rtol=1e-6, atol=1e-6)
    assert grads1.keys() == grads0.keys() and any("vision" in n for n in grads0)
    for n in grads0:  # relative to each gradient's norm, as the coverage matrix compares
        assert rel_err(grads1[n], grads0[n]) < 1e-5, n


def test_the_probe_catches_a_plan_that_drops_a_key(monkeypatch):
    rule._numbers_agree.cache_clear()
    real = rule.plan

    def short(mask, q_len, k_len, block=None):
        chunks = real(mask, q_len, k_len, block)
        return chunks and [(q0, q1, k0, max(k0 + 1, k1 - 1)) for q0, q1, k0, k1 in chunks]

    monkeypatch.setattr(rule, "plan", short)
    try:
        assert "differs from sdpa_attention_forward" in rule._numbers_agree()
    finally:
        rule._numbers_agree.cache_clear()
    monkeypatch.setattr(rule, "plan", real)
    assert rule._numbers_agree() is None


def test_dropout_and_unpatched_modules_get_transformers_sdpa(monkeypatch):
    """Dropout draws would differ block by block: one call. A module not patched (here: llama, while
    only gemma3 is) never blocks, though the registry's wrapper is in place."""
    monkeypatch.setattr(rule, "QUERY_BLOCK", 8)
    gemma, _ = _gemma3_text()
    rule.RULE.patch_module(gemma, current(), everything)
    _, llama = _llama()
    seen = _KeysSeen(monkeypatch)
    train_and_eval(llama, _inputs("llama"))
    assert min(seen.keys) == 48
    _, model = _gemma3_text()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    seen.keys.clear()
    model.train()
    model(**_inputs("gemma3")).loss.backward()
    assert min(seen.keys) == 48


def test_disabled_idempotent_and_undone_by_apply(monkeypatch):
    import autopatch
    from transformers.modeling_utils import AttentionInterface

    module, model = _gemma3_text()
    off = rule.RULE.patch_module(module, current(), lambda kernel: kernel != KERNEL)
    assert off and not any(r.patched for r in off) and "disabled" in off[0].reason
    assert not patching.is_item_patched(AttentionInterface._global_mapping, "sdpa")
    first = rule.RULE.patch_module(module, current(), everything)
    assert rule.RULE.patch_module(module, current(), everything) == first and all(r.patched for r in first)
    patching.restore_all()
    autopatch.apply(model)
    assert rule._patched_for(model.model.layers[0].self_attn)
    records = autopatch.apply(model, masked_attention=False)
    assert not rule._patched_for(model.model.layers[0].self_attn)
    assert not any(r.patched for r in records if r.kernel == KERNEL), records
    assert any("turned off by apply()" in r.reason for r in records if r.kernel == KERNEL), records


@pytest.mark.gpu
def test_gpu_bf16_gemma3_sliding_attention_at_4096_tokens():
    """On the GPU in bf16 at the benchmark's length (sliding window 1024, GQA 8/4, head_dim 256): the
    blocked attention's output and gradients within 1e-2 of the float64 reference, as close as the
    unblocked call; the peak memory of forward + backward no higher."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 4096, 256, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 4, 4096, 256, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    mask = _causal(4096, 1024).cuda().expand(2, 1, 4096, 4096)
    grad = torch.randn(2, 4096, 8, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True

    def run(fn, *tensors):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, _ = fn(module, *tensors, mask, dropout=0.0, scaling=0.0625)
        grads = torch.autograd.grad(out, tensors, grad.to(out.dtype))
        torch.cuda.synchronize()
        return (out, *grads), torch.cuda.max_memory_allocated() - base

    ref, _ = run(sdpa_attention_forward, *(t.detach().double().requires_grad_() for t in (q, k, v)))
    plain, plain_peak = run(sdpa_attention_forward, q, k, v)
    blocked, blocked_peak = run(rule.masked_attention(sdpa_attention_forward, check_owner=False, count=False), q, k, v)
    for name, r, a, b in zip(("out", "dq", "dk", "dv"), ref, plain, blocked):
        r = r.float()
        err_plain = ((a.float() - r).norm() / r.norm()).item()
        err_blocked = ((b.float() - r).norm() / r.norm()).item()
        assert err_blocked < 1e-2 and err_blocked < 2 * err_plain + 1e-3, (name, err_blocked, err_plain)
    assert blocked_peak <= plain_peak, (blocked_peak, plain_peak)


def test_compiling_gets_one_call(monkeypatch):
    """While torch.compile traces, the block plan (a host sync) is never made: transformers' one call."""
    module, model = _llama()
    monkeypatch.setattr(rule, "QUERY_BLOCK", 8)
    rule.RULE.patch_module(module, current(), everything)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    seen = _KeysSeen(monkeypatch)
    model.train()
    with torch.no_grad():
        model(**_inputs("llama"))
    assert min(seen.keys) == 48


_ENV_SCRIPT = '''
import json, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).float().train()
g = torch.Generator().manual_seed(4)
ids = torch.randint(0, 96, (2, 2560), generator=g)
mask = torch.ones_like(ids)
mask[1, 2000:] = 0
seen = []
sdpa = torch.nn.functional.scaled_dot_product_attention
def counted(q, k, *args, **kwargs):
    seen.append(k.shape[-2])
    return sdpa(q, k, *args, **kwargs)
torch.nn.functional.scaled_dot_product_attention = counted
loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
loss.backward()
grad = sum(p.grad.double().norm() ** 2 for p in model.parameters()).sqrt().item()
import autopatch
from autopatch import report
rows = [r.as_dict() for r in autopatch.applied() if r.kernel == "masked_attention"]
print(json.dumps({"loss": loss.item(), "grad": grad, "keys": min(seen), "records": rows,
                  "runs": report.runs().get("masked_attention")}))
'''


def test_from_the_environment_alone(tmp_path):
    """FUSED_KERNELS=masked_attention in a fresh process that imports nothing from autopatch: the hooks mark
    modeling_llama, a padded 2 x 2560 batch runs in blocks of 1024 queries, and the loss and the gradient's
    norm are the unpatched process's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]

    def run(kernels):
        env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
        env.update(FUSED_KERNELS=kernels, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
        proc = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    on, off = run("masked_attention"), run("none")
    assert [r["patched"] for r in on["records"]] == [True] and on["runs"]["calls"] > 0, on
    assert on["keys"] < 2560 == off["keys"] and not off["records"], (on, off)
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6) and on["loss"] > 0
    assert on["grad"] == pytest.approx(off["grad"], rel=1e-6) and on["grad"] > 0
