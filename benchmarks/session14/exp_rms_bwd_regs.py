"""Experiment (session 14, prepared on the CPU: it compiles for sm_90a; NOT yet run on a GPU): the RMSNorm
backward for long rows (1024 x 65536 bf16, the one RMSNorm target not met: 0.242 ms fwd+bwd against
<= 0.20) with each row read from HBM once, built like cross_entropy_smem's register rows, which took
cross entropy from 69-80 % to 86-89 % of a copy in session 13.

Session 9's cluster design (../session9/exp_rms_bwd_cluster.py) kept x, dy, w *and the fp32 dw
accumulator* in shared memory: per element and row, 24 bytes of shared-memory traffic (the copy in, x, dy
and w read twice, dw read and written) and two CTAs per SM; it ran at 0.198 ms against the library's
0.181 (session 10, "bound by instruction issue and latency"). Here:
  - w_eff and the dw accumulator live in registers for the whole launch (a CTA always owns the same
    columns: slice k of every chunk), so shared memory carries x and dy only: 12 bytes per element;
  - the first IN_REGS chunks of x and dy stay in registers (plain loads, the next row's issued as soon as
    a chunk's dx is stored), the rest arrive by cp.async into shared memory (issued a whole row ahead);
  - ptxas is capped at the registers that let per_sm CTAs share an SM (cross_entropy_smem.register_cap);
  - the partial row dots meet in two exchange slots per cluster, used in turn (ring_exchange.patch's
    scheme), behind one cluster barrier; rows are strided by cluster (dw's summation order is fixed).

Math (llama casting, as the library's _grad_terms; offset o): w_eff = round_w(w + o), xhat = x·rstd,
g = round_x(dy·w_eff), c = Σ_j g_j·xhat_j / N, dx = rstd·(g − xhat·c), dw = Σ_rows dy·round_x(xhat).
Bytes: x and dy read once, dx written once (1.5 copies of x: the one-read floor), plus one fp32 dw
partial row per cluster.

    .venv/bin/python benchmarks/session14/exp_rms_bwd_regs.py --compile-only   (CPU: registers, spills, smem)
    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8 python3 benchmarks/session14/exp_rms_bwd_regs.py  (GPU)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"),
                os.path.join(ROOT, "benchmarks", "session9"), os.path.join(ROOT, "benchmarks", "session15")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

smem_ce = importlib.import_module("fused_kernels.cross_entropy_smem")  # layouts, offsets, cluster barrier
# the library path this experiment became (session 15) holds the helpers both use; w read from global
# memory per chunk, as then (since session 16 the library's w is in shared memory)
from fused_kernels.rms_norm_smem import _pick, _terms  # noqa: E402
from exp_rms_fwd_cluster import _w_chunk  # noqa: E402
_async_load = smem_ce._async_load
MAX_CHUNKS = 4  # w0-w3, dw0-dw3, x0-x3 / d0-d3 below


@gluon.jit
def _dot_chunk(x, dy, w, rstd, acc, OFFSET: gl.constexpr, CASTING: gl.constexpr):
    """Pass 1 for one chunk: acc (per thread) += Σ g·xhat over its 8 columns."""
    xhat, g, _dyf = _terms(x, dy, w, rstd, OFFSET, CASTING)
    return acc + gl.sum(g * xhat, 2)


@gluon.jit
def _grad_chunk(x, dy, w, rstd, c, dw, dx_ptrs, OFFSET: gl.constexpr, CASTING: gl.constexpr,
                COMPUTE_DW: gl.constexpr):
    """Pass 2 for one chunk: dx stored; dw (fp32, per column) += dy·h (h = round_x(xhat) for llama
    casting, xhat otherwise), returned."""
    xhat, g, dyf = _terms(x, dy, w, rstd, OFFSET, CASTING)
    gl.store(dx_ptrs, (rstd * (g - xhat * c)).to(dx_ptrs.dtype.element_ty))
    if COMPUTE_DW:
        if CASTING == 0:
            xhat = xhat.to(x.dtype).to(gl.float32)
        dw = dw + dyf * xhat
    return dw


@gluon.jit
def _w_use(k: gl.constexpr, W_REGS: gl.constexpr, w_ptr, CHUNK: gl.constexpr, offs, OFFSET: gl.constexpr,
           CASTING: gl.constexpr, w0, w1, w2, w3):
    """w_eff of chunk k: the launch-long registers (W_REGS), or loaded again (an L1 hit: a CTA's slice of
    w is 16 KB) to give those 16 registers to more CTAs per SM."""
    if W_REGS:
        w = _pick(k, w0, w1, w2, w3)
    else:
        w = _w_chunk(w_ptr, k, CHUNK, offs, OFFSET, CASTING)
    return w


@gluon.jit
def _rms_bwd_regs_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, partials_ptr, next_ptr, counter_ptr,
                         n_rows, stride_dy, stride_x, stride_dx,
                         OFFSET: gl.constexpr, CASTING: gl.constexpr, COMPUTE_DW: gl.constexpr, N: gl.constexpr,
                         WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr,
                         SMEM: gl.constexpr, IN_REGS: gl.constexpr, W_REGS: gl.constexpr, CLAIM: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK  # the host checks N % CHUNK == 0 and NCHUNK <= 4
    NSMEM: gl.constexpr = NCHUNK - IN_REGS  # >= 2 (a one-chunk buffer does not build on triton 3.6)
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
    xbuf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NSMEM, CTAS, T, 8], SMEM)
    dybuf = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [NSMEM, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)  # the cluster
    n_prog = gl.num_programs(0)
    ranks = gl.arange(0, CTAS, layout=per_cta)
    offs = smem_ce.slice_offsets(CTAS, T, REG)

    w0 = gl.zeros([CTAS, T, 8], w_ptr.dtype.element_ty, REG)  # held only with W_REGS
    w1 = w0
    w2 = w0
    w3 = w0
    if W_REGS:
        w0 = _w_chunk(w_ptr, 0, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 1:
            w1 = _w_chunk(w_ptr, 1, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 2:
            w2 = _w_chunk(w_ptr, 2, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 3:
            w3 = _w_chunk(w_ptr, 3, CHUNK, offs, OFFSET, CASTING)
    dw0 = gl.zeros([CTAS, T, 8], gl.float32, REG)
    dw1 = dw0
    dw2 = dw0
    dw3 = dw0

    if CLAIM:  # rows from a counter (a cluster the GPU cannot hold at first finds them taken); CTAS > 1
        smem_ce._claim_row(counter_ptr, next_ptr + 3 * pid)
        smem_ce._cluster_sync()
        r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
    else:  # rows pid, pid + clusters, ...: dw summed in a fixed order
        r = pid
    xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
    dyrow = dy_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_dy
    x0 = gl.zeros([CTAS, T, 8], x_ptr.dtype.element_ty, REG)  # register chunks (those past IN_REGS unused)
    d0 = gl.zeros([CTAS, T, 8], dy_ptr.dtype.element_ty, REG)
    if IN_REGS > 0:
        x0 = gl.load(xrow + offs)
        d0 = gl.load(dyrow + offs)
    x1 = x0
    d1 = d0
    x2 = x0
    d2 = d0
    if IN_REGS > 1:
        x1 = gl.load(xrow + CHUNK + offs)
        d1 = gl.load(dyrow + CHUNK + offs)
    if IN_REGS > 2:
        x2 = gl.load(xrow + 2 * CHUNK + offs)
        d2 = gl.load(dyrow + 2 * CHUNK + offs)
    for i in gl.static_range(IN_REGS, NCHUNK):
        _async_load(xbuf.index(i - IN_REGS), xrow + i * CHUNK + offs)
        _async_load(dybuf.index(i - IN_REGS), dyrow + i * CHUNK + offs)
    async_copy.commit_group()

    parity = 0
    while r < n_rows:
        row = r.to(gl.int64)
        rstd = gl.load(rstd_ptr + row)
        async_copy.wait_group(0)
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for k in gl.static_range(NCHUNK):
            wk = _w_use(k, W_REGS, w_ptr, CHUNK, offs, OFFSET, CASTING, w0, w1, w2, w3)
            if k < IN_REGS:
                acc = _dot_chunk(_pick(k, x0, x1, x2, x2), _pick(k, d0, d1, d2, d2), wk, rstd, acc, OFFSET, CASTING)
            else:
                acc = _dot_chunk(xbuf.index(k - IN_REGS).load(REG), dybuf.index(k - IN_REGS).load(REG), wk, rstd, acc,
                                 OFFSET, CASTING)
        dot_cta = gl.sum(acc, 1)
        if not CLAIM:
            nxt = r + n_prog
        if CTAS == 1:
            dot = gl.sum(dot_cta, 0)
        else:
            # Two slots per cluster, in turn: a CTA writes this slot again two rows later, after the
            # barrier of the row between, which every CTA reaches only after reading it.
            slot = partials_ptr + (2 * pid + parity) * CTAS
            gl.store(slot + ranks, dot_cta)
            if CLAIM:
                smem_ce._claim_row(counter_ptr, next_ptr + 3 * pid + 1 + parity)
            smem_ce._cluster_sync()
            dot = gl.load(slot, cache_modifier=".cg")
            for k in gl.static_range(1, CTAS):
                dot += gl.load(slot + k, cache_modifier=".cg")
            if CLAIM:
                nxt = gl.load(next_ptr + 3 * pid + 1 + parity, cache_modifier=".cg")
        c = dot / N
        dxrow = dx_ptr + row * stride_dx
        nxrow = x_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * stride_x
        ndyrow = dy_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * stride_dy
        for k in gl.static_range(NCHUNK):
            if k < IN_REGS:
                xk = _pick(k, x0, x1, x2, x2)
                dk = _pick(k, d0, d1, d2, d2)
            else:
                xk = xbuf.index(k - IN_REGS).load(REG)
                dk = dybuf.index(k - IN_REGS).load(REG)
            wk = _w_use(k, W_REGS, w_ptr, CHUNK, offs, OFFSET, CASTING, w0, w1, w2, w3)
            dwk = _grad_chunk(xk, dk, wk, rstd, c, _pick(k, dw0, dw1, dw2, dw3), dxrow + k * CHUNK + offs, OFFSET,
                              CASTING, COMPUTE_DW)
            dw0 = dwk if k == 0 else dw0  # k is a constexpr: one of these takes dwk
            dw1 = dwk if k == 1 else dw1
            dw2 = dwk if k == 2 else dw2
            dw3 = dwk if k == 3 else dw3
            # this chunk of the cluster's next row (the last row: a harmless re-read of a valid row)
            if k < IN_REGS:
                if k == 0:
                    x0 = gl.load(nxrow + offs)
                    d0 = gl.load(ndyrow + offs)
                if k == 1:
                    x1 = gl.load(nxrow + CHUNK + offs)
                    d1 = gl.load(ndyrow + CHUNK + offs)
                if k == 2:
                    x2 = gl.load(nxrow + 2 * CHUNK + offs)
                    d2 = gl.load(ndyrow + 2 * CHUNK + offs)
            else:
                if nxt < n_rows:
                    _async_load(xbuf.index(k - IN_REGS), nxrow + k * CHUNK + offs)
                    _async_load(dybuf.index(k - IN_REGS), ndyrow + k * CHUNK + offs)
        async_copy.commit_group()
        r = nxt
        parity = 1 - parity
    async_copy.wait_group(0)
    if COMPUTE_DW:
        part = dw_part_ptr + pid.to(gl.int64) * N
        gl.store(part + offs, dw0)
        if NCHUNK > 1:
            gl.store(part + CHUNK + offs, dw1)
        if NCHUNK > 2:
            gl.store(part + 2 * CHUNK + offs, dw2)
        if NCHUNK > 3:
            gl.store(part + 3 * CHUNK + offs, dw3)


def check_shape(n: int, warps: int, ctas: int, in_regs: int) -> None:
    chunk = ctas * 32 * warps * 8
    nchunk = n // chunk
    if n % chunk or not 1 <= nchunk <= MAX_CHUNKS or not 0 <= in_regs <= min(3, nchunk - 2):
        raise ValueError(f"N={n} warps={warps} ctas={ctas} in_regs={in_regs}: N must be 1-{MAX_CHUNKS} chunks of "
                         f"{chunk} columns, with >= 2 of them in shared memory and <= 3 in registers")


CASTING_ID = {"llama": 0, "gemma": 1, "none": 2}


def meta(n: int, warps: int, ctas: int, in_regs: int, w_regs: bool, claim: bool = False, offset: float = 0.0,
         casting: str = "llama", compute_dw: bool = True) -> dict:
    check_shape(n, warps, ctas, in_regs)
    if claim and ctas == 1:
        raise ValueError("rows are claimed by clusters (ctas > 1)")
    reg, smem = smem_ce.layouts(warps, ctas)
    return dict(OFFSET=float(offset), CASTING=CASTING_ID[casting], COMPUTE_DW=compute_dw, N=n, WARPS=warps, CTAS=ctas,
                REG=reg, SMEM=smem, IN_REGS=in_regs, W_REGS=w_regs, CLAIM=claim)


def launch(dy, x, w, rstd, warps, ctas, per_sm, in_regs, w_regs, claim, sms, offset=0.0, casting="llama",
           compute_dw=True):
    """(dx, dw or None): per_sm CTAs per SM, rows split over clusters of ctas CTAs, strided by cluster or
    claimed."""
    n_rows, n = x.shape
    clusters = min(n_rows, per_sm * sms // ctas)
    dx = torch.empty_like(x)
    dw_part = torch.empty(clusters if compute_dw else 1, n, dtype=torch.float32, device=x.device)
    partials = torch.empty(clusters * 2 * ctas, dtype=torch.float32, device=x.device)
    next_rows = torch.empty(clusters * 3, dtype=torch.int32, device=x.device)
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    _rms_bwd_regs_kernel[(clusters,)](dy, x, w, rstd, dx, dw_part, partials, next_rows, counter, n_rows, dy.stride(0),
                                      x.stride(0), dx.stride(0),
                                      **meta(n, warps, ctas, in_regs, w_regs, claim, offset, casting, compute_dw),
                                      num_warps=warps, num_ctas=ctas, maxnreg=smem_ce.register_cap(warps, per_sm))
    # dw's last step as the library takes it (one kernel: the partial rows summed and cast)
    rms = importlib.import_module("fused_kernels.rms_norm")
    return dx, (rms._sum_partial_rows(dw_part, dw_part.shape[0], w) if compute_dw else None)


def check_options(n: int, cfg, sms: int) -> None:
    """The other casting modes, a weight offset and no dw, on one shape: against float64 (the library's
    backward semantics, rms_norm._grad_terms)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = 256
    x = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    for casting, offset, compute_dw in (("gemma", 1.0, True), ("none", 0.0, True), ("llama", 1.0, False)):
        x64, dy64, r64 = x.double(), dy.double(), rstd.double()[:, None]
        w_eff = (w.double() + offset) if casting != "llama" else (w.float() + offset).to(torch.bfloat16).double()
        xhat = x64 * r64
        gr = dy64 * w_eff
        h = xhat
        if casting == "llama":
            gr = gr.to(torch.bfloat16).double()
            h = xhat.to(torch.bfloat16).double()
        dx_ref = r64 * (gr - xhat * (gr * xhat).mean(-1, keepdim=True))
        dw_ref = (dy64 * h).sum(0)
        dx, dw = launch(dy, x, w, rstd, *cfg, sms, offset=offset, casting=casting, compute_dw=compute_dw)
        torch.cuda.synchronize()
        ex = ((dx.double() - dx_ref).abs().max() / dx_ref.abs().max()).item()
        ew = 0.0 if dw is None else ((dw.double() - dw_ref).abs().max() / dw_ref.abs().max()).item()
        ok = ex < 1e-2 and ew < 1e-2 and not dx.isnan().any() and (dw is None or not dw.isnan().any())
        print(f"  options casting={casting} offset={offset} dw={compute_dw}: dx err {ex:.1e}, dw err {ew:.1e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)


# (warps, ctas, per_sm, in_regs, w_regs, claim) timed per row length: the spill-free shapes on triton 3.6
# (--compile-only), and their neighbours with more CTAs per SM
CONFIGS = {
    65536: [(8, 8, 2, 0, True, False), (8, 8, 2, 2, True, False), (8, 8, 3, 0, True, False),
            (8, 8, 3, 0, False, False), (8, 8, 3, 0, False, True), (8, 8, 3, 2, False, False),
            (8, 8, 4, 0, False, False), (8, 8, 4, 0, False, True)],
    32768: [(8, 4, 2, 2, True, False), (8, 4, 3, 0, False, False), (8, 4, 3, 2, False, False),
            (4, 8, 4, 2, True, False), (4, 8, 6, 0, False, False), (4, 8, 6, 0, False, True)],
    16384: [(8, 2, 2, 2, True, False), (8, 2, 3, 2, False, False), (4, 4, 4, 2, True, False),
            (4, 4, 6, 0, False, False), (4, 4, 6, 0, False, True)],
}


def compile_only():
    from check_sm90 import compile_sm90
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
           "dw_part_ptr": "*fp32", "partials_ptr": "*fp32", "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32",
           "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
    for n, cfgs in CONFIGS.items():
        for cfg in cfgs:
            warps, ctas, per_sm, in_regs, w_regs, claim = cfg
            cap = smem_ce.register_cap(warps, per_sm)
            label = "N={} warps={} ctas={} per_sm={} in_regs={} w_regs={} claim={}".format(n, *cfg)
            try:
                res = compile_sm90(_rms_bwd_regs_kernel, sig, dict(meta(n, warps, ctas, in_regs, w_regs, claim),
                                                                    num_ctas=ctas, maxnreg=cap), aligned, warps, 1)
            except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            fit = 233472 // (res["shared"] + 1024)
            print(f"{label}: regs {res['regs']} (cap {cap}), spills {res['local'] + res['stack']} B, "
                  f"shared {res['shared']} B per CTA ({fit} fit per SM)", flush=True)
        warps, ctas, per_sm, in_regs, w_regs, claim = cfgs[0]  # check_options' variants build too
        for casting, offset, compute_dw in (("gemma", 1.0, True), ("none", 0.0, True), ("llama", 1.0, False)):
            res = compile_sm90(_rms_bwd_regs_kernel, sig,
                               dict(meta(n, warps, ctas, in_regs, w_regs, claim, offset, casting, compute_dw),
                                    num_ctas=ctas, maxnreg=smem_ce.register_cap(warps, per_sm)), aligned, warps, 1)
            print(f"N={n} {cfgs[0]} casting={casting} offset={offset} dw={compute_dw}: regs {res['regs']}, "
                  f"spills {res['local'] + res['stack']} B", flush=True)


def gpu_main(lengths, rounds):
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import ROWS, check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    rms = importlib.import_module("fused_kernels.rms_norm")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for n in lengths:
        rows = ROWS[n]
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, rows)
        copy = copy_ms(x, timer=queued_ms)
        fwd = queued_ms(lambda: rms._forward_impl(x, w, 1e-6, 0.0, "llama"), reps=15)
        print(f"N={n} rows={rows}: copy {copy:.3f} ms; the one-read backward moves 1.5 copies: {1.5 * copy:.3f} ms; "
              f"the library's forward {fwd:.3f} ms (fwd+bwd target at 1024 x 65536 and 4096 x 16384: 0.20)", flush=True)
        runs = [("library backward", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for cfg in CONFIGS[n]:
            runs.append(("regs warps={} ctas={} per_sm={} in_regs={} w_regs={} claim={}".format(*cfg),
                         lambda a=cfg: launch(dy, x, w, rstd, *a, sms)))
        check_options(n, CONFIGS[n][0], sms)
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)
        x = dy = dx_ref = dw_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--lengths", default="65536,32768,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="1024 x 65536 only, three shapes (2, 3, 4 CTAs per SM), two rounds: for little device time")
    a = ap.parse_args()
    if a.quick:
        CONFIGS[65536] = [(8, 8, 2, 0, True, False), (8, 8, 3, 0, False, False), (8, 8, 4, 0, False, False)]
        a.lengths, a.rounds = "65536", 2
    if a.compile_only:
        compile_only()
    else:
        gpu_main([int(v) for v in a.lengths.split(",")], a.rounds)
