"""fused_kernels.moe_experts against a float64 per-expert loop (the formula of transformers' eager experts)."""


import pytest
import torch
import torch.nn.functional as F

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


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_grouped_gemm_bf16_against_fp32(transposed):
    """Qwen3-30B-A3B's expert sizes at 2048 tokens, bf16 on the grouped-GEMM path, against the float32
    per-expert loop; one expert with no token (its weight gradients must be exact zeros), and the
    memory the op keeps for its backward."""
    device = torch.device("cuda")
    tokens, hidden, width, n_experts, k = 2048, 2048, 768, 128, 8
    x, idx, w, gate_up, down = make(tokens, hidden, width, n_experts, k, torch.float32, transposed)
    leaves = [t.detach().to(device) for t in (x, w, gate_up, down)]
    idx = idx.to(device)
    dout = torch.randn(tokens, hidden, device=device)
    bf = [t.bfloat16().requires_grad_() for t in leaves]
    assert mod._plan_for(bf[0].detach(), tokens * k, width, *mod._views(bf[2], bf[3], transposed)).path == "grouped_mm"
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with poisoned_outputs(mod):
        out = fused_kernels.moe_experts(bf[0], idx, bf[1], bf[2], bf[3], transposed=transposed)
        kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        grads = torch.autograd.grad(out, bf, dout.bfloat16())
    # gu (tokens·k × 2I) plus the routing: never x_s, h or y
    assert kept <= tokens * k * 2 * width * 2 + tokens * k * 16 + (4 << 20), kept
    f32 = [t.clone().requires_grad_() for t in leaves]
    ref = reference(f32[0], idx, f32[1], f32[2], f32[3], "silu", transposed)
    ref_grads = torch.autograd.grad(ref, f32, dout)
    assert rel(out, ref) < 1e-2
    for name, got, want in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) < 1e-2, name
    unused = n_experts - 1
    assert grads[2][unused].abs().max() == 0 and grads[3][unused].abs().max() == 0
