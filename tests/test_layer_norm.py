"""fused_kernels.layer_norm against a float64 LayerNorm written out (mean, centred variance, affine step).

Every buffer the op allocates for its kernels starts as NaN (`poisoned_outputs`), and `rel_err` turns NaN
anywhere into an infinite error, so an element a kernel fails to write, or a NaN it makes, cannot pass.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fused_kernels
from fused_kernels import _dispatch, layer_norm
from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import OFF_GPU, ClusterLaunch, ClusterShape, DeviceFacts
import helpers
from helpers import REL_TOL, assert_close, randn

from fused_kernels.ops import layer_norm as ln_module
from fused_kernels.ops import layer_norm_config as ln_cfg

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AFFINE = ("weight+bias", "weight", "bias", "none")


def poisoned_outputs():
    return helpers.poisoned_outputs(ln_module)


def reference(x64, w64, b64, eps):
    mean = x64.mean(-1, keepdim=True)
    d = x64 - mean
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    y = d * rstd
    if w64 is not None:
        y = y * w64
    if b64 is not None:
        y = y + b64
    return y


def _tol(*dtypes):
    return max(REL_TOL[d] for d in dtypes if d is not None)


def _assert_close_to_scale(name, got, ref, scale, tol):
    """got finite, its error within tol of |ref| or, where the result cancels (width 1: dx = 0), of
    `scale`, the size of the terms that cancel."""
    assert torch.isfinite(got).all(), f"{name} has NaN/inf"
    err = (got.detach().to(torch.float64).cpu() - ref.cpu()).norm().item()
    bound = tol * max(ref.norm().item(), scale)
    assert err <= bound, f"{name}: error {err:.3e} > {bound:.3e} (|ref| {ref.norm().item():.3e}, scale {scale:.3e})"


def make_params(n, affine, dtype, param_dtype=None):
    pd = dtype if param_dtype is None else param_dtype
    w = randn(n, dtype=pd, scale=0.7) + 1.0 if "weight" in affine else None
    b = randn(n, dtype=pd, scale=0.5) if "bias" in affine else None
    return w, b


def check(x, weight, bias, eps=1e-5, dy=None):
    """Forward and backward of layer_norm against the float64 reference: y, dx, dweight, dbias."""
    dtypes = [x.dtype] + [p.dtype for p in (weight, bias) if p is not None]
    tol = _tol(*dtypes)
    x_in = x.detach().requires_grad_(True)
    w_in = None if weight is None else weight.detach().clone().requires_grad_(True)
    b_in = None if bias is None else bias.detach().clone().requires_grad_(True)
    with poisoned_outputs():
        y = layer_norm(x_in, w_in, b_in, eps)
    assert y.dtype == x.dtype and y.shape == x.shape

    x64 = x.detach().to(torch.float64).requires_grad_(True)
    w64 = None if weight is None else weight.detach().to(torch.float64).requires_grad_(True)
    b64 = None if bias is None else bias.detach().to(torch.float64).requires_grad_(True)
    y_ref = reference(x64, w64, b64, eps)
    n = x.shape[-1]
    if x.numel() == 0:
        assert_close(y, y_ref, x.dtype, "y")
        return
    if n == 1:  # y = bias exactly (or 0): measure against the scale of the centred value's terms
        _assert_close_to_scale("y", y, y_ref.detach(), x64.detach().norm().item(), tol)
    else:
        assert_close(y, y_ref, x.dtype, "y", tol=tol)

    dy = randn(*y.shape, dtype=y.dtype) if dy is None else dy
    with poisoned_outputs():
        y.backward(dy)
    y_ref.backward(dy.to(torch.float64))
    dy64 = dy.to(torch.float64)
    xd = x64.detach()
    rstd = torch.rsqrt((xd - xd.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + eps)
    w_eff = 1.0 if w64 is None else w64.detach()
    # dx cancels almost entirely for short rows: measure against rstd·|g|, the terms that cancel
    _assert_close_to_scale("dx", x_in.grad, x64.grad, (rstd * dy64 * w_eff).norm().item(), tol)
    assert x_in.grad.dtype == x.dtype
    xhat = ((xd - xd.mean(-1, keepdim=True)) * rstd).reshape(-1, n)
    if weight is not None:
        assert w_in.grad.dtype == weight.dtype
        scale = (dy64.reshape(-1, n) * xhat).abs().sum(0).norm().item()
        _assert_close_to_scale("dweight", w_in.grad, w64.grad, scale, tol)
    if bias is not None:
        assert b_in.grad.dtype == bias.dtype
        _assert_close_to_scale("dbias", b_in.grad, b64.grad, dy64.reshape(-1, n).abs().sum(0).norm().item(), tol)


# --- widths × dtypes × affine ----------------------------------------------------------------

@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,rows", [(1, 9), (7, 37), (100, 21), (1000, 5)])
def test_matches_reference(width, rows, dtype, affine):
    torch.manual_seed(width * 31 + rows)
    x = randn(rows, width, dtype=dtype, scale=2.0) + 0.5
    w, b = make_params(width, affine, dtype)
    check(x, w, b)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("affine", ("weight+bias", "none"))
def test_width_4097(dtype, affine):
    torch.manual_seed(4097)
    x = randn(3, 4097, dtype=dtype, scale=1.5)
    w, b = make_params(4097, affine, dtype)
    check(x, w, b)


@pytest.mark.parametrize("width,path", [(9000, "chunked backward"), (20000, "chunked")])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_long_rows_chunked(width, path, dtype):
    """Rows longer than the whole-row limits: the chunked sweeps (mean merged across chunks), with a
    mean far from 0 so that a variance taken as E[x²] − mean² would lose the fp32 bound."""
    assert helpers.plan(ln_cfg, 5, width, dtype, "forward", device=OFF_GPU).path == path
    torch.manual_seed(width)
    x = randn(5, width, dtype=dtype) * 0.25 + 30.0
    w, b = make_params(width, "weight+bias", dtype)
    check(x, w, b)


def test_more_rows_than_programs_accumulate_partials():
    """Many more tiles than programs: each program sums several tiles into its dw/db partial rows, in
    registers (whole rows) and in memory (chunked)."""
    for width, rows in ((48, 300), (9000, 11)):
        torch.manual_seed(rows)
        x = randn(rows, width, dtype=torch.float32)
        w, b = make_params(width, "weight+bias", torch.float32)
        check(x, w, b)


def test_mixed_parameter_dtype():
    """bf16 x with fp32 parameters: y in bf16, gradients of the parameters in fp32."""
    x = randn(4, 6, 96, dtype=torch.bfloat16, scale=3.0)
    w, b = make_params(96, "weight+bias", torch.bfloat16, torch.float32)
    check(x, w, b)


@pytest.mark.parametrize("eps", (1e-6, 1e-5, 0.1))
def test_eps_used(eps):
    x = randn(6, 33, dtype=torch.float32, scale=0.05)  # small variance: eps matters
    w, b = make_params(33, "weight+bias", torch.float32)
    check(x, w, b, eps=eps)


def test_zero_rows():
    for shape in ((0, 64), (2, 0, 64)):
        x = randn(*shape, dtype=torch.bfloat16, requires_grad=True)
        w = randn(64, dtype=torch.bfloat16, requires_grad=True)
        b = randn(64, dtype=torch.bfloat16, requires_grad=True)
        y = layer_norm(x, w, b)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert torch.equal(w.grad, torch.zeros(64, dtype=torch.bfloat16))
        assert torch.equal(b.grad, torch.zeros(64, dtype=torch.bfloat16))


def test_non_contiguous_input_and_grad():
    torch.manual_seed(3)
    base = randn(40, 6, dtype=torch.float32, scale=2.0)
    x = base.t()  # (6, 40), column stride 6
    assert not x.is_contiguous()
    w, b = make_params(40, "weight+bias", torch.float32)
    dy = randn(40, 6, dtype=torch.float32).t()
    check(x, w, b, dy=dy)
    x3 = randn(4, 10, 64, dtype=torch.bfloat16)[:, ::3, :]  # row-strided view
    check(x3, *make_params(64, "weight+bias", torch.bfloat16))


def test_matches_torch_layer_norm_module():
    """Against torch.nn.LayerNorm itself in fp32: the same numbers to fp32 rounding."""
    torch.manual_seed(0)
    mod = torch.nn.LayerNorm(80, eps=1e-5)
    with torch.no_grad():
        mod.weight.copy_(randn(80) + 1.0)
        mod.bias.copy_(randn(80))
    x = randn(3, 5, 80, scale=2.0)
    y_ref = mod(x)
    y = layer_norm(x, mod.weight, mod.bias, mod.eps)
    assert_close(y, y_ref, torch.float32, "y vs nn.LayerNorm")


def test_nan_input_is_not_hidden():
    x = randn(4, 32)
    x[1, 3] = float("nan")
    y = layer_norm(x, randn(32), randn(32))
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_launch_counts():
    x = randn(8, 64, requires_grad=True)
    w = randn(64, requires_grad=True)
    before = fused_kernels.launch_counts()
    layer_norm(x, w, None).sum().backward()
    after = fused_kernels.launch_counts()
    assert after.get("layer_norm_fwd", 0) - before.get("layer_norm_fwd", 0) == 1
    assert after.get("layer_norm_bwd", 0) - before.get("layer_norm_bwd", 0) == 1


def test_bad_input():
    x = randn(4, 32)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, randn(31))
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, None, randn(2, 16))
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, None, None, float("nan"))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer_norm(x.double())
    with pytest.raises(ValueError, match="non-empty last dimension"):
        layer_norm(randn(4, 0))


# --- torch.library and torch.compile ---------------------------------------------------------

@pytest.mark.parametrize("affine", ("weight+bias", "none", "bias"))
def test_opcheck(affine):
    x = randn(3, 5, 24, dtype=torch.bfloat16, requires_grad=True)
    w, b = make_params(24, affine, torch.float32)
    w = None if w is None else w.requires_grad_(True)
    b = None if b is None else b.requires_grad_(True)
    torch.library.opcheck(torch.ops.fused_kernels.layer_norm_fwd.default, (x, w, b, 1e-5))

    y, mean, rstd = torch.ops.fused_kernels.layer_norm_fwd(x.detach(), w, b, 1e-5)
    x64 = x.detach().double()
    assert mean.dtype == torch.float32 and mean.shape == x.shape[:-1]
    assert_close(mean, x64.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(x64.var(-1, unbiased=False) + 1e-5), torch.float32, "rstd")
    dy = randn(*y.shape, dtype=y.dtype)
    plain = [None if p is None else p.detach() for p in (w, b)]
    torch.library.opcheck(torch.ops.fused_kernels.layer_norm_bwd.default,
                          (dy.detach(), x.detach(), plain[0], plain[1], mean.detach(), rstd.detach(), w is not None,
                           b is not None))


def test_compile_fullgraph_no_graph_breaks():
    torch._dynamo.reset()

    def block(x, w, b):
        return (layer_norm(x, w, b, 1e-5) * 2.0).sum(-1)

    x = randn(2, 5, 48, dtype=torch.bfloat16)
    w, b = make_params(48, "weight+bias", torch.bfloat16)
    explanation = torch._dynamo.explain(block)(x, w, b)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_in = [t.clone().requires_grad_(True) for t in (x, w, b)]
    comp_in = [t.clone().requires_grad_(True) for t in (x, w, b)]
    block(*eager_in).sum().backward()
    before = fused_kernels.launch_counts().get("layer_norm_bwd", 0)
    out = compiled(*comp_in)
    out.sum().backward()
    assert fused_kernels.launch_counts().get("layer_norm_bwd", 0) == before + 1
    assert torch.equal(out, block(x, w, b))
    for e, c in zip(eager_in, comp_in):
        assert torch.isfinite(c.grad).all() and torch.equal(c.grad, e.grad)


# --- the plan: one place decides the launch shape ---------------------------------------------

def test_plan_named_shapes_h200():
    """The launch shapes dev/tune_layer_norm.py measured fastest on an H200 (docs/kernels/layer_norm.md)."""
    p = helpers.plan(ln_cfg, 16384, 4096, torch.bfloat16, "forward", device=H200)
    assert p.path == "whole-row"
    c = p.config
    assert (c.fwd_block, c.fwd_rows, c.fwd_warps, c.fwd_stages, c.fwd_chunked) == (4096, 1, 8, 3, False)
    assert c.fwd_programs == 1024  # 8 per SM = 1056 wanted: 16 tiles each, so 1024 programs do the same
    # 2 per SM = 264 wanted: 63 tiles each, so 261 programs do the same sweeps with fewer partial rows
    assert (c.bwd_rows, c.bwd_warps, c.bwd_stages, c.bwd_programs) == (1, 8, 3, 261)
    assert "fit in registers" in p.reason

    p = helpers.plan(ln_cfg, 65536, 1024, torch.bfloat16, "forward", device=H200)
    c = p.config
    assert p.path == "whole-row" and (c.fwd_block, c.fwd_rows, c.fwd_warps) == (1024, 1, 2)
    assert c.fwd_programs == 1041  # 8 per SM = 1056 wanted: 63 tiles each
    assert (c.bwd_rows, c.bwd_warps, c.bwd_programs) == (2, 4, 521)  # 4 per SM: 32768 tiles, 63 each

    p = helpers.plan(ln_cfg, 4096, 16384, torch.bfloat16, "forward", device=H200)
    c = p.config
    assert p.path == "chunked backward"
    # the forward holds the row: 32 warps, 2 programs an SM, pipelined
    assert (c.fwd_block, c.fwd_rows, c.fwd_chunked, c.fwd_warps, c.fwd_stages) == (16384, 1, False, 32, 3)
    assert c.fwd_programs == 256  # 264 wanted: 16 rows each, so 256 programs do the same
    assert (c.bwd_block, c.bwd_rows, c.bwd_chunked, c.bwd_warps) == (4096, 1, True, 8)
    assert c.bwd_programs == 512  # 4 per SM = 528 wanted (L2 allows 512 of 64 KiB tiles): 8 rows each
    assert c.param_grid == (32, 128, 4, 3)  # 128 column blocks x 3 row groups = 2.9 programs an SM
    assert "L2" in p.reason and "column-parallel" in p.reason

    p = helpers.plan(ln_cfg, 1024, 65536, torch.bfloat16, "forward", device=H200)
    c = p.config
    assert p.path == "chunked" and c.fwd_chunked and c.bwd_chunked and (c.fwd_rows, c.bwd_rows) == (1, 1)
    assert c.fwd_programs == 1024  # a program per row
    assert c.bwd_programs == 128  # 32 MiB of L2 / (65536 · 4 bytes of x and dy) = 128 -> 8 rows each
    assert c.param_grid == (32, 128, 4, 1)  # 512 column blocks already fill the GPU
    assert "exceed 16384" in p.reason


def test_plan_interpreter_grids_stay_small():
    for rows, cols in ((16384, 4096), (65536, 1024), (4096, 16384), (7, 100000)):
        c = helpers.plan(ln_cfg, rows, cols, torch.bfloat16, "forward", device=OFF_GPU).config
        assert 1 <= c.fwd_programs <= 4 and 1 <= c.bwd_programs <= 4


def test_plan_rejects_empty_rows():
    with pytest.raises(ValueError, match="n_cols"):
        helpers.plan(ln_cfg, 4, 0, torch.float32, "forward", device=OFF_GPU)
    with pytest.raises(ValueError, match="direction"):
        helpers.plan(ln_cfg, 4, 8, torch.float32, "fwd", device=OFF_GPU)


# --- the cluster backward (fused_kernels/norm_smem.py, Gluon: its kernels run on the GPU only) ----------

H200 = DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)


@pytest.fixture
def fresh_dispatch():
    """No path turned off or built before the test, and none after it."""
    _dispatch.reset()
    yield
    _dispatch.reset()


def _backward_plan(rows, cols, dtype=torch.bfloat16, weight_dtype=torch.bfloat16, *, device=H200,
                   dy_dtype=None, aligned=True, deterministic=False):
    # compiled kernels' facts (not the interpreter's, which never plans a cluster), so that every refusal shows
    return helpers.plan(ln_cfg, rows, cols, dtype, "backward", weight_dtype=weight_dtype,
                        dy_dtype=dtype if dy_dtype is None else dy_dtype, aligned=aligned, deterministic=deterministic,
                        device=dataclasses.replace(device, interpreted=False))


def test_plan_cluster_backward_h200(fresh_dispatch):
    """Rows of 16384 in bf16/fp16 on an H100/H200: the backward reads each row once over a cluster of
    CLUSTER_BACKWARD_SHAPES's shape, the forward is the Triton plan's, and the Triton backward's fields
    stay (the fallback)."""
    p = _backward_plan(4096, 16384)
    shape = ln_cfg.CLUSTER_BACKWARD_SHAPES[16384]
    assert p.path == "cluster backward", p
    triton_plan = helpers.plan(ln_cfg, 4096, 16384, torch.bfloat16, "forward", device=H200)
    assert p.config.bwd_cluster == ClusterLaunch(shape, ln_cfg._gpu.clusters(4096, shape, 132))
    assert dataclasses.replace(p.config, bwd_cluster=None) == triton_plan.config
    assert "read once" in p.reason and p.reason.startswith("forward: rows of 16384 fit in registers")
    assert _backward_plan(4096, 16384, torch.float16, None).path == "cluster backward"  # no weight
    # the forward and the interpreter never plan a cluster
    assert triton_plan.path == "chunked backward" and triton_plan.config.bwd_cluster is None
    assert helpers.plan(ln_cfg, 4096, 16384, torch.bfloat16, "backward", weight_dtype=torch.bfloat16,
                        dy_dtype=torch.bfloat16, aligned=True,
                        device=dataclasses.replace(H200, interpreted=True)).config.bwd_cluster is None


@pytest.mark.parametrize("kwargs,why", [
    (dict(dtype=torch.float32, weight_dtype=torch.float32), "16-bit"),
    (dict(weight_dtype=torch.float32), "16-bit"),  # bf16 activations, fp32 parameters
    (dict(dy_dtype=torch.float32), "dy"),
    (dict(deterministic=True), "deterministic mode"),
    (dict(aligned=False), "16-byte aligned"),
    (dict(device=OFF_GPU), "no Gluon"),
    (dict(device=dataclasses.replace(H200, capability=(8, 0))), "no thread-block clusters"),
    (dict(rows=200), "per cluster"),
])
def test_plan_cluster_backward_refusals(fresh_dispatch, kwargs, why):
    """What keeps a backward off the cluster: the Triton plan, with the reason appended."""
    kwargs = dict(kwargs)
    rows = kwargs.pop("rows", 4096)
    p = _backward_plan(rows, 16384, **kwargs)
    assert p.path == "chunked backward" and p.config.bwd_cluster is None, p
    assert "not cluster: " in p.reason and why in p.reason.split("not cluster: ")[1], p.reason
    # a length outside the table is not mentioned at all
    assert "cluster" not in _backward_plan(4096, 8192).reason


class _FakeClusterKernels:
    """Stands in for norm_smem on the CPU: launch_layer_norm_backward either fails (a Triton whose Gluon
    API the kernel does not build with) or writes dx in float64 torch, and dw and db into the first of the
    `grid` partial rows and zeros into the rest (so the dispatch's sum over the grid is what is checked)."""

    def __init__(self, fail: bool):
        self.fail = fail
        self.calls = 0

    def launch_layer_norm_backward(self, dy2, x2, weight, mean, rstd, dx, dw_partial, db_partial, *, shape, grid,
                                   compute_dw, compute_db):
        self.calls += 1
        if self.fail:
            raise RuntimeError("PassManager::run failed")
        assert grid == 3 and dw_partial.shape[0] == (3 if compute_dw else 1)
        x64, dy64 = x2.double(), dy2.double()
        xhat = (x64 - mean.double()[:, None]) * rstd.double()[:, None]
        g = dy64 * (1.0 if weight is None else weight.double())
        dx.copy_((rstd.double()[:, None] * (g - g.mean(-1, keepdim=True)
                                            - xhat * (g * xhat).mean(-1, keepdim=True))).view_as(dx))
        for wanted, partial, value in ((compute_dw, dw_partial, (dy64 * xhat).sum(0)),
                                       (compute_db, db_partial, dy64.sum(0))):
            if wanted:
                partial.zero_()
                partial[0] = value


def _force_cluster_plan(monkeypatch, fake):
    """layer_norm's backward plans the cluster (3 clusters of a made-up shape) while the dispatch has the
    path on, the Triton plan after; norm_smem is `fake`."""
    real_plan = ln_module.plan

    def plan(call, device):
        p = real_plan(call, device)
        if call.direction == "backward" and _dispatch.path_on("layer_norm_bwd", Path.CLUSTER):
            launch = ClusterLaunch(ClusterShape(warps=1, ctas=2, per_sm=1), 3)
            return Plan(Path.CLUSTER_BACKWARD, dataclasses.replace(p.config, bwd_cluster=launch), "forced")
        return p

    monkeypatch.setattr(ln_module, "plan", plan)
    monkeypatch.setattr(ln_module, "_cluster_kernels", lambda: fake)


@pytest.mark.parametrize("affine", ("weight+bias", "weight", "none"))
@pytest.mark.parametrize("fail", (False, True))
def test_cluster_backward_dispatch_and_build_failure(monkeypatch, fresh_dispatch, fail, affine):
    """A backward planned on the cluster returns the launcher's dx and the sums of its dw and db partial
    rows (over the grid it was planned with). A first build that fails warns once, turns the path off,
    and the Triton backward gives the numbers; later calls do not try again."""
    fake = _FakeClusterKernels(fail)
    _force_cluster_plan(monkeypatch, fake)
    for call in range(2):
        x = randn(12, 96, dtype=torch.bfloat16, scale=2.0) + 0.5
        w, b = make_params(96, affine, torch.bfloat16)
        ins = [x.clone().requires_grad_(True)] + [None if p is None else p.clone().requires_grad_(True) for p in (w, b)]
        y = layer_norm(*ins, 1e-5)
        dy = randn(12, 96, dtype=torch.bfloat16)
        if fail and call == 0:
            with pytest.warns(RuntimeWarning, match="cluster kernel did not build"):
                y.backward(dy)
        else:
            y.backward(dy)
        refs = [None if t is None else t.detach().double().requires_grad_(True) for t in ins]
        reference(*refs, 1e-5).backward(dy.double())
        for name, got, ref in zip(("dx", "dw", "db"), ins, refs):
            if got is not None:
                assert_close(got.grad, ref.grad, torch.bfloat16, f"{name} call {call}")
    assert fake.calls == (1 if fail else 2)


def test_cluster_launchers_write_dx_rows_n_cols_apart(monkeypatch):
    """Both norms' cluster launchers give the kernel dx's row stride as n_cols for an output of x's shape
    with any number of dimensions ((batch, seq, N): its stride(0) is seq·N, not a row's)."""
    smem = pytest.importorskip("fused_kernels.ops.norm_smem")
    if smem.gluon is None:
        pytest.skip("no Gluon in this Triton")
    seen = []
    monkeypatch.setattr(smem, "launch", lambda kernel, grid, args, meta: seen.append(args[-1]))
    monkeypatch.setattr(smem, "_claim_scratch", lambda grid, device: (torch.zeros(3 * grid, dtype=torch.int32),
                                                                      torch.zeros(1, dtype=torch.int32)))
    n = 16384
    x2 = torch.zeros(8, n, dtype=torch.bfloat16)
    dx = torch.empty(2, 4, n, dtype=torch.bfloat16)
    partial, stats = torch.empty(3, n), torch.ones(8)
    smem.launch_backward(x2, x2, x2[0], stats, dx, partial, shape=ClusterShape(4, 4, 6), grid=3, offset=0.0,
                         casting_id=0, compute_dw=True)
    smem.launch_layer_norm_backward(x2, x2, None, stats, stats, dx, partial, partial,
                                    shape=ln_cfg.CLUSTER_BACKWARD_SHAPES[n], grid=3, compute_dw=False,
                                    compute_db=False)
    assert seen == [n, n]
    with pytest.raises(ValueError, match="dx must be contiguous"):
        smem.launch_layer_norm_backward(x2, x2, None, stats, stats, dx.transpose(0, 1), partial, partial,
                                        shape=ln_cfg.CLUSTER_BACKWARD_SHAPES[n], grid=3, compute_dw=False,
                                        compute_db=False)


# --- the H200 at real sizes (dev/gpu_check.sh) -------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(16384, 4096), (65536, 1024), (4096, 16384), (1024, 65536)])
def test_gpu_real_sizes(device, rows, hidden):
    torch.manual_seed(0)
    x = randn(rows, hidden, dtype=torch.bfloat16, device=device, scale=2.0) + 0.5
    w = (randn(hidden, dtype=torch.bfloat16, scale=0.5) + 1.0).to(device)
    b = randn(hidden, dtype=torch.bfloat16, device=device, scale=0.5)
    ins = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = layer_norm(*ins, 1e-5)
    dy = randn(rows, hidden, dtype=torch.bfloat16, device=device)
    y.backward(dy)
    refs = [t.double().requires_grad_(True) for t in (x, w, b)]
    y_ref = reference(*refs, 1e-5)
    y_ref.backward(dy.double())
    for name, got, ref in (("y", y, y_ref), ("dx", ins[0].grad, refs[0].grad), ("dw", ins[1].grad, refs[1].grad),
                           ("db", ins[2].grad, refs[2].grad)):
        assert torch.isfinite(got).all(), f"{name} has NaN/inf"
        assert_close(got, ref, torch.bfloat16, f"{name} {rows}x{hidden}")


@pytest.mark.gpu
def test_gpu_fp32_matches_torch(device):
    x = randn(4096, 2048, device=device, scale=2.0)
    w = randn(2048, device=device) + 1.0
    b = randn(2048, device=device)
    y = layer_norm(x, w, b)
    assert_close(y, reference(x.double(), w.double(), b.double(), 1e-5), torch.float32, "y fp32")


def _cluster_backward_calls(monkeypatch):
    """The shapes norm_smem.launch_layer_norm_backward is called with, from now on."""
    from fused_kernels.ops import norm_smem

    return helpers.launch_shapes(monkeypatch, norm_smem,
                                 "launch_layer_norm_backward")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,dtype,affine,row_pad,grads",
    [
        (4096, torch.bfloat16, "weight+bias", 0, True),
        (4096, torch.float16, "weight+bias", 64, True),  # padded rows: strides differ from N
        (2000, torch.bfloat16, "weight", 0, True),  # dw, no db
        (2000, torch.bfloat16, "bias", 0, True),  # db, no weight
        (1000, torch.bfloat16, "none", 0, True),
        (3000, torch.bfloat16, "weight+bias", 0, False),  # frozen parameters: dx alone
        (600, torch.float16, "weight+bias", 0, True),  # few rows: 5 per cluster (120 clusters)
        (-2048, torch.bfloat16, "weight+bias", 0, True),  # x of (2, 1024, N): rows of dx N apart
    ],
)
def test_gpu_cluster_backward_matches_reference(monkeypatch, device, rows, dtype, affine, row_pad, grads):
    """Rows of 16384 take the cluster backward on an H100/H200 (each row read once): dx, dw and db
    against float64, the outputs poisoned first."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("thread-block clusters need compute capability 9.0")
    calls = _cluster_backward_calls(monkeypatch)
    n = 16384
    torch.manual_seed(0)
    batched, rows = rows < 0, abs(rows)
    base = randn(rows, n + row_pad, dtype=dtype, device=device, scale=2.0) + 0.5
    x = base[:, :n].reshape(2, rows // 2, n) if batched else base[:, :n]
    w, b = make_params(n, affine, dtype)
    w, b = (None if p is None else p.to(device) for p in (w, b))
    x_in = x.detach().clone() if not row_pad else x.detach()
    x_in.requires_grad_(True)
    params = [None if p is None else p.clone().requires_grad_(grads) for p in (w, b)]
    with poisoned_outputs():
        y = layer_norm(x_in, *params, 1e-5)
        dy = randn(*x.shape, dtype=dtype, device=device)
        y.backward(dy)
    assert calls == [ln_cfg.CLUSTER_BACKWARD_SHAPES[n]], calls
    refs = [None if t is None else t.detach().double().requires_grad_(True) for t in (x, w, b)]
    reference(*refs, 1e-5).backward(dy.double())
    for name, got, ref in zip(("dx", "dw", "db"), [x_in] + params, refs):
        if got is None:
            continue
        if name != "dx" and not grads:
            assert got.grad is None
            continue
        assert torch.isfinite(got.grad).all(), f"{name} has NaN/inf"
        assert_close(got.grad, ref.grad, dtype, f"{name} {rows}x{n} {affine}")


@pytest.mark.gpu
def test_gpu_cluster_backward_off_in_deterministic_mode(monkeypatch, device):
    """Clusters claim rows, so which rows a dw / db partial row sums varies between runs; deterministic
    mode takes the Triton backward, whose dw and db are the same bit for bit."""
    calls = _cluster_backward_calls(monkeypatch)
    x = randn(1024, 16384, dtype=torch.bfloat16, device=device)
    w = randn(16384, dtype=torch.bfloat16, device=device)
    b = randn(16384, dtype=torch.bfloat16, device=device)
    dy = randn(1024, 16384, dtype=torch.bfloat16, device=device)

    def dw_db():
        w_in, b_in = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        layer_norm(x, w_in, b_in).backward(dy)
        return w_in.grad, b_in.grad

    first, second = helpers.twice_deterministic(dw_db)
    assert calls == [] and all(torch.equal(a, c) for a, c in zip(first, second))
