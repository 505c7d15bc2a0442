"""The lora rule (toggle lora_input): peft's LoRA Linear keeps its input in its own dtype for the
backward, the float32 cast recomputed there in chunks (autopatch/rules/lora.py).

A tiny Llama under peft (r 4 on every linear layer, random lora_B) against the same model on peft's
own forward: loss, every LoRA gradient and the input gradient (fp32 base 1e-5, bf16 base 1e-2), also
under both kinds of gradient checkpointing, host offload and torch.compile; the bytes autograd saves
for one LoRA linear; buffers poisoned with NaN; the per-call fallbacks (dropout in training, DoRA,
several adapters) run peft's forward and say why; the hooks patch peft when it is imported and say
the line only once a LoRA model is used."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from autopatch import audit, offload, patching  # noqa: E402
from autopatch.rules import _probe, lora  # noqa: E402
from autopatch.session import Session, current  # noqa: E402
from helpers import assert_close, everything, poisoned_outputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_patches")

LAYER = sys.modules.get("peft.tuners.lora.layer") or __import__("peft.tuners.lora.layer", fromlist=["Linear"])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _patch(session=None):
    records = lora.RULE.patch_module(LAYER, session or current(), everything)
    assert [(r.target, r.patched, r.kernel) for r in records] == [("Linear", True, "lora_input")], records
    return records


def _tiny_peft_llama(dtype, dropout=0.0, use_dora=False, layers=2, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    base = LlamaForCausalLM(config).to(dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=use_dora,
                                            target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapters' gradients would be trivial
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.3)
    return model.train()


def _step(model, dtype, seed=3, autocast=None):
    """One step; `autocast`: the forward under torch.autocast("cpu", dtype=autocast), the backward
    outside it (as HF Trainer and accelerate run it)."""
    gen = torch.Generator().manual_seed(seed)
    embeds = (torch.randn(2, 9, 32, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, 64, (2, 9), generator=gen)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(inputs_embeds=embeds, labels=labels).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach().clone(), embeds.grad.detach().clone(), grads


def _assert_same(got, ref, dtype, what):
    (loss, dx, grads), (loss_ref, dx_ref, grads_ref) = got, ref
    assert grads.keys() == grads_ref.keys()
    assert_close(loss, loss_ref, dtype, f"{what}: loss")
    assert dx_ref.abs().max() > 0 and torch.isfinite(dx).all()
    assert_close(dx, dx_ref, dtype, f"{what}: input gradient")
    for name in grads_ref:
        assert grads_ref[name].abs().max() > 0, name  # never compare zeros
        assert_close(grads[name], grads_ref[name], dtype, f"{what}: {name}")


def _calls(session):
    return session.calls.get("lora_input", 0)


# --------------------------------------------------------------------------- the function
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_lora_delta_against_float64(dtype, rows):
    """LoraDelta (chunks of `rows` over 7 tokens, buffers poisoned) against the formula in float64."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(7, 12, generator=gen)).to(dtype).requires_grad_()
    base_w = torch.randn(10, 12, generator=gen).to(dtype)
    a = torch.randn(3, 12, generator=gen).requires_grad_()
    b = torch.randn(10, 3, generator=gen).requires_grad_()
    dy = torch.randn(7, 10, generator=gen).to(dtype)
    with poisoned_outputs(lora, "_empty"):
        y = lora.lora_delta(x, x @ base_w.t(), a, b, 0.75, rows=rows)
        grads = torch.autograd.grad(y, (x, a, b), dy)
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, b))
    y64 = x64 @ base_w.double().t() + (x64 @ a64.t()) @ b64.t() * 0.75
    grads64 = torch.autograd.grad(y64, (x64, a64, b64), dy.double())
    assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == torch.float32
    assert_close(y, y64, dtype, "output")
    for what, g, g64 in zip(("dx", "dA", "dB"), grads, grads64):
        assert_close(g, g64, dtype, what)


def test_chunk_rows_bound_the_transient():
    assert lora.chunk_rows(4096) == (64 << 20) // (4096 * 4)
    assert lora.chunk_rows(10, budget=1) == 1


def test_probe_verdict():
    verdict = _probe.sealed(lora.RULE.prove, lora.RULE.candidates(LAYER)[0], LAYER)
    assert verdict.variant is not None, verdict.reason
    assert torch.bfloat16 in verdict.variant.autocast  # proved under torch.autocast("cpu", bfloat16)
    assert lora.RULE.candidates(types.ModuleType("transformers.models.llama.modeling_llama")) == []


# --------------------------------------------------------------------------- a tiny Llama under peft
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_matches_peft(dtype):
    model = _tiny_peft_llama(dtype)
    ref = _step(model, dtype)
    session = current()
    _patch(session)
    before = _calls(session)
    with poisoned_outputs(lora, "_empty"):
        got = _step(model, dtype)
    assert _calls(session) - before == 2 * 7  # every LoRA linear of both layers took our path
    _assert_same(got, ref, dtype, f"{dtype} base")


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = _tiny_peft_llama(torch.bfloat16)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    ref = _step(model, torch.bfloat16)
    session = current()
    _patch(session)
    before = _calls(session)
    got = _step(model, torch.bfloat16)
    # the forward, then each layer's recompute (the non-reentrant one stops once it has what it needs)
    assert 2 * 7 < _calls(session) - before <= 2 * 2 * 7
    _assert_same(got, ref, torch.bfloat16, f"checkpointing (reentrant={reentrant})")


def test_host_offload():
    """autopatch.offload's saved-tensor hooks (the copy target, every saved tensor) over our saves."""
    model = _tiny_peft_llama(torch.float32)
    ref = _step(model, torch.float32)
    _patch()
    off = offload.install(model.base_model.model, None, types.SimpleNamespace(offload="true"), target="copy")
    off.min_bytes = 0
    got = _step(model, torch.float32)
    _assert_same(got, ref, torch.float32, "host offload")


def test_torch_compile_aot_eager():
    """Under torch.compile peft's forward runs (Dynamo traces it): the same numbers, no failure."""
    model = _tiny_peft_llama(torch.float32)
    ref = _step(model, torch.float32)
    session = current()
    _patch(session)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    before = _calls(session)
    got = _step(compiled, torch.float32)
    assert _calls(session) == before
    _assert_same(got, ref, torch.float32, "torch.compile")
    torch._dynamo.reset()


# --------------------------------------------------------------------------- what is kept
def _saved(layer, x):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_lora_delta_in_autocast_dtype_against_float64(dtype, rows):
    """LoraDelta with compute = bfloat16 (what autocast gives it), float32 adapters, buffers poisoned,
    against the formula in float64; the output in the base's dtype, dA and dB in float32."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(7, 12, generator=gen).to(dtype).requires_grad_()
    base = torch.randn(7, 10, generator=gen).to(dtype)
    a = torch.randn(3, 12, generator=gen).requires_grad_()
    b = torch.randn(10, 3, generator=gen).requires_grad_()
    dy = torch.randn(7, 10, generator=gen).to(dtype)
    with poisoned_outputs(lora, "_empty"):
        y = lora.lora_delta(x, base, a, b, 0.75, rows=rows, compute=torch.bfloat16)
        grads = torch.autograd.grad(y, (x, a, b), dy)
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, b))
    y64 = base.double() + (x64 @ a64.t()) @ b64.t() * 0.75
    grads64 = torch.autograd.grad(y64, (x64, a64, b64), dy.double())
    assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == grads[2].dtype == torch.float32
    assert_close(y, y64, torch.bfloat16, "output")
    for what, g, g64 in zip(("dx", "dA", "dB"), grads, grads64):
        assert_close(g, g64, torch.bfloat16, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_matches_peft_under_autocast(dtype):
    """The forward under torch.autocast("cpu", dtype=torch.bfloat16) (HF Trainer's bf16=True): every
    LoRA linear takes our path and the loss, the input gradient and every LoRA gradient equal peft's
    under the same autocast."""
    model = _tiny_peft_llama(dtype)
    ref = _step(model, dtype, autocast=torch.bfloat16)
    session = current()
    _patch(session)
    before = _calls(session)
    with poisoned_outputs(lora, "_empty"):
        got = _step(model, dtype, autocast=torch.bfloat16)
    assert _calls(session) - before == 2 * 7
    # one chunk at these sizes and the same operations in the same dtypes: the same bits (matmuls in
    # float32 instead, the LoRA gradients differ from peft's by about 2e-2)
    assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    _assert_same(got, ref, torch.bfloat16, f"{dtype} base under bf16 autocast")


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_under_autocast(reentrant):
    """Checkpointing replays the forward under the autocast state it recorded: ours again in the recompute."""
    model = _tiny_peft_llama(torch.bfloat16)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    ref = _step(model, torch.bfloat16, autocast=torch.bfloat16)
    session = current()
    _patch(session)
    before = _calls(session)
    got = _step(model, torch.bfloat16, autocast=torch.bfloat16)
    assert 2 * 7 < _calls(session) - before <= 2 * 2 * 7
    _assert_same(got, ref, torch.bfloat16, f"checkpointing under autocast (reentrant={reentrant})")


def test_unproved_autocast_dtype_runs_peft():
    """An autocast dtype the proof did not cover keeps peft's forward, and says which."""
    model, layer = _one_layer_case(lora_dropout=0.0)
    x = torch.ones(2, 16)
    assert lora.why_not(layer, LAYER.Linear, x, (), {}, ()) == ""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, (torch.bfloat16,)) == ""
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, ()) == "under autocast to torch.bfloat16 (not proved)"


def test_saved_bytes_drop_by_the_float32_copy():
    """One LoRA linear (bf16 base, float32 adapters): peft saves x.to(float32) (T·H·4 bytes); ours
    saves x itself (the caller's tensor) and nothing of T·H in float32."""
    tokens, hidden = 64, 48
    model = _tiny_peft_llama(torch.bfloat16)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LAYER.Linear)
    layer.base_layer = nn.Linear(hidden, 40, dtype=torch.bfloat16).requires_grad_(False)
    layer.lora_A["default"] = nn.Linear(hidden, 4, bias=False)
    layer.lora_B["default"] = nn.Linear(4, 40, bias=False)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)

    kept_anyway = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def bytes_beside(saved):  # what the layer's saves add to the input and the weights
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(n for ptr, n in storages.items() if ptr not in kept_anyway)

    peft_saved = _saved(layer, x)
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in peft_saved)
    _patch()
    ours = _saved(layer, x)
    assert any(t.data_ptr() == x.data_ptr() for t in ours), "ours keeps the caller's x"
    assert not any(t.shape == x.shape and t.data_ptr() != x.data_ptr() for t in ours)
    assert bytes_beside(peft_saved) - bytes_beside(ours) == tokens * hidden * 4  # the float32 copy of x
    assert bytes_beside(ours) == tokens * 4 * 4  # h = x·Aᵀ, float32, r 4


# --------------------------------------------------------------------------- peft's forward runs
def _one_layer_case(dtype=torch.float32, **config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 12)).to(dtype)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0"], **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model, model.base_model.model[0]


def _run(model, seed=5):
    torch.manual_seed(seed)
    x = torch.randn(6, 16, requires_grad=True)
    y = model(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *[p for p in model.parameters() if p.requires_grad]])
    return y.detach(), grads


@pytest.mark.parametrize("case, why", [
    ({"lora_dropout": 0.1}, "LoRA dropout in training"),
    ({"lora_dropout": 0.0, "use_dora": True}, "a LoRA variant (DoraLinearVariant)"),
    ({"lora_dropout": 0.0, "lora_bias": True}, "lora_bias"),
])
def test_fallbacks_run_peft_and_say_why(case, why):
    model, layer = _one_layer_case(**case)
    ref = _run(model)
    session = Session()
    _patch(session)
    got = _run(model)
    assert _calls(session) == 0
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # peft's own forward, same RNG draws
    assert why in session.bypassed["lora_input"]["why"], session.bypassed
    assert session.bypassed["lora_input"]["target"] == "Linear"


def test_dropout_in_eval_and_several_adapters():
    model, layer = _one_layer_case(lora_dropout=0.1)
    session = Session()
    _patch(session)
    model.eval()
    ref_y = layer.base_layer(torch.ones(1, 16)) + layer.lora_B["default"](layer.lora_A["default"](torch.ones(1, 16))) * layer.scaling["default"]
    assert torch.allclose(model(torch.ones(1, 16)), ref_y, rtol=1e-6, atol=1e-6)
    assert _calls(session) == 1  # dropout in eval is the identity: ours
    from peft import LoraConfig

    model.add_adapter("second", LoraConfig(r=2, target_modules=["0"]))
    model.base_model.set_adapter(["default", "second"])
    model(torch.ones(1, 16))
    assert _calls(session) == 1 and "2 active adapters" in session.bypassed["lora_input"]["why"]


# --------------------------------------------------------------------------- the audit and the hooks
def test_audit_calls_our_swap_ours_and_sees_a_replacement():
    model = _tiny_peft_llama(torch.float32, layers=1)
    session = current()
    records = _patch(session)
    session.add(records)
    assert not [f for f in audit.find(model, session) if f[0] == "lora_input"]

    def other(self, x, *args, **kwargs):
        return self.base_layer(x)

    patched = LAYER.Linear.forward
    LAYER.Linear.forward = other
    try:
        found = [f for f in audit.find(model, session) if f[0] == "lora_input"]
        assert found and found[0][1] == "Linear" and found[0][2].endswith("other"), found
    finally:
        LAYER.Linear.forward = patched


HOOKED = r"""
import sys, torch
from transformers import Trainer  # imports peft
import peft.tuners.lora.layer as layer
from autopatch import patching
from autopatch.session import current
say = lambda *a: print(*a, file=sys.stderr, flush=True)
say("PATCHED", patching.is_patched(layer.Linear, "forward"))
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, use_cache=False)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
say("BUILT")
ids = torch.randint(0, 64, (1, 8))
model.train()
model(input_ids=ids, labels=ids).loss.backward()
say("CALLS", current().calls.get("lora_input", 0))
"""


def _hooked(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOPATCH_", "FUSED_KERNELS"))}
    env.update(FUSED_KERNELS="all", TRITON_INTERPRET="1", PYTHONPATH=ROOT, **extra)
    out = subprocess.run([sys.executable, "-c", HOOKED], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stderr.splitlines()


def test_hooks_patch_peft_and_say_it_when_a_lora_model_runs(tmp_path):
    """FUSED_KERNELS=all: peft's Linear is patched at its import (Trainer imports peft), every LoRA
    linear of the step takes our path, and the line comes once the LoRA model is used, not at import."""
    err = _hooked(tmp_path)
    line = "autopatch: peft: lora_input (Linear)"
    assert "PATCHED True" in err and "CALLS 7" in err, err
    assert line in err and err.index(line) > err.index("BUILT"), err
    off = _hooked(tmp_path, AUTOPATCH_LORA_INPUT="false")
    assert "PATCHED False" in off and "CALLS 0" in off and line not in off, off


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_saved_bytes_under_autocast_drop_by_the_cast_copy(x_dtype):
    """One LoRA linear (bf16 base, float32 adapters) under torch.autocast("cpu", bfloat16): peft casts
    x to float32 and autocast casts that to bf16 for lora_A, so autograd saves a bf16 copy of x
    (T·H·2 bytes) beside x, and bf16 casts of A and B (r·H·2, O·r·2); ours saves x itself (the
    caller's tensor, bf16 or float32), the float32 A and B, and h = x·Aᵀ in bf16 (T·r·2)."""
    tokens, hidden, out, rank = 64, 48, 40, 4
    model = _tiny_peft_llama(torch.bfloat16)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.base_layer = nn.Linear(hidden, out, dtype=torch.bfloat16).requires_grad_(False)
    layer.lora_A["default"] = nn.Linear(hidden, rank, bias=False)
    layer.lora_B["default"] = nn.Linear(rank, out, bias=False)
    # not a leaf, as a layer's input is: autocast caches its casts of leaves that require grad
    x = torch.randn(tokens, hidden, dtype=x_dtype, requires_grad=True).clone()
    kept_anyway = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def saved_under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _saved(layer, x)

    def bytes_beside(saved):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(n for ptr, n in storages.items() if ptr not in kept_anyway)

    peft_saved = saved_under_autocast()  # the frozen base keeps its weight only (no dW: no x needed)
    assert sum(t.dtype == torch.bfloat16 and t.shape == x.shape for t in peft_saved) == 1
    _patch()
    ours = saved_under_autocast()
    assert any(t.data_ptr() == x.data_ptr() for t in ours), "ours keeps the caller's x"
    assert not any(t.shape == x.shape and t.data_ptr() != x.data_ptr() for t in ours)
    cast_copy = tokens * hidden * 2
    assert bytes_beside(peft_saved) - bytes_beside(ours) == cast_copy + (rank * hidden + out * rank) * 2
    assert bytes_beside(ours) == tokens * rank * 2  # h, bf16
