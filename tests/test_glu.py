"""SwiGLU / GeGLU kernels (fused_kernels/glu.py) against float64 references.

Inputs are random (never zeros), laid out contiguously or as strided views (halves of a fused
gate_up tensor, transposed, every other row, sliced rows); every output buffer the op allocates is
poisoned with NaN first; gradients are checked against float64 autograd with a random upstream
gradient. Small tile sizes are forced in some runs so that multi-program grids and masked tails run
under the interpreter too.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, reject
from hypothesis import strategies as st

import fused_kernels
from fused_kernels._dispatch import Path
from fused_kernels._gpu import OFF_GPU, DeviceFacts
from fused_kernels.ops import glu
from fused_kernels.ops import glu_config
from helpers import REL_TOL, assert_close, plan, poison_, randn, rel_err

H200 = DeviceFacts(True, 132, (9, 0), 233472, True)

# Saturated activations overflow exp() to inf inside the interpreter's numpy (harmless: σ → 0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (op, approximate): approximate is None for swiglu.
OPS = [("swiglu", None), ("geglu", "tanh"), ("geglu", "none")]
LAYOUTS = ["contiguous", "transposed", "second_half", "every_other_row", "sliced_rows"]


def run_op(op, approximate, gate, up):
    if op == "swiglu":
        return fused_kernels.swiglu(gate, up)
    return fused_kernels.geglu(gate, up, approximate=approximate)


def reference(op, approximate, gate, up, dtype=torch.float64):
    """The same op with torch's own activations, computed in `dtype`."""
    g, u = gate.to(dtype), up.to(dtype)
    act = F.silu(g) if op == "swiglu" else F.gelu(g, approximate=approximate)
    return act * u


def layout(lead, cols, kind):
    """(shape of a leaf tensor, function leaf -> a view of shape (*lead, cols) with that layout)."""
    n = len(lead)
    if kind == "transposed":  # every stride reversed: last-dim stride is not 1
        return (cols, *lead[::-1]), lambda t: t.permute(*range(n, -1, -1))
    if kind == "second_half":  # like up in x.chunk(2, -1): row stride 2·cols, offset storage
        return (*lead, 2 * cols), lambda t: t[..., cols:]
    if kind == "every_other_row" and n:  # leading dims still collapse into one row stride
        return (*lead[:-1], 2 * lead[-1], cols), lambda t: t[..., ::2, :]
    if kind == "sliced_rows" and n:  # leading dims that do not collapse (copied)
        return (*lead[:-1], lead[-1] + 1, cols), lambda t: t[..., : lead[-1], :]
    return (*lead, cols), lambda t: t


@contextlib.contextmanager
def poisoned_outputs_and_tile(tile=None):
    """Every buffer glu allocates starts as NaN; optionally force a small tile (many programs)."""
    real_empty = glu._empty_output
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(glu, "_empty_output", lambda shape, like: poison_(real_empty(shape, like)))
        )
        if tile is not None:
            stack.enter_context(mock.patch.dict(glu_config._TILE_ELEMS, {2: tile, 4: tile}))
        yield


@st.composite
def shapes(draw, max_numel=1536):
    """(leading dims, cols): 0–3 leading dims (zeros allowed), numel kept small for the interpreter."""
    cols = draw(st.sampled_from([1, 2, 7, 16, 33, 64, 100, 257]))
    budget = max(1, max_numel // cols)
    lead = []
    for _ in range(draw(st.integers(0, 3))):
        size = draw(st.integers(0, min(6, budget)))
        lead.append(size)
        budget = max(1, budget // max(size, 1))
    return tuple(lead), cols


def check_forward_backward(op, approximate, lead, cols, dtype, gate_kind, up_kind, fused, dout_kind, tile,
                           scale=1.0, seed=0, out_of_reach=None):
    """Run op forward + backward on views of random leaves (drawn from `seed`); compare against float64
    autograd. out_of_reach: called instead of comparing when torch's own op computed in float32 and
    rounded once to `dtype` (the most a float32 kernel can do) already misses the float64 result by more
    than the dtype's bound: fp16 subnormal gradients (a value of 1e-7 has 2-3 % rounding steps), or a
    GELU of a gate below about -6, where 1 + erf(x/√2) cancels to 0 in float32 (torch's F.gelu gives 0
    too). Such examples only come up with every element in that regime (tiny tensors, large scale);
    the hypothesis test rejects them."""
    gen = torch.Generator().manual_seed(seed)
    if fused:  # both halves of one gate_up tensor, exactly as a fused gate_up_proj produces them
        leaf_shapes = [(*lead, 2 * cols)]

        def views(leaves):
            return leaves[0].chunk(2, dim=-1)
    else:
        (gshape, gview), (ushape, uview) = layout(lead, cols, gate_kind), layout(lead, cols, up_kind)
        leaf_shapes = [gshape, ushape]

        def views(leaves):
            return gview(leaves[0]), uview(leaves[1])

    leaves = [randn(*s, dtype=dtype, scale=scale, requires_grad=True, generator=gen) for s in leaf_shapes]
    gate, up = views(leaves)
    assert gate.shape == up.shape == (*lead, cols)

    dshape, dview = layout(lead, cols, dout_kind)
    if dout_kind == "expanded":
        dout = randn(cols, dtype=dtype, generator=gen).expand(*lead, cols)
    else:
        dout = dview(randn(*dshape, dtype=dtype, generator=gen))

    with poisoned_outputs_and_tile(tile):
        out = run_op(op, approximate, gate, up)
        out.backward(dout)

    leaves64 = [leaf.detach().to(torch.float64).requires_grad_(True) for leaf in leaves]
    ref = reference(op, approximate, *views(leaves64))
    ref.backward(dout.to(torch.float64))

    what = f"{op}/{approximate} {dtype} lead={lead} cols={cols} {gate_kind}/{up_kind} fused={fused} tile={tile}"
    assert out.dtype == dtype and out.shape == gate.shape and out.is_contiguous()
    if out_of_reach is not None:
        leaves32 = [leaf.detach().float().requires_grad_(True) for leaf in leaves]
        best = reference(op, approximate, *views(leaves32), dtype=torch.float32)
        best.backward(dout.float())
        pairs = [(best, ref), *((l32.grad, l64.grad) for l32, l64 in zip(leaves32, leaves64))]
        if any(rel_err(got.to(dtype), want) > REL_TOL[dtype] for got, want in pairs):
            out_of_reach()
    assert_close(out, ref, dtype, f"out {what}")
    for i, (leaf, leaf64) in enumerate(zip(leaves, leaves64)):
        assert leaf.grad is not None and leaf.grad.dtype == dtype
        assert_close(leaf.grad, leaf64.grad, dtype, f"grad of leaf {i} {what}")


@given(
    shape=shapes(),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    gate_kind=st.sampled_from(LAYOUTS),
    up_kind=st.sampled_from(LAYOUTS),
    fused=st.booleans(),
    dout_kind=st.sampled_from(["contiguous", "transposed", "expanded", "second_half"]),
    tile=st.sampled_from([None, 64, 256]),
    scale=st.sampled_from([1.0, 6.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_layouts_dtypes(shape, dtype, op, gate_kind, up_kind, fused, dout_kind, tile, scale, seed):
    lead, cols = shape
    check_forward_backward(op[0], op[1], lead, cols, dtype, gate_kind, up_kind, fused, dout_kind, tile, scale,
                           seed, out_of_reach=reject)


@pytest.mark.parametrize("op,approximate", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead,cols,fused,kind,tile",
    [
        ((3, 5), 48, True, "contiguous", None),  # fused gate_up halves, the HF gate_up_proj case
        ((13,), 37, False, "contiguous", 64),  # flat path, masked tail over many programs
        ((2, 9), 40, False, "every_other_row", 64),  # strided rows, 2-D tiles with a column tail
        ((4, 3), 11, False, "transposed", None),  # copied to rows first
        ((0, 5), 16, True, "contiguous", None),  # zero rows
    ],
)
def test_every_op_dtype_layout(op, approximate, dtype, lead, cols, fused, kind, tile):
    check_forward_backward(op, approximate, lead, cols, dtype, kind, kind, fused, "contiguous", tile)


@pytest.mark.parametrize("op,approximate", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_gate_values(op, approximate, dtype):
    """Saturated activations (|gate| up to 1e4) stay finite and exact in value and gradient."""
    values = torch.tensor([-1e4, -300.0, -80.0, -20.0, -5.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 5.0, 20.0, 80.0,
                           300.0, 1e4])
    gate = values.repeat(4, 1).to(dtype).requires_grad_(True)
    up = randn(4, values.numel(), dtype=dtype, requires_grad=True)
    dout = randn(4, values.numel(), dtype=dtype)
    with poisoned_outputs_and_tile():
        out = run_op(op, approximate, gate, up)
        out.backward(dout)
    g64, u64 = (t.detach().double().requires_grad_(True) for t in (gate, up))
    ref = reference(op, approximate, g64, u64)
    ref.backward(dout.double())
    for got, want, name in [(out, ref, "out"), (gate.grad, g64.grad, "dgate"), (up.grad, u64.grad, "dup")]:
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        assert_close(got, want, dtype, f"{name} {op}/{approximate}")


def test_rounds_once_from_fp32(device):
    """Each bf16 output element is the exact value rounded once: within one bf16 step of float64
    (HF rounds twice: act, then the product). On the GPU the rounding is to nearest, so nearly every
    element equals the float64 value rounded to nearest; the interpreter truncates, hence one step."""
    gate = randn(64, 96, dtype=torch.bfloat16, scale=2.0, device=device)
    up = randn(64, 96, dtype=torch.bfloat16, device=device)
    ours = fused_kernels.swiglu(gate, up).double()
    exact = reference("swiglu", None, gate, up)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # bf16 spacing at |exact|
    assert ((ours - exact).abs() <= step).all()
    if device.type == "cuda":
        assert (ours == exact.to(torch.bfloat16).double()).float().mean().item() > 0.99


def test_backward_saves_only_gate_and_up():
    """The output is never saved: autograd holds exactly the two inputs (here the halves of one tensor)."""
    for op, approximate in OPS:
        x = randn(6, 2 * 40, dtype=torch.bfloat16, requires_grad=True)
        gate, up = x.chunk(2, dim=-1)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_op(op, approximate, gate, up)
        assert len(saved) == 2, f"{op}: saved {len(saved)} tensors"
        assert {(t.data_ptr(), t.shape) for t in saved} == {(gate.data_ptr(), gate.shape), (up.data_ptr(), up.shape)}
        assert all(t.data_ptr() != out.data_ptr() for t in saved)


GLU_LINEAR_ACTS = {"silu": ("swiglu", None), "gelu_tanh": ("geglu", "tanh"), "gelu": ("geglu", "none")}


@pytest.mark.parametrize("activation", list(GLU_LINEAR_ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_glu_linear_matches_float64(activation, dtype, with_bias):
    """linear(act(gate) * up, W, b): output and every gradient against float64, from the halves of one
    fused projection (strided views), with poisoned output buffers."""
    op, approximate = GLU_LINEAR_ACTS[activation]
    x = randn(2, 5, 2 * 48, dtype=dtype, requires_grad=True)
    w = randn(24, 48, dtype=dtype, scale=0.2, requires_grad=True)
    b = randn(24, dtype=dtype, requires_grad=True) if with_bias else None
    dout = randn(2, 5, 24, dtype=dtype)
    with poisoned_outputs_and_tile():
        gate, up = x.chunk(2, dim=-1)
        out = fused_kernels.glu_linear(gate, up, w, b, activation=activation)
        out.backward(dout)
    leaves = [t for t in (x, w, b) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    g64, u64 = ref_leaves[0].chunk(2, dim=-1)
    ref = F.linear(reference(op, approximate, g64, u64), ref_leaves[1], ref_leaves[2] if with_bias else None)
    ref.backward(dout.double())
    assert out.dtype == dtype
    assert_close(out, ref, dtype, f"{activation} out")
    for t, r, name in zip(leaves, ref_leaves, ("gate/up", "weight", "bias")):
        assert_close(t.grad, r.grad, dtype, f"{activation} grad {name}")


def test_glu_linear_does_not_keep_the_product():
    """Autograd keeps gate, up and the weight, never act(gate) * up; the backward recomputes it."""
    x = randn(4, 2 * 32, requires_grad=True)
    w = randn(16, 32, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_kernels.glu_linear(gate, up, w)
    assert {(t.data_ptr(), tuple(t.shape)) for t in saved} == {
        (gate.data_ptr(), (4, 32)), (up.data_ptr(), (4, 32)), (w.data_ptr(), (16, 32))}
    before = fused_kernels.launch_counts()
    out.sum().backward()
    after = fused_kernels.launch_counts()
    assert after.get("swiglu_recompute", 0) - before.get("swiglu_recompute", 0) == 1
    assert after.get("swiglu_bwd", 0) - before.get("swiglu_bwd", 0) == 1


@pytest.mark.parametrize("fused", [False, True], ids=["gate_proj+up_proj", "gate_up_proj"])
def test_glu_linear_temporaries_take_their_gradients(fused):
    """temporaries=True: dgate and dup are written over gate and up (no new buffers), the gradients
    are the same as without, a retain_graph second backward fails loudly, and leaves are never
    overwritten even when the flag is passed."""
    x = randn(3, 4, 16, requires_grad=True)
    wg, wu, wd = randn(24, 16, scale=0.3), randn(24, 16, scale=0.3), randn(16, 24, scale=0.3, requires_grad=True)
    dout = randn(3, 4, 16)

    def run(temporaries, retain=False):
        x.grad = wd.grad = None
        if fused:
            gate, up = F.linear(x, torch.cat([wg, wu])).chunk(2, dim=-1)
        else:
            gate, up = F.linear(x, wg), F.linear(x, wu)
        seen = {}
        gate.register_hook(lambda g: seen.update(dgate=g.data_ptr()))
        out = fused_kernels.glu_linear(gate, up, wd, temporaries=temporaries)
        out.backward(dout, retain_graph=retain)
        return out, x.grad.clone(), wd.grad.clone(), seen["dgate"] == gate.data_ptr(), out

    ref_out, ref_dx, ref_dw, ref_shared, _ = run(False)
    out, dx, dw, shared, _ = run(True)
    assert shared and not ref_shared
    for a, b, what in ((out, ref_out, "out"), (dx, ref_dx, "dx"), (dw, ref_dw, "dweight")):
        assert_close(a, b, torch.float32, what, tol=1e-6)
    with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
        *_, out = run(True, retain=True)
        out.backward(dout)
    gate, up = randn(5, 8, requires_grad=True), randn(5, 8, requires_grad=True)
    kept = gate.detach().clone(), up.detach().clone()
    fused_kernels.glu_linear(gate, up, randn(4, 8), temporaries=True).sum().backward()
    assert torch.equal(gate.detach(), kept[0]) and torch.equal(up.detach(), kept[1])


def test_glu_linear_bad_inputs():
    gate, up = randn(3, 8), randn(3, 8)
    with pytest.raises(ValueError, match="out_features, 8"):
        fused_kernels.glu_linear(gate, up, randn(4, 7))
    with pytest.raises(TypeError, match="dtype"):
        fused_kernels.glu_linear(gate, up, randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="activation"):
        fused_kernels.glu_linear(gate, up, randn(4, 8), activation="relu")


def test_chunked_halves_are_read_in_place():
    """Halves of a fused gate_up tensor reach the kernel as strided views, not copies."""
    x = randn(3, 5, 2 * 24)
    gate, up = x.chunk(2, dim=-1)
    for half in (gate, up):
        rows = glu._as_rows(half)
        assert rows.data_ptr() == half.data_ptr() and rows.shape == (15, 24) and rows.stride() == (48, 1)
    every_other = randn(4, 10, 8)[:, ::2]
    assert glu._as_rows(every_other).data_ptr() == every_other.data_ptr()
    transposed = randn(8, 6).t()
    assert glu._as_rows(transposed).is_contiguous()


def test_block_config():
    # The H200 target shape: a power-of-two column block that divides 14336, so no masked tail.
    cfg = glu_config._block_config(16384, 14336, 2, "bwd")
    assert 14336 % cfg.block_n == 0 and cfg.block_m * cfg.block_n <= glu_config._TILE_ELEMS[2]
    # Flat contiguous launch: one long row.
    cfg = glu_config._block_config(1, 16384 * 14336, 2, "fwd")
    assert cfg.block_m == 1 and cfg.block_n == glu_config._TILE_ELEMS[2]
    for n_rows, n_cols, elem in [(1, 1, 4), (1000, 7, 2), (3, 5, 4), (5, 4097, 2), (1, 12289, 4)]:
        for direction in ("fwd", "bwd"):
            cfg = glu_config._block_config(n_rows, n_cols, elem, direction)
            tile = glu_config._TILE_ELEMS[elem]
            assert cfg.block_m * cfg.block_n <= max(tile, triton_pow2(n_cols))
            assert cfg.block_m == triton_pow2(cfg.block_m) and cfg.block_n == triton_pow2(cfg.block_n)
            assert cfg.block_m <= triton_pow2(n_rows) and 1 <= cfg.num_warps <= 32


def test_plan_for_named_shapes():
    """plan() names the layout path, the tile and why: SwiGLU 16384 x 14336 bf16 contiguous (one flat
    row) and as the halves of a fused gate_up output (row stride 2 x 14336); fp32 tiles are half as
    long; offsets past 2**31 switch to 64-bit indexing."""
    G = glu_config.GluConfig
    p = plan(glu_config, 16384, 14336, 2, "fwd", device=H200)
    assert p == plan(glu_config, 16384, 14336, 2, "fwd", device=OFF_GPU)
    assert (p.path, p.config) == (Path.FLAT, G(1, 4096, 8, True, False, 16384 * 14336 // 4096))
    assert "1 x 4096 tiles" in p.reason and "no masks" in p.reason and "32-bit" in p.reason
    p = plan(glu_config, 16384, 14336, 2, "bwd", row_strides=(28672, 28672, 14336), device=H200)
    assert (p.path, p.config) == (Path.ROWS, G(2, 2048, 8, True, False, 8192 * 7))
    p = plan(glu_config, 16384, 14336, 4, "fwd", row_strides=(28672, 28672, 14336), device=H200)
    assert p.config[:4] == (1, 2048, 8, True)
    p = plan(glu_config, 5, 4097, 2, "fwd", row_strides=(4097, 4097, 4097), device=H200)
    assert p.config.even is False and "masked" in p.reason
    halves = (32768, 32768, 16384)
    p = plan(glu_config, 70000, 16384, 2, "bwd", row_strides=halves, device=H200)  # 70000 x 32768 > 2**31
    assert p.config.wide_index and "64-bit" in p.reason
    assert not plan(glu_config, 60000, 16384, 2, "bwd", row_strides=halves, device=H200).config.wide_index
    assert plan(glu_config, 1, 1, 4, "fwd", device=H200).config == G(1, 1, 1, True, False, 1)


def triton_pow2(n):
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def test_wide_index_path():
    """The int64 index path (taken when an offset passes 2**31) computes the same numbers."""
    x = randn(7, 2 * 50, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    with mock.patch.object(glu_config, "_INT32_LIMIT", 0), poisoned_outputs_and_tile(64):
        out = fused_kernels.geglu(gate, up)
        dgate, dup = torch.ops.fused_kernels.geglu_bwd(out, gate, up, "tanh")
    gate64, up64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    ref = reference("geglu", "tanh", gate64, up64)
    ref.backward(out.double())
    assert_close(out, ref, torch.bfloat16, "out")
    assert_close(dgate, gate64.grad, torch.bfloat16, "dgate")
    assert_close(dup, up64.grad, torch.bfloat16, "dup")


def test_launch_counts():
    gate, up = randn(4, 8, requires_grad=True), randn(4, 8, requires_grad=True)
    before = fused_kernels.launch_counts()
    fused_kernels.swiglu(gate, up).sum().backward()
    fused_kernels.geglu(gate, up, approximate="none").sum().backward()
    after = fused_kernels.launch_counts()
    for name in ("swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd"):
        assert after.get(name, 0) == before.get(name, 0) + 1, name


@pytest.mark.parametrize("op,approximate", OPS)
def test_opcheck(op, approximate):
    x = randn(3, 2 * 20, requires_grad=True)
    extra = () if op == "swiglu" else (approximate,)
    fwd = getattr(torch.ops.fused_kernels, f"{op}_fwd").default
    bwd = getattr(torch.ops.fused_kernels, f"{op}_bwd").default
    gate, up = x.chunk(2, dim=-1)
    torch.library.opcheck(fwd, (gate, up, *extra))
    torch.library.opcheck(bwd, (randn(3, 20), gate.detach(), up.detach(), *extra))


@pytest.mark.parametrize("op,approximate", OPS)
def test_torch_compile_fullgraph_no_graph_breaks(op, approximate):
    torch._dynamo.reset()

    def mlp(x, w_gate_up):
        gate, up = (x @ w_gate_up).chunk(2, dim=-1)
        return run_op(op, approximate, gate, up).sum(dim=-1)

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")  # raises on any graph break
    x = randn(2, 5, 16, requires_grad=True)
    w = randn(16, 2 * 24, scale=0.25, requires_grad=True)
    dy = randn(2, 5)
    got = compiled(x, w)
    got.backward(dy)
    got_grads = (x.grad, w.grad)
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    gate64, up64 = (x64 @ w64).chunk(2, dim=-1)
    want = reference(op, approximate, gate64, up64).sum(dim=-1)
    want.backward(dy.double())
    assert_close(got, want, torch.float32, "compiled out")
    assert_close(got_grads[0], x64.grad, torch.float32, "compiled dx")
    assert_close(got_grads[1], w64.grad, torch.float32, "compiled dw")


@pytest.mark.parametrize("op,approximate", OPS)
def test_eager_and_compiled_paths_agree(op, approximate):
    """Eager calls run the torch.autograd.Function (no custom-op dispatch), torch.compile traces the
    custom op; both launch the kernels once forward and once backward and give the same bits."""
    torch._dynamo.reset()
    x = randn(3, 2 * 24, dtype=torch.bfloat16, scale=2.0)
    dy = randn(3, 24, dtype=torch.bfloat16)

    def fn(x):
        gate, up = x.chunk(2, dim=-1)
        return run_op(op, approximate, gate, up)

    results = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True, backend="aot_eager"))):
        xi = x.clone().requires_grad_(True)
        before = fused_kernels.launch_counts()
        out = f(xi)
        if name == "eager":
            assert type(out.grad_fn).__name__ == "_GLUFunctionBackward"
        out.backward(dy)
        after = fused_kernels.launch_counts()
        for direction in ("fwd", "bwd"):
            assert after.get(f"{op}_{direction}", 0) - before.get(f"{op}_{direction}", 0) == 1, (name, direction)
        results[name] = (out.detach(), xi.grad)
    for got, want in zip(results["compiled"], results["eager"]):
        assert torch.equal(got, want)
    x64 = x.double().requires_grad_(True)
    ref = reference(op, approximate, *x64.chunk(2, dim=-1))
    ref.backward(dy.double())
    assert_close(results["eager"][0], ref, torch.bfloat16, "out")
    assert_close(results["eager"][1], x64.grad, torch.bfloat16, "grad")


def test_no_grad_call_skips_autograd():
    gate, up = randn(4, 8, requires_grad=True), randn(4, 8, requires_grad=True)
    before = fused_kernels.launch_counts().get("swiglu_fwd", 0)
    with torch.no_grad():
        out = fused_kernels.swiglu(gate, up)
    assert out.grad_fn is None
    assert fused_kernels.launch_counts().get("swiglu_fwd", 0) == before + 1
    assert_close(out, reference("swiglu", None, gate.detach(), up.detach()), torch.float32, "out")


@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda: fused_kernels.swiglu(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3)), TypeError, "gate"),
        (lambda: fused_kernels.swiglu(randn(2, 3), torch.ones(2, 3, dtype=torch.int32)), TypeError, "up"),
        (lambda: fused_kernels.geglu(randn(2, 3), randn(2, 3, dtype=torch.bfloat16)), TypeError, "up"),
        (lambda: fused_kernels.swiglu(randn(2, 3), randn(2, 3, dtype=torch.float16)), TypeError, "up"),
        (lambda: fused_kernels.swiglu(randn(2, 3, dtype=torch.float64), randn(2, 3)), TypeError, "gate"),
        (lambda: fused_kernels.swiglu([1.0], randn(1)), TypeError, "gate"),
        (lambda: fused_kernels.swiglu(randn(2, 3), randn(3, 2)), ValueError, "up"),
        (lambda: fused_kernels.geglu(randn(2, 3), randn(2, 4)), ValueError, "up"),
        (lambda: fused_kernels.geglu(randn(2, 3), randn(2, 3), approximate="erf"), ValueError, "approximate"),
        (lambda: fused_kernels.geglu(randn(2, 3), randn(2, 3), approximate=None), ValueError, "approximate"),
    ],
)
def test_bad_inputs(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_kernels.swiglu(randn(2, 3), randn(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("op,approximate", OPS)
def test_gpu_real_size(op, approximate):
    """16384 × 14336 bf16 (a Llama-3-8B MLP at 16k tokens): values, gradients, and memory."""
    device = torch.device("cuda")
    rows, cols = 16384, 14336
    gen = torch.Generator(device=device).manual_seed(0)
    gate = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    up = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    dout = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen)
    nbytes = gate.numel() * gate.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run_op(op, approximate, gate, up)
    torch.cuda.synchronize()
    # Forward: the output and nothing else (no saved activation).
    assert torch.cuda.max_memory_allocated() - base <= nbytes + (1 << 20)
    out.backward(dout)
    torch.cuda.synchronize()
    # Backward: dgate and dup on top of the output, nothing more.
    assert torch.cuda.max_memory_allocated() - base <= 3 * nbytes + (1 << 20)
    # Compare in row blocks in float64 (a full float64 copy would take 1.9 GB per tensor).
    errs = {"out": [0.0, 0.0], "dgate": [0.0, 0.0], "dup": [0.0, 0.0]}
    for r in range(0, rows, 2048):
        g64 = gate[r:r + 2048].detach().double().requires_grad_(True)
        u64 = up[r:r + 2048].detach().double().requires_grad_(True)
        ref = reference(op, approximate, g64, u64)
        ref.backward(dout[r:r + 2048].double())
        for name, got, want in [("out", out[r:r + 2048], ref), ("dgate", gate.grad[r:r + 2048], g64.grad),
                                ("dup", up.grad[r:r + 2048], u64.grad)]:
            assert torch.isfinite(got).all(), name
            errs[name][0] += (got.double() - want.detach()).pow(2).sum().item()
            errs[name][1] += want.detach().pow(2).sum().item()
    for name, (num, den) in errs.items():
        assert math.sqrt(num / den) <= 1e-2, f"{name}: relative error {math.sqrt(num / den):.3e}"
