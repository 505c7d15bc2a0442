"""The lora rule (toggle lora_input): peft's LoRA Linear keeps its input in its own dtype for the
backward, the float32 cast recomputed there in chunks (autopatch/rules/lora.py).

A tiny Llama under peft (r 4 on every linear layer, random lora_B) against the same model on peft's
own forward: loss, every LoRA gradient and the input gradient (fp32 base 1e-5, bf16 base 1e-2), also
under both kinds of gradient checkpointing, host offload and torch.compile; the bytes autograd saves
for one LoRA linear; buffers poisoned with NaN; LoRA dropout in training (p 0.1) from the same seed:
the same loss and gradients as peft's, the global generator left where peft's leaves it, also under
checkpointing, offload and autocast; the per-call fallbacks (DoRA, several adapters, a dropout not
proved) run peft's forward and say why, and the exit check says when most calls did; an autocast dtype
whose proof fails is left alone by itself; the hooks patch peft when it is imported and say the line
only once a LoRA model is used."""

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

from autopatch import audit, offload, patching, report, runtime  # noqa: E402
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
    assert lora.why_not(layer, LAYER.Linear, x, (), {}, lora.Variant()) == ""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, lora.Variant(autocast=(torch.bfloat16,))) == ""
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, lora.Variant()) == \
            "under autocast to torch.bfloat16 (not proved)"


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


# --------------------------------------------------------------------------- LoRA dropout in training
def _seeded_step(model, dtype, seed, autocast=None):
    """_step from the global seed `seed`, and the global generator's next draw after it."""
    torch.manual_seed(seed)
    out = _step(model, dtype, autocast=autocast)
    return out, torch.rand(8)


def _assert_same_with_dropout(model, dtype, what, autocast=None, calls=None, seed=11, other_seed=True):
    """Peft's own step and ours (patched after the reference) from the same seed: the same loss (bits),
    input gradient and every LoRA gradient; the global generator's next draw the same after both.
    `other_seed`: also a different seed gives peft another loss (the mask is in force: equal losses are
    not equal by chance)."""
    ref, ref_after = _seeded_step(model, dtype, seed, autocast)
    if other_seed:
        other, _ = _seeded_step(model, dtype, seed + 1, autocast)
        assert not torch.equal(other[0], ref[0]), "the dropout mask changes peft's loss"
    session = current()
    _patch(session)
    before = _calls(session)
    with poisoned_outputs(lora, "_empty"):
        got, got_after = _seeded_step(model, dtype, seed, autocast)
    if calls is not None:
        assert calls(_calls(session) - before), _calls(session) - before
    assert torch.equal(got[0], ref[0]), (what, got[0], ref[0])
    _assert_same(got, ref, dtype, what)
    assert torch.equal(got_after, ref_after), f"{what}: the global generator after the step"


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.bfloat16)])
def test_tiny_llama_with_dropout_matches_peft(dtype, autocast):
    """lora_dropout 0.1 in training: every LoRA linear of both layers takes our path; from the same seed
    the loss is peft's to the bit and every gradient peft's."""
    model = _tiny_peft_llama(dtype, dropout=0.1)
    _assert_same_with_dropout(model, dtype, f"{dtype} base, dropout 0.1, autocast {autocast}", autocast,
                              calls=lambda n: n == 2 * 7)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_dropout(reentrant):
    """Checkpointing replays each layer from the random state it recorded: the recompute's forward draws
    the forward's masks, and our backward's redraw equals both."""
    model = _tiny_peft_llama(torch.bfloat16, dropout=0.1)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    _assert_same_with_dropout(model, torch.bfloat16, f"checkpointing (reentrant={reentrant}), dropout 0.1",
                              calls=lambda n: 2 * 7 < n <= 2 * 2 * 7, other_seed=False)


def test_host_offload_with_dropout():
    model = _tiny_peft_llama(torch.float32, dropout=0.1)
    off = offload.install(model.base_model.model, None, types.SimpleNamespace(offload="true"), target="copy")
    off.min_bytes = 0
    _assert_same_with_dropout(model, torch.float32, "host offload, dropout 0.1", calls=lambda n: n == 2 * 7,
                              other_seed=False)


def test_tiled_mlp_with_dropout(monkeypatch):
    """The tiled MLP (AUTOPATCH_TILED_MLP_TOKENS) calls the LoRA projections chunk by chunk, without
    autograd, then again in its backward from the random state it kept: our forward draws each chunk's
    mask as peft's does and the backward's redraw equals it. Tiled, from the same seed, ours and peft's
    forward give the same output and gradients and leave the global generator at the same place."""
    from autopatch.rules import glu_mlp

    model = _tiny_peft_llama(torch.float32, dropout=0.5, layers=1)
    glu_mlp.RULE.patch_module(sys.modules[type(model.base_model.model).__module__], current(), everything)
    monkeypatch.setattr(current(), "settings", types.SimpleNamespace(tiled_mlp_tokens=4))
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(9))
    g = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(10))
    params = [p for p in mlp.parameters() if p.requires_grad]

    def run():
        torch.manual_seed(123)
        xa = x.clone().requires_grad_(True)
        y = mlp(xa)
        assert type(y.grad_fn).__name__.startswith("_TiledMLP")
        return (y, *torch.autograd.grad(y, [xa, *params], g)), torch.rand(8)

    ref, ref_after = run()
    session = current()
    _patch(session)
    before = _calls(session)
    got, got_after = run()
    assert _calls(session) - before == 2 * 3 * 3  # 3 chunks × gate, up, down; forward and recompute
    assert torch.equal(got_after, ref_after)
    for i, (a, r) in enumerate(zip(got, ref)):
        assert r.abs().max() > 0
        assert_close(a, r, torch.float32, f"tiled, dropout 0.5: {i}")


def test_dropout_scale_is_peft_mask_and_redraw_leaves_the_stream():
    """dropout_scale under a seed is the mask F.dropout draws over a real input (x·k its very output)
    and takes the same draws; redrawn_scale gives it again and leaves the global generator alone."""
    x = torch.randn(3, 5, 17)
    torch.manual_seed(4)
    state = lora.rng_state(x.device)
    dropped = torch.nn.functional.dropout(x, 0.3, training=True)
    after = torch.rand(8)
    torch.manual_seed(4)
    keep = lora.dropout_scale(x.shape, torch.float32, x.device, 0.3)
    assert torch.equal(torch.rand(8), after)
    assert 0 < int((keep == 0).sum()) < keep.numel()
    assert torch.equal(x * keep, dropped)
    torch.manual_seed(9)
    expected = torch.rand(8)
    torch.manual_seed(9)
    assert torch.equal(lora.redrawn_scale(state, x.shape, torch.float32, x.device, 0.3), keep)
    assert torch.equal(torch.rand(8), expected)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_saved_bytes_with_dropout(autocast):
    """One LoRA linear (bf16 base, float32 adapters) with dropout 0.1 in training. peft keeps dropout's
    float32 scale (T·H·4) and lora_A's input, the dropped x (float32 T·H·4; under bf16 autocast its bf16
    cast T·H·2, and bf16 casts of A and B); ours keeps x itself and h (T·r) and the random state, nothing
    of T·H."""
    tokens, hidden, out, rank = 64, 48, 40, 4
    model = _tiny_peft_llama(torch.bfloat16, dropout=0.1)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.base_layer = nn.Linear(hidden, out, dtype=torch.bfloat16).requires_grad_(False)
    layer.lora_A["default"] = nn.Linear(hidden, rank, bias=False)
    layer.lora_B["default"] = nn.Linear(rank, out, bias=False)
    assert type(layer.lora_dropout["default"]) is nn.Dropout and layer.training
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True).clone()
    kept_anyway = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def saved():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return _saved(layer, x)

    def bytes_beside(tensors):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(n for ptr, n in storages.items() if ptr not in kept_anyway)

    peft_saved = saved()
    session = Session()
    _patch(session)
    ours = saved()
    assert session.calls.get("lora_input") == 1 and not session.bypassed, session.bypassed
    assert any(t.data_ptr() == x.data_ptr() for t in ours), "ours keeps the caller's x"
    assert not any(t.shape == x.shape and t.data_ptr() != x.data_ptr() for t in ours)
    scale = tokens * hidden * 4
    if autocast is None:
        assert bytes_beside(peft_saved) - bytes_beside(ours) == scale + tokens * hidden * 4
        assert bytes_beside(ours) == tokens * rank * 4
    else:
        casts = tokens * hidden * 2 + (rank * hidden + out * rank) * 2
        assert bytes_beside(peft_saved) - bytes_beside(ours) == scale + casts
        assert bytes_beside(ours) == tokens * rank * 2


@pytest.mark.parametrize("case, why", [
    ("bf16 adapters", "LoRA dropout in training over torch.bfloat16 adapters"),
    ("in place", "an in-place LoRA dropout"),
    ("not contiguous", "LoRA dropout in training over an input that is not contiguous"),
    ("misaligned", "LoRA dropout in training over an input that is not contiguous and 16-byte aligned"),
])
def test_dropout_fallbacks_run_peft_and_say_why(case, why):
    model, layer = _one_layer_case(lora_dropout=0.1)
    # not a leaf (an in-place dropout may write into it), as a layer's input is
    x_of = {"not contiguous": lambda x: x.t().contiguous().t(),
            "misaligned": lambda x: torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)}.get(
        case, lambda x: x.clone())
    if case == "bf16 adapters":
        layer.lora_A["default"].to(torch.bfloat16), layer.lora_B["default"].to(torch.bfloat16)
    if case == "in place":
        layer.lora_dropout["default"].inplace = True

    def run():
        torch.manual_seed(5)
        leaf = torch.randn(6, 16).requires_grad_()
        y = model(x_of(leaf))
        return y.detach(), torch.autograd.grad(y.square().sum(),
                                               [leaf, *[p for p in model.parameters() if p.requires_grad]])

    ref = run()
    session = Session()
    _patch(session)
    got = run()
    assert _calls(session) == 0 and session.originals["lora_input"] == 1
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # peft's own forward, same RNG draws
    assert why in session.bypassed["lora_input"]["why"], session.bypassed


# --------------------------------------------------------------------------- what the proof leaves out
def test_a_failing_autocast_proof_leaves_only_that_dtype(monkeypatch):
    """A proof that fails under fp16 autocast: bf16 autocast and no autocast keep our path, fp16 autocast
    runs peft's forward with the proof's reason."""
    real = lora.prove

    def failing_under_fp16(cls, forward, autocast=None, dropout=0.0):
        return "made to fail" if autocast == torch.float16 else real(cls, forward, autocast, dropout)

    monkeypatch.setattr(lora, "prove", failing_under_fp16)
    verdict = _probe.sealed(lora.RULE.prove, lora.RULE.candidates(LAYER)[0], LAYER)
    scope = verdict.variant
    assert scope is not None, verdict.reason
    assert scope.autocast == (torch.bfloat16,) and scope.dropout == (None, torch.bfloat16), scope
    assert scope.why("autocast to torch.float16") == "made to fail"
    assert "peft's forward under: autocast to torch.float16" in scope.describe()
    model, layer = _one_layer_case(lora_dropout=0.1)
    x = torch.ones(2, 16)
    assert lora.why_not(layer, LAYER.Linear, x, (), {}, scope) == ""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, scope) == ""
    with torch.autocast("cpu", dtype=torch.float16):
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, scope) == \
            "under autocast to torch.float16 (not proved: made to fail)"
    unproved_dropout = lora.Variant(autocast=(torch.bfloat16,), dropout=(None,),
                                    unproved=(("dropout in training under autocast to torch.bfloat16", "why"),))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora.why_not(layer, LAYER.Linear, x, (), {}, unproved_dropout) == \
            "LoRA dropout in training under autocast to torch.bfloat16 (not proved: why)"


def test_exit_check_says_when_most_calls_ran_peft(capsys):
    """Per-call fallbacks are counted (report.runs' original_calls) and the exit check says when they
    outnumber our calls, with the first reason; not when ours ran most."""
    model, layer = _one_layer_case(lora_dropout=0.0, use_dora=True)
    session = Session()
    session.add(_patch(session))
    for _ in range(3):
        model(torch.randn(2, 16))
    runs = report.runs(session)["lora_input"]
    assert runs["calls"] == 0 and runs["original_calls"] == 3, runs
    line = report.mostly_original(session)
    assert line == ("autopatch: lora_input ran the original code in 3 of 3 calls (the first reason: peft's "
                    "forward ran: a LoRA variant (DoraLinearVariant))"), line
    capsys.readouterr()
    runtime.at_exit(session)
    assert line in capsys.readouterr().err.splitlines()
    assert session.exit_status is None, "said, not a failure"
    plain, _ = _one_layer_case(lora_dropout=0.1)
    for _ in range(4):
        plain(torch.randn(2, 16))
    assert report.runs(session)["lora_input"]["calls"] == 4 and report.mostly_original(session) is None


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", [((4096, 4096), torch.bfloat16), ((3, 1001, 999), torch.bfloat16),
                                          ((7, 33), torch.float32), ((2, 2050, 2048), torch.float32)])
def test_cuda_dropout_scale_is_peft_mask(shape, dtype):
    """On CUDA, dropout's kernel picks its vector width (hence which random number each element gets)
    from the layout, the alignment and the element count (an odd count: its unvectorised kernel): the
    scale drawn over ones equals the mask F.dropout draws over peft's input x.to(float32) (a fresh cast,
    or x itself for a float32 x), and advances the CUDA generator the same."""
    x = torch.randn(shape, device="cuda").to(dtype)
    cast = x.to(torch.float32)
    torch.manual_seed(5)
    dropped = torch.nn.functional.dropout(cast, 0.1, training=True)
    after = torch.cuda.get_rng_state(), torch.get_rng_state()
    torch.manual_seed(5)
    keep = lora.dropout_scale(x.shape, torch.float32, x.device, 0.1)
    assert torch.equal(torch.cuda.get_rng_state(), after[0]) and torch.equal(torch.get_rng_state(), after[1])
    dropped_ours = cast * keep
    assert 0 < int((keep == 0).sum()) < keep.numel()
    assert torch.equal(dropped_ours, dropped), (dropped_ours != dropped).sum()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, autocast, reentrant", [(torch.float32, None, None),
                                                        (torch.bfloat16, torch.bfloat16, False),
                                                        (torch.bfloat16, None, True)])
def test_cuda_tiny_llama_with_dropout_matches_peft(dtype, autocast, reentrant):
    """A tiny Llama on CUDA (hidden 256, 2 × 512 tokens) under peft with lora_dropout 0.1, with and
    without checkpointing: from the same seed the loss and every gradient are peft's and the CUDA and
    CPU generators end where peft's end."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config).to(dtype), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                                          target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model = model.cuda().train()
    if reentrant is not None:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
    gen = torch.Generator().manual_seed(3)
    embeds = (torch.randn(2, 512, 256, generator=gen) * 0.5).to(dtype).cuda()
    labels = torch.randint(0, 128, (2, 512), generator=gen).cuda()

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_()
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(inputs_embeds=x, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return (loss.detach(), x.grad.detach().clone(), grads), (torch.cuda.get_rng_state(), torch.get_rng_state())

    ref, ref_after = step(11)
    session = Session()
    _patch(session)
    got, got_after = step(11)
    assert _calls(session) >= 2 * 7 and not session.bypassed, session.bypassed
    what = f"CUDA {dtype} base, autocast {autocast}, reentrant {reentrant}"
    assert torch.equal(got_after[0], ref_after[0]) and torch.equal(got_after[1], ref_after[1]), what
    _assert_same(got, ref, torch.float32 if dtype == torch.float32 and autocast is None else torch.bfloat16, what)
