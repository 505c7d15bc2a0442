"""fused_kernels.rms_norm against float64 references that follow the same casting semantics.

The references are the transformers modules rewritten in float64, with their intermediate roundings
made explicit (`_round`): LlamaRMSNorm rounds the normalised value to x.dtype before the multiply (and
computes offset + weight in weight.dtype); Gemma and "none" stay in fp32 until the final cast. The
rounding casts also round the gradients flowing back through them, exactly as torch autograd does in
the original modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

import fused_kernels
from fused_kernels import _dispatch, _gpu, rms_norm
from fused_kernels._dispatch import Plan
import helpers
from helpers import REL_TOL, assert_close, randn, rel_err

# The package re-exports the function under the module's name, so fetch the module itself.
from fused_kernels.ops import rms_norm as rms_norm_module
from fused_kernels.ops import rms_norm_config as rms_cfg

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = ("llama", "gemma", "none")


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 values to `dtype` and back (autograd rounds the gradient the same way)."""
    return t.to(dtype).to(torch.float64)


def reference(x64, w64, eps, offset, casting_mode, x_dtype, w_dtype):
    """Float64 RMSNorm with the intermediate roundings of `casting_mode`; x64/w64 hold the values of
    the low-precision inputs (w64 None: weightless norm, offset unused)."""
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x64 * rstd
    if w64 is None:
        return xhat
    if casting_mode == "llama":
        return _round(offset + w64, w_dtype) * _round(xhat, x_dtype)
    return xhat * (offset + w64)


def expected_dtype(x_dtype, w_dtype, casting_mode):
    if casting_mode == "llama" and w_dtype is not None:
        return torch.promote_types(x_dtype, w_dtype)
    return x_dtype


def tolerance(*dtypes) -> float:
    return max(REL_TOL[d] for d in dtypes if d is not None)


def poisoned_outputs():
    """Every buffer the op allocates for its kernels to write starts as NaN."""
    return helpers.poisoned_outputs(rms_norm_module)


def check_against_reference(x, weight, eps, offset, casting_mode, tol=None, keep="input"):
    """Run forward + backward of rms_norm on (x, weight) and of the float64 reference; compare y,
    dx, dw. `x` may be a non-contiguous view."""
    x_dtype = x.dtype
    w_dtype = None if weight is None else weight.dtype
    tol = tolerance(x_dtype, w_dtype) if tol is None else tol

    x_in = x.detach().requires_grad_(True)
    w_in = None if weight is None else weight.detach().clone().requires_grad_(True)
    with poisoned_outputs():
        y = rms_norm(x_in, w_in, eps=eps, offset=offset, casting_mode=casting_mode, keep=keep)
    assert y.dtype == expected_dtype(x_dtype, w_dtype, casting_mode)
    assert y.shape == x.shape

    x64 = x.detach().to(torch.float64).requires_grad_(True)
    w64 = None if weight is None else weight.detach().to(torch.float64).requires_grad_(True)
    y_ref = reference(x64, w64, eps, offset, casting_mode, x_dtype, w_dtype)
    assert_close(y, y_ref, x_dtype, "y", tol=tol)

    if x.numel() == 0:
        return
    dy = randn(*y.shape, dtype=y.dtype, device=y.device)
    with poisoned_outputs():
        y.backward(dy)
    y_ref.backward(dy.to(torch.float64))

    # dx = rstd·(g − xhat·mean(g·xhat)) cancels almost entirely for hidden 1 (xhat = ±1): measure
    # its error against the size of the terms that cancel, rstd·|g|, not against the tiny result.
    rstd64 = torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + eps)
    w_eff = 1.0 if w64 is None else (offset + w64.detach())
    scale = (rstd64 * dy.to(torch.float64) * w_eff).norm().item()
    assert x_in.grad.dtype == x_dtype
    _assert_close_to_scale("dx", x_in.grad, x64.grad, scale, tol)
    if weight is not None:
        # dw = Σ_rows dy·xhat cancels the same way for few columns (hidden 1: 36 rows of ±dy summed to
        # 1/3500 of Σ|dy|, hypothesis seed 176): its error is measured against Σ_rows |dy·xhat| as well.
        assert w_in.grad.dtype == w_dtype
        xhat64 = (x64.detach() * rstd64).reshape(-1, x.shape[-1])
        dw_scale = (dy.to(torch.float64).reshape(-1, x.shape[-1]) * xhat64).abs().sum(0).norm().item()
        _assert_close_to_scale("dweight", w_in.grad, w64.grad, dw_scale, tol)


def _assert_close_to_scale(name, got, ref, scale, tol):
    """got finite, and its error (2-norm) within tol of |ref| or, where the result cancels, of `scale`, the
    size of the terms that cancel."""
    assert torch.isfinite(got).all(), f"{name} has NaN/inf"
    err = (got.to(torch.float64).cpu() - ref.cpu()).norm().item()
    assert err <= tol * max(ref.norm().item(), scale), (
        f"{name}: error {err:.3e} vs |{name}_ref| {ref.norm().item():.3e}, scale {scale:.3e} (tol {tol:.0e})"
    )


# --- hypothesis: shapes × dtypes × casting modes × offsets × weight / no weight --------------------

HIDDEN = (1, 7, 64, 100, 257, 4100)


@st.composite
def leading_shapes(draw):
    hidden = draw(st.sampled_from(HIDDEN))
    max_rows = 3 if hidden > 1000 else 40
    if draw(st.booleans()):
        lead = (draw(st.integers(0, max_rows)),)
    else:
        b = draw(st.integers(0, 3))
        lead = (b, draw(st.integers(0, max_rows // 3)))
    return (*lead, hidden)


@pytest.mark.parametrize("casting_mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    shape=leading_shapes(),
    offset=st.sampled_from([0.0, 1.0]),
    weight_kind=st.sampled_from(["same", "float32", "none"]),
    eps=st.sampled_from([1e-6, 1e-5]),
    scale=st.sampled_from([0.3, 1.0, 5.0]),
    seed=st.integers(0, 2**31 - 1),  # the data too is part of the example, so a failure replays
)
def test_matches_reference(dtype, casting_mode, shape, offset, weight_kind, eps, scale, seed):
    torch.manual_seed(seed)
    x = randn(*shape, dtype=dtype, scale=scale)
    weight = None
    if weight_kind != "none":
        w_dtype = dtype if weight_kind == "same" else torch.float32
        weight = randn(shape[-1], dtype=w_dtype, scale=0.5)
    check_against_reference(x, weight, eps, offset, casting_mode)


def test_llama_rounds_like_transformers():
    """bf16 x with an fp32 weight: y is fp32 (torch promotion) and equals weight · bf16(xhat)
    bit for bit up to fp32 rounding; "gemma" keeps xhat in fp32 and returns bf16."""
    x = randn(6, 96, dtype=torch.bfloat16, scale=3.0)
    w = randn(96, dtype=torch.float32)
    y = rms_norm(x, w, 1e-6, 0.0, "llama")
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    expected = w * h
    assert y.dtype == torch.float32
    assert rel_err(y, expected) <= 1e-6
    g = rms_norm(x, w, 1e-6, 1.0, "gemma")
    assert g.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_same_numbers_as_the_transformers_modules(dtype):
    """Against LlamaRMSNorm and Gemma3RMSNorm themselves, in low precision, forward and backward:
    each casting mode is much closer to its own module than the other mode is (the modes differ by
    where they round), so a swapped or missing rounding cannot pass."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 96
    llama = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    gemma = Gemma3RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.copy_(randn(hidden, scale=1.0))
        gemma.weight.copy_(randn(hidden, scale=1.0))
    x = randn(16, hidden, dtype=dtype, scale=3.0)
    dy = randn(16, hidden, dtype=dtype)

    def run(fn, weight):
        x_in = x.clone().requires_grad_(True)
        y = fn(x_in)
        y.backward(dy)
        return y.detach(), x_in.grad, weight.grad

    for module, offset, mode, other in ((llama, 0.0, "llama", "gemma"), (gemma, 1.0, "gemma", "llama")):
        expected = run(module, module.weight)
        module.weight.grad = None
        for casting, bound in ((mode, None), (other, "looser")):
            w = module.weight.detach().clone().requires_grad_(True)
            got = run(lambda t, w=w, c=casting: rms_norm(t, w, 1e-6, offset, c), w)
            errs = [rel_err(g, e) for g, e in zip(got, expected)]
            if bound is None:
                assert got[0].dtype == expected[0].dtype
                assert max(errs) <= REL_TOL[dtype], (mode, errs)
                own = errs[0]
            else:
                assert errs[0] > 3 * own, f"{casting} matches {mode}'s module as well as {mode}: {errs[0]} vs {own}"


# --- non-contiguous inputs -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("casting_mode", MODES)
@pytest.mark.parametrize("hidden", (7, 100, 257))
def test_non_contiguous_x(dtype, casting_mode, hidden):
    base = randn(5, 3, hidden + 3, dtype=dtype, scale=2.0)
    sliced = base[:, 1, 2 : hidden + 2]  # unit column stride, row stride 3·(hidden+3): no copy
    assert not sliced.is_contiguous()
    weight = randn(hidden, dtype=dtype)
    check_against_reference(sliced, weight, 1e-6, 1.0, casting_mode)
    transposed = randn(hidden, 9, dtype=dtype).t()  # column stride 9: the op copies it
    assert transposed.stride(-1) != 1
    check_against_reference(transposed, weight, 1e-6, 0.0, casting_mode)


def test_non_contiguous_grad_output():
    """dy from .sum() is an expanded (stride-0) tensor."""
    x = randn(4, 33, dtype=torch.float32, requires_grad=True)
    w = randn(33, dtype=torch.float32, requires_grad=True)
    rms_norm(x, w).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    reference(x64, w64, 1e-6, 0.0, "llama", torch.float32, torch.float32).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(w.grad, w64.grad, torch.float32, "dw")


# --- the long-row (chunked) and persistent multi-tile paths, forced on small shapes -------------

def forced_plans(forward=None, backward=None):
    """A stand-in for rms_norm's plan(): the Plan `forward` / `backward` for calls in that direction
    (None: the real plan's), except where the real plan picks the cluster path (the fake cluster
    kernels below), which still runs."""
    real = rms_cfg.plan

    def forced(call, device):
        planned = real(call, device)
        wanted = forward if call.direction == "forward" else backward
        return planned if wanted is None or planned.path == "cluster" else wanted

    return forced


def force_plans(monkeypatch, forward=None, backward=None):
    """rms_norm runs `forward` / `backward` (Plans; None: plan()'s own) from now on (forced_plans)."""
    monkeypatch.setattr(rms_norm_module, "plan", forced_plans(forward, backward))


def force_config(monkeypatch, config):
    """The one-kernel path with `config` in both directions."""
    force_plans(monkeypatch, Plan("triton", config, "forced"), Plan("triton", config, "forced"))


@pytest.mark.parametrize("casting_mode", ("llama", "gemma"))  # "none" shares gemma's kernel code
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(
    "config",
    [
        # chunked: 150 columns in chunks of 64 (the last one ragged), 2 rows per tile, 3 programs
        # (1.5 per "SM", 2 on the CPU) → several tiles per program, so each dw partial row is
        # stored once and then read-modified-written
        rms_cfg.LaunchConfig(block_n=64, rows=2, num_warps=4, programs_per_sm=1.5, chunked=True),
        # single pass with 4 rows per tile and a ragged last tile
        rms_cfg.LaunchConfig(block_n=512, rows=4, num_warps=4, programs_per_sm=1),
    ],
    ids=["chunked", "single-pass"],
)
def test_forced_launch_configs(monkeypatch, config, dtype, casting_mode):
    force_config(monkeypatch, config)
    x = randn(11, 150, dtype=dtype, scale=2.0)
    weight = randn(150, dtype=dtype)
    check_against_reference(x, weight, 1e-6, 1.0, casting_mode)
    check_against_reference(x, None, 1e-6, 0.0, casting_mode)


# Split backward forced on a small shape: 150 columns as 3 row-dot blocks of 64 (the last ragged,
# DOT_BLOCKS = 4 masked) and 5 dx/dw blocks of 32; 8 programs per "SM" (2 on the CPU) over 5 column
# blocks = 3 row groups of 4, 4 and 3 rows (each its own dw partial row).
_SMALL_SPLIT = rms_cfg.SplitBackwardConfig(dot_block=64, dot_warps=4, block_n=32, num_warps=4,
                                                    programs_per_sm=8, num_stages=2)


@pytest.mark.parametrize("casting_mode", rms_norm_module.CASTING_MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("keep", ("input", "output"))
def test_forced_split_backward(monkeypatch, dtype, casting_mode, keep):
    force_plans(monkeypatch, backward=Plan("split", _SMALL_SPLIT, "forced"))
    x = randn(11, 150, dtype=dtype, scale=2.0)
    weight = randn(150, dtype=dtype)
    check_against_reference(x, weight, 1e-6, 1.0 if casting_mode == "gemma" else 0.0, casting_mode, keep=keep)
    check_against_reference(x, None, 1e-6, 0.0, casting_mode, keep=keep)
    check_against_reference(randn(1, 150, dtype=dtype), weight, 1e-6, 0.0, casting_mode, keep=keep)  # one row


def test_split_backward_is_used_for_long_rows_only(monkeypatch):
    """Rows longer than SPLIT_BACKWARD_FROM go through the two split kernels; shorter ones do not. A
    strided (row-padded) input and a weight without a gradient exercise the strides and no-dw path."""
    n = rms_cfg.SPLIT_BACKWARD_FROM
    assert _plan(4, n, torch.float32, "backward").path == "triton"
    assert _plan(4, n + 1, torch.float32, "backward").path == "split"
    calls = []
    real = rms_norm_module._split_backward
    monkeypatch.setattr(rms_norm_module, "_split_backward", lambda *a: calls.append(1) or real(*a))
    n = rms_cfg.SPLIT_BACKWARD_FROM + 40
    base = randn(3, n + 24, dtype=torch.float32, scale=2.0)
    x = base[:, :n].requires_grad_(True)
    w = randn(n, dtype=torch.float32)
    y = rms_norm(x, w)
    dy = randn(3, n)
    y.backward(dy)
    assert calls, "the split backward was not used"
    x64 = x.detach().double().requires_grad_(True)
    reference(x64, w.double(), 1e-6, 0.0, "llama", torch.float32, torch.float32).backward(dy.double())
    assert_close(x.grad, x64.grad, torch.float32, "dx")


# --- keep="output": the backward recovers xhat from y -------------------------------------------

@pytest.mark.parametrize("casting_mode", rms_norm_module.CASTING_MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("offset,weight_kind", [(0.0, "random"), (1.0, "random"), (0.0, "none")])
def test_keep_output_matches_reference(dtype, casting_mode, offset, weight_kind):
    """Same tolerances against float64 as keeping the input (fp32 1e-5, bf16 1e-2)."""
    x = randn(6, 3, 100, dtype=dtype, scale=3.0)
    weight = None if weight_kind == "none" else randn(100, dtype=dtype, scale=0.5)
    check_against_reference(x, weight, 1e-6, offset, casting_mode, keep="output")


@pytest.mark.parametrize("casting_mode", ("llama", "gemma"))
def test_keep_output_forced_chunked_path(monkeypatch, casting_mode):
    config = rms_cfg.LaunchConfig(block_n=64, rows=2, num_warps=4, programs_per_sm=1.5, chunked=True)
    force_config(monkeypatch, config)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(11, 150, dtype=dtype, scale=2.0)
        check_against_reference(x, randn(150, dtype=dtype), 1e-6, 1.0, casting_mode, keep="output")


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_keep_output_saves_y_not_x_and_zero_weights_keep_x():
    """keep="output" keeps y (which a following Linear keeps anyway), not x; a weight with an exact
    zero in offset + weight keeps x, and its gradient there is exact."""
    x = randn(4, 64, requires_grad=True)
    w = randn(64, requires_grad=True)
    y, saved = _saved(lambda: rms_norm(x, w, keep="output"))
    ptrs = {t.data_ptr() for t in saved}
    assert y.data_ptr() in ptrs and x.data_ptr() not in ptrs
    _, saved = _saved(lambda: rms_norm(x, w))
    assert x.data_ptr() in {t.data_ptr() for t in saved}
    for offset, zero_value in ((0.0, 0.0), (1.0, -1.0)):
        w0 = w.detach().clone()
        w0[5] = zero_value
        w0.requires_grad_(True)
        y0, saved = _saved(lambda: rms_norm(x, w0, offset=offset, keep="output"))
        assert x.data_ptr() in {t.data_ptr() for t in saved}, "a zero in offset + weight must keep x"
        check_against_reference(x.detach(), w0.detach(), 1e-6, offset, "llama", keep="output")


def test_keep_output_rejects_unknown_choice():
    with pytest.raises(ValueError, match="keep"):
        rms_norm(randn(2, 8), randn(8), keep="both")


@pytest.mark.parametrize("hidden", (9000, 20000))
def test_long_rows_default_config(hidden):
    """The shipped long-row configs: 9000 is one chunk in the backward (held whole in the forward),
    20000 is chunked in both (a full chunk of 16384 and a ragged one)."""
    assert rms_cfg.heuristic_config(hidden, True).chunked
    x = randn(3, hidden, dtype=torch.bfloat16, scale=2.0)
    weight = randn(hidden, dtype=torch.bfloat16)
    check_against_reference(x, weight, 1e-6, 0.0, "llama")


def test_launch_config_table():
    """Every row length gets a power-of-two block and row count; a row is held whole (block >= row)
    unless its config says chunked. Under the interpreter the heuristic config is the one launched."""
    for n in (1, 7, 64, 100, 257, 1024, 4095, 4096, 8192, 16384, 65536, 262144):
        for backward in (False, True):
            cfg = rms_cfg.heuristic_config(n, backward)
            planned = _plan(8, n, torch.float32, "backward" if backward else "forward")
            if planned.path == "split":
                assert backward and n > rms_cfg.SPLIT_BACKWARD_FROM
            else:
                assert planned == Plan("triton", cfg, planned.reason)
            assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.rows & (cfg.rows - 1) == 0
            assert cfg.num_warps in (1, 2, 4, 8, 16, 32)
            assert cfg.chunked or cfg.block_n >= n
            if backward:
                assert cfg.programs_per_sm > 0
            # fp32 values per thread for one held [rows, block] array: more than 32 would spill
            assert cfg.tile // (32 * cfg.num_warps) <= 32, (n, backward, cfg)
    # long-row backward: persistent programs capped by the L2 budget, never more than the tiles
    cfg = rms_cfg.heuristic_config(65536, True)
    programs = rms_cfg.backward_programs(cfg, 1024, 65536, 8, sm_count=132)
    assert 1 <= programs and programs * 65536 * 8 <= rms_cfg.L2_BUDGET_BYTES
    assert rms_cfg.backward_programs(cfg, 3, 65536, 8, sm_count=132) == 3
    # the uncapped candidate: every SM busy (the autotuner weighs that against the L2 re-use)
    uncapped = dataclasses.replace(cfg, l2_cap=False)
    assert rms_cfg.backward_programs(uncapped, 1024, 65536, 8, sm_count=132) > programs
    assert any(not c.l2_cap and c.chunked for c in rms_cfg.candidate_configs(True))
    assert all(c.l2_cap for c in rms_cfg.candidate_configs(False))


def _triton_configs(backward):
    return [triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages)
            for c in rms_cfg.candidate_configs(backward)]


def test_autotune_candidates_cover_every_row_length():
    """On a GPU the autotuner chooses among the candidates that `_prune` keeps: at least one for
    every row length and row count, each a valid launch (power-of-two shapes, at most 32 fp32 values
    per thread and held array, whole rows only where the block covers the row, persistent backward
    grids of 1–4 programs per SM), and few enough that tuning a new shape stays quick."""
    for backward, dtype in itertools.product((False, True), (torch.bfloat16, torch.float32)):
        configs = _triton_configs(backward)
        tensors = {"X": torch.empty(0, dtype=dtype)}
        if backward:
            tensors["DY"] = torch.empty(0, dtype=dtype)
        bytes_per_col = 2 * dtype.itemsize if backward else dtype.itemsize
        for n in (1, 7, 64, 100, 257, 1000, 1024, 4095, 4096, 5000, 8192, 9000, 16384, 20000, 65536, 262144):
            for row_bucket in (16, 256, 65536):
                kept = rms_cfg._prune(configs, {"n_cols": n, "row_bucket": row_bucket, **tensors})
                assert 1 <= len(kept) <= 16, (n, backward, row_bucket, len(kept))
                for c in kept:
                    shared = rms_cfg._pipelined_shared_bytes(c.kwargs, bytes_per_col, 4 if backward else 0)
                    assert shared <= rms_cfg._SHARED_LIMIT
                    block, rows, warps = c.kwargs["BLOCK_N"], c.kwargs["ROWS"], c.num_warps
                    assert block & (block - 1) == 0 and rows & (rows - 1) == 0
                    assert block * rows // (32 * warps) <= 32
                    if c.kwargs["SINGLE_PASS"]:
                        assert block >= n
                    else:
                        assert block < n and rows == 1
                    per_sm = c.kwargs["PROGRAMS_PER_SM"]
                    assert (1 <= per_sm <= 4) if backward else (0 <= per_sm <= 4)
                    assert c.kwargs["NUM_STAGES"] == c.num_stages >= 1
                if row_bucket == 16 and n <= 1024:
                    assert all(c.kwargs["ROWS"] <= 16 for c in kept) or len({c.kwargs["ROWS"] for c in kept}) == 1


@contextlib.contextmanager
def autotuned_path(fake_bench):
    """Run the GPU path on the CPU: plan() gives the one kernel with no config (triton.autotune decides)
    and the autotuners' benchmark is `fake_bench(kernel_call, quantiles)`; their caches start and end empty."""
    tuned = (rms_norm_module._rms_norm_fwd_tuned, rms_norm_module._rms_norm_bwd_tuned)
    original = rms_norm_module.plan
    rms_norm_module.plan = forced_plans(Plan("triton", None, "autotuned"), Plan("triton", None, "autotuned"))
    rms_norm_module.reset_autotuning()
    for t in tuned:
        t.__dict__["do_bench"] = fake_bench  # shadows Autotuner.do_bench (a cached property)
    try:
        yield tuned
    finally:
        rms_norm_module.plan = original
        rms_norm_module.reset_autotuning()
        for t in tuned:
            t.__dict__.pop("do_bench", None)


@pytest.mark.parametrize("hidden", (100, 9000))  # single pass; single pass vs chunked (chunked only backward)
def test_autotuned_path_every_candidate_is_correct(hidden):
    """Each candidate the autotuner times writes the right outputs from the same buffers it would
    use for real (so the benchmark runs cannot corrupt them), and the winner's launch gives the
    reference result, forward and backward."""
    rows = 5 if hidden < 1000 else 2  # few interpreted programs per candidate
    x = randn(rows, hidden, dtype=torch.bfloat16, scale=2.0)
    w = randn(hidden, dtype=torch.bfloat16)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref = reference(x64, w64, 1e-6, 0.0, "llama", x.dtype, w.dtype)
    y_ref.backward(dy.double())
    buffers = []
    original_new_output = rms_norm_module._new_output

    def recorded(shape, dtype, device):
        buffers.append(original_new_output(shape, dtype, device))
        return buffers[-1]

    snapshots = []
    counter = iter(range(10**6))

    def fake_bench(kernel_call, quantiles):
        out = buffers[0]  # y in the forward, dx in the backward
        out.fill_(float("nan"))
        kernel_call()
        snapshots.append(out.clone())
        t = 100.0 - next(counter)  # a later candidate is "faster": the winner is not simply the first
        return [t, t, t]

    rms_norm_module._new_output = recorded
    try:
        with autotuned_path(fake_bench) as (fwd_tuned, bwd_tuned):
            y, rstd = torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
            n_fwd = len(snapshots)
            buffers.clear()
            dx, dw = torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)
            n_bwd = len(snapshots) - n_fwd
            # Tuned once per key: later calls launch the chosen config directly, with the same result.
            y2, _ = torch.ops.fused_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
            dx2, dw2 = torch.ops.fused_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True)
            assert len(snapshots) == n_fwd + n_bwd
            assert torch.equal(y2, y) and torch.equal(dx2, dx) and torch.equal(dw2, dw)
    finally:
        rms_norm_module._new_output = original_new_output
    assert n_fwd >= 2 and n_bwd >= 2, (n_fwd, n_bwd)
    for i, snap in enumerate(snapshots):
        assert_close(snap, y_ref if i < n_fwd else x64.grad, torch.bfloat16, f"candidate {i} output")
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(dx, x64.grad, torch.bfloat16, "dx")
    assert_close(dw, w64.grad, torch.bfloat16, "dw")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", (300, 16385))  # both rows of _DW_SUM_TABLE, neither a whole block
@pytest.mark.parametrize("n_parts", (1, 37))  # 37: the last load of 16 partial rows is part-masked
def test_dw_sum_kernel_sums_the_first_partial_rows(dtype, n_cols, n_parts):
    partial = torch.full((n_parts + 3, n_cols), float("nan"))  # rows past n_parts are never read
    partial[:n_parts] = randn(n_parts, n_cols, dtype=torch.float32) * 4
    weight = randn(n_cols, dtype=dtype)
    with poisoned_outputs():
        dw = rms_norm_module._sum_partial_rows(partial, n_parts, weight)
    assert dw.dtype == dtype and dw.shape == weight.shape
    expected = partial[:n_parts].double().sum(0)
    assert_close(dw, expected, dtype, "dw")


def test_zero_rows():
    for shape in ((0, 64), (2, 0, 7)):
        x = randn(*shape, requires_grad=True)
        w = randn(shape[-1], requires_grad=True)
        y = rms_norm(x, w)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert torch.equal(w.grad, torch.zeros_like(w))


def test_counts_launches():
    fused_kernels.reset_launch_counts()
    x = randn(3, 16, requires_grad=True)
    rms_norm(x, randn(16, requires_grad=True)).sum().backward()
    counts = fused_kernels.launch_counts()
    assert counts.get("rms_norm_fwd") == 1 and counts.get("rms_norm_bwd") == 1


def test_only_x_needs_grad_and_only_weight_needs_grad():
    x = randn(5, 40, dtype=torch.float32)
    w = randn(40, dtype=torch.float32)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    reference(x64, w64, 1e-6, 0.0, "gemma", torch.float32, torch.float32).sum().backward()

    x1 = x.clone().requires_grad_(True)
    rms_norm(x1, w, casting_mode="gemma").sum().backward()
    assert_close(x1.grad, x64.grad, torch.float32, "dx")

    w1 = w.clone().requires_grad_(True)
    rms_norm(x, w1, casting_mode="gemma").sum().backward()
    assert_close(w1.grad, w64.grad, torch.float32, "dw")


# --- bad inputs --------------------------------------------------------------------------------

def test_errors_name_the_argument():
    x = randn(3, 8)
    w = randn(8)
    with pytest.raises(TypeError, match="x"):
        rms_norm(torch.ones(3, 8, dtype=torch.int32), w)
    with pytest.raises(TypeError, match="weight"):
        rms_norm(x, torch.ones(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.double(), w)
    with pytest.raises(ValueError, match=r"weight must have shape \(x.shape\[-1\],\) = \(8,\)"):
        rms_norm(x, randn(9))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(1, 8))
    with pytest.raises(ValueError, match="casting_mode.*'llama', 'gemma', 'none'.*'mistral'"):
        rms_norm(x, w, casting_mode="mistral")
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        rms_norm(torch.tensor(1.0), None)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        rms_norm(randn(3, 0), None)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)


# --- torch.library and torch.compile ----------------------------------------------------------

@pytest.mark.parametrize("casting_mode,with_weight", [("llama", True), ("gemma", True), ("none", False)])
def test_opcheck(casting_mode, with_weight):
    x = randn(3, 5, 24, dtype=torch.bfloat16, requires_grad=True)
    w = randn(24, dtype=torch.float32, requires_grad=True) if with_weight else None
    torch.library.opcheck(torch.ops.fused_kernels.rms_norm_fwd.default, (x, w, 1e-6, 1.0, casting_mode))

    y, rstd = torch.ops.fused_kernels.rms_norm_fwd(x.detach(), w, 1e-6, 1.0, casting_mode)
    rstd_ref = torch.rsqrt(x.detach().double().pow(2).mean(-1) + 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    assert_close(rstd, rstd_ref, torch.float32, "rstd")

    dy = randn(*y.shape, dtype=y.dtype)
    w_plain = None if w is None else w.detach()
    torch.library.opcheck(
        torch.ops.fused_kernels.rms_norm_bwd.default,
        (dy, x.detach(), w_plain, rstd.detach(), 1.0, casting_mode, with_weight),
    )


@pytest.mark.parametrize("casting_mode", ("llama", "gemma"))
def test_compile_fullgraph_no_graph_breaks(casting_mode):
    torch._dynamo.reset()

    def block(x, w):
        h = rms_norm(x, w, eps=1e-5, offset=1.0, casting_mode=casting_mode)
        return (h * 2.0).sum(-1)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = randn(2, 5, 48, dtype=torch.bfloat16)
    w = randn(48, dtype=torch.bfloat16)

    explanation = torch._dynamo.explain(block)(x, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xc, wc = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    block(xe, we).sum().backward()
    out = compiled(xc, wc)
    out.sum().backward()
    assert torch.equal(out, block(x, w))
    assert torch.equal(xc.grad, xe.grad) and torch.equal(wc.grad, we.grad)


def test_eager_and_compiled_paths_agree():
    """Eager calls run the torch.autograd.Function (no custom-op dispatch), torch.compile traces the
    custom op; both launch the same kernels once forward and once backward and give the same bits."""
    torch._dynamo.reset()
    x = randn(3, 7, 40, dtype=torch.bfloat16, scale=2.0)
    w = randn(40, dtype=torch.float32)
    dy = randn(3, 7, 40, dtype=torch.float32)

    def block(x, w):
        return rms_norm(x, w, eps=1e-5, offset=0.0, casting_mode="llama")

    results = {}
    for name, fn in (("eager", block), ("compiled", torch.compile(block, fullgraph=True, backend="aot_eager"))):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        before = fused_kernels.launch_counts()
        y = fn(xi, wi)
        if name == "eager":
            assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"
        y.backward(dy)
        after = fused_kernels.launch_counts()
        for op in ("rms_norm_fwd", "rms_norm_bwd"):
            assert after.get(op, 0) - before.get(op, 0) == 1, (name, op)
        results[name] = (y.detach(), xi.grad, wi.grad)
    for got, want in zip(results["compiled"], results["eager"]):
        assert torch.equal(got, want)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref = reference(x64, w64, 1e-5, 0.0, "llama", x.dtype, w.dtype)
    y_ref.backward(dy.double())
    assert_close(results["eager"][0], y_ref, torch.bfloat16, "y")
    assert_close(results["eager"][1], x64.grad, torch.bfloat16, "dx")
    assert_close(results["eager"][2], w64.grad, torch.bfloat16, "dw")


def test_no_grad_call_runs_the_kernel_without_autograd():
    x = randn(4, 24, requires_grad=True)
    w = randn(24, requires_grad=True)
    before = fused_kernels.launch_counts().get("rms_norm_fwd", 0)
    with torch.no_grad():
        y = rms_norm(x, w)
    assert y.grad_fn is None and not y.requires_grad
    assert fused_kernels.launch_counts().get("rms_norm_fwd", 0) == before + 1
    x64, w64 = x.detach().double(), w.detach().double()
    assert_close(y, reference(x64, w64, 1e-6, 0.0, "llama", x.dtype, w.dtype), torch.float32, "y")


def test_double_backward_is_refused():
    """The backward is not itself differentiable: asking for a second derivative raises instead of
    silently returning wrong numbers."""
    x = randn(3, 16, requires_grad=True)
    w = randn(16, requires_grad=True)
    (dx,) = torch.autograd.grad(rms_norm(x, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiable"):
        dx.sum().backward()


# --- plan(): the path and config of a call, asked for devices this machine is not -----------------

from fused_kernels._gpu import DeviceFacts  # noqa: E402

def _plan(n_rows, n_cols, dtype, direction, device=None, **facts):
    """plan() for x, weight and dy of one dtype, on `device` (DeviceFacts; None: this CPU's)."""
    device = rms_norm_module.device_facts(torch.device("cpu")) if device is None else device
    return helpers.plan(rms_cfg, n_rows, n_cols, dtype, facts.pop("weight_dtype", dtype), direction, device=device,
                        dy_dtype=facts.pop("dy_dtype", dtype), **facts)


H200 = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)
SM80 = DeviceFacts(cuda=True, sm_count=108, capability=(8, 0), smem_per_sm=167936, gluon=True)  # no clusters
NO_GLUON = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=False)
ROCM = DeviceFacts(cuda=True, sm_count=304, capability=(9, 4), smem_per_sm=65536, gluon=False)  # Gluon is CUDA's

_CLUSTER = _gpu.ClusterLaunch
_SHAPE = _gpu.ClusterShape
_AUTOTUNED = ("triton", None)
_SPLIT = ("split", rms_cfg.SplitBackwardConfig())
# (rows, n_cols): {(device, direction): (path, config)} for bf16 x, weight and dy, from the input
NAMED_SHAPES = {
    (16384, 4096): {(dev, d): _AUTOTUNED for dev in ("h200", "sm80") for d in ("forward", "backward")},
    (65536, 1024): {(dev, d): _AUTOTUNED for dev in ("h200", "sm80") for d in ("forward", "backward")},
    (4096, 16384): {
        ("h200", "forward"): _AUTOTUNED,
        ("h200", "backward"): ("cluster", _CLUSTER(_SHAPE(warps=4, ctas=4, per_sm=6), 196)),  # 4 chunks of 4096
        ("sm80", "forward"): _AUTOTUNED,
        ("sm80", "backward"): _AUTOTUNED,  # held whole in registers: not longer than SPLIT_BACKWARD_FROM
    },
    (1024, 65536): {
        # 99 clusters of 8 fit 132 SMs at 6 CTAs each: 11 rounds of 1024 rows, as 94 clusters take
        ("h200", "forward"): ("cluster", _CLUSTER(_SHAPE(warps=4, ctas=8, per_sm=6), 94)),
        # 66 fit at 4 per SM: 16 rounds, as 64 take
        ("h200", "backward"): ("cluster", _CLUSTER(_SHAPE(warps=8, ctas=8, per_sm=4), 64)),
        ("sm80", "forward"): _AUTOTUNED,
        ("sm80", "backward"): _SPLIT,
    },
}


@pytest.mark.parametrize("shape", list(NAMED_SHAPES), ids=lambda s: f"{s[0]}x{s[1]}")
def test_plan_of_the_named_shapes(shape, fresh_dispatch):
    """bf16 on an H200 (132 SMs, sm_90, Gluon), on an sm_80 GPU (no clusters) and on a GPU without Gluon
    (the sm_80 answers), forward and backward; fp16 plans as bf16."""
    rows, n = shape
    for (dev, direction), (path, config) in NAMED_SHAPES[shape].items():
        for device in ((H200,) if dev == "h200" else (SM80, NO_GLUON, ROCM)):
            for dtype in (torch.bfloat16, torch.float16):
                got = _plan(rows, n, dtype, direction, device)
                assert (got.path, got.config) == (path, config), (shape, device, direction, dtype, got)
                assert got.reason, got


def test_plan_fp32_and_mixed_dtypes_never_take_clusters(fresh_dispatch):
    """The cluster kernels copy 16-bit elements: fp32 x, an fp32 weight beside bf16 x, or fp32 dy take
    the other paths (the split backward for rows of 65536)."""
    for rows, n in NAMED_SHAPES:
        for direction in ("forward", "backward"):
            got = _plan(rows, n, torch.float32, direction, H200)
            want = _SPLIT if direction == "backward" and n > rms_cfg.SPLIT_BACKWARD_FROM else _AUTOTUNED
            assert (got.path, got.config) == want, (rows, n, direction, got)
            assert "16-bit" in got.reason or "no rows of" in got.reason, got
    assert _plan(1024, 65536, torch.bfloat16, "forward", H200, weight_dtype=torch.float32).path == "triton"
    assert _plan(1024, 65536, torch.bfloat16, "backward", H200, weight_dtype=torch.float32).path == "split"
    assert _plan(1024, 65536, torch.bfloat16, "backward", H200, dy_dtype=torch.float32).path == "split"
    assert _plan(4096, 16384, torch.bfloat16, "backward", H200, dy_dtype=torch.float32).path == "triton"


def test_plan_cluster_conditions(fresh_dispatch):
    """What else keeps a call off the cluster path: no weight (backward only), the backward from the saved
    output, deterministic mode (backward only: a forward row's y does not depend on which cluster claims
    it), unaligned rows, and too few rows per cluster (MIN_ROWS_PER_CLUSTER)."""
    bf16 = torch.bfloat16
    assert _plan(1024, 65536, bf16, "forward", H200, weight_dtype=None).path == "cluster"
    no_weight = _plan(1024, 65536, bf16, "backward", H200, weight_dtype=None)
    assert (no_weight.path, no_weight.config) == _SPLIT and "no weight" in no_weight.reason, no_weight
    assert _plan(1024, 65536, bf16, "backward", H200, from_output=True).path == "split"
    assert _plan(4096, 16384, bf16, "backward", H200, from_output=True).path == "triton"
    assert _plan(1024, 65536, bf16, "backward", H200, deterministic=True).path == "split"
    assert _plan(1024, 65536, bf16, "forward", H200, deterministic=True).path == "cluster"
    for direction in ("forward", "backward"):
        assert _plan(1024, 65536, bf16, direction, H200, aligned=False).path != "cluster"
    # too few rows per cluster: 256 rows take 64 clusters of the backward's (4 rounds of the 66 that
    # fit), 4 each; 255 rows too, 3.98 each. The forward: 396 rows over 99 clusters, 395 over 99.
    assert _plan(256, 65536, bf16, "backward", H200).config == _CLUSTER(_SHAPE(8, 8, 4), 64)
    below = _plan(255, 65536, bf16, "backward", H200)
    assert below.path == "split" and "fewer than 4 per cluster" in below.reason, below
    assert _plan(396, 65536, bf16, "forward", H200).config == _CLUSTER(_SHAPE(4, 8, 6), 99)
    assert _plan(395, 65536, bf16, "forward", H200).path == "triton"
    assert _plan(3, 65536, bf16, "backward", H200).path == "split"
    # lengths the tables do not name: 40960 is 2.5 chunks of 16384, 73728 is 9 of 8192
    assert _plan(1024, 40960, bf16, "backward", H200).path == "split"
    assert _plan(1024, 32768, bf16, "forward", H200).path == "triton"
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward'"):
        _plan(8, 64, bf16, "fwd", H200)


def test_plan_without_the_cluster_path_once_dispatch_turns_it_off(fresh_dispatch):
    """After the cluster backward's first build failed (`_dispatch.run_path`), plan() takes the next path
    for every backward; the forward's cluster path is another one and stays on."""
    def fails():
        raise RuntimeError("PassManager::run failed")

    with pytest.warns(RuntimeWarning, match="rms_norm_bwd: the cluster kernel did not build"):
        assert not _dispatch.run_path("rms_norm_bwd", "cluster", ("key",), fails, instead="the Triton backward")
    off = _plan(1024, 65536, torch.bfloat16, "backward", H200)
    assert (off.path, off.config) == _SPLIT and "off" in off.reason, off
    assert _plan(4096, 16384, torch.bfloat16, "backward", H200).path == "triton"
    assert _plan(1024, 65536, torch.bfloat16, "forward", H200).path == "cluster"


def test_plan_under_the_interpreter_is_the_heuristic_table():
    """This CPU: no Gluon, no clusters; the one kernel with the heuristic table's config, the split
    backward above SPLIT_BACKWARD_FROM."""
    cpu = rms_norm_module.device_facts(torch.device("cpu"))
    assert not cpu.cuda and not cpu.gluon and cpu.sm_count >= 1
    for rows, n in NAMED_SHAPES:
        assert _plan(rows, n, torch.bfloat16, "forward").config == rms_cfg.heuristic_config(n, False)
        back = _plan(rows, n, torch.bfloat16, "backward")
        if n > rms_cfg.SPLIT_BACKWARD_FROM:
            assert (back.path, back.config) == _SPLIT
        else:
            assert (back.path, back.config) == ("triton", rms_cfg.heuristic_config(n, True))


# --- the H200 at real sizes (dev/gpu_check.sh) ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,hidden,casting_mode",
    [
        (16384, 4096, "llama"),
        (16384, 4096, "gemma"),
        (65536, 1024, "llama"),
        (4096, 16384, "llama"),  # chunked backward (one chunk)
        (1024, 65536, "gemma"),  # chunked forward and backward
    ],
)
@pytest.mark.parametrize("keep", ("input", "output"))
def test_gpu_real_sizes(device, rows, hidden, casting_mode, keep):
    torch.manual_seed(0)
    x = randn(rows, hidden, dtype=torch.bfloat16, device=device, scale=2.0)
    w = randn(hidden, dtype=torch.bfloat16, device=device, scale=0.5)
    offset = 1.0 if casting_mode == "gemma" else 0.0
    x_in, w_in = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = rms_norm(x_in, w_in, 1e-6, offset, casting_mode, keep=keep)
    dy = randn(rows, hidden, dtype=y.dtype, device=device)
    y.backward(dy)

    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref = reference(x64, w64, 1e-6, offset, casting_mode, x.dtype, w.dtype)
    y_ref.backward(dy.double())
    for name, got, ref in (("y", y, y_ref), ("dx", x_in.grad, x64.grad), ("dw", w_in.grad, w64.grad)):
        assert torch.isfinite(got).all(), f"{name} has NaN/inf"
        assert_close(got, ref, torch.bfloat16, f"{name} {rows}x{hidden}")


# --- the long-row backward read once (fused_kernels/norm_smem.py, Gluon: GPU only) ----------

def test_smem_backward_table_shapes_fit_an_sm():
    """Every length the cluster backward takes (CLUSTER_BACKWARD_SHAPES) is 2-4 whole chunks of its shape; per_sm CTAs' x and dy slices fit an
    H100/H200 SM's shared memory (228 KB, 1 KB reserved per CTA) and the register cap keeps >= 64 per
    thread (8 fp32 dw sums per chunk live in registers)."""
    smem = pytest.importorskip("fused_kernels.ops.norm_smem")
    from fused_kernels import _gpu as gpu
    assert rms_cfg.cluster_shape(16384, True) == _gpu.ClusterShape(warps=4, ctas=4, per_sm=6)  # 4 chunks of 4096
    assert rms_cfg.cluster_shape(24576, True).chunk == 8192 and rms_cfg.cluster_shape(32768, True).warps == 4  # measured at 32768
    assert rms_cfg.cluster_shape(65536, True) == _gpu.ClusterShape(warps=8, ctas=8, per_sm=4)
    assert rms_cfg.cluster_shape(49152, True).chunk == 16384
    for n in (40960, 65537, 131072, 4096, 8192, 12288, 8192 * 3 + 8):  # below 16384: the one-kernel backward
        assert rms_cfg.cluster_shape(n, True) is None, n
    for n in range(4096, 65536 + 1, 4096):
        shape = rms_cfg.cluster_shape(n, True)
        if shape is None:
            continue
        assert n % shape.chunk == 0 and smem.MIN_CHUNKS <= n // shape.chunk <= smem.MAX_CHUNKS
        assert shape.per_sm * (smem.buffer_bytes(n, shape, 2) + 1024 + 256) <= 228 * 1024, (n, shape)
        assert gpu.register_cap(shape.warps, shape.per_sm) >= 64
        fit = shape.per_sm * 132 // shape.ctas
        grid = _gpu.clusters(1024, shape, 132)  # the fewest clusters that take as many rounds as all that fit
        assert grid <= fit and -(-1024 // grid) == -(-1024 // fit) and -(-1024 // (grid - 1)) > -(-1024 // fit)
    assert _gpu.clusters(1024, rms_cfg.cluster_shape(65536, True), 132) == 64  # 66 fit: 16 rounds either way
    assert _gpu.clusters(3, rms_cfg.cluster_shape(65536, True), 132) == 3
    assert _gpu.clusters(10_000, rms_cfg.cluster_shape(65536, True), 132) == 66  # 152 rounds, 66 · 152 - 10 000 = 32 idle
    with pytest.raises(ValueError, match="whole chunks of 16384"):
        smem.kernel_constexprs(40960, rms_cfg.cluster_shape(65536, True), offset=0.0, casting_id=0, compute_dw=True)


def test_smem_forward_table_shapes_fit_an_sm():
    """The long-row forward takes 65536 only (8 chunks of 8192: where it was measured to win); per_sm
    CTAs' x and w slices fit an H100/H200 SM's shared memory."""
    smem = pytest.importorskip("fused_kernels.ops.norm_smem")
    assert rms_cfg.cluster_shape(65536, False) == _gpu.ClusterShape(warps=4, ctas=8, per_sm=6)
    for n in (32768, 49152, 65536 + 8192, 131072, 4096):
        assert rms_cfg.cluster_shape(n, False) is None, n
    shape = rms_cfg.cluster_shape(65536, False)
    assert shape.per_sm * (smem.buffer_bytes(65536, shape, 2, forward=True) + 1024 + 256) <= 228 * 1024
    with pytest.raises(ValueError, match="8-8 whole chunks of 8192 .* forward"):
        smem.forward_constexprs(32768, shape, offset=0.0, casting_id=0, has_weight=True)


def test_smem_kernels_compile_for_sm90():
    """The Gluon kernels compile for sm_90a with this Triton (the CPU suite cannot run them): every
    length and casting mode, the backward with and without dw, the forward with and without a weight,
    LayerNorm's backward with and without a weight, dw and db;
    spills only within check_sm90.CAPPED_SPILL_BYTES (the launch caps registers so that per_sm CTAs share
    an SM), and shared memory within the slices of x, w and (backward) dy."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.experimental.gluon")
    from fused_kernels.ops import norm_smem as smem
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, os.path.join(root, "dev", "check_sm90.py"), "--op", "norm_smem"],
                          capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "28 kernels compiled for sm_90a, 0 with spills or failures" in out, out + proc.stderr[-3000:]
    from fused_kernels.ops import layer_norm as ln
    for line in out.splitlines():
        if "norm_smem " in line and " N=" in line:
            n = int(line.split("N=")[1].split()[0])
            forward = "norm_smem forward" in line
            shape = ln.cluster_shape(n) if "layer_norm" in line else rms_cfg.cluster_shape(n, not forward)
            shared = int(line.split("shared")[1].split()[0])
            assert "capped" in line, line
            assert shared <= smem.buffer_bytes(n, shape, 2, forward) + 256, line


class _FakeSmem:
    """Stands in for norm_smem on the CPU: plan()'s cluster conditions (`cluster_launch`) hold for every
    call with a weight (and, backward, from the input) in its `only` direction; launch_backward either
    fails (a Triton whose Gluon API the kernel does not build with) or computes dx and dw in float64
    torch, dw in the first of its partial rows and zeros in the rest (so that the dispatch's sum over
    `grid` partial rows is what is checked); launch_forward likewise, y and rstd."""

    shortest = 100  # cluster_launch: None for shorter rows

    def __init__(self, fail: bool, fail_forward: bool = False, only: str = "backward"):
        self.fail = fail
        self.fail_forward = fail_forward
        self.only = only
        self.calls = 0
        self.forward_calls = 0
        self.shape = ("fake shape", 4, 2, 2)

    def cluster_launch(self, n_rows, n_cols, x_dtype, weight_dtype, direction, *, device, from_output=False, **facts):
        if direction != self.only or weight_dtype is None or n_cols < self.shortest:
            return None, "not taken by the fake"
        if direction == "backward" and from_output:
            return None, "the backward from the saved output"
        return _gpu.ClusterLaunch(self.shape, 3), "the fake cluster kernels"

    def launch_forward(self, x2, weight, y2, rstd, *, shape, grid, eps, offset, casting_id):
        self.forward_calls += 1
        if self.fail_forward:
            raise RuntimeError("PassManager::run failed")
        assert casting_id == 0 and grid == 3 and shape == self.shape
        x64 = x2.double()
        r = torch.rsqrt(x64.pow(2).mean(-1) + eps)
        rstd.copy_(r)
        y2.copy_((x64 * r[:, None]).to(x2.dtype).double() * (offset + weight.double()))

    def launch_backward(self, dy2, x2, weight, rstd, dx, partial, *, shape, grid, offset, casting_id, compute_dw):
        self.calls += 1
        if self.fail:
            raise RuntimeError("PassManager::run failed")
        assert casting_id == 0 and grid == 3 and shape == self.shape
        x64, dy64, r = x2.double(), dy2.double(), rstd.double()[:, None]
        xhat = x64 * r
        g = dy64 * (offset + weight.double())
        dx.copy_((r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).view_as(dx))
        if compute_dw:
            partial.zero_()
            partial[0] = (dy64 * xhat).sum(0)


@pytest.fixture
def fresh_dispatch():
    """No path turned off or built before the test, and none after it."""
    _dispatch.reset()
    yield
    _dispatch.reset()


def _use_fake_smem(monkeypatch, fake) -> None:
    """rms_norm's dispatch sees `fake` as norm_smem (its conditions and its launchers)."""
    monkeypatch.setattr(rms_cfg, "cluster_launch", fake.cluster_launch)
    monkeypatch.setattr(rms_norm_module, "_cluster_kernels", lambda: fake)


@pytest.mark.parametrize("fail", (False, True))
def test_smem_backward_dispatch_and_build_failure(monkeypatch, fresh_dispatch, fail):
    """Rows the split backward would take go to norm_smem when it is eligible: its dx and its dw
    partial rows (summed over the grid it reports) are what the backward returns. A first build that
    fails warns once, turns the path off and the split backward gives the numbers; later calls do not
    try again."""
    fake = _FakeSmem(fail)
    _use_fake_smem(monkeypatch, fake)
    force_plans(monkeypatch, backward=Plan("split", _SMALL_SPLIT, "forced"))
    x = randn(11, 150, dtype=torch.float32, scale=2.0)
    w = randn(150, dtype=torch.float32)
    if fail:
        with pytest.warns(RuntimeWarning, match="rms_norm_bwd: the cluster kernel did not build.*PassManager.*Triton backward"):
            check_against_reference(x, w, 1e-6, 0.0, "llama")
        assert not _dispatch.path_on("rms_norm_bwd", "cluster") and _dispatch.path_on("rms_norm_fwd", "cluster")
        check_against_reference(x, w, 1e-6, 0.0, "llama")
        assert fake.calls == 1
    else:
        check_against_reference(x, w, 1e-6, 0.0, "llama")
        assert fake.calls == 1
        check_against_reference(x, w, 1e-6, 0.0, "llama", keep="output")  # from the output: the split kernels
        check_against_reference(x, None, 1e-6, 0.0, "llama")  # no weight: the split kernels
        assert fake.calls == 1


def test_smem_backward_takes_the_lengths_its_table_names(monkeypatch, fresh_dispatch):
    """norm_smem's table (cluster_launch) decides which lengths its backward takes, whether or not the
    split backward would take them: a length it has no shape for never reaches it; one it has, under the
    split backward's threshold (the one-kernel backward's lengths), does."""
    fake = _FakeSmem(False)
    _use_fake_smem(monkeypatch, fake)
    check_against_reference(randn(5, 64, dtype=torch.float32), randn(64, dtype=torch.float32), 1e-6, 0.0, "llama")
    assert fake.calls == 0
    assert 150 <= rms_cfg.SPLIT_BACKWARD_FROM  # the split backward would not take these rows
    check_against_reference(randn(11, 150, dtype=torch.float32), randn(150, dtype=torch.float32), 1e-6, 0.0, "llama")
    assert fake.calls == 1


@pytest.mark.parametrize("fail", (False, True))
def test_smem_forward_dispatch_and_build_failure(monkeypatch, fresh_dispatch, fail):
    """Rows with a weight go to norm_smem's forward when it applies: its y and rstd are what the
    forward returns (and the backward reads). A first build that fails warns once, turns the forward
    off (not the backward) and the Triton forward gives the numbers; later calls do not try again."""
    fake = _FakeSmem(False, fail_forward=fail, only="forward")
    _use_fake_smem(monkeypatch, fake)
    x = randn(11, 150, dtype=torch.float32, scale=2.0)
    w = randn(150, dtype=torch.float32)
    if fail:
        with pytest.warns(RuntimeWarning, match="rms_norm_fwd: the cluster kernel did not build.*Triton forward"):
            check_against_reference(x, w, 1e-6, 0.0, "llama")
        assert not _dispatch.path_on("rms_norm_fwd", "cluster") and _dispatch.path_on("rms_norm_bwd", "cluster")
    else:
        check_against_reference(x, w, 1e-6, 0.0, "llama")
    check_against_reference(x, w, 1e-6, 1.0, "llama")
    check_against_reference(x, None, 1e-6, 0.0, "llama")  # not eligible here: the Triton forward
    assert fake.forward_calls == (1 if fail else 2) and fake.calls == 0


def _smem_backward_calls(monkeypatch, launcher="launch_backward"):
    """The shapes norm_smem's `launcher` is called with, from now on."""
    from fused_kernels.ops import norm_smem

    return helpers.launch_shapes(monkeypatch, norm_smem, launcher)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,hidden,dtype,casting_mode,offset,row_pad,weight_grad",
    [
        (1024, 65536, torch.bfloat16, "llama", 0.0, 0, True),
        (1024, 65536, torch.bfloat16, "gemma", 1.0, 0, True),
        (1024, 65536, torch.bfloat16, "none", 0.0, 0, True),
        (2048, 32768, torch.bfloat16, "llama", 1.0, 64, True),  # padded rows: strides differ from N
        (2048, 32768, torch.bfloat16, "llama", 0.0, 0, False),  # no dw
        (300, 49152, torch.float16, "llama", 0.0, 0, True),  # few rows: ~4.5 per cluster
        (4000, 24576, torch.bfloat16, "gemma", 1.0, 0, True),
        (4096, 16384, torch.bfloat16, "llama", 0.0, 0, True),  # 4 CTAs a cluster, 4 chunks
        (1000, 16384, torch.float16, "gemma", 1.0, 64, True),
        (-4096, 16384, torch.bfloat16, "llama", 0.0, 0, True),  # x of (2, 2048, N): rows of dx N apart
    ],
)
def test_gpu_smem_backward_matches_reference(monkeypatch, device, rows, hidden, dtype, casting_mode, offset, row_pad,
                                             weight_grad):
    calls = _smem_backward_calls(monkeypatch)
    torch.manual_seed(0)
    batched, rows = rows < 0, abs(rows)
    base = randn(rows, hidden + row_pad, dtype=dtype, device=device, scale=2.0)
    x = base[:, :hidden].reshape(2, rows // 2, hidden) if batched else base[:, :hidden]
    w = randn(hidden, dtype=dtype, device=device, scale=0.5)
    x_in, w_in = x.detach().clone() if not row_pad else x.detach(), w.clone()
    x_in.requires_grad_(True)
    w_in.requires_grad_(weight_grad)
    y = rms_norm(x_in, w_in, 1e-6, offset, casting_mode)
    dy = randn(*x.shape, dtype=y.dtype, device=device)
    y.backward(dy)
    assert calls == [rms_cfg.cluster_shape(hidden, True)], calls

    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    reference(x64, w64, 1e-6, offset, casting_mode, dtype, dtype).backward(dy.double())
    grads = [("dx", x_in.grad, x64.grad)] + ([("dw", w_in.grad, w64.grad)] if weight_grad else [])
    for name, got, ref in grads:
        assert torch.isfinite(got).all(), f"{name} has NaN/inf"
        assert_close(got, ref, dtype, f"{name} {rows}x{hidden} {casting_mode}")
    assert weight_grad or w_in.grad is None


@pytest.mark.gpu
def test_gpu_smem_backward_off_in_deterministic_mode(monkeypatch, device):
    """Clusters claim rows, so which rows a dw partial row sums varies between runs; deterministic mode
    takes the split backward, whose dw is the same bit for bit."""
    calls = _smem_backward_calls(monkeypatch)
    x = randn(1024, 65536, dtype=torch.bfloat16, device=device)
    w = randn(65536, dtype=torch.bfloat16, device=device)
    dy = randn(1024, 65536, dtype=torch.bfloat16, device=device)

    def dw():
        w_in = w.clone().requires_grad_(True)
        rms_norm(x, w_in).backward(dy)
        return w_in.grad

    first, second = helpers.twice_deterministic(dw)
    assert calls == [] and torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,dtype,casting_mode,offset,row_pad,with_weight",
    [
        (1024, torch.bfloat16, "llama", 0.0, 0, True),
        (1024, torch.bfloat16, "gemma", 1.0, 64, True),  # padded rows: x's stride differs from N
        (600, torch.float16, "none", 0.0, 0, True),
        (400, torch.bfloat16, "llama", 1.0, 0, True),  # few rows: ~4 per cluster
        (1024, torch.bfloat16, "llama", 0.0, 0, False),  # no weight
    ],
)
def test_gpu_smem_forward_matches_reference(monkeypatch, device, rows, dtype, casting_mode, offset, row_pad,
                                            with_weight):
    """Rows of 65536 take norm_smem's forward: y (poisoned first) against float64, and the backward
    from the rstd it saved."""
    calls = _smem_backward_calls(monkeypatch, "launch_forward")
    torch.manual_seed(0)
    x = randn(rows, 65536 + row_pad, dtype=dtype, device=device, scale=2.0)[:, :65536]
    w = randn(65536, dtype=dtype, device=device, scale=0.5) if with_weight else None
    check_against_reference(x, w, 1e-6, offset, casting_mode)
    assert calls == [rms_cfg.cluster_shape(65536, False)], calls


@pytest.mark.gpu
def test_gpu_claim_counter_resets_itself_and_graphs_capture(device):
    """The row-claiming kernels leave their stream's counter at zero (no fill per launch), so a second
    launch claims every row again and gives the same y bit for bit; launches captured in a CUDA graph use
    a counter of their own and replay to the same numbers."""
    from fused_kernels import _gpu as smem_ce
    x = randn(1024, 65536, dtype=torch.bfloat16, device=device)
    w = randn(65536, dtype=torch.bfloat16, device=device)
    y1 = rms_norm(x, w)
    y2 = rms_norm(x, w)
    x_in, w_in = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rms_norm(x_in, w_in).backward(torch.ones_like(x))
    torch.cuda.synchronize()
    counters = [c for (index, _stream), c in smem_ce._CLAIM_COUNTERS.items() if index == x.device.index]
    assert counters and all(int(c.item()) == 0 for c in counters)
    assert torch.isfinite(y1).all() and torch.equal(y1, y2)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        rms_norm(x, w)  # warm up on the side stream (its own counter), as torch.cuda.graph wants
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = rms_norm(x, w)
    for _ in range(2):
        y_graph.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y1)
