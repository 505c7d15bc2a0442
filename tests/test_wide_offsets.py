"""Offsets past 2**31 elements, on the CPU: every op reads rows that lie more than 2**31 elements from its
tensors' base, without 2**31 elements of data.

How: one 16-bit buffer of START + 2·STRIDE + a few thousand elements (8 GiB of address space) made by
torch.empty, which touches none of it: only the pages of the rows a test writes become resident (a few
MiB). Inputs are strided views over it, row r (or batch r) at START + r·STRIDE. STRIDE is below 2**31, so
Triton passes it as a 32-bit integer and a kernel that forms row × stride in 32 bits gets a wrapped,
negative offset for row 2 (2·STRIDE > 2**31 − 1); the views begin START = 2**31 elements into the buffer, so
such an offset still points inside it and the test fails on its numbers instead of crashing. Each row is
compared with a float64 reference on its own, so a wrong far row cannot hide in a norm over the tensor.

Outputs the ops allocate themselves are dense and small here; kernels index them with the same 64-bit
row arithmetic, which tests/test_wide_offsets_gpu.py checks on tensors of more than 2**31 elements. The
GLU's in-place backward writes into the caller's far rows, so it is checked here for stores too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fused_kernels
from fused_kernels._activations import GELU_TANH, SILU
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts
from fused_kernels.ops import cross_entropy as ce_module
from fused_kernels.ops import cross_entropy_config as ce_cfg
from fused_kernels.ops import fused_linear_cross_entropy as flce_module
from fused_kernels.ops import gelu as gelu_module
from fused_kernels.ops import glu as glu_module
from fused_kernels.ops import glu_config
from fused_kernels.ops import layer_norm as ln_module
from fused_kernels.ops import layer_norm_config as ln_cfg
from fused_kernels.ops import rms_norm as rms_module
from fused_kernels.ops import rms_norm_config as rms_cfg
from fused_kernels.ops import rope as rope_module
from fused_kernels.ops import rope_config
from helpers import REL_TOL, poison_, poisoned_outputs, randn, rel_err

INT32_MAX = 2**31 - 1
STRIDE = 2**30 + 256  # a row (or batch) stride that fits 32 bits; row 2 lies at 2·STRIDE > INT32_MAX
START = 2**31  # where every view begins: a wrapped 32-bit offset (>= -2**31) stays inside the buffer
ROWS = 3  # rows 0 and 1 below 2**31 elements, row 2 past it
DTYPE = torch.bfloat16
TOL = REL_TOL[DTYPE]
H100 = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)


@pytest.fixture(scope="module")
def arena():
    """The reserved buffer (see the module docstring); STRIDE must stay a 32-bit argument."""
    assert STRIDE <= INT32_MAX < (ROWS - 1) * STRIDE
    return torch.empty(START + (ROWS - 1) * STRIDE + 8192, dtype=DTYPE)


def far(arena, shape, strides, column, scale=1.0):
    """A view of `shape` / `strides` over the arena at element START + column, filled with random values."""
    view = arena.as_strided(shape, strides, START + column)
    view.copy_(randn(*shape, scale=scale))
    return view


def far_rows(arena, n_cols, column, scale=1.0):
    """ROWS rows of n_cols, row r at START + r·STRIDE + column."""
    return far(arena, (ROWS, n_cols), (STRIDE, 1), column, scale)


def assert_rows_close(out, ref, what, tol=TOL):
    """Each slice along dim 0 (row or batch) within tol of the reference, finite (NaN and inf never pass)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    for r in range(out.shape[0]):
        err = rel_err(out[r], ref[r])
        assert err <= tol, (f"{what}, row {r} (element offset {r * STRIDE:,} from the view's base"
                            f"{', past 2**31' if r * STRIDE > INT32_MAX else ''}): relative error {err:.3e} > {tol:.0e}")


# --- RMSNorm: forward and backward on each Triton path ---------------------------------------------------

_RMS_PATHS = {
    # the whole row in registers (the interpreter's table for 150 columns), both directions
    "single-pass": (None, None),
    # 150 columns swept twice in chunks of 64, 2 rows a tile, persistent programs
    "chunked": (Plan("triton", rms_cfg.LaunchConfig(block_n=64, rows=2, num_warps=4, programs_per_sm=1.5,
                                                    chunked=True), "forced"),) * 2,
    # the split backward: row-dot blocks of 64 columns, then dx/dw in blocks of 32 by row group
    "split": (None, Plan("split", rms_cfg.SplitBackwardConfig(dot_block=64, dot_warps=4, block_n=32, num_warps=4,
                                                              programs_per_sm=8, num_stages=2), "forced")),
}


def _rms_reference(x64, w64, eps):
    """LlamaRMSNorm in float64, with its rounding of the normalised value to bf16 before the weight."""
    xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return w64 * xhat.to(DTYPE).to(torch.float64)


@pytest.mark.parametrize("path", list(_RMS_PATHS))
def test_rms_norm_far_rows(arena, monkeypatch, path):
    forward, backward = _RMS_PATHS[path]
    real_plan = rms_cfg.plan
    monkeypatch.setattr(rms_module, "plan", lambda call, device: (forward if call.direction == "forward" else backward)
                        or real_plan(call, device))
    n = 150
    x = far_rows(arena, n, 0, scale=2.0)
    dy = far_rows(arena, n, n)
    w = randn(n, dtype=DTYPE) + 1.0
    x_in, w_in = x.detach().requires_grad_(True), w.clone().requires_grad_(True)
    with poisoned_outputs(rms_module):
        y = fused_kernels.rms_norm(x_in, w_in, eps=1e-6)
        y.backward(dy)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = _rms_reference(x64, w64, 1e-6)
    ref.backward(dy.double())
    assert_rows_close(y, ref, "y")
    assert_rows_close(x_in.grad, x64.grad, "dx")
    assert rel_err(w_in.grad, w64.grad) <= TOL, f"dw: relative error {rel_err(w_in.grad, w64.grad):.3e}"


# --- LayerNorm: forward and backward on each Triton path -------------------------------------------------

def _ln_config(chunked: bool, param_grid):
    block = 32 if chunked else 256
    return ln_cfg.LayerNormConfig(fwd_rows=1, fwd_block=block, fwd_chunked=chunked, fwd_warps=4, fwd_programs=2,
                                  fwd_stages=1, bwd_rows=1, bwd_block=block, bwd_chunked=chunked, bwd_warps=4,
                                  bwd_programs=2, bwd_stages=1, param_grid=param_grid)


_LN_CONFIGS = {
    "whole-row": None,  # plan()'s own: 150 columns held whole
    # rows swept twice in 32-column chunks; dw/db from the chunked backward's partial rows
    "chunked": _ln_config(True, None),
    # the same, dw/db from the column-parallel kernel: 2 row groups of 2-row loads, 32-column programs
    "chunked-param-kernel": _ln_config(True, (2, 32, 4, 2)),
}


@pytest.mark.parametrize("path", list(_LN_CONFIGS))
def test_layer_norm_far_rows(arena, monkeypatch, path):
    monkeypatch.setitem(ln_cfg._CONFIG, "force", _LN_CONFIGS[path])
    n = 150
    x = far_rows(arena, n, 0, scale=2.0)
    dy = far_rows(arena, n, n)
    w, b = randn(n, dtype=DTYPE) + 1.0, randn(n, dtype=DTYPE)
    x_in, w_in, b_in = x.detach().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with poisoned_outputs(ln_module):
        y = fused_kernels.layer_norm(x_in, w_in, b_in, 1e-5)
        y.backward(dy)
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    ref = F.layer_norm(x64, (n,), w64, b64, 1e-5)
    ref.backward(dy.double())
    assert_rows_close(y, ref, "y")
    assert_rows_close(x_in.grad, x64.grad, "dx")
    for name, got, want in (("dweight", w_in.grad, w64.grad), ("dbias", b_in.grad, b64.grad)):
        assert rel_err(got, want) <= TOL, f"{name}: relative error {rel_err(got, want):.3e}"


# --- RoPE: q, k, cos, sin and the output gradients with far batches ----------------------------------------

def _rope_reference(x64, cos64, sin64, interleaved):
    """transformers' apply_rotary_pos_emb on the first rot channels (unsqueeze_dim=1), the rest passed."""
    rot = cos64.shape[-1]
    c, s = cos64.unsqueeze(1), sin64.unsqueeze(1)
    xr, xp = x64[..., :rot], x64[..., rot:]
    if interleaved:
        rotated = torch.stack((-xr[..., 1::2], xr[..., ::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), dim=-1)
    return torch.cat((xr * c + rotated * s, xp), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_far_batches(arena, interleaved):
    """Batch b of q, k (the (batch, heads, seq, head_dim) view of a (batch, seq, heads, head_dim) buffer, as
    HF's transpose(1, 2) gives), of cos / sin (batch, seq, rot) and of the output gradients at b·STRIDE;
    partial rotary (rot 12 of head_dim 16), GQA (4 q heads, 2 k heads)."""
    seq, hq, hk, d, rot = 5, 4, 2, 16, 12
    col = 0

    def batch_far(heads, width):  # (ROWS, heads, seq, width) over (seq, heads, width) per batch
        nonlocal col
        view = far(arena, (ROWS, heads, seq, width), (STRIDE, width, heads * width, 1), col)
        col += heads * seq * width
        return view

    q, k = batch_far(hq, d), batch_far(hk, d)
    cos = far(arena, (ROWS, seq, rot), (STRIDE, rot, 1), col)
    sin = far(arena, (ROWS, seq, rot), (STRIDE, rot, 1), col + seq * rot)
    col += 2 * seq * rot
    dq_out, dk_out = batch_far(hq, d), batch_far(hk, d)
    q_in, k_in = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    with poisoned_outputs(rope_module):
        q_out, k_out = fused_kernels.rope(q_in, k_in, cos, sin, 1, interleaved=interleaved)
        torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
    cos64, sin64 = cos.double(), sin.double()
    q_ref, k_ref = (_rope_reference(t, cos64, sin64, interleaved) for t in (q64, k64))
    torch.autograd.backward((q_ref, k_ref), (dq_out.double(), dk_out.double()))
    assert_rows_close(q_out, q_ref, "q_out")
    assert_rows_close(k_out, k_ref, "k_out")
    assert_rows_close(q_in.grad, q64.grad, "dq")
    assert_rows_close(k_in.grad, k64.grad, "dk")


# --- SwiGLU / GeGLU: far rows in, and the in-place backward's stores into far rows --------------------------

def _glu_reference(op, gate64, up64):
    act = F.silu(gate64) if op == "swiglu" else F.gelu(gate64, approximate="tanh")
    return act * up64


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_glu_far_rows(arena, op):
    """gate and up as the halves of far gate_up rows (row stride STRIDE): plan() picks 64-bit indexing, and the
    forward, the backward and the in-place backward (gradients written over gate and up) match float64."""
    n = 100
    gate, up = far_rows(arena, n, 0), far_rows(arena, n, n)
    dout = far_rows(arena, n, 2 * n)
    p = glu_config.plan(glu_config.Call(ROWS, n, 2, "fwd", row_strides=(STRIDE, STRIDE, n)), H100)
    assert p.config.wide_index and "64-bit" in p.reason, p
    gate64, up64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    ref = _glu_reference(op, gate64, up64)
    ref.backward(dout.double())
    gate_in, up_in = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
    with poisoned_outputs(glu_module, "_empty_output"):
        out = getattr(fused_kernels, op)(gate_in, up_in)
        out.backward(dout)
    assert_rows_close(out, ref, "out")
    assert_rows_close(gate_in.grad, gate64.grad, "dgate")
    assert_rows_close(up_in.grad, up64.grad, "dup")
    # in place: dgate over gate's far rows, dup over up's (the stores' offsets pass 2**31)
    act = SILU if op == "swiglu" else GELU_TANH
    dgate, dup = glu_module._backward(f"{op}_bwd", dout, gate, up, act, in_place=True)
    assert dgate.data_ptr() == gate.data_ptr() and dup.data_ptr() == up.data_ptr()
    assert_rows_close(gate, gate64.grad, "dgate written over gate")
    assert_rows_close(up, up64.grad, "dup written over up")


def test_glu_plan_index_width():
    """plan() takes 64-bit offsets where one can pass 2**31 − 1 (its bound counts a whole last tile of rows):
    contiguous tensors of 2**31 elements or more (one flat row), row views whose last rows start past it;
    32-bit well below."""
    def wide(n_rows, n_cols, strides=None):
        return glu_config.plan(glu_config.Call(n_rows, n_cols, 2, "fwd", row_strides=strides), H100).config.wide_index

    tokens, inter = 2**19 + 8, 4096  # 512K tokens x 4096 > 2**31 elements
    assert wide(tokens, inter) and wide(tokens, inter, (2 * inter, 2 * inter, inter))
    assert not wide(2**19 - 8, inter) and not wide(2**18 - 8, inter, (2 * inter, 2 * inter, inter))
    assert wide(3, 100, (STRIDE, STRIDE, 100)) and not wide(3, 100, (2**28, 2**28, 100))


# --- cross entropy: far logits rows on each Triton launch shape -----------------------------------------------

_CE_SHAPES = {
    "whole-row": dict(force=ce_cfg.LaunchConfig(block=1024, warps=4, per_sm=0)),  # a row in registers
    "blocks": dict(force=ce_cfg.LaunchConfig(block=64, warps=4, per_sm=0)),  # 64-class blocks, masked tail
    "persistent": dict(force=ce_cfg.LaunchConfig(block=64, warps=4, per_sm=1, stages=2, l2_hints=True),
                       sm_count=2),  # 2 programs looping over the rows
}


@pytest.mark.parametrize("shape", list(_CE_SHAPES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_far_rows(arena, monkeypatch, shape, reduction):
    for key, value in dict(_CE_SHAPES[shape], poison=True).items():
        monkeypatch.setitem(ce_module._CONFIG, key, value)
    v = 300
    logits = far_rows(arena, v, 0, scale=3.0)
    target = torch.randint(0, v, (ROWS,))
    upstream = randn(ROWS) if reduction == "none" else torch.tensor(0.7)
    x_in = logits.detach().requires_grad_(True)
    loss = fused_kernels.cross_entropy(x_in, target, reduction=reduction)
    loss.backward(upstream)
    x64 = logits.double().requires_grad_(True)
    ref = F.cross_entropy(x64, target, reduction=reduction)
    ref.backward(upstream.double())
    if reduction == "none":
        assert_rows_close(loss, ref, "per-row loss", tol=REL_TOL[torch.float32])
    else:
        assert rel_err(loss, ref) <= REL_TOL[torch.float32], f"loss {loss.item()} vs {ref.item()}"
    assert_rows_close(x_in.grad, x64.grad, "dlogits")


def test_flce_side_stats_far_rows(arena):
    """fused_linear_cross_entropy's statistics kernel (entropy, log Σp², mean logit, target is top-1) over
    far logits rows, as it reads a chunk; its loss and gradient go through the cross-entropy kernel above."""
    v = 300
    logits = far_rows(arena, v, 0, scale=3.0)
    target = torch.randint(0, v, (ROWS,))
    target[1] = logits[1].float().argmax()
    out = {name: torch.full((ROWS,), float("nan")) for name in flce_module.SIDE_STATS}
    top1 = torch.zeros(ROWS, dtype=torch.bool)
    flce_module._side_stats_(logits, target, dict(softcap=None, logit_scale=1.0), out, top1)
    z = logits.double()
    p = z.softmax(-1)
    # Each may lie near 0 (a peaked row: entropy and log Σp²; the mean logit by chance), so each error is
    # measured against a scale that does not vanish: 1 + |value| for the two logarithmic ones (an error in
    # log Σp² is a relative error of Σp²), the rows' mean |z| for the mean logit.
    want = {"entropy": (-(p * p.log()).sum(-1), None), "log_sum_sq_probs": (p.pow(2).sum(-1).log(), None),
            "mean_logits": (z.mean(-1), z.abs().mean(-1))}
    for name, (ref, scale) in want.items():
        scale = 1.0 + ref.abs() if scale is None else scale
        err = (out[name].double() - ref).abs() / scale
        assert torch.isfinite(out[name]).all() and (err <= REL_TOL[torch.float32]).all(), (
            f"{name}: {out[name].tolist()} vs {ref.tolist()} (rows 0, 1 and 2, the last past 2**31)")
    assert top1.tolist() == (z.argmax(-1) == target).tolist()


# --- launch grids at long-context shapes: within CUDA's limits ---------------------------------------------

GRID_X_MAX, GRID_YZ_MAX = 2**31 - 1, 65535


def test_grids_at_long_context_shapes():
    """The launch grids the host computes for shapes past 2**31 elements stay within CUDA's grid limits (x below
    2**31, y and z at most 65535): the flat elementwise kernels, RMSNorm's split backward (column blocks on y),
    LayerNorm's dw/db kernel (row groups on y), RoPE's token blocks and cross entropy's rows."""
    tokens = 2**20  # 1M tokens
    # GLU and GELU over 1M x 16384 bf16 (2**34 elements): one program per tile of 4096 / 8192 elements
    glu = glu_config.plan(glu_config.Call(tokens, 16384, 2, "bwd"), H100).config
    assert glu.wide_index and glu.programs <= GRID_X_MAX
    gelu = gelu_module.plan(gelu_module.Call(tokens * 16384, 2), H100).config
    assert -(-tokens * 16384 // gelu.block) <= GRID_X_MAX
    # RMSNorm split backward of rows of 2**20 columns: (rows, row-dot blocks) and (row groups, column blocks)
    split = rms_cfg.SplitBackwardConfig()
    n_cols = 2**20
    assert -(-n_cols // split.dot_block) <= GRID_YZ_MAX and -(-n_cols // split.block_n) <= GRID_YZ_MAX
    # LayerNorm's dw/db kernel: (column blocks, row groups)
    for n_rows, width in ((tokens, 16384), (2**17, 2**20)):
        config = ln_cfg.plan(ln_cfg.Call(n_rows, width, DTYPE, "backward"), dataclasses.replace(H100, gluon=False))
        _rows, block_n, _warps, groups = config.config.param_grid
        assert groups <= GRID_YZ_MAX and -(-width // block_n) <= GRID_X_MAX, config
    # RoPE: one program per BLOCK_T tokens, whatever the heads
    assert -(-tokens * 8 // min(rope_config._TILE_SIZES)) <= GRID_X_MAX
    # cross entropy: at most one program per row
    ce = ce_cfg.plan(ce_cfg.Call(tokens, 128256, DTYPE, DTYPE, True), H100)
    assert ce_cfg.grid_programs(ce.config, tokens, H100) <= min(tokens, GRID_X_MAX)
    assert ce.path in (Path.TRITON, Path.SMEM, Path.SMEM_SPLIT, Path.SMEM_REGISTERS)
