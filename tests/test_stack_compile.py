"""torch.compile, gradient checkpointing and PEFT LoRA over a patched tiny Llama (CPU, kernels in
Triton's interpreter; float32, 1e-5 relative).

  - torch.compile(model, fullgraph=True, backend="aot_eager") of a patched model traces a training
    forward with labels (the fused linear CE path) without a graph break (fullgraph raises on one), the
    graph calls our custom ops, and the loss and every gradient equal eager patched (and plain);
  - gradient_checkpointing_enable() (reentrant and not): the same loss and gradients as without, with
    the forward kernels run again in the recomputation;
  - a PEFT LoRA model over a patched base: the same losses and adapter gradients as over a plain base
    for two AdamW steps, only the adapters change; with lm_head itself a LoRA target (one step) the
    fused linear CE steps aside.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import stack_worker
from helpers import assert_close

F32 = torch.float32
KERNELS = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")

pytestmark = pytest.mark.slow


@pytest.fixture
def restore_patches():
    from autopatch import patching

    patching.restore_all()
    yield
    patching.restore_all()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return ids, labels


def launches() -> dict:
    import fused_kernels

    return fused_kernels.launch_counts()


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def train_step(model, ids, labels, call=None):
    """Loss and every parameter's gradient of one training forward+backward."""
    model.zero_grad(set_to_none=True)
    model.train()
    out = (model if call is None else call)(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().clone(), grads


def assert_same(got, ref, what: str) -> None:
    loss, grads = got
    ref_loss, ref_grads = ref
    assert_close(loss, ref_loss, F32, f"{what}: loss")
    assert set(grads) == set(ref_grads), f"{what}: not the same parameters got gradients"
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, F32, f"{what}: grad {name}")


def patched_tiny_llama():
    import autopatch

    model = stack_worker.tiny_llama()
    records = autopatch.apply(model)
    assert {r.kernel for r in records if r.patched} >= set(KERNELS), records
    return model


def test_compile_fullgraph_trains_like_eager(restore_patches):
    ids, labels = batch()
    plain = train_step(stack_worker.tiny_llama(), ids, labels)
    model = patched_tiny_llama()
    eager = train_step(model, ids, labels)
    assert_same(eager, plain, "eager patched vs plain")

    traced_ops: list[str] = []

    def recording_aot_eager(gm, example_inputs):
        traced_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_aot_eager)
    before = launches()
    got = train_step(model, ids, labels, call=compiled)  # fullgraph=True: a graph break raises here
    ran = delta(before, launches())
    assert_same(got, eager, "torch.compile(fullgraph=True) vs eager patched")
    ours = {op for op in traced_ops if op.startswith("fused_kernels.")}
    for kernel in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
        assert any(kernel in op for op in ours), f"{kernel} is not in the compiled graph: {sorted(ours)}"
        assert ran.get(f"{kernel}_fwd", 0) > 0 and ran.get(f"{kernel}_bwd", 0) > 0, (kernel, ran)
    torch._dynamo.reset()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_same_gradients(restore_patches, reentrant):
    ids, labels = batch()
    model = patched_tiny_llama()
    before = launches()
    ref = train_step(model, ids, labels)
    plain_run = delta(before, launches())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.2x renames it; 5.1x has only this name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert model.is_gradient_checkpointing
    before = launches()
    got = train_step(model, ids, labels)
    checkpointed_run = delta(before, launches())
    assert_same(got, ref, f"gradient checkpointing (use_reentrant={reentrant})")
    # the decoder layer's forward ran twice (forward, then recomputed in backward), through the kernels
    for kernel in ("rope", "swiglu"):
        assert checkpointed_run[f"{kernel}_fwd"] == 2 * plain_run[f"{kernel}_fwd"], (checkpointed_run, plain_run)
    assert checkpointed_run["fused_linear_cross_entropy_fwd"] == plain_run["fused_linear_cross_entropy_fwd"]


def lora_model(base, target_modules):
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    # init_lora_weights=False: random A and B, so every adapter gets a gradient at the first step
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    return peft.get_peft_model(base, config)


def train_lora(model, steps: int = 2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses, grads = [], {}
    for step in range(steps):
        ids, labels = batch(seed=10 + step)
        model.train()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    for name, value in frozen.items():
        assert torch.equal(dict(model.named_parameters())[name], value), f"frozen {name} changed"
    return losses, grads


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("targets", [LORA_TARGETS, ["q_proj", "v_proj", "lm_head"]], ids=["layers", "with-lm_head"])
def test_peft_lora_over_patched_base(restore_patches, targets):
    steps = 1 if "lm_head" in targets else 2  # the lm_head case checks the fallback only: one step
    plain_losses, plain_grads = train_lora(lora_model(stack_worker.tiny_llama(), targets), steps)
    assert all(g.abs().sum() > 0 for g in plain_grads.values())

    model = lora_model(patched_tiny_llama(), targets)
    before = launches()
    losses, grads = train_lora(model, steps)
    ran = delta(before, launches())
    for step, (got, want) in enumerate(zip(losses, plain_losses)):
        assert_close(got, want, F32, f"LoRA {targets}: loss of step {step}")
    assert set(grads) == set(plain_grads) and len(grads) == 2 * len(targets)  # lora_A and lora_B, one layer
    for name, grad in plain_grads.items():
        assert_close(grads[name], grad, F32, f"LoRA {targets}: grad {name}")
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert ran.get(f"{kernel}_fwd", 0) > 0, (kernel, ran)
    if "lm_head" in targets:
        # a LoRA-wrapped lm_head is not a plain nn.Linear: lm_head and the loss run as the model defines them
        assert "fused_linear_cross_entropy_fwd" not in ran, ran
    else:
        assert ran.get("fused_linear_cross_entropy_fwd") == steps and ran.get("fused_linear_cross_entropy_bwd") == steps, ran


def test_apply_after_accelerate_hooks_runs_the_kernels(restore_patches):
    """A model loaded with device_map / offloading carries accelerate hooks that call the forward each
    module had when the hook was added (module._old_forward). autopatch.apply() afterwards must still
    reach those modules: same loss and gradients as plain, and the module kernels run."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    ids, labels = batch()
    plain = train_step(stack_worker.tiny_llama(), ids, labels)
    model = stack_worker.tiny_llama()
    for module in model.modules():
        if module is not model and not list(module.children()):  # leaves, as device_map="auto" does
            accelerate_hooks.add_hook_to_module(module, accelerate_hooks.ModelHook())
        elif type(module).__name__.endswith(("MLP", "RMSNorm")):
            accelerate_hooks.add_hook_to_module(module, accelerate_hooks.ModelHook())
    import autopatch

    autopatch.apply(model)
    before = launches()
    got = train_step(model, ids, labels)
    ran = delta(before, launches())
    assert_same(got, plain, "apply() after accelerate hooks vs plain")
    # (a hooked lm_head makes the fused linear CE step aside, by design: the hook may move its weight)
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert ran.get(f"{kernel}_fwd", 0) > 0, (kernel, ran)
