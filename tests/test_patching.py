"""autopatch.patching: a swapped function keeps the original readable (__wrapped__, so
inspect.signature and inspect.unwrap read it), calls reach ours (instance, class and module calls),
restore() puts the original back, and torch.compile(fullgraph=True) traces a training step of a
patched tiny Llama without a graph break (backend "aot_eager": Dynamo and AOTAutograd, no code
generation). Why the swaps are plain functions and not wrapt wrappers: autopatch/patching.py."""

from __future__ import annotations

import inspect
import types

import torch

from autopatch import patching


def test_swap_keeps_the_original_readable_and_calls_ours(restore_patches):
    class Norm(torch.nn.Module):
        def forward(self, x, scale: float = 1.0):
            """the original"""
            return x * scale

    original = Norm.forward

    def fused(self, x, scale: float = 1.0):
        return x * scale + 1

    assert patching.replace(Norm, "forward", fused)
    assert vars(Norm)["forward"] is fused and patching.installed(Norm, "forward") is fused
    assert Norm.forward.__wrapped__ is original and inspect.unwrap(Norm.forward) is original
    assert inspect.signature(Norm.forward) == inspect.signature(original)
    x = torch.ones(2)
    assert torch.equal(Norm()(x), x + 1) and torch.equal(Norm.forward(Norm(), x), x + 1)
    assert patching.original(Norm, "forward") is original
    assert not patching.replace(Norm, "forward", lambda self, x: x), "idempotent: the first patch stays"
    patching.restore_all()
    assert vars(Norm)["forward"] is original and torch.equal(Norm()(x), x)


def test_a_rules_own_wrapped_is_kept(restore_patches):
    module = types.ModuleType("transformers.models.fake.modeling_fake")

    def rotate(q, k):
        return q, k

    def elsewhere(q, k):
        return q, k

    def ours(q, k):
        return k, q

    ours.__wrapped__ = elsewhere
    module.rotate = rotate
    patching.replace(module, "rotate", ours)
    assert module.rotate(1, 2) == (2, 1) and module.rotate.__wrapped__ is elsewhere
    patching.replace(module, "CONSTANT", 3)  # not a function: set as given
    assert module.CONSTANT == 3 and patching.entries()[-1] == (module, "CONSTANT", 3)


def test_compiled_fullgraph_training_step_of_a_patched_llama(restore_patches):
    """A tiny Llama whose RMSNorm, model forward, MLP and rotary function are swapped compiles with
    fullgraph=True for a training step (a graph break would raise) and matches eager."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    norm_forward = modeling_llama.LlamaRMSNorm.forward
    model_forward = modeling_llama.LlamaModel.forward
    rotary = modeling_llama.apply_rotary_pos_emb
    calls = []

    def fused_norm(self, hidden_states):
        calls.append("norm")
        return norm_forward(self, hidden_states)

    def fused_model(self, *args, **kwargs):
        calls.append("model")
        return model_forward(self, *args, **kwargs)

    def fused_mlp(self, x):
        calls.append("mlp")
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused_rotary(q, k, cos, sin, *args, **kwargs):
        calls.append("rope")
        return rotary(q, k, cos, sin, *args, **kwargs)

    patching.replace(modeling_llama.LlamaRMSNorm, "forward", fused_norm)
    patching.replace(modeling_llama.LlamaModel, "forward", fused_model)
    patching.replace(modeling_llama.LlamaMLP, "forward", fused_mlp)
    patching.replace(modeling_llama, "apply_rotary_pos_emb", fused_rotary)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).train()
    ids = torch.randint(0, 64, (1, 8))
    eager = model(input_ids=ids, labels=ids).loss
    assert {"norm", "model", "mlp", "rope"} <= set(calls)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
