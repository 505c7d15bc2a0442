"""The causal_mask rule (autopatch.rules.causal_mask): under torch.compile, a model forward given no
positions, mask or cache reaches SDPA with no mask tensor and its k/v heads unrepeated (is_causal, GQA),
as in eager; given positions (packed rows), a padding mask or a cache, transformers decides as before.
Tiny Qwen3 (GQA: 4 query heads, 2 k/v heads), fp32 on the CPU, compiled with dynamo's eager backend
(the mask is decided while dynamo traces); losses and every gradient against the unpatched eager model."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, everything, modeling, verdict_of

pytest.importorskip("transformers")

import transformers  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.rules import causal_mask  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = causal_mask.RULE
FP32 = torch.float32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(causal_mask._masking_utils() is None, reason="this transformers has no masking_utils"),
]


@pytest.fixture(autouse=True)
def restore():
    torch._dynamo.reset()
    yield
    patching.restore_all()
    torch._dynamo.reset()


@pytest.fixture
def sdpa_calls():
    """What each SDPA attention call receives: (mask is None, k/v heads). Recorded while dynamo traces
    (compiled) or at every call (eager)."""
    from transformers.integrations import sdpa_attention

    calls = []
    original = sdpa_attention.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((attention_mask is None, key.shape[1]))
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    mapping = transformers.AttentionInterface._global_mapping
    saved = mapping["sdpa"]
    mapping["sdpa"] = spy
    yield calls
    mapping["sdpa"] = saved


def tiny_qwen3(seed: int = 0):
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, use_cache=False)
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").float().train()


def step(call, model, **inputs):
    model.zero_grad(set_to_none=True)
    out = call(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, ref, what):
    assert_close(got[0], ref[0], FP32, f"{what}: loss")
    assert set(got[1]) == set(ref[1])
    for name, grad in ref[1].items():
        assert_close(got[1][name], grad, FP32, f"{what}: grad {name}")


def ids_and_labels(seed: int = 1):
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids.clone())


def test_detects_the_models_that_build_the_mask():
    module = modeling("qwen3")
    assert causal_mask.candidate(module.Qwen3Model) is not None
    assert causal_mask.candidate(module.Qwen3ForCausalLM) is None  # its forward calls the model's
    record = verdict_of(RULE.patch_module(module, current(), everything), "Qwen3Model.forward")
    assert record.patched and record.kernel == "causal_mask", record
    assert verdict_of(RULE.patch_module(module, current(), everything), "Qwen3Model.forward") == record  # idempotent
    disabled = RULE.patch_module(modeling("llama"), current(), lambda k: False)
    assert disabled and all(not r.patched and "disabled" in r.reason for r in disabled)


def test_compiled_model_keeps_is_causal_and_gqa(sdpa_calls):
    model = tiny_qwen3()
    inputs = ids_and_labels()
    ref = step(model, model, **inputs)  # unpatched eager
    assert sdpa_calls and all(none and heads == 2 for none, heads in sdpa_calls), sdpa_calls  # eager skips the mask

    RULE.patch_module(modeling("qwen3"), current(), everything)
    sdpa_calls.clear()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # the wrapper breaks no graph
    for _ in range(2):
        assert_same(step(compiled, model, **inputs), ref, "compiled, patched")
    assert sdpa_calls and all(none and heads == 2 for none, heads in sdpa_calls), sdpa_calls
    assert causal_mask._MODEL_MADE_POSITIONS == [False]  # reset after the forward


def test_given_positions_or_padding_go_to_transformers(sdpa_calls):
    """Packed rows (positions restarting mid-row) and a padding mask: transformers builds the mask under
    compile, patched or not, and the numbers equal the unpatched eager model's."""
    model = tiny_qwen3()
    packed = dict(ids_and_labels(), position_ids=torch.tensor([list(range(5)) + list(range(7))] * 2))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    padded = dict(ids_and_labels(2), attention_mask=padding)
    refs = [step(model, model, **packed), step(model, model, **padded)]
    RULE.patch_module(modeling("qwen3"), current(), everything)
    compiled = torch.compile(model, backend="eager")
    for inputs, ref, what in ((packed, refs[0], "packed"), (padded, refs[1], "padded")):
        sdpa_calls.clear()
        assert_same(step(compiled, model, **inputs), ref, f"compiled, patched, {what}")
        assert sdpa_calls and not any(none for none, _ in sdpa_calls), (what, sdpa_calls)


def test_eager_results_unchanged_and_flag_scoped():
    model = tiny_qwen3()
    inputs = ids_and_labels()
    ref = step(model, model, **inputs)
    RULE.patch_module(modeling("qwen3"), current(), everything)
    got = step(model, model, **inputs)
    assert torch.equal(got[0], ref[0])
    seen = []
    original = patching.original(modeling("qwen3").Qwen3Model, "forward")

    def probe(self, *args, **kwargs):
        seen.append(causal_mask._MODEL_MADE_POSITIONS[0])
        raise RuntimeError("boom")

    wrapped = causal_mask._make_forward(probe, causal_mask.candidate(modeling("qwen3").Qwen3Model))
    base = model.model
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(base, input_ids=inputs["input_ids"])
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(base, inputs["input_ids"], None, torch.arange(12)[None])  # positions given positionally
    base._is_replica = True  # a DataParallel replica (runs in a thread): never sets the shared flag
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(base, input_ids=inputs["input_ids"])
    assert seen == [True, False, False] and causal_mask._MODEL_MADE_POSITIONS == [False]
    assert modeling("qwen3").Qwen3Model.forward.__wrapped__ is original  # the wrapper calls the model's own


@pytest.mark.parametrize("window,skipped", [(64, True), (4, False)])
def test_sliding_window(sdpa_calls, window, skipped):
    """Mistral with a sliding window: longer than the sequence, the window changes nothing and the mask is
    skipped; shorter, the mask is built (is_causal cannot express it). Equal to unpatched eager either way."""
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128, sliding_window=window, use_cache=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM._from_config(config, attn_implementation="sdpa").float().train()
    inputs = ids_and_labels()
    ref = step(model, model, **inputs)
    RULE.patch_module(modeling("mistral"), current(), everything)
    sdpa_calls.clear()
    assert_same(step(torch.compile(model, backend="eager"), model, **inputs), ref, f"window {window}")
    assert sdpa_calls and all(none == skipped for none, _ in sdpa_calls), sdpa_calls


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen2MoeForCausalLM",
                                  "Cohere2ForCausalLM"])
def test_architectures_compiled_match_eager(arch):
    """Tiny models of other families (Gemma 3 / Cohere 2: sliding and full layers; an MoE), SDPA,
    compiled and patched: the loss and every gradient of the unpatched eager model."""
    import tiny_models

    spec = next(a for a in tiny_models.causal_lm_architectures() if a.class_name == arch)
    model = tiny_models.build_tiny(spec).train()
    model.set_attn_implementation("sdpa")
    inputs = tiny_models.smoke_inputs(model, seq=12)
    ref = step(model, model, **inputs)
    module = modeling(spec.module_name.split(".")[-2])
    records = [r for r in RULE.patch_module(module, current(), everything) if r.patched]
    assert records, f"{arch}: no model forward wrapped"
    assert_same(step(torch.compile(model, backend="eager"), model, **inputs), ref, arch)
