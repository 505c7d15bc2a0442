"""The moe_gate rule (autopatch.rules.moe_gate): transformers' expert containers whose gate is the
shared default (`act_fn(gate) * up` of `gate_up_out.chunk(2)`) run it through fused_kernels.swiglu /
geglu, in the batched_mm and grouped_mm experts implementations; a container with a gate of its own
(gpt-oss) is not touched; the eager implementation never calls the gate. Whole tiny models, patched
against unpatched: loss and every gradient at fp32 1e-5, with the kernels counted."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, everything, modeling, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
import tiny_models  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.rules import glu_mlp, moe_gate  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = moe_gate.RULE
FP32 = torch.float32
ARCHS = {a.class_name: a for a in tiny_models.causal_lm_architectures()}

pytestmark = [pytest.mark.skipif(moe_gate.default_gate() is None,
                                 reason="this transformers has no shared expert gate (integrations.moe)"),
              pytest.mark.usefixtures("restore_patches")]




def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,experts_cls,implementation,act", [
    ("Qwen3MoeForCausalLM", "Qwen3MoeExperts", "grouped_mm", None),
    ("Qwen3MoeForCausalLM", "Qwen3MoeExperts", "batched_mm", None),
    ("MixtralForCausalLM", "MixtralExperts", "grouped_mm", None),
    # the activation is the instance's: the same experts class with GELU-tanh runs geglu
    ("MixtralForCausalLM", "MixtralExperts", "batched_mm", "gelu_pytorch_tanh"),
])
def test_patched_model_matches_and_runs_the_kernel(arch, experts_cls, implementation, act):
    model = tiny_models.build_tiny(ARCHS[arch])
    model.set_experts_implementation(implementation)
    experts = [m for m in model.modules() if type(m).__name__ == experts_cls]
    assert experts, f"no {experts_cls} in the tiny {arch}"
    if act is not None:
        from transformers.activations import ACT2FN

        for m in experts:
            m.act_fn = ACT2FN[act]
    inputs = tiny_models.smoke_inputs(model)
    ref_loss, ref_grads = _step(model, inputs)

    module = modeling(ARCHS[arch].module_name.split(".")[-2])
    cls = getattr(module, experts_cls)
    record = verdict_of(RULE.patch_module(module, current(), everything), f"{experts_cls}._apply_gate")
    assert record.patched and record.kernel == "swiglu", record
    assert patching.original(cls, "_apply_gate") is moe_gate.default_gate()
    assert verdict_of(RULE.patch_module(module, current(), everything), f"{experts_cls}._apply_gate") == record  # idempotent

    before = fused_kernels.launch_counts()
    kernel = "geglu" if act else "swiglu"
    loss, grads = _step(model, inputs)
    after = fused_kernels.launch_counts()
    ran = after.get(f"{kernel}_fwd", 0) - before.get(f"{kernel}_fwd", 0)
    assert ran >= len(experts), f"{kernel} ran {ran} times for {len(experts)} expert layers"
    assert_close(loss, ref_loss, FP32, "loss")
    for name, ref in ref_grads.items():
        assert_close(grads[name], ref, FP32, f"grad {name}")


def test_eager_experts_never_call_the_gate():
    """The eager implementation is the model's own per-expert loop: no _apply_gate, no kernel, the
    same numbers."""
    model = tiny_models.build_tiny(ARCHS["Qwen3MoeForCausalLM"])
    model.set_experts_implementation("eager")
    inputs = tiny_models.smoke_inputs(model)
    ref_loss, _ = _step(model, inputs)
    RULE.patch_module(modeling("qwen3_moe"), current(), everything)
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    loss, _ = _step(model, inputs)
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) == before  # the rule alone: no dense MLP patch
    assert torch.equal(loss, ref_loss), (loss, ref_loss)


def test_custom_gate_is_not_a_candidate():
    """gpt-oss defines its own clamped gate: not this rule's (and glu_mlp says why it leaves it)."""
    module = modeling("gpt_oss")
    assert not any(r.target.startswith("GptOssExperts") for r in RULE.patch_module(module, current(), everything))
    assert vars(module.GptOssExperts)["_apply_gate"] is not moe_gate.default_gate()
    record = verdict_of(glu_mlp.RULE.patch_module(module, current(), everything), "GptOssExperts")
    assert not record.patched and "gate of its own" in record.reason


def test_disabled_kernels_and_other_dtypes_run_the_original():
    module = modeling("qwen3_moe")
    records = RULE.patch_module(module, current(), lambda k: False)
    assert records and all(not r.patched and "disabled" in r.reason for r in records)
    assert "_apply_gate" not in [name for _, name, _ in patching._originals.values()]
    # patched, then a float64 input (the kernels take fp32/bf16/fp16): the original formula
    RULE.patch_module(module, current(), everything)
    experts = type("E", (), {"act_fn": torch.nn.SiLU()})()
    gate_up = torch.randn(5, 8, dtype=torch.float64)
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    out = module.Qwen3MoeExperts._apply_gate(experts, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) == before


@pytest.mark.gpu
def test_grouped_mm_on_cuda_bf16():
    """The default on a GPU: torch's grouped_mm experts in bf16. Patched against unpatched, the same
    model and batch: loss and every gradient within bf16 tolerance (the fused gate rounds once where
    the original rounds silu(gate) and the product), the kernel counted once per expert layer."""
    model = tiny_models.build_tiny(ARCHS["Qwen3MoeForCausalLM"]).to("cuda", torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in tiny_models.smoke_inputs(model).items()}
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    ref_loss, ref_grads = _step(model, inputs)
    assert torch.isfinite(ref_loss)
    RULE.patch_module(modeling("qwen3_moe"), current(), everything)
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    loss, grads = _step(model, inputs)
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) - before >= len(experts)
    assert_close(loss.float(), ref_loss.float(), torch.bfloat16, "loss")
    for name, ref in ref_grads.items():
        assert_close(grads[name].float(), ref.float(), torch.bfloat16, f"grad {name}", tol=3e-2)
