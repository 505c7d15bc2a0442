"""Experiment (session 17, prepared on the CPU: it compiles for sm_90a on triton 3.6 and 3.9; NOT yet run on
a GPU; run in session 18: benchmarks/session18/exp_rms_dsmem.txt, then adopted into the library, so on
later commits "library" and "dsmem" below are the same scheme): rms_norm_smem's two kernels with the row
exchange through the cluster's shared memory (DSMEM) instead of global memory.

In the library (81af050) a row's exchange is: thread 0 of each CTA stores its partial in a global slot,
CTA 0's also the claimed row; thread 0 fences; one cluster barrier; then every thread loads the CTAS
partials and the claimed row from L2 (.cg), one L2 round trip on every row's path before pass 2 can
start its refills. Here thread 0 of each CTA writes its partial into every CTA's shared memory (mapa +
st.shared::cluster into a static .shared array of the inline PTX block, two parities of 16 words), CTA
0's thread 0 the claimed row too; thread 0 fences (fence.acq_rel.cluster: still MEMBAR.ALL.GPU in SASS,
so that cost stays); one cluster barrier; then every thread reads the slots from its own shared memory.
The claimed row so read is a [CTAS] tensor, not a scalar (Gluon 3.6 cannot reduce across a cluster), so
pass 2 addresses its refills with it ([CTAS, 1, 1] pointers, masked copies past the last row), and the
loop's scalar row is still loaded from global memory after the barrier, needed only at the end of pass 2.

Expected: the L2 round trip off the path between the barrier and pass 2 (about 0.5-1 µs per row per
cluster, partly hidden by the other CTAs on the SM). The target gap at 1024 x 65536 is 3 µs
(0.203 ms: forward 76 µs, backward 122, dw sum 5).

    .venv/bin/python benchmarks/session17/exp_rms_dsmem.py --compile-only                (CPU)
    bash benchmarks/session17/call.sh exp_rms_dsmem                                      (GPU, ~30 s)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"), HERE]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from fused_kernels import cross_entropy_smem as _smem  # noqa: E402
from fused_kernels import rms_norm_smem as lib  # noqa: E402
from fused_kernels._launch import launch  # noqa: E402
from fused_kernels.rms_norm_smem import (  # noqa: E402  (the library kernels' helpers, as of 81af050)
    _chunk_arrived, _chunk_buffer, _normalised, _pick, _pick8, _terms, _w_chunk)

_claim_issue, _claim_publish = _smem._claim_issue, _smem._claim_publish  # row claiming, split in two

# The exchange's PTX, as this experiment wrote it, is the library's since session 18 (byte-identical):
# rms_norm_smem.exchange_ptx (two parities of 16 words: CTAS partials, then the claimed row).
dsmem_exchange_ptx = lib.exchange_ptx


@gluon.jit
def _exchange_dsmem(part, parity, got, PTX: gl.constexpr):
    """(Σ over the cluster of part, the claimed row), both [CTAS, 1, 1] (every thread has them)."""
    total, row = gl.inline_asm_elementwise(PTX, "=r,=r,r,r,r", [part.to(gl.int32, bitcast=True), parity, got],
                                           dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
    return (gl.expand_dims(gl.expand_dims(total.to(gl.float32, bitcast=True), 1), 2),
            gl.expand_dims(gl.expand_dims(row, 1), 2))


@gluon.jit
def _rms_bwd_dsmem_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, next_ptr, counter_ptr,
                          n_rows, stride_dy, stride_x, stride_dx,
                          OFFSET: gl.constexpr, CASTING: gl.constexpr, COMPUTE_DW: gl.constexpr, N: gl.constexpr,
                          WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr,
                          PTX: gl.constexpr):
    """The library's _rms_bwd_smem_kernel (81af050) with the exchange through shared memory."""
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    x_t: gl.constexpr = x_ptr.dtype.element_ty
    dy_t: gl.constexpr = dy_ptr.dtype.element_ty
    x0 = gl.allocate_shared_memory(x_t, [CTAS, T, 8], SMEM)
    x1 = _chunk_buffer(x_t, 1, NCHUNK, x0, CTAS, T, SMEM)
    x2 = _chunk_buffer(x_t, 2, NCHUNK, x0, CTAS, T, SMEM)
    x3 = _chunk_buffer(x_t, 3, NCHUNK, x0, CTAS, T, SMEM)
    dy0 = gl.allocate_shared_memory(dy_t, [CTAS, T, 8], SMEM)
    dy1 = _chunk_buffer(dy_t, 1, NCHUNK, dy0, CTAS, T, SMEM)
    dy2 = _chunk_buffer(dy_t, 2, NCHUNK, dy0, CTAS, T, SMEM)
    dy3 = _chunk_buffer(dy_t, 3, NCHUNK, dy0, CTAS, T, SMEM)
    wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)
    offs = _smem.slice_offsets(CTAS, T, REG)
    dw0 = gl.zeros([CTAS, T, 8], gl.float32, REG)
    dw1 = dw0
    dw2 = dw0
    dw3 = dw0

    last_claim = n_rows + gl.num_programs(0) - 1
    _smem._claim_row(counter_ptr, next_ptr + 3 * pid, last_claim)
    _smem._cluster_sync()
    r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
    xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
    dyrow = dy_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_dy
    for k in gl.static_range(NCHUNK):
        _smem._async_load(wbuf.index(k), w_ptr + k * CHUNK + offs)
        _smem._async_load(_pick(k, x0, x1, x2, x3), xrow + k * CHUNK + offs)
        _smem._async_load(_pick(k, dy0, dy1, dy2, dy3), dyrow + k * CHUNK + offs)
        async_copy.commit_group()

    parity = 0
    while r < n_rows:
        row = r.to(gl.int64)
        got = _claim_issue(counter_ptr)
        rstd = gl.load(rstd_ptr + row)
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for k in gl.static_range(NCHUNK):
            _chunk_arrived(k, NCHUNK)
            xhat, g, _dyf = _terms(_pick(k, x0, x1, x2, x3).load(REG), _pick(k, dy0, dy1, dy2, dy3).load(REG),
                                   _w_chunk(wbuf, k, OFFSET, CASTING, REG), rstd, OFFSET, CASTING)
            acc = acc + gl.sum(g * xhat, 2)
        claimed = next_ptr + 3 * pid + 1 + parity
        _claim_publish(counter_ptr, claimed, got, last_claim)  # for the loop's scalar row (and the reset)
        dot, nxt_t = _exchange_dsmem(gl.sum(acc, 1), parity, got, PTX)
        nxt = gl.load(claimed, cache_modifier=".cg")  # needed only at the end of pass 2
        c = dot / N
        dxrow = dx_ptr + row * stride_dx
        nbase = gl.minimum(nxt_t, n_rows - 1).to(gl.int64)
        nxrow = x_ptr + nbase * stride_x
        ndyrow = dy_ptr + nbase * stride_dy
        more = (offs * 0 + nxt_t) < n_rows
        for k in gl.static_range(NCHUNK):
            x = _pick(k, x0, x1, x2, x3).load(REG)
            xhat, g, dyf = _terms(x, _pick(k, dy0, dy1, dy2, dy3).load(REG), _w_chunk(wbuf, k, OFFSET, CASTING, REG),
                                  rstd, OFFSET, CASTING)
            gl.store(dxrow + k * CHUNK + offs, (rstd * (g - xhat * c)).to(dx_ptr.dtype.element_ty))
            if COMPUTE_DW:
                if CASTING == 0:
                    xhat = xhat.to(x.dtype).to(gl.float32)
                dwk = _pick(k, dw0, dw1, dw2, dw3) + dyf * xhat
                dw0 = dwk if k == 0 else dw0
                dw1 = dwk if k == 1 else dw1
                dw2 = dwk if k == 2 else dw2
                dw3 = dwk if k == 3 else dw3
            _smem._async_load(_pick(k, x0, x1, x2, x3), nxrow + k * CHUNK + offs, mask=more)
            _smem._async_load(_pick(k, dy0, dy1, dy2, dy3), ndyrow + k * CHUNK + offs, mask=more)
            async_copy.commit_group()
        r = nxt
        parity = 1 - parity
    async_copy.wait_group(0)
    if COMPUTE_DW:
        part = dw_part_ptr + pid.to(gl.int64) * N
        for k in gl.static_range(NCHUNK):
            gl.store(part + k * CHUNK + offs, _pick(k, dw0, dw1, dw2, dw3))


@gluon.jit
def _rms_fwd_dsmem_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, next_ptr, counter_ptr,
                          n_rows, stride_x, stride_y, eps,
                          OFFSET: gl.constexpr, CASTING: gl.constexpr, HAS_WEIGHT: gl.constexpr, N: gl.constexpr,
                          WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr,
                          PTX: gl.constexpr):
    """The library's _rms_fwd_smem_kernel (81af050) with the exchange through shared memory."""
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
    x_t: gl.constexpr = x_ptr.dtype.element_ty
    x0 = gl.allocate_shared_memory(x_t, [CTAS, T, 8], SMEM)
    x1 = _chunk_buffer(x_t, 1, NCHUNK, x0, CTAS, T, SMEM)
    x2 = _chunk_buffer(x_t, 2, NCHUNK, x0, CTAS, T, SMEM)
    x3 = _chunk_buffer(x_t, 3, NCHUNK, x0, CTAS, T, SMEM)
    x4 = _chunk_buffer(x_t, 4, NCHUNK, x0, CTAS, T, SMEM)
    x5 = _chunk_buffer(x_t, 5, NCHUNK, x0, CTAS, T, SMEM)
    x6 = _chunk_buffer(x_t, 6, NCHUNK, x0, CTAS, T, SMEM)
    x7 = _chunk_buffer(x_t, 7, NCHUNK, x0, CTAS, T, SMEM)
    wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)
    ranks3 = gl.expand_dims(gl.expand_dims(gl.arange(0, CTAS, layout=per_cta), 1), 2)
    offs = _smem.slice_offsets(CTAS, T, REG)

    last_claim = n_rows + gl.num_programs(0) - 1
    _smem._claim_row(counter_ptr, next_ptr + 3 * pid, last_claim)
    _smem._cluster_sync()
    r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
    xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
    for k in gl.static_range(NCHUNK):
        if HAS_WEIGHT:
            _smem._async_load(wbuf.index(k), w_ptr + k * CHUNK + offs)
        _smem._async_load(_pick8(k, x0, x1, x2, x3, x4, x5, x6, x7), xrow + k * CHUNK + offs)
        async_copy.commit_group()

    parity = 0
    while r < n_rows:
        row = r.to(gl.int64)
        got = _claim_issue(counter_ptr)
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for k in gl.static_range(NCHUNK):
            _chunk_arrived(k, NCHUNK)
            xf = _pick8(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG).to(gl.float32)
            acc = acc + gl.sum(xf * xf, 2)
        claimed = next_ptr + 3 * pid + 1 + parity
        _claim_publish(counter_ptr, claimed, got, last_claim)
        ss, nxt_t = _exchange_dsmem(gl.sum(acc, 1), parity, got, PTX)
        nxt = gl.load(claimed, cache_modifier=".cg")
        rstd = gl.rsqrt(ss / N + eps)  # [CTAS, 1, 1]
        gl.store(rstd_ptr + row + ranks3 * 0, rstd, mask=ranks3 == 0)
        yrow = y_ptr + row * stride_y
        nxrow = x_ptr + gl.minimum(nxt_t, n_rows - 1).to(gl.int64) * stride_x
        more = (offs * 0 + nxt_t) < n_rows
        for k in gl.static_range(NCHUNK):
            xk = _pick8(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG)
            wk = xk
            if HAS_WEIGHT:
                wk = _w_chunk(wbuf, k, OFFSET, CASTING, REG)
            gl.store(yrow + k * CHUNK + offs,
                     _normalised(xk, wk, rstd, OFFSET, CASTING, HAS_WEIGHT).to(y_ptr.dtype.element_ty))
            _smem._async_load(_pick8(k, x0, x1, x2, x3, x4, x5, x6, x7), nxrow + k * CHUNK + offs, mask=more)
            async_copy.commit_group()
        r = nxt
        parity = 1 - parity
    async_copy.wait_group(0)


def launch_backward(dy2, x2, weight, rstd, dx, partial, *, shape, grid):
    n_rows, n_cols = x2.shape
    next_rows, counter = lib._claim_scratch(grid, x2.device)
    launch(_rms_bwd_dsmem_kernel, (grid,),
           (dy2, x2, weight, rstd, dx, partial, next_rows, counter, n_rows, dy2.stride(0), x2.stride(0),
            dx.stride(0)),
           dict(lib.kernel_constexprs(n_cols, shape, offset=0.0, casting_id=0, compute_dw=True),
                PTX=dsmem_exchange_ptx(shape.ctas)))


def launch_forward(x2, weight, y2, rstd, *, shape, grid, eps):
    n_rows, n_cols = x2.shape
    next_rows, counter = lib._claim_scratch(grid, x2.device)
    launch(_rms_fwd_dsmem_kernel, (grid,),
           (x2, weight, y2, rstd, next_rows, counter, n_rows, x2.stride(0), y2.stride(0), float(eps)),
           dict(lib.forward_constexprs(n_cols, shape, offset=0.0, casting_id=0, has_weight=True),
                PTX=dsmem_exchange_ptx(shape.ctas)))


def compile_only() -> None:
    from check_sm90 import compile_sm90
    t = "*bf16"
    bwd_sig = {"dy_ptr": t, "x_ptr": t, "w_ptr": t, "rstd_ptr": "*fp32", "dx_ptr": t, "dw_part_ptr": "*fp32",
               "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32",
               "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32"}
    fwd_sig = {"x_ptr": t, "w_ptr": t, "y_ptr": t, "rstd_ptr": "*fp32", "next_ptr": "*i32",
               "counter_ptr": "*i32", "n_rows": "i32", "stride_x": "i32", "stride_y": "i32", "eps": "fp32"}
    print(f"triton {triton.__version__}, sm_90a", flush=True)
    for n in (65536, 32768):
        shape = lib.shape_for(n)
        flags = dict(lib.kernel_constexprs(n, shape, offset=0.0, casting_id=0, compute_dw=True),
                     PTX=dsmem_exchange_ptx(shape.ctas))
        flags.pop("num_warps")
        aligned = [a for a in bwd_sig if a.endswith("_ptr") or a.startswith("stride")]
        res = compile_sm90(_rms_bwd_dsmem_kernel, bwd_sig, flags, aligned, shape.warps, 1)
        print(f"backward N={n} {shape}: {res}", flush=True)
    shape = lib.shape_for(65536, forward=True)
    flags = dict(lib.forward_constexprs(65536, shape, offset=0.0, casting_id=0, has_weight=True),
                 PTX=dsmem_exchange_ptx(shape.ctas))
    flags.pop("num_warps")
    aligned = [a for a in fwd_sig if a.endswith("_ptr") or a.startswith("stride")]
    res = compile_sm90(_rms_fwd_dsmem_kernel, fwd_sig, flags, aligned, shape.warps, 1)
    print(f"forward N=65536 {shape}: {res}", flush=True)


def gpu_main(rounds: int) -> None:
    from exp_rms_knobs import N, ROWS, case, checked_backward, checked_forward, header, rms, timed
    t0 = time.time()
    sms = header()
    x, dy, w, rstd, y_ref, dx_ref, dw_ref = case()
    fshape, bshape = lib.shape_for(N, forward=True), lib.shape_for(N)
    fgrid, bgrid = lib.clusters(ROWS, fshape, sms), lib.clusters(ROWS, bshape, sms)
    y = torch.empty_like(x)
    r = torch.empty(ROWS, device="cuda")
    runs = []
    for label, fn in (("library forward", lambda: lib.launch_forward(x, w, y, r, shape=fshape, grid=fgrid, eps=1e-6,
                                                                     offset=0.0, casting_id=0)),
                      ("dsmem forward", lambda: launch_forward(x, w, y, r, shape=fshape, grid=fgrid, eps=1e-6))):
        if checked_forward(label, fn, y, r, y_ref, rstd):
            runs.append((label, fn))
    timed(runs, rounds)
    dx = torch.empty_like(x)
    partial = torch.empty(bgrid, N, device="cuda")
    runs = []
    for label, launcher in (("library backward", lambda: lib.launch_backward(
            dy, x, w, rstd, dx, partial, shape=bshape, grid=bgrid, offset=0.0, casting_id=0, compute_dw=True)),
            ("dsmem backward", lambda: launch_backward(dy, x, w, rstd, dx, partial, shape=bshape, grid=bgrid))):
        def fn(launcher=launcher):
            launcher()
            return rms._sum_partial_rows(partial, bgrid, w)
        if checked_backward(label + " + dw sum", fn, dx, partial, dx_ref, dw_ref):
            runs.append((label + " + dw sum", fn))
    timed(runs, rounds)
    print(f"claim counter after the runs: {int(_smem.claim_counter(x.device).item())} (0: every launch reset it)")
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    compile_only() if a.compile_only else gpu_main(a.rounds)
