"""autopatch.patching swaps functions through wrapt: the original's __wrapped__, name, doc and
signature stay readable, calls reach our function (instance, class and module calls), restore()
puts the original back, and torch.compile(fullgraph=True) traces a patched tiny Llama without a
graph break (backend "eager": Dynamo's tracing, no code generation)."""

from __future__ import annotations

import inspect
import types

import pytest
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
    swapped = vars(Norm)["forward"]
    assert patching.is_swap(swapped) and patching.replacement(swapped) is fused
    assert Norm.forward.__wrapped__ is original and inspect.unwrap(Norm.forward) is original
    assert Norm.forward.__name__ == "forward" and Norm.forward.__doc__ == "the original"
    assert inspect.signature(Norm.forward) == inspect.signature(original)
    x = torch.ones(2)
    assert torch.equal(Norm()(x), x + 1) and torch.equal(Norm.forward(Norm(), x), x + 1)
    assert patching.installed(Norm, "forward") is swapped and patching.original(Norm, "forward") is original
    assert not patching.replace(Norm, "forward", fused), "idempotent"
    patching.restore_all()
    assert vars(Norm)["forward"] is original and torch.equal(Norm()(x), x)


def test_module_function_swap(restore_patches):
    module = types.ModuleType("transformers.models.fake.modeling_fake")

    def rotate(q, k):
        return q, k

    module.rotate = rotate
    patching.replace(module, "rotate", lambda q, k: (k, q))
    assert module.rotate(1, 2) == (2, 1) and module.rotate.__wrapped__ is rotate
    patching.replace(module, "CONSTANT", 3)  # not a function: set as given
    assert module.CONSTANT == 3


def test_compiled_fullgraph_patched_llama_has_no_graph_break(restore_patches):
    """A tiny Llama whose RMSNorm, MLP and rotary function are swapped through wrapt compiles with
    fullgraph=True (a graph break would raise) and gives the eager numbers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    norm_forward = modeling_llama.LlamaRMSNorm.forward
    mlp_forward = modeling_llama.LlamaMLP.forward
    rotary = modeling_llama.apply_rotary_pos_emb
    calls = []

    def fused_norm(self, hidden_states):
        calls.append("norm")
        return norm_forward(self, hidden_states)

    def fused_mlp(self, x):
        calls.append("mlp")
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused_rotary(q, k, cos, sin, *args, **kwargs):
        calls.append("rope")
        return rotary(q, k, cos, sin, *args, **kwargs)

    patching.replace(modeling_llama.LlamaRMSNorm, "forward", fused_norm)
    patching.replace(modeling_llama.LlamaMLP, "forward", fused_mlp)
    patching.replace(modeling_llama, "apply_rotary_pos_emb", fused_rotary)
    assert patching.is_swap(vars(modeling_llama.LlamaMLP)["forward"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        assert {"norm", "mlp", "rope"} <= set(calls)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids).logits
    torch.testing.assert_close(compiled, eager)
