"""fused_kernels.moe_experts against a float64 per-expert loop (the formula of transformers' eager experts)."""


import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fused_kernels
from fused_kernels._gpu import OFF_GPU, DeviceFacts
from tests.helpers import plan, poisoned_outputs

from fused_kernels.ops import moe_experts as mod
from fused_kernels.ops import moe_experts_config as cfg_mod

ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}


def reference(hidden, idx, w, gate_up, down, activation, transposed):
    """The experts' output as transformers' eager loop computes it, one expert at a time."""
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(idx == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(ACT[activation](gate) * up, down[e]) * w[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def make(n_tokens, hidden, width, n_experts, k, dtype, transposed=False, empty_expert=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=g)
    scores = torch.rand(n_tokens, n_experts, generator=g)
    if empty_expert:
        scores[:, n_experts - 1] = -1.0  # one expert gets no token: its weight gradients must be exact zeros
    w, idx = torch.softmax(scores, -1).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
    gate_up = torch.randn(n_experts, 2 * width, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(n_experts, hidden, width, generator=g) / width ** 0.5
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, gate_up, down)]
    return leaves[0], idx, leaves[1], leaves[2], leaves[3]


def run(fn, x, idx, w, gate_up, down, dout, **kw):
    out = fn(x, idx, w, gate_up, down, **kw)
    grads = torch.autograd.grad(out, (x, w, gate_up, down), dout)
    return out, grads


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("width,path", [(16, "grouped_mm"), (10, "loop")])
def test_matches_float64_loop_fp32(activation, transposed, width, path):
    x, idx, w, gate_up, down = make(24, 32, width, 5, 2, torch.float32, transposed)
    dout = torch.randn(24, 32)
    assert mod._plan_for(x.detach(), 48, width, *mod._views(gate_up, down, transposed)).path == path
    with poisoned_outputs(mod):
        out, grads = run(fused_kernels.moe_experts, x, idx, w, gate_up, down, dout, activation=activation,
                         transposed=transposed)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
    ref, ref_grads = run(reference, leaves64[0], idx, *leaves64[1:], dout.double(), activation=activation,
                         transposed=transposed)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    assert rel(out, ref) < 1e-5
    for name, got, want in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        assert want.abs().max() > 0, name
        assert rel(got, want) < 1e-5, name
    unused = gate_up.shape[0] - 1  # the expert no token chose
    assert grads[2][unused].abs().max() == 0 and grads[3][unused].abs().max() == 0


@pytest.mark.parametrize("k", [1, 3])
def test_bf16_within_1e2(k):
    x, idx, w, gate_up, down = make(40, 64, 32, 6, k, torch.bfloat16, empty_expert=False, seed=k)
    dout = torch.randn(40, 64).bfloat16()
    out, grads = run(fused_kernels.moe_experts, x, idx, w, gate_up, down, dout)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
    ref, ref_grads = run(reference, leaves64[0], idx, *leaves64[1:], dout.double(), activation="silu",
                         transposed=False)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and rel(got, want) < 1e-2


def test_frozen_weights_and_3d_hidden():
    """LoRA-style: expert weights frozen (no weight gradients computed); hidden of shape (B, T, H)."""
    x, idx, w, gate_up, down = make(12, 16, 8, 4, 2, torch.float32)
    gate_up.requires_grad_(False)
    down.requires_grad_(False)
    x3, idx3, w3 = x.detach().view(3, 4, 16).requires_grad_(), idx.view(3, 4, 2), w.detach().view(3, 4, 2)
    out = fused_kernels.moe_experts(x3, idx3, w3, gate_up, down)
    assert out.shape == (3, 4, 16)
    ref = reference(x.detach().double(), idx, w.detach().double(), gate_up.double(), down.double(), "silu", False)
    assert rel(out.view(12, 16), ref) < 1e-5
    (dx,) = torch.autograd.grad(out.square().sum(), x3)
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, idx, w.detach().double(), gate_up.double(), down.double(), "silu", False)
    (dx64,) = torch.autograd.grad(ref.square().sum(), x64)
    assert rel(dx.view(12, 16), dx64) < 1e-5


def test_deterministic():
    x, idx, w, gate_up, down = make(32, 16, 8, 4, 2, torch.float32, empty_expert=False)
    dout = torch.randn(32, 16)
    first = run(fused_kernels.moe_experts, x, idx, w, gate_up, down, dout)
    second = run(fused_kernels.moe_experts, x, idx, w, gate_up, down, dout)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_bad_inputs_say_what_is_expected():
    x, idx, w, gate_up, down = make(4, 16, 8, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="gate_up_proj and down_proj must be"):
        fused_kernels.moe_experts(x, idx, w, down, gate_up)  # swapped
    with pytest.raises(ValueError, match="top_k_index and top_k_weights"):
        fused_kernels.moe_experts(x, idx[:, :1], w, gate_up, down)
    with pytest.raises(ValueError, match="activation"):
        fused_kernels.moe_experts(x, idx, w, gate_up, down, activation="relu")


def test_plan_names_the_path():
    h200 = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)
    a100 = DeviceFacts(cuda=True, sm_count=108, capability=(8, 0), smem_per_sm=167936, gluon=False)
    t4 = DeviceFacts(cuda=True, sm_count=40, capability=(7, 5), smem_per_sm=65536, gluon=False)
    assert plan(cfg_mod, 131072, 2048, 768, torch.bfloat16, device=h200).path == "grouped_mm"
    assert plan(cfg_mod, 131072, 2048, 768, torch.bfloat16, device=a100).path == "grouped_mm"
    assert plan(cfg_mod, 131072, 2048, 768, torch.bfloat16, device=t4).path == "loop"
    assert "bfloat16" in plan(cfg_mod, 1024, 2048, 768, torch.float16, device=h200).reason
    assert plan(cfg_mod, 1024, 2048, 768, torch.bfloat16, device=h200, aligned=False).path == "loop"
    assert plan(cfg_mod, 0, 2048, 768, torch.bfloat16, device=h200).path == "loop"
    assert plan(cfg_mod, 1024, 2048, 768, torch.float32, device=OFF_GPU).path == "grouped_mm"
    assert plan(cfg_mod, 1024, 2048, 768, torch.float16, device=OFF_GPU).path == "loop"
    cfg = plan(cfg_mod, 131072, 2048, 768, torch.bfloat16, device=h200).config
    assert (cfg.combine_block, cfg.bwd_block_n, cfg.bwd_block_m) == (2048, 1024, 2)


def test_opcheck_and_compile_fullgraph():
    x, idx, w, gate_up, down = make(8, 16, 8, 3, 2, torch.float32)
    torch.library.opcheck(torch.ops.fused_kernels.moe_experts_fwd.default,
                          (x.detach(), idx, w.detach(), gate_up.detach(), down.detach(), 0, False),
                          test_utils=("test_schema", "test_faketensor"))

    def block(x, idx, w, gate_up, down):
        return fused_kernels.moe_experts(x, idx, w, gate_up, down).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # raises on a graph break
    got = compiled(x, idx, w, gate_up, down)
    assert torch.allclose(got, block(x, idx, w, gate_up, down), rtol=1e-6)
    leaves = (x, w, gate_up, down)
    compiled_grads = torch.autograd.grad(got, leaves)  # the backward traced too
    eager_grads = torch.autograd.grad(block(x, idx, w, gate_up, down), leaves)
    for got_g, want_g in zip(compiled_grads, eager_grads):
        assert want_g.abs().max() > 0 and torch.allclose(got_g, want_g, rtol=1e-5, atol=1e-6)


def _backward_args(n_tokens=8, hidden=16, width=8, n_experts=3, k=2):
    x, idx, w, gate_up, down = make(n_tokens, hidden, width, n_experts, k, torch.float32)
    x, w, gate_up, down = (t.detach() for t in (x, w, gate_up, down))
    _, gu, perm, inv, offsets = torch.ops.fused_kernels.moe_experts_fwd(x, idx, w, gate_up, down, 0, False)
    return (torch.randn(n_tokens, hidden), x, w, gate_up, down, gu, perm, inv, offsets, 0, False, True, True, True)


@pytest.mark.parametrize("op", ["moe_experts_bwd", "moe_experts_bwd_into_gu"])
def test_opcheck_backward_ops(op):
    """Both backward ops: their schemas (moe_experts_bwd_into_gu declares that it writes gu) and fakes."""
    torch.library.opcheck(getattr(torch.ops.fused_kernels, op).default, _backward_args(),
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_into_gu_equals_the_backward_that_keeps_it():
    args = _backward_args()
    kept = torch.ops.fused_kernels.moe_experts_bwd(*args)
    gu = args[5].clone()
    into = torch.ops.fused_kernels.moe_experts_bwd_into_gu(*args[:5], gu, *args[6:])
    assert all(torch.equal(a, b) for a, b in zip(kept, into))
    assert not torch.equal(gu, args[5])  # gu now holds its gradient


def test_retained_graph_runs_its_backward_again():
    """retain_graph=True keeps gu for the next backward (no gradient is written over it); the last
    backward, which frees the graph, writes over it. Every one equals the float64 loop."""
    x, idx, w, gate_up, down = make(24, 32, 16, 5, 2, torch.float32)
    dout = torch.randn(24, 32)
    leaves = (x, w, gate_up, down)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(leaves64[0], idx, *leaves64[1:], activation="silu", transposed=False)
    want = torch.autograd.grad(ref, leaves64, dout.double())
    with poisoned_outputs(mod):
        out = fused_kernels.moe_experts(*leaves[:1], idx, *leaves[1:])
        runs = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(2)]
        runs.append(torch.autograd.grad(out, leaves, dout))
    for grads in runs:
        for name, got, ref_g in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), grads, want):
            assert torch.isfinite(got).all() and ref_g.abs().max() > 0, name
            assert rel(got, ref_g) < 1e-5, name


# ----------------------------------------------------------------------------------------------
# Memory: what the forward keeps for the backward, and the backward's high-water mark


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages made since it started (an op's outputs that share no input's storage)
    and still alive, after each op, and their high-water mark. The experts' custom ops run their Python bodies under it (their kernels do not run:
    the buffers are what is measured), so the allocations inside them count one by one."""

    def __init__(self):
        super().__init__()
        self.ops = {torch.ops.fused_kernels.moe_experts_bwd.default: lambda *a: mod._backward(*a, gu_scratch=False),
                    torch.ops.fused_kernels.moe_experts_bwd_into_gu.default:
                        lambda *a: mod._backward(*a, gu_scratch=True)}
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            with self:
                return self.ops[func](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for key, (n, ref) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= n
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:  # views and in-place results share an input's storage: not made here
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live.keys() | inputs:
                storage = t.untyped_storage()
                self.live[storage._cdata] = (storage.nbytes(), StorageWeakRef(storage))
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
        return out


def _storage_bytes(tensors):
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("transposed", [False, True])
def test_saved_for_backward_is_gu_and_the_routing(transposed):
    """What autograd keeps beyond the op's inputs (saved_tensors_hooks see every saved tensor): gu
    (S × 2I), perm and inv (S int64 each), offsets (E int32); never x_s, h or y."""
    n_tokens, hidden, width, n_experts, k = 40, 32, 24, 6, 3
    x, idx, w, gate_up, down = make(n_tokens, hidden, width, n_experts, k, torch.float32, transposed)
    inputs = {t.untyped_storage()._cdata for t in (x, idx, w, gate_up, down)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_kernels.moe_experts(x, idx, w, gate_up, down, transposed=transposed)
    new = [t for t in saved if t.untyped_storage()._cdata not in inputs]
    rows, elem = n_tokens * k, x.element_size()
    gu_bytes = rows * 2 * width * elem
    claimed = gu_bytes + 2 * rows * 8 + n_experts * 4
    assert _storage_bytes(new) == claimed, (sorted((tuple(t.shape), t.dtype) for t in new), claimed)
    assert any(tuple(t.shape) == (rows, 2 * width) for t in new)  # the measurement sees gu


@pytest.mark.parametrize("transposed", [False, True])
def test_backward_high_water_mark(transposed, monkeypatch):
    """The backward's high-water mark: its gradients plus one S × H buffer (x_s, or dx_s) and S-long
    vectors; no S × 2I buffer (neither zeros for gu's gradient nor a separate dgu: it goes over gu). With
    retain_graph=True, where gu must stay, the S × 2I dgu is made, which shows the measurement sees it."""
    monkeypatch.setattr(mod, "launch", lambda *args, **kwargs: None)  # bytes are measured, not values
    n_tokens, hidden, width, n_experts, k = 32, 16, 64, 4, 2
    x, idx, w, gate_up, down = make(n_tokens, hidden, width, n_experts, k, torch.float32, transposed)
    leaves = (x, w, gate_up, down)
    rows, elem = n_tokens * k, x.element_size()
    row_by_2i = rows * 2 * width * elem
    for retain in (True, False):
        out = fused_kernels.moe_experts(x, idx, w, gate_up, down, transposed=transposed)
        dout = torch.randn(n_tokens, hidden)
        meter = _LiveBytes()
        with meter:
            grads = torch.autograd.grad(out, leaves, dout, retain_graph=retain)
        beyond = meter.peak - _storage_bytes(grads)
        if retain:
            assert beyond >= row_by_2i, (meter.peak, beyond)
        else:
            assert beyond <= rows * hidden * elem + rows * 24 + 1024, (meter.peak, beyond, row_by_2i)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_grouped_gemm_bf16_against_fp32(transposed):
    """Qwen3-30B-A3B's expert sizes at 2048 tokens, bf16 on the grouped-GEMM path, against the float32
    per-expert loop; one expert with no token (its weight gradients must be exact zeros), the memory
    the op keeps for its backward and the backward's high-water mark."""
    device = torch.device("cuda")
    tokens, hidden, width, n_experts, k = 2048, 2048, 768, 128, 8
    x, idx, w, gate_up, down = make(tokens, hidden, width, n_experts, k, torch.float32, transposed)
    leaves = [t.detach().to(device) for t in (x, w, gate_up, down)]
    idx = idx.to(device)
    dout = torch.randn(tokens, hidden, device=device)
    bf = [t.bfloat16().requires_grad_() for t in leaves]
    assert mod._plan_for(bf[0].detach(), tokens * k, width, *mod._views(bf[2], bf[3], transposed)).path == "grouped_mm"
    dout_bf = dout.bfloat16()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with poisoned_outputs(mod):
        out = fused_kernels.moe_experts(bf[0], idx, bf[1], bf[2], bf[3], transposed=transposed)
        kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before_backward = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(out, bf, dout_bf)
        backward_peak = torch.cuda.max_memory_allocated() - before_backward
    rows = tokens * k
    # gu (tokens·k × 2I) plus the routing: never x_s, h or y
    assert kept <= rows * 2 * width * 2 + rows * 16 + (4 << 20), kept
    # the backward: its gradients, one rows × H buffer and rows-long vectors; no rows × 2I buffer (48 MiB
    # here: zeros for gu's gradient, or dgu beside gu) beyond 16 MiB of slack for the GEMMs' workspaces
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    allowed = grad_bytes + rows * hidden * 2 + rows * 32 + (16 << 20)
    assert backward_peak <= allowed, (f"backward peak {backward_peak / 2**20:.1f} MiB above its start, allowed "
                                      f"{allowed / 2**20:.1f} MiB (gradients {grad_bytes / 2**20:.1f} MiB)")
    f32 = [t.clone().requires_grad_() for t in leaves]
    ref = reference(f32[0], idx, f32[1], f32[2], f32[3], "silu", transposed)
    ref_grads = torch.autograd.grad(ref, f32, dout)
    assert rel(out, ref) < 1e-2
    for name, got, want in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) < 1e-2, name
    unused = n_experts - 1
    assert grads[2][unused].abs().max() == 0 and grads[3][unused].abs().max() == 0


# ----------------------------------------------------------------------------------------------
# A whole model: where the saved gu comes from changes (a checkpointed layer's recomputation, a
# saved-tensor hook's copy); the backward writes its gradient over whichever copy it is handed


def _train_step(model, inputs, mode):
    """(loss, {name: grad}) of one training step under `mode`."""
    model.zero_grad(set_to_none=True)
    model.train()
    if mode.startswith("checkpoint"):
        kwargs = {"use_reentrant": mode.endswith("reentrant")}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t) if mode == "saved_copies"
             else contextlib.nullcontext())
    with hooks:
        loss = model(**inputs).loss
    loss.backward()
    if mode.startswith("checkpoint"):
        getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("mode", ["plain", "checkpoint", "checkpoint_reentrant", "saved_copies"])
def test_qwen3_moe_model_equals_transformers(mode):
    """A tiny Qwen3-MoE with the fused experts against transformers' own experts (grouped_mm), fp32: the
    loss and every parameter gradient within 1e-5, plainly, under gradient checkpointing (non-reentrant
    and reentrant) and under saved-tensor hooks that hand back copies (what AUTOPATCH_OFFLOAD does)."""
    pytest.importorskip("transformers")
    import autopatch
    import tiny_models
    from helpers import assert_close

    arch = next(a for a in tiny_models.causal_lm_architectures() if a.class_name == "Qwen3MoeForCausalLM")
    model = tiny_models.build_tiny(arch)
    model.set_experts_implementation("grouped_mm")
    inputs = tiny_models.smoke_inputs(model)
    ref_loss, ref_grads = _train_step(model, inputs, "plain")
    autopatch.apply(model, swiglu=True)
    before = fused_kernels.launch_counts().get("moe_experts_bwd", 0)
    loss, grads = _train_step(model, inputs, mode)
    n_layers = sum(type(m).__name__ == "Qwen3MoeExperts" for m in model.modules())
    assert fused_kernels.launch_counts().get("moe_experts_bwd", 0) - before >= n_layers
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        assert_close(grads[name], ref, torch.float32, f"grad {name}")


@pytest.mark.slow
def test_real_shape_experts_backward_accounted(tmp_path):
    """benchmarks/moe_memory.py on bench_e2e's Qwen3-30B-A3B step (fake tensors, seconds): in layer 0's
    experts backward, where that step peaks, the memory above the backward's start stays within its
    gradients plus one S × H buffer and S-long vectors (1732 MiB; 2435 before dgu went over gu and gu's
    gradient stopped being a tensor of zeros); the forward keeps gu and the routing (386 MiB)."""
    pytest.importorskip("transformers")
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "moe_memory.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "moe_memory.py"), "--peers", "ours",
                           "--trace", "model.layers.0.mlp.experts", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (res,) = json.loads(out.read_text())
    tokens, hidden, width, n_experts, k = 16384, 2048, 768, 128, 8
    rows, mib = tokens * k, 2**20
    backward = [e for e in res["trace"] if e["at"].startswith("bwd")]
    assert backward, res["trace"][:5]
    start = backward[0]["live_mib"] - backward[0]["mib"]
    above = max(e["live_mib"] for e in backward) - start
    grads = (n_experts * 3 * width * hidden + tokens * hidden) * 2
    assert above <= (grads + rows * hidden * 2 + rows * 32) / mib, (above, backward)  # + S-long vectors
    kept = res["after_forward_by_module_mib"]["model.layers.0.mlp.experts"]
    assert kept <= (rows * 2 * width * 2 + 2 * rows * 8 + n_experts * 4) / mib + 0.1, kept
