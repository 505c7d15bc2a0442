"""The moe_experts rule (autopatch.rules.moe_experts): transformers' experts containers with the standard
layout and gate run fused_kernels.moe_experts; the rest is left alone with its reason. Whole tiny models,
patched against unpatched: loss, eval logits and every gradient at fp32 1e-5, with the kernel counted."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, everything, modeling, train_and_eval, verdict_of

pytest.importorskip("transformers")

import fused_kernels  # noqa: E402
import tiny_models  # noqa: E402
from autopatch import patching  # noqa: E402
from autopatch.rules import moe_experts  # noqa: E402
from autopatch.session import current  # noqa: E402

RULE = moe_experts.RULE
FP32 = torch.float32
ARCHS = {a.class_name: a for a in tiny_models.causal_lm_architectures()}

pytestmark = [pytest.mark.skipif(moe_experts._dispatcher_code() is None,
                                 reason="this transformers has no experts decorator (integrations.moe)"),
              pytest.mark.usefixtures("restore_patches")]


@pytest.mark.parametrize("arch,experts_cls,implementation", [
    ("Qwen3MoeForCausalLM", "Qwen3MoeExperts", "grouped_mm"),
    ("Qwen3MoeForCausalLM", "Qwen3MoeExperts", "eager"),
    # shared expert, sigmoid routing with a routed scaling factor: the router's business, the experts are the same
    ("DeepseekV3ForCausalLM", "DeepseekV3Experts", "grouped_mm"),
    ("AriaTextForCausalLM", "AriaExperts", "grouped_mm"),  # weights stored transposed
    ("MixtralForCausalLM", "MixtralExperts", "batched_mm"),
])
def test_patched_model_matches_and_runs_the_kernel(arch, experts_cls, implementation):
    model = tiny_models.build_tiny(ARCHS[arch])
    model.set_experts_implementation(implementation)
    experts = [m for m in model.modules() if type(m).__name__ == experts_cls]
    assert experts, f"no {experts_cls} in the tiny {arch}"
    inputs = tiny_models.smoke_inputs(model)
    ref_loss, ref_logits, ref_grads = train_and_eval(model, inputs)

    module = modeling(ARCHS[arch].module_name.split(".")[-2])
    record = verdict_of(RULE.patch_module(module, current(), everything), f"{experts_cls}.forward")
    assert record.patched and record.kernel == "swiglu" and moe_experts.is_experts_record(record), record
    assert verdict_of(RULE.patch_module(module, current(), everything), f"{experts_cls}.forward") == record  # idempotent

    before = fused_kernels.launch_counts()
    loss, logits, grads = train_and_eval(model, inputs)
    after = fused_kernels.launch_counts()
    for direction in ("fwd", "bwd"):
        ran = after.get(f"moe_experts_{direction}", 0) - before.get(f"moe_experts_{direction}", 0)
        assert ran >= len(experts), f"moe_experts {direction} ran {ran} times for {len(experts)} expert layers"
    assert_close(loss, ref_loss, FP32, "loss")
    assert_close(logits, ref_logits, FP32, "eval logits")
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert_close(grads[name], ref, FP32, f"grad {name}")


def test_gates_and_layouts_of_their_own_are_left_alone_with_the_reason():
    records = RULE.patch_module(modeling("gpt_oss"), current(), everything)
    record = verdict_of(records, "GptOssExperts.forward")
    assert not record.patched and "biases" in record.reason and "gate of its own" in record.reason
    assert not patching.is_patched(modeling("gpt_oss").GptOssExperts, "forward")
    record = verdict_of(RULE.patch_module(modeling("deepseek_v4"), current(), everything), "DeepseekV4Experts.forward")
    assert not record.patched and "gate of its own" in record.reason


def test_disabled_kernels_leave_the_experts_alone():
    module = modeling("qwen3_moe")
    record = verdict_of(RULE.patch_module(module, current(), lambda k: False), "Qwen3MoeExperts.forward")
    assert not record.patched and "disabled" in record.reason
    assert not patching.is_patched(module.Qwen3MoeExperts, "forward")


def test_runtime_hands_back_to_transformers():
    """What the fused path does not reproduce runs the original dispatcher: a kernel backend named by
    the config, expert parallelism, weights of another dtype than the hidden states."""
    model = tiny_models.build_tiny(ARCHS["Qwen3MoeForCausalLM"])
    module = modeling("qwen3_moe")
    assert verdict_of(RULE.patch_module(module, current(), everything), "Qwen3MoeExperts.forward").patched
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    x = torch.randn(5, experts.gate_up_proj.shape[-1])
    idx = torch.randint(0, experts.num_experts, (5, 2))
    w = torch.rand(5, 2)
    reference = patching.original(module.Qwen3MoeExperts, "forward")

    def launches():
        return fused_kernels.launch_counts().get("moe_experts_fwd", 0)

    start = launches()
    experts(x, idx, w)
    assert launches() == start + 1
    experts._is_expert_parallel = True
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        got, want = experts(x, idx, w), reference(experts, x, idx, w)
    assert launches() == start + 1 and torch.equal(got, want)
    experts._is_expert_parallel = False
    experts.config._experts_implementation = "a-kernel-backend"
    with pytest.raises(KeyError):  # transformers' own error for a name it does not know: the original ran
        experts(x, idx, w)
    experts.config._experts_implementation = "grouped_mm"
    out = experts(x.bfloat16(), idx, w)  # bfloat16 hidden states, float32 weights: transformers casts
    assert launches() == start + 1 and out.dtype == torch.bfloat16


@pytest.mark.gpu
def test_gpu_bf16_model_on_the_grouped_gemm_path():
    """A tiny Qwen3-MoE in bf16 on the GPU (experts of width 64: the grouped-GEMM path), against the same
    model in fp32: the patched bf16 model's loss and gradients are no further from fp32 than the
    unpatched bf16 model's (transformers' own grouped_mm path), and its loss within 1e-2."""
    from helpers import rel_err

    fp32 = tiny_models.build_tiny(ARCHS["Qwen3MoeForCausalLM"]).to("cuda")
    fp32.set_experts_implementation("grouped_mm")
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in tiny_models.smoke_inputs(fp32).items()}
    ref_loss, _, ref_grads = train_and_eval(fp32, inputs)
    model = fp32.to(torch.bfloat16)
    plain_loss, _, plain_grads = train_and_eval(model, inputs)
    assert verdict_of(RULE.patch_module(modeling("qwen3_moe"), current(), everything), "Qwen3MoeExperts.forward").patched
    before = fused_kernels.launch_counts().get("moe_experts_bwd", 0)
    loss, _, grads = train_and_eval(model, inputs)
    assert fused_kernels.launch_counts().get("moe_experts_bwd", 0) > before
    assert_close(loss.float(), ref_loss, torch.bfloat16, "loss")
    for name, ref in ref_grads.items():
        ours, theirs = rel_err(grads[name].float(), ref), rel_err(plain_grads[name].float(), ref)
        assert ours <= 1.5 * theirs + 1e-3, f"grad {name}: {ours:.2e} from fp32, transformers' bf16 {theirs:.2e}"
