"""The tiled MLP (autopatch.rules._tiled, AUTOPATCH_TILED_MLP_TOKENS) on the CPU: the patched gated and
GELU MLPs run over chunks of the tokens and recomputed in the backward give the output and every
gradient of the untiled patched forward and of the original (fp32, 1e-5) — alone, in a tiny Llama
with and without gradient checkpointing, with LoRA (peft) on the MLP's projections, LoRA dropout's
masks the same in the recompute — and a module the rule cannot prove is left alone, untiled. Under
non-reentrant checkpointing the layer's recompute stops before the chunks."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import assert_close, everything, modeling, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.config import load_settings  # noqa: E402
from autopatch.rules import _tiled, gelu_mlp, glu_mlp  # noqa: E402
from autopatch.session import current  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_patches")
TOL = 1e-5


@pytest.fixture
def tiled(monkeypatch):
    """set(limit): the session's AUTOPATCH_TILED_MLP_TOKENS (None: untiled), read at each call."""

    def set_limit(limit):
        monkeypatch.setattr(current(), "settings", types.SimpleNamespace(tiled_mlp_tokens=limit))

    set_limit(None)
    return set_limit


def _is_tiled(y) -> bool:
    return type(y.grad_fn).__name__.startswith("_TiledMLP")


def _run(mlp, forward, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    y = forward(mlp, x)
    y.backward(grad_out)
    return y, [y, x.grad] + [p.grad for p in mlp.parameters()]


def _build(cls, config, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        mlp = cls(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mlp


def test_chunks_cover_the_tokens_in_near_equal_pieces():
    assert _tiled.chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert _tiled.chunks(12, 4) == [(0, 4), (4, 8), (8, 12)]
    assert _tiled.chunks(9, 100) == [(0, 9)]
    for tokens, limit in ((1000, 64), (65, 64), (64, 64), (7, 1)):
        pieces = _tiled.chunks(tokens, limit)
        assert pieces[0][0] == 0 and pieces[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert max(e - s for s, e in pieces) <= limit


def test_setting_is_read_and_validated():
    assert load_settings({}).tiled_mlp_tokens is None
    assert load_settings({"AUTOPATCH_TILED_MLP_TOKENS": "8192"}).tiled_mlp_tokens == 8192
    assert _tiled.limit_of(types.SimpleNamespace(settings=load_settings({"AUTOPATCH_TILED_MLP_TOKENS": "16"}))) == 16
    assert _tiled.limit_of(types.SimpleNamespace(settings=None)) is None
    for bad in ("0", "-4", "many", "1.5"):
        with pytest.raises(ValueError, match="AUTOPATCH_TILED_MLP_TOKENS"):
            load_settings({"AUTOPATCH_TILED_MLP_TOKENS": bad})


# (model, class, config class, config extras, rule, kernel op that must run)
MLPS = [
    ("llama", "LlamaMLP", "LlamaConfig", {}, glu_mlp, "swiglu"),
    ("llama", "LlamaMLP", "LlamaConfig", {"mlp_bias": True}, glu_mlp, "swiglu"),
    ("phi3", "Phi3MLP", "Phi3Config", {}, glu_mlp, "swiglu"),  # fused gate_up_proj
    ("gemma2", "Gemma2MLP", "Gemma2Config", {}, glu_mlp, "geglu"),
    ("gpt_neox", "GPTNeoXMLP", "GPTNeoXConfig", {"num_attention_heads": 4}, gelu_mlp, "gelu"),
    ("gpt2", "GPT2MLP", None, {}, gelu_mlp, "gelu"),  # Conv1D projections, a trailing dropout
]


@pytest.mark.parametrize("model,cls_name,config_name,extra,rule,op", MLPS,
                         ids=[f"{c[1]}{'-bias' if c[3].get('mlp_bias') else ''}" for c in MLPS])
def test_tiled_equals_untiled_and_original(tiled, model, cls_name, config_name, extra, rule, op):
    module = modeling(model)
    cls = getattr(module, cls_name)
    assert verdict_of(rule.RULE.patch_module(module, current(), everything), cls_name).patched
    if cls_name == "GPT2MLP":
        config = module.GPT2Config(n_embd=32, n_head=4, resid_pdrop=0.0)
        mlp = _build(lambda c: cls(4 * 32, c), config, 3)
    else:
        config = getattr(module, config_name)(hidden_size=32, intermediate_size=48, **extra)
        mlp = _build(cls, config, 3)
    mlp.train()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 32, generator=gen)  # 14 tokens: chunks of 5, 5, 4 at a limit of 5
    grad_out = torch.randn(2, 7, 32, generator=gen)

    tiled(5)
    before = fused_kernels.launch_counts()
    y, out = _run(mlp, cls.forward, x, grad_out)
    after = fused_kernels.launch_counts()
    assert _is_tiled(y), y.grad_fn
    # three chunks forward and three recomputed in the backward, each through the kernel
    assert after.get(f"{op}_fwd", 0) - before.get(f"{op}_fwd", 0) >= 6, op
    tiled(None)
    y_plain, plain = _run(mlp, cls.forward, x, grad_out)
    assert not _is_tiled(y_plain)
    _, ref = _run(mlp, patching.original(cls, "forward"), x, grad_out)
    assert len(out) == len(plain) == len(ref) == 2 + len(list(mlp.parameters()))
    for i, (a, p, r) in enumerate(zip(out, plain, ref)):
        assert a is not None and a.shape == r.shape
        assert_close(a, p, torch.float32, f"{cls_name} tiled vs untiled, output/grad {i}", tol=TOL)
        assert_close(a, r, torch.float32, f"{cls_name} tiled vs original, output/grad {i}", tol=TOL)


def test_not_tiled_at_or_below_the_limit_nor_without_autograd(tiled):
    module = modeling("llama")
    glu_mlp.RULE.patch_module(module, current(), everything)
    mlp = _build(module.LlamaMLP, module.LlamaConfig(hidden_size=32, intermediate_size=48), 5)
    x = torch.randn(2, 4, 32, requires_grad=True)
    tiled(8)
    assert not _is_tiled(mlp(x))  # 8 tokens: at the limit
    tiled(7)
    assert _is_tiled(mlp(x))
    with torch.no_grad():
        y = mlp(x)
    assert y.grad_fn is None
    assert_close(y, patching.original(module.LlamaMLP, "forward")(mlp, x), torch.float32, "no_grad", tol=TOL)


def test_unproven_module_is_left_alone_with_its_reason_and_not_tiled(tiled):
    """T5Gemma's MLP holds a dropout between the projections: the rule cannot prove it, so it is left
    alone with the reason whatever the tiling setting, and runs whole."""
    tiled(2)
    module = modeling("t5gemma")
    record = verdict_of(glu_mlp.RULE.patch_module(module, current(), everything), "T5GemmaMLP")
    assert not record.patched and "has other submodules (dropout)" in record.reason
    config = module.T5GemmaModuleConfig(hidden_size=32, intermediate_size=48)
    config.dropout_rate = 0.0
    mlp = _build(module.T5GemmaMLP, config, 6)
    y = mlp(torch.randn(2, 5, 32, requires_grad=True))
    assert y.grad_fn is not None and not _is_tiled(y)


# --- whole models -----------------------------------------------------------------------------------


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().train()


def _step(model, ids, seed=11):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _tiled_mlp_nodes(model, ids) -> int:
    """How many tiled MLP nodes a forward of `model` records."""
    loss = model(input_ids=ids, labels=ids).loss
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__.startswith("_TiledMLP")
        stack.extend(n for n, _ in node.next_functions)
    return count


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "grad-ckpt", "grad-ckpt-reentrant"])
def test_tiny_llama_loss_and_every_gradient(tiled, reentrant):
    glu_mlp.RULE.patch_module(modeling("llama"), current(), everything)
    model = _tiny_llama()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    tiled(None)
    loss_ref, grads_ref = _step(model, ids)
    assert _tiled_mlp_nodes(model, ids) == 0
    tiled(5)  # 24 tokens: five chunks per MLP
    # a non-reentrant checkpoint records the graph too; a reentrant one tiles in its recompute only
    assert _tiled_mlp_nodes(model, ids) == (0 if reentrant else 2)
    loss, grads = _step(model, ids)
    assert_close(loss, loss_ref, torch.float32, "loss", tol=TOL)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert_close(grads[name], grads_ref[name], torch.float32, name, tol=TOL)


def test_checkpoint_recompute_stops_before_the_chunks(tiled, monkeypatch):
    """Under non-reentrant checkpointing the backward's recompute of a decoder layer stops at the last
    tensor the layer saved: the MLP's input, saved by its own node before the chunks run, so the tiled
    forward (its chunks and its [tokens, hidden] output) does not run again in the backward (it ran once
    per layer there, for an output the recompute throws away). Loss and every gradient as untiled."""
    glu_mlp.RULE.patch_module(modeling("llama"), current(), everything)
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    tiled(None)
    loss_ref, grads_ref = _step(model, ids)
    forwards = []
    tiled_forward = _tiled._TiledMLP.forward

    def counted(ctx, *args):
        forwards.append(1)
        return tiled_forward(ctx, *args)

    monkeypatch.setattr(_tiled._TiledMLP, "forward", staticmethod(counted))
    tiled(5)
    torch.manual_seed(11)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert len(forwards) == 2  # one per layer
    loss.backward()
    assert len(forwards) == 2, f"{len(forwards) - 2} tiled forwards in the backward's recompute"
    assert_close(loss.detach(), loss_ref, torch.float32, "loss", tol=TOL)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert_close(grads[name], grads_ref[name], torch.float32, name, tol=TOL)


def _lora(model, dropout):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                            target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]))


def test_lora_on_the_mlp_projections(tiled):
    """peft's LoRA wraps gate/up/down: the rule's forward calls the module's own projections, so the
    chunks run the adapters, and their gradients come out of the tiled node equal to untiled."""
    glu_mlp.RULE.patch_module(modeling("llama"), current(), everything)
    model = _lora(_tiny_llama(), 0.0)
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters something to carry
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    tiled(None)
    loss_ref, grads_ref = _step(model, ids)
    tiled(6)
    assert _tiled_mlp_nodes(model, ids) == 2
    loss, grads = _step(model, ids)
    assert any("mlp.gate_proj.lora_A" in n for n in grads) and any("mlp.down_proj.lora_B" in n for n in grads)
    assert_close(loss, loss_ref, torch.float32, "loss", tol=TOL)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name].abs().sum() > 0, name
        assert_close(grads[name], grads_ref[name], torch.float32, name, tol=TOL)


def test_lora_dropout_masks_are_the_same_in_the_recompute(tiled):
    """With LoRA dropout, the tiled forward draws per chunk; the backward's recompute must draw the
    same masks. Reference: the untiled patched MLP run on the same chunks in order from the same seed,
    with autograd — equal output and gradients only if the recompute replayed the random state."""
    module = modeling("llama")
    glu_mlp.RULE.patch_module(module, current(), everything)
    from peft import LoraConfig, get_peft_model

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _build(module.LlamaMLP, module.LlamaConfig(hidden_size=32, intermediate_size=48), 8)

        def forward(self, x):
            return self.mlp(x)

    holder = get_peft_model(Holder(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                 target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    holder.train()
    mlp = holder.base_model.model.mlp
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(9))
    g = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(10))
    params = [p for p in holder.parameters() if p.requires_grad]

    tiled(4)  # chunks of 4, 3, 3 tokens
    torch.manual_seed(123)
    xa = x.clone().requires_grad_(True)
    y = mlp(xa)
    assert _is_tiled(y)
    torch.manual_seed(999)  # the backward must not depend on the random state at its time
    grads = torch.autograd.grad(y, [xa, *params], g)

    tiled(None)
    torch.manual_seed(123)
    xb = x.clone().requires_grad_(True)
    flat = xb.reshape(-1, 32)
    y_ref = torch.cat([mlp(flat[s:e]) for s, e in _tiled.chunks(10, 4)]).view(1, 10, 32)
    grads_ref = torch.autograd.grad(y_ref, [xb, *params], g)
    assert_close(y, y_ref, torch.float32, "output", tol=TOL)
    for i, (a, r) in enumerate(zip(grads, grads_ref)):
        assert_close(a, r, torch.float32, f"grad {i}", tol=TOL)


def test_bf16_weight_gradients_summed_in_float32(tiled):
    """bf16: the chunks' weight gradients are summed in float32 and returned in bf16, within bf16's
    bound of the untiled patched MLP and of the original."""
    module = modeling("llama")
    glu_mlp.RULE.patch_module(module, current(), everything)
    mlp = _build(module.LlamaMLP, module.LlamaConfig(hidden_size=32, intermediate_size=48), 7).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 40, 32, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn(1, 40, 32, generator=gen).to(torch.bfloat16)
    tiled(8)
    y, out = _run(mlp, module.LlamaMLP.forward, x, grad_out)
    assert _is_tiled(y)
    tiled(None)
    _, plain = _run(mlp, module.LlamaMLP.forward, x, grad_out)
    _, ref = _run(mlp, patching.original(module.LlamaMLP, "forward"), x, grad_out)
    for i, (a, p, r) in enumerate(zip(out, plain, ref)):
        assert a.dtype == torch.bfloat16
        assert_close(a, p, torch.bfloat16, f"tiled vs untiled {i}")
        assert_close(a, r, torch.bfloat16, f"tiled vs original {i}")
