"""fused_kernels.rope against a float64 transcription of transformers' apply_rotary_pos_emb.

Covers both layouts, (seq, rot) and (batch, seq, rot) cos/sin (with broadcasting), GQA head counts,
partial rotary, the interleaved variant, non-contiguous q/k/cos/grad, fp32/bf16/fp16 (cos in its own
dtype), gradients against float64 autograd, the custom ops (opcheck, torch.compile fullgraph), errors,
empty inputs, and one real-size check on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_kernels
from helpers import assert_close, plan, poison_

from fused_kernels._dispatch import Path
from fused_kernels._gpu import OFF_GPU, DeviceFacts
from fused_kernels.ops import rope as rope_module
from fused_kernels.ops import rope_config

H200 = DeviceFacts(True, 132, (9, 0), 233472, True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------------------
# Reference: the HF formula, in float64
# ---------------------------------------------------------------------------------------------------------


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def reference_rope(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    """q*cos + rotate(q)*sin on the first rot channels, the rest passed through; all in float64.
    A (seq, rot) cos broadcasts over batch, whatever the layout."""
    cos, sin = cos.to(torch.float64), sin.to(torch.float64)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    rotate = rotate_half_interleaved if interleaved else rotate_half

    def apply(x):
        x = x.to(torch.float64)
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

STORAGES = ["contiguous", "transposed", "offset_slice", "strided_channels"]


def make_qk(batch, heads, seq, head_dim, unsqueeze_dim, dtype, storage, device):
    """Random q or k of logical shape given by the layout, stored as `storage` says:
    contiguous; transposed (the HF pattern: projection output viewed (b, s, h, d) then transpose(1, 2));
    offset_slice (channels [3, 3+head_dim) of a wider buffer: unaligned base, head stride != head_dim);
    strided_channels (every other channel of a 2x wider buffer: last-dim stride 2)."""
    logical = (batch, heads, seq, head_dim) if unsqueeze_dim == 1 else (batch, seq, heads, head_dim)
    if storage == "contiguous":
        t = torch.randn(logical)
    elif storage == "transposed":
        other = (logical[0], logical[2], logical[1], logical[3])
        t = torch.randn(other).transpose(1, 2)
    elif storage == "offset_slice":
        t = torch.randn(*logical[:3], head_dim + 5)[..., 3 : 3 + head_dim]
    else:
        t = torch.randn(*logical[:3], 2 * head_dim)[..., ::2]
    assert t.shape == logical
    return t.to(dtype=dtype, device=device)


def make_cos_sin(batch, seq, rot, cos_shape, dtype, device, generator=None):
    """Random cos and sin (their two halves differ, so a wrong pairing shows), shaped
    "seq" (seq, rot), "batch" (batch, seq, rot), "batch1" (1, seq, rot), "expanded" (1, seq, rot)
    expanded to batch (stride 0), or "sliced" (a channel slice of a wider buffer)."""
    def one():
        if cos_shape == "seq":
            return torch.randn(seq, rot)
        if cos_shape == "batch":
            return torch.randn(batch, seq, rot)
        if cos_shape == "batch1":
            return torch.randn(1, seq, rot)
        if cos_shape == "expanded":
            return torch.randn(1, seq, rot).expand(batch, seq, rot)
        return torch.randn(batch, seq, rot + 4)[..., 2 : 2 + rot]
    return one().to(dtype=dtype, device=device), one().to(dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_outputs():
    """Make every output buffer the op allocates start as NaN, so unwritten elements fail the comparison."""
    original = rope_module._new_output

    def poisoned(*args):
        return poison_(original(*args))

    rope_module._new_output = poisoned
    try:
        yield
    finally:
        rope_module._new_output = original


@contextlib.contextmanager
def forced_config(tiles):
    """Force (tokens per program, q heads per tile, k heads per tile), so that small test shapes still run
    several programs and several head tiles with ragged ends; None keeps the real configuration."""
    if tiles is None:
        yield
        return
    original = rope_config._CONFIG["force"]
    rope_config._CONFIG["force"] = rope_config.RopeConfig(*tiles, num_warps=4)
    try:
        yield
    finally:
        rope_config._CONFIG["force"] = original


def check_against_reference(q, k, cos, sin, unsqueeze_dim, interleaved, grad_storage="contiguous"):
    """Forward and both gradients of fused_kernels.rope vs float64 autograd of the reference."""
    q_in = q.detach().clone()
    k_in = k.detach().clone()
    q = q.detach().requires_grad_(True)
    k = k.detach().requires_grad_(True)
    with poisoned_outputs():
        q_out, k_out = fused_kernels.rope(q, k, cos, sin, unsqueeze_dim, interleaved=interleaved)

    q64 = q_in.to(torch.float64).requires_grad_(True)
    k64 = k_in.to(torch.float64).requires_grad_(True)
    ref_q, ref_k = reference_rope(q64, k64, cos, sin, unsqueeze_dim, interleaved)

    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    assert_close(q_out, ref_q, q.dtype, "q_out")
    assert_close(k_out, ref_k, k.dtype, "k_out")
    # Inputs untouched (the op returns new tensors).
    assert torch.equal(q.detach(), q_in) and torch.equal(k.detach(), k_in)

    # Random upstream gradients, possibly non-contiguous.
    def upstream(t):
        b, x, y, d = t.shape
        if grad_storage == "transposed":
            return torch.randn(b, y, x, d).to(t.dtype).transpose(1, 2)
        return torch.randn(t.shape).to(t.dtype)

    g_q, g_k = upstream(q_out), upstream(k_out)
    with poisoned_outputs():
        grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k))
    ref_grad_q, ref_grad_k = torch.autograd.grad(
        (ref_q, ref_k), (q64, k64), (g_q.to(torch.float64), g_k.to(torch.float64))
    )
    assert_close(grad_q, ref_grad_q, q.dtype, "grad q")
    assert_close(grad_k, ref_grad_k, k.dtype, "grad k")


# ---------------------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------------------


@st.composite
def rope_cases(draw):
    head_dim = draw(st.sampled_from([2, 8, 16, 64, 96]))
    rot = draw(st.sampled_from([head_dim, *range(2, head_dim, 2)]))
    dtype = draw(st.sampled_from(DTYPES))
    return dict(
        batch=draw(st.integers(1, 2)),
        q_heads=draw(st.integers(1, 4)),
        k_heads=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, 9)),
        head_dim=head_dim,
        rot=rot,
        unsqueeze_dim=draw(st.sampled_from([1, 2])),
        cos_shape=draw(st.sampled_from(["seq", "batch", "batch1", "expanded", "sliced"])),
        dtype=dtype,
        cos_dtype=draw(st.sampled_from([dtype, torch.float32])),
        interleaved=draw(st.booleans()),
        q_storage=draw(st.sampled_from(STORAGES)),
        k_storage=draw(st.sampled_from(STORAGES)),
        grad_storage=draw(st.sampled_from(["contiguous", "transposed"])),
        tiles=draw(st.sampled_from([None, (1, 1, 1), (2, 2, 1), (4, 1, 2)])),
        seed=draw(st.integers(0, 2**31 - 1)),  # the data too is part of the example, so a failure replays
    )


# `device` is a plain value (no state to reset between examples).
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=rope_cases())
def test_matches_reference_random_shapes(case, device):
    c = case
    torch.manual_seed(c["seed"])
    q = make_qk(c["batch"], c["q_heads"], c["seq"], c["head_dim"], c["unsqueeze_dim"], c["dtype"], c["q_storage"], device)
    k = make_qk(c["batch"], c["k_heads"], c["seq"], c["head_dim"], c["unsqueeze_dim"], c["dtype"], c["k_storage"], device)
    cos, sin = make_cos_sin(c["batch"], c["seq"], c["rot"], c["cos_shape"], c["cos_dtype"], device)
    with forced_config(c["tiles"]):
        check_against_reference(q, k, cos, sin, c["unsqueeze_dim"], c["interleaved"], c["grad_storage"])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout_dtype_and_variant(dtype, unsqueeze_dim, interleaved, device):
    """Each axis at least once, whatever hypothesis draws: GQA 4/2 heads, partial rotary 16 of 24,
    the HF transposed storage for q, (batch, seq, rot) cos in fp32."""
    q = make_qk(2, 4, 7, 24, unsqueeze_dim, dtype, "transposed", device)
    k = make_qk(2, 2, 7, 24, unsqueeze_dim, dtype, "contiguous", device)
    cos, sin = make_cos_sin(2, 7, 16, "batch", torch.float32, device)
    check_against_reference(q, k, cos, sin, unsqueeze_dim, interleaved, "transposed")


def test_more_tokens_than_one_program(device):
    """Enough tokens that several programs run, with a ragged last block."""
    cfg = rope_config.heuristic_config(2 * 37, 3, 1, 16)
    assert 2 * 37 > cfg.block_t and (2 * 37) % cfg.block_t != 0
    q = make_qk(2, 3, 37, 16, 1, torch.float32, "transposed", device)
    k = make_qk(2, 1, 37, 16, 1, torch.float32, "contiguous", device)
    cos, sin = make_cos_sin(2, 37, 16, "seq", torch.float32, device)
    check_against_reference(q, k, cos, sin, 1, False)


def test_more_heads_than_one_tile(device):
    """More heads than one tile holds, so the loop over head tiles runs several times (with a ragged end)."""
    tile = rope_config.heuristic_config(3, 1000, 1000, 64).block_hq
    n_q, n_k = 2 * tile + 3, tile + 1
    cfg = rope_config.heuristic_config(3, n_q, n_k, 64)
    assert cfg.block_hq == tile and cfg.block_hk == tile
    q = make_qk(1, n_q, 3, 64, 2, torch.bfloat16, "contiguous", device)
    k = make_qk(1, n_k, 3, 64, 2, torch.bfloat16, "offset_slice", device)
    cos, sin = make_cos_sin(1, 3, 32, "batch", torch.bfloat16, device)
    check_against_reference(q, k, cos, sin, 2, False)


def test_q_and_k_with_different_head_dims_and_dtypes(device):
    q = make_qk(2, 3, 5, 32, 1, torch.float32, "contiguous", device)
    k = make_qk(2, 1, 5, 16, 1, torch.bfloat16, "transposed", device)
    cos, sin = make_cos_sin(2, 5, 12, "batch", torch.float16, device)
    check_against_reference(q, k, cos, sin, 1, True)


def test_cos_with_seq_one_broadcasts(device):
    q = make_qk(2, 2, 6, 8, 1, torch.float32, "contiguous", device)
    k = make_qk(2, 1, 6, 8, 1, torch.float32, "contiguous", device)
    cos, sin = torch.randn(2, 1, 8, device=device), torch.randn(2, 1, 8, device=device)
    check_against_reference(q, k, cos, sin, 1, False)


@pytest.mark.parametrize("model", ["llama", "cohere"])
def test_equals_transformers_apply_rotary_pos_emb(model, device):
    """The real HF functions with the real HF cos/sin construction (cat or repeat_interleave of the
    frequencies, position_ids per batch), bf16 q/k as HF feeds them."""
    mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    batch, seq, head_dim = 2, 6, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.stack([torch.arange(seq), torch.arange(3, 3 + seq)]).float()
    freqs = positions[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if model == "cohere" else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16).to(device), emb.sin().to(torch.bfloat16).to(device)
    q = make_qk(batch, 4, seq, head_dim, 1, torch.bfloat16, "transposed", device)
    k = make_qk(batch, 2, seq, head_dim, 1, torch.bfloat16, "transposed", device)
    hf_q, hf_k = mod.apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    q_out, k_out = fused_kernels.rope(q, k, cos, sin, interleaved=(model == "cohere"))
    assert_close(q_out, hf_q, torch.bfloat16, "q_out vs HF")
    assert_close(k_out, hf_k, torch.bfloat16, "k_out vs HF")


def test_double_backward(device):
    """rope_bwd is differentiable too (its gradient is the forward rotation)."""
    q = make_qk(1, 2, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    k = make_qk(1, 1, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    cos, sin = make_cos_sin(1, 3, 8, "batch", torch.float32, device)
    g_q = torch.randn(q.shape, device=device, requires_grad=True)
    g_k = torch.randn(k.shape, device=device, requires_grad=True)
    q_out, k_out = fused_kernels.rope(q, k, cos, sin)
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k), create_graph=True)
    w_q, w_k = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    gg = torch.autograd.grad((grad_q * w_q).sum() + (grad_k * w_k).sum(), (g_q, g_k))

    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    g_q64, g_k64 = g_q.detach().double().requires_grad_(True), g_k.detach().double().requires_grad_(True)
    r_q, r_k = reference_rope(q64, k64, cos, sin)
    rg_q, rg_k = torch.autograd.grad((r_q, r_k), (q64, k64), (g_q64, g_k64), create_graph=True)
    rgg = torch.autograd.grad((rg_q * w_q.double()).sum() + (rg_k * w_k.double()).sum(), (g_q64, g_k64))
    assert_close(gg[0], rgg[0], torch.float32, "grad of grad_q")
    assert_close(gg[1], rgg[1], torch.float32, "grad of grad_k")


@pytest.mark.parametrize(
    "q_shape, k_shape, cos_shape",
    [
        ((0, 2, 3, 8), (0, 1, 3, 8), (0, 3, 8)),   # no batch
        ((2, 2, 0, 8), (2, 1, 0, 8), (0, 8)),      # no tokens
        ((2, 0, 3, 8), (2, 1, 3, 8), (2, 3, 8)),   # no q heads
        ((2, 2, 3, 8), (2, 0, 3, 8), (2, 3, 8)),   # no k heads: q rotated alone (one-tensor functions, Gemma 4)
        ((1, 2, 3, 8), (1, 1, 3, 8), (3, 0)),      # rot 0: everything passes through
    ],
)
def test_empty_inputs(q_shape, k_shape, cos_shape, device):
    q = torch.randn(q_shape, device=device, requires_grad=True)
    k = torch.randn(k_shape, device=device, requires_grad=True)
    cos, sin = torch.randn(cos_shape, device=device), torch.randn(cos_shape, device=device)
    with poisoned_outputs():
        q_out, k_out = fused_kernels.rope(q, k, cos, sin)
    ref_q, ref_k = reference_rope(q.detach(), k.detach(), cos, sin)
    assert q_out.shape == q_shape and k_out.shape == k_shape
    assert_close(q_out, ref_q, torch.float32, "q_out")
    assert_close(k_out, ref_k, torch.float32, "k_out")
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q_shape and k.grad.shape == k_shape
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_launch_counts_one_kernel_each_way(device):
    q = make_qk(1, 2, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    k = make_qk(1, 1, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    cos, sin = make_cos_sin(1, 3, 8, "seq", torch.float32, device)
    before = fused_kernels.launch_counts()
    q_out, k_out = fused_kernels.rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    after = fused_kernels.launch_counts()
    assert after.get("rope_fwd", 0) - before.get("rope_fwd", 0) == 1
    assert after.get("rope_bwd", 0) - before.get("rope_bwd", 0) == 1


# ---------------------------------------------------------------------------------------------------------
# Autotuning (the GPU path), run on the CPU with a stand-in benchmark
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hq, hk, dim, tokens",
    [(32, 8, 128, 16384), (32, 32, 128, 4096), (16, 2, 64, 8192), (4, 1, 16, 1), (1, 1, 2, 7), (64, 8, 256, 4096),
     (128, 8, 128, 2048), (28, 4, 96, 100), (3, 1, 8, 20000)],
)
def test_autotune_candidates(hq, hk, dim, tokens):
    """For every shape the autotuner gets a short list of candidates, all in its static config list (so
    `_prune` returns exactly them), all valid tiles: powers of two, k tiles no wider than q tiles, at most
    32 values per thread, several tokens per program only when one token's heads fill less than the tile."""
    bucket = rope_config._token_bucket(tokens)
    cands = rope_config.candidate_configs(hq, hk, dim, bucket)
    assert 1 <= len(cands) <= 12, cands
    statics = rope_module._static_configs()
    kept = rope_config._prune(statics, dict(n_q_heads=hq, n_k_heads=hk, q_head_dim=dim, k_head_dim=dim,
                                            token_bucket=bucket))
    assert {rope_config._config_key(c.kwargs, c.num_warps) for c in kept} == {
        rope_config._config_key(c.meta(), c.num_warps) for c in cands}
    d = 1 << max(dim - 1, 1).bit_length()
    for c in cands:
        for v in (c.block_t, c.block_hq, c.block_hk, c.num_warps):
            assert v & (v - 1) == 0
        assert c.block_hk <= c.block_hq and c.block_t <= max(bucket, 1)
        assert c.block_t * c.block_hq * d // (32 * c.num_warps) <= 32
        if c.block_t > 1:
            assert c.block_hq >= hq


def test_autotuned_path_every_candidate_is_correct(device):
    """A device that is not interpreted hands the choice to triton.autotune: each candidate it times writes the
    right rotation into the real output buffers (so timing runs cannot corrupt them) and the winner's launch
    gives the reference, forward and backward."""
    q = make_qk(2, 4, 9, 16, 1, torch.float32, "transposed", device)
    k = make_qk(2, 2, 9, 16, 1, torch.float32, "contiguous", device)
    cos, sin = make_cos_sin(2, 9, 16, "batch1", torch.float32, device)
    g_q, g_k = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
    ref_q, ref_k = reference_rope(q64, k64, cos, sin)
    ref_gq, ref_gk = torch.autograd.grad((ref_q, ref_k), (q64, k64), (g_q.double(), g_k.double()))
    buffers, snapshots = [], []
    counter = iter(range(10**6))
    original_new_output = rope_module._new_output

    def recorded(x, order):
        buffers.append(original_new_output(x, order))
        return buffers[-1]

    def fake_bench(kernel_call, quantiles):
        for b in buffers[-2:]:
            b.fill_(float("nan"))
        kernel_call()
        snapshots.append([b.clone() for b in buffers[-2:]])
        t = 100.0 - next(counter)  # later candidates "faster": the winner is not simply the first
        return [t, t, t]

    tuned = rope_module._rope_tuned
    rope_module._new_output = recorded
    # a GPU's facts but the interpreter's kernels: plan() takes the autotune path, the kernels run on the CPU
    rope_config._CONFIG["device"] = DeviceFacts(cuda=False, sm_count=2, interpreted=False)
    rope_module.reset_autotuning()
    tuned.__dict__["do_bench"] = fake_bench  # shadows Autotuner.do_bench (a cached property)
    try:
        q_out, k_out = torch.ops.fused_kernels.rope_fwd(q, k, cos, sin, 1, False)
        n_fwd = len(snapshots)
        grad_q, grad_k = torch.ops.fused_kernels.rope_bwd(g_q, g_k, cos, sin, 1, False,
                                                           rope_module.memory_order(q), rope_module.memory_order(k))
        # Tuned once per key: a later call launches the chosen config directly, with the same result.
        n_timed = len(snapshots)
        again = torch.ops.fused_kernels.rope_fwd(q, k, cos, sin, 1, False)
        assert len(snapshots) == n_timed
        assert torch.equal(again[0], q_out) and torch.equal(again[1], k_out)
    finally:
        rope_module._new_output, rope_config._CONFIG["device"] = original_new_output, None
        rope_module.reset_autotuning()
        tuned.__dict__.pop("do_bench", None)
    assert n_fwd >= 2 and len(snapshots) - n_fwd >= 2
    for i, (sq, sk) in enumerate(snapshots):
        want_q, want_k = (ref_q, ref_k) if i < n_fwd else (ref_gq, ref_gk)
        assert_close(sq, want_q, torch.float32, f"candidate {i} q")
        assert_close(sk, want_k, torch.float32, f"candidate {i} k")
    for got, want, name in ((q_out, ref_q, "q_out"), (k_out, ref_k, "k_out"), (grad_q, ref_gq, "grad q"),
                            (grad_k, ref_gk, "grad k")):
        assert_close(got, want, torch.float32, name)


def test_eager_and_compiled_paths_agree(device):
    """Eager calls run the torch.autograd.Function (no custom-op dispatch); torch.compile traces the custom
    op. Both launch the kernel once forward and once backward and give the same bits."""
    torch._dynamo.reset()
    q0 = make_qk(2, 4, 5, 32, 1, torch.bfloat16, "transposed", device)
    k0 = make_qk(2, 2, 5, 32, 1, torch.bfloat16, "contiguous", device)
    cos, sin = make_cos_sin(2, 5, 32, "batch1", torch.bfloat16, device)
    g_q, g_k = torch.randn(q0.shape).to(torch.bfloat16), torch.randn(k0.shape).to(torch.bfloat16)

    def fn(q, k):
        return fused_kernels.rope(q, k, cos, sin, 1)

    results = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True, backend="aot_eager"))):
        q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        before = fused_kernels.launch_counts()
        q_out, k_out = f(q, k)
        if name == "eager":
            assert type(q_out.grad_fn).__name__ == "_RopeFunctionBackward"
        grads = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k))
        after = fused_kernels.launch_counts()
        for op in ("rope_fwd", "rope_bwd"):
            assert after.get(op, 0) - before.get(op, 0) == 1, (name, op)
        results[name] = (q_out.detach(), k_out.detach(), *grads)
    for got, want in zip(results["compiled"], results["eager"]):
        assert torch.equal(got, want)
    ref_q, ref_k = reference_rope(q0, k0, cos, sin)
    assert_close(results["eager"][0], ref_q, torch.bfloat16, "q_out")
    assert_close(results["eager"][1], ref_k, torch.bfloat16, "k_out")


def test_no_grad_call_skips_autograd(device):
    q = make_qk(1, 2, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    k = make_qk(1, 1, 3, 8, 1, torch.float32, "contiguous", device).requires_grad_(True)
    cos, sin = make_cos_sin(1, 3, 8, "seq", torch.float32, device)
    before = fused_kernels.launch_counts().get("rope_fwd", 0)
    with torch.no_grad():
        q_out, k_out = fused_kernels.rope(q, k, cos, sin)
    assert q_out.grad_fn is None and k_out.grad_fn is None
    assert fused_kernels.launch_counts().get("rope_fwd", 0) == before + 1
    ref_q, ref_k = reference_rope(q.detach(), k.detach(), cos, sin)
    assert_close(q_out, ref_q, torch.float32, "q_out")
    assert_close(k_out, ref_k, torch.float32, "k_out")


# ---------------------------------------------------------------------------------------------------------
# Custom ops: opcheck, torch.compile
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(interleaved, device):
    q = make_qk(2, 2, 3, 16, 2, torch.float32, "transposed", device).requires_grad_(True)
    k = make_qk(2, 1, 3, 16, 2, torch.float32, "contiguous", device).requires_grad_(True)
    cos, sin = make_cos_sin(2, 3, 8, "batch", torch.float32, device)
    torch.library.opcheck(torch.ops.fused_kernels.rope_fwd.default, (q, k, cos, sin, 2, interleaved))
    g_q, g_k = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    q_order, k_order = rope_module.memory_order(q), rope_module.memory_order(k)
    assert q_order == [0, 2, 1, 3] and k_order == [0, 1, 2, 3]
    torch.library.opcheck(
        torch.ops.fused_kernels.rope_bwd.default, (g_q, g_k, cos, sin, 2, interleaved, q_order, k_order)
    )


def test_outputs_and_gradients_keep_the_input_layout(device):
    """HF's pattern: q, k are transpose(1, 2) views of (batch, seq, heads, dim) projections. The outputs
    are views of the same kind, and the gradients reaching q and k have q's and k's strides (so the
    leaves' AccumulateGrad takes them without a copy); a contiguous q gives contiguous results."""
    q_leaf = torch.randn(2, 5, 4, 16, device=device, requires_grad=True)
    k_leaf = torch.randn(2, 5, 2, 16, device=device, requires_grad=True)
    q, k = q_leaf.transpose(1, 2), k_leaf.transpose(1, 2)
    cos, sin = make_cos_sin(2, 5, 16, "batch1", torch.float32, device)
    q_out, k_out = fused_kernels.rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    g_q, g_k = torch.randn(q_out.shape, device=device), torch.randn(k_out.shape, device=device)  # contiguous
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k))
    assert grad_q.stride() == q.stride() and grad_k.stride() == k.stride()
    ref_q, ref_k = reference_rope(q.detach(), k.detach(), cos, sin)
    assert_close(q_out, ref_q, torch.float32, "q_out")
    assert_close(k_out, ref_k, torch.float32, "k_out")

    q2 = torch.randn(2, 4, 5, 16, device=device, requires_grad=True)
    q2_out, _ = fused_kernels.rope(q2, k, cos, sin)
    assert q2_out.is_contiguous()
    (grad_q2,) = torch.autograd.grad(q2_out, q2, torch.randn(2, 5, 4, 16, device=device).transpose(1, 2))
    assert grad_q2.is_contiguous()


def test_torch_compile_fullgraph(device):
    """A function around rope compiles with no graph break (fullgraph=True raises on one), runs our
    kernels forward and backward, and gives the eager numbers."""
    torch._dynamo.reset()

    def attention_inputs(q, k, cos, sin):
        q_out, k_out = fused_kernels.rope(q, k, cos, sin, 1)
        return (q_out * 2.0).sum() + k_out.square().sum()

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")
    q = make_qk(2, 2, 5, 16, 1, torch.float32, "transposed", device).requires_grad_(True)
    k = make_qk(2, 1, 5, 16, 1, torch.float32, "contiguous", device).requires_grad_(True)
    cos, sin = make_cos_sin(2, 5, 16, "batch", torch.float32, device)
    before = fused_kernels.launch_counts()
    loss = compiled(q, k, cos, sin)
    loss.backward()
    after = fused_kernels.launch_counts()
    assert after.get("rope_fwd", 0) > before.get("rope_fwd", 0)
    assert after.get("rope_bwd", 0) > before.get("rope_bwd", 0)

    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    ref_q, ref_k = reference_rope(q64, k64, cos, sin)
    ref_loss = (ref_q * 2.0).sum() + ref_k.square().sum()
    ref_loss.backward()
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert_close(q.grad, q64.grad, torch.float32, "grad q")
    assert_close(k.grad, k64.grad, torch.float32, "grad k")


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def _args(**over):
    args = dict(
        q=torch.randn(2, 4, 5, 16), k=torch.randn(2, 2, 5, 16),
        cos=torch.randn(2, 5, 16), sin=torch.randn(2, 5, 16), unsqueeze_dim=1,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=torch.randint(0, 5, (2, 4, 5, 16))), r"^q must be float32"),
        (dict(k=torch.randn(2, 2, 5, 16).to(torch.float64)), r"^k must be float32"),
        (dict(cos=torch.randint(0, 5, (2, 5, 16))), r"^cos must be float32"),
        (dict(sin=torch.ones(2, 5, 16, dtype=torch.bool)), r"^sin must be float32"),
        (dict(interleaved=1), r"^interleaved must be a bool"),
    ],
)
def test_type_errors(over, match):
    with pytest.raises(TypeError, match=match):
        fused_kernels.rope(**_args(**over))


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(sin=torch.randn(2, 5, 8)), r"cos and sin must have the same shape"),
        (dict(cos=torch.randn(2, 5, 7), sin=torch.randn(2, 5, 7)), r"rot\) must be even"),
        (dict(cos=torch.randn(2, 5, 18), sin=torch.randn(2, 5, 18)), r"rot=18\) must be <= q's head_dim"),
        (dict(k=torch.randn(2, 2, 5, 8), cos=torch.randn(2, 5, 12), sin=torch.randn(2, 5, 12)), r"<= k's head_dim"),
        (dict(cos=torch.randn(2, 6, 16), sin=torch.randn(2, 6, 16)), r"cos/sin seq extent \(6\)"),
        (dict(cos=torch.randn(3, 5, 16), sin=torch.randn(3, 5, 16)), r"cos/sin batch extent \(3\)"),
        (dict(cos=torch.randn(1, 2, 5, 16), sin=torch.randn(1, 2, 5, 16)), r"cos and sin must be \(seq, rot\)"),
        (dict(k=torch.randn(2, 2, 6, 16)), r"q and k must share batch and seq"),
        (dict(k=torch.randn(1, 2, 5, 16)), r"q and k must share batch and seq"),
        (dict(q=torch.randn(2, 4, 5)), r"^q must be 4-D"),
        (dict(k=torch.randn(2, 2, 5, 16, 1)), r"^k must be 4-D"),
        (dict(unsqueeze_dim=0), r"^unsqueeze_dim must be 1"),
        (dict(unsqueeze_dim=3), r"^unsqueeze_dim must be 1"),
        (dict(unsqueeze_dim=True), r"^unsqueeze_dim must be 1"),
    ],
)
def test_value_errors(over, match):
    with pytest.raises(ValueError, match=match):
        fused_kernels.rope(**_args(**over))


def test_layout_is_read_from_unsqueeze_dim():
    """The same q is (batch 2, heads 4, seq 5) with unsqueeze_dim=1 and (batch 2, seq 4, heads 5) with
    unsqueeze_dim=2; a cos with seq 5 fits the first reading only."""
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 2, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"seq extent \(5\) must be 1 or q's seq \(4\)"):
        fused_kernels.rope(q, k, cos, sin, unsqueeze_dim=2)
    with pytest.raises(ValueError, match=r"q and k must share batch and seq"):
        fused_kernels.rope(q, k, cos, sin, unsqueeze_dim=1)


# ---------------------------------------------------------------------------------------------------------
# GPU, real size
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_real_size_llama3_8b_shape(interleaved):
    """q 4x32x4096x128 and k 4x8x4096x128 bf16, read through the HF transpose views, HF-built cos/sin
    (batch, seq, 128) bf16; forward and both gradients against an fp32 reference of the HF formula."""
    device = torch.device("cuda")
    batch, seq, head_dim = 4, 4096, 128
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, seq, 32, head_dim, device=device, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, seq, 8, head_dim, device=device, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    q.requires_grad_(True)
    k.requires_grad_(True)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[None, :, None].expand(batch, seq, 1) * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)

    q_out, k_out = fused_kernels.rope(q, k, cos, sin, 1, interleaved=interleaved)
    g_q = torch.randn(q_out.shape, device=device, generator=gen, dtype=torch.bfloat16)
    g_k = torch.randn(k_out.shape, device=device, generator=gen, dtype=torch.bfloat16)
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k))

    rotate = rotate_half_interleaved if interleaved else rotate_half
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    q32, k32 = q.detach().float(), k.detach().float()
    ref_q, ref_k = q32 * c + rotate(q32) * s, k32 * c + rotate(k32) * s
    # With equal cos/sin halves (cat or repeat_interleave of the frequencies) the gradient is the rotation by -sin.
    ref_gq, ref_gk = g_q.float() * c + rotate(g_q.float()) * -s, g_k.float() * c + rotate(g_k.float()) * -s
    for name, out, ref in (("q_out", q_out, ref_q), ("k_out", k_out, ref_k),
                           ("grad q", grad_q, ref_gq), ("grad k", grad_k, ref_gk)):
        assert torch.isfinite(out).all(), name
        assert_close(out, ref, torch.bfloat16, name)


@pytest.mark.gpu
def test_real_size_one_tensor_gemma4_layout():
    """One tensor rotated alone, as the rope rule does for Gemma 3n / 4's apply_rotary_pos_emb(x, cos, sin,
    unsqueeze_dim=2): q 4x4096x16x256 (batch, seq, heads, head_dim) bf16 and a k of no heads; forward and
    gradient against an fp32 reference."""
    device = torch.device("cuda")
    batch, seq, heads, head_dim = 4, 4096, 16, 256
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, seq, heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    x.requires_grad_(True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[None, :, None].expand(batch, seq, 1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    x_out, k_out = fused_kernels.rope(x, x.detach().narrow(2, 0, 0), cos, sin, 2)
    assert k_out.shape == (batch, seq, 0, head_dim)
    g = torch.randn(x_out.shape, device=device, generator=gen, dtype=torch.bfloat16)
    (grad_x,) = torch.autograd.grad(x_out, x, g)
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    x32 = x.detach().float()
    for name, out, ref in (("x_out", x_out, x32 * c + rotate_half(x32) * s),
                           ("grad x", grad_x, g.float() * c + rotate_half(g.float()) * -s)):
        assert torch.isfinite(out).all(), name
        assert_close(out, ref, torch.bfloat16, name)


def test_plan_for_named_shapes():
    """plan(): under the interpreter (or forced) one fixed config, on a GPU triton.autotune; Llama-3-8B
    (16384 tokens, 32 / 8 heads, head_dim 128) and a tiny GQA shape."""
    p = plan(rope_config, 16384, 32, 8, 128, device=OFF_GPU)
    assert (p.path, p.config) == (Path.FIXED, rope_config.RopeConfig(1, 32, 8, 4))
    assert "interpreter" in p.reason and "16384 programs" in p.reason
    p = plan(rope_config, 16384, 32, 8, 128, device=H200)
    assert (p.path, p.config) == (Path.AUTOTUNE, None) and "candidate_configs(32, 8, 128, 16384)" in p.reason
    p = plan(rope_config, 6, 3, 1, 16, device=OFF_GPU)
    assert p.config == rope_config.RopeConfig(8, 4, 1, 4) and "1 programs" in p.reason
    with forced_config((2, 2, 1)):
        p = plan(rope_config, 16384, 32, 8, 128, device=H200)
        assert (p.path, p.config) == (Path.FIXED, rope_config.RopeConfig(2, 2, 1, num_warps=4))
        assert "forces" in p.reason


def test_cos_sin_that_require_grad_are_refused_with_the_reason():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos = torch.randn(1, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="cos and sin get no gradient"):
        fused_kernels.rope(q, k, cos, torch.randn(1, 3, 8))
    with torch.no_grad():  # nothing to differentiate: runs
        qo, _ = fused_kernels.rope(q, k, cos, torch.randn(1, 3, 8))
    assert torch.isfinite(qo).all()

