"""Experiment (session 9, prepared on the CPU; NOT yet run on a GPU): the RMSNorm backward for long rows
(1024 x 65536, 2048 x 32768, 4096 x 16384 bf16) with each row read from HBM once, split over a
thread-block cluster as the cross-entropy kernel now is (fused_kernels/cross_entropy_smem.py).

Why: the library's split backward reads x and dy twice (the second time mostly from L2) and takes
~0.176 ms at 1024 x 65536; the fwd+bwd target (<= 0.20 ms, 0.244 now) needs the backward near 0.125
(its one-read floor, x + dy read and dx written, is 384 MB: 0.090 ms at 4.28 TB/s). Session 6 found no
one-read design in Triton; Gluon's clusters, which gave cross entropy 76-80 % of a copy, are the lever.

Math (llama casting, offset o): xhat = x·rstd, g = dy·(w + o), dot = Σ_j g_j·x_j,
dx = rstd·g − x·rstd³·dot / N, dw = Σ_rows dy·xhat.

Kernel: a cluster of CTAS CTAs owns a row (CTA k: slice k of every chunk of CHUNK = 8·32·WARPS·CTAS
columns); rows are claimed from a counter (cross_entropy_smem's inline-PTX claim and cluster barrier).
Per CTA, shared memory holds its slice of x and dy (bf16, cp.async, the next row prefetched into each
slot as pass 2 consumes it), of w (loaded once) and of the dw accumulator (fp32): 80 KB at
N / CTAS = 8192 columns, two CTAs per SM. Pass 1: the CTA's partial dot; exchange through a per-row
global slot + one cluster barrier; pass 2: dx, and dw += dy·x·rstd into shared memory. At the end each
CTA writes its dw slice to a per-cluster partial row; torch sums the partials (clusters x N fp32).
Rows claimed in arrival order make dw's summation order vary from run to run (last-bit differences);
a library version that must be bitwise reproducible would stride rows by cluster instead (and size the
grid to the clusters that fit, see ../session9/README.md on residency).

    .venv/bin/python benchmarks/session9/exp_rms_bwd_cluster.py --compile-only      (CPU: does it build?)
    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session9/exp_rms_bwd_cluster.py  (GPU: check + time)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")]  # ce_case
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

smem_ce = importlib.import_module("fused_kernels.cross_entropy_smem")  # layouts, claim, cluster barrier
_async_load = smem_ce._async_load


@gluon.jit
def _rms_bwd_cluster_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, partials_ptr, next_ptr, counter_ptr,
                            n_rows, stride, offset,
                            N: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr,
                            SMEM: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK  # the experiment takes N a multiple of CHUNK
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
    xbuf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)
    dybuf = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)
    wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)
    dwbuf = gl.allocate_shared_memory(gl.float32, [NCHUNK, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)
    ranks = gl.arange(0, CTAS, layout=per_cta)
    offs = smem_ce.slice_offsets(CTAS, T, REG)

    # w once; the dw accumulator zeroed (each thread only ever touches its own 8 columns per chunk)
    for i in range(NCHUNK):
        _async_load(wbuf.index(i), w_ptr + i * CHUNK + offs)
        dwbuf.index(i).store(gl.zeros([CTAS, T, 8], gl.float32, REG))
    if CTAS == 1:
        r = pid
        n_prog = gl.num_programs(0)
    else:
        smem_ce._claim_row(counter_ptr, next_ptr + n_rows + pid)
        smem_ce._cluster_sync()
        r = gl.load(next_ptr + n_rows + pid, cache_modifier=".cg")
    first = gl.minimum(r, n_rows - 1).to(gl.int64) * stride
    for i in range(NCHUNK):
        _async_load(xbuf.index(i), x_ptr + first + i * CHUNK + offs)
        _async_load(dybuf.index(i), dy_ptr + first + i * CHUNK + offs)
    async_copy.commit_group()

    while r < n_rows:
        row = r.to(gl.int64)
        rstd = gl.load(rstd_ptr + row)
        async_copy.wait_group(0)
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for i in range(NCHUNK):
            xv = xbuf.index(i).load(REG).to(gl.float32)
            g = dybuf.index(i).load(REG).to(gl.float32) * (wbuf.index(i).load(REG).to(gl.float32) + offset)
            acc += gl.sum(g * xv, 2)
        dot_cta = gl.sum(acc, 1)
        if CTAS == 1:
            dot = gl.sum(dot_cta, 0)
            nxt = r + n_prog
        else:
            slot = partials_ptr + row * CTAS
            gl.store(slot + ranks, dot_cta)
            smem_ce._claim_row(counter_ptr, next_ptr + row)
            smem_ce._cluster_sync()
            dot = gl.load(slot, cache_modifier=".cg")
            for k in gl.static_range(1, CTAS):
                dot += gl.load(slot + k, cache_modifier=".cg")
            nxt = gl.load(next_ptr + row, cache_modifier=".cg")
        c = rstd * rstd * rstd * dot / N
        base = row * stride
        nbase = gl.minimum(nxt, n_rows - 1).to(gl.int64) * stride
        for i in range(NCHUNK):
            xv = xbuf.index(i).load(REG).to(gl.float32)
            dyv = dybuf.index(i).load(REG).to(gl.float32)
            g = dyv * (wbuf.index(i).load(REG).to(gl.float32) + offset)
            gl.store(dx_ptr + base + i * CHUNK + offs, (rstd * g - xv * c).to(dx_ptr.dtype.element_ty))
            dwb = dwbuf.index(i)
            dwb.store(dwb.load(REG) + dyv * xv * rstd)
            if nxt < n_rows:
                _async_load(xbuf.index(i), x_ptr + nbase + i * CHUNK + offs)
                _async_load(dybuf.index(i), dy_ptr + nbase + i * CHUNK + offs)
        async_copy.commit_group()
        r = nxt
    async_copy.wait_group(0)
    for i in range(NCHUNK):
        gl.store(dw_part_ptr + pid.to(gl.int64) * N + i * CHUNK + offs, dwbuf.index(i).load(REG))


def meta(n: int, warps: int, ctas: int) -> dict:
    reg, smem = smem_ce.layouts(warps, ctas)
    return dict(N=n, WARPS=warps, CTAS=ctas, REG=reg, SMEM=smem)


def launch(dy, x, w, rstd, warps, ctas, per_sm, sms):
    """(dx, dw) of the cluster kernel: per_sm CTAs per SM, rows split over ctas of them."""
    n_rows, n = x.shape
    clusters = min(n_rows, per_sm * sms // ctas)
    dx = torch.empty_like(x)
    dw_part = torch.empty(clusters, n, dtype=torch.float32, device=x.device)
    partials = torch.empty(n_rows * ctas, dtype=torch.float32, device=x.device)
    next_rows = torch.empty(n_rows + clusters, dtype=torch.int32, device=x.device)
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    _rms_bwd_cluster_kernel[(clusters,)](dy, x, w, rstd, dx, dw_part, partials, next_rows, counter, n_rows,
                                         x.stride(0), 0.0, **meta(n, warps, ctas), num_warps=warps, num_ctas=ctas)
    return dx, dw_part.sum(0).to(w.dtype)


def compile_only():
    from check_sm90 import compile_sm90
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
           "dw_part_ptr": "*fp32", "partials_ptr": "*fp32", "next_ptr": "*i32", "counter_ptr": "*i32",
           "n_rows": "i32", "stride": "i32", "offset": "fp32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a == "stride"]
    for n, warps, ctas in CONFIGS_BY_N_FLAT:
        res = compile_sm90(_rms_bwd_cluster_kernel, sig, dict(meta(n, warps, ctas), num_ctas=ctas), aligned, warps, 1)
        fit = min(65536 // (-(-res["regs"] // 8) * 8 * 32 * warps), 233472 // (res["shared"] + 1024))
        print(f"N={n} warps={warps} ctas={ctas}: shared {res['shared']} B per CTA, regs {res['regs']}, "
              f"local {res['local']}, {fit} CTAs fit per SM", flush=True)


# (N, warps, ctas, per_sm) tried per row length
CONFIGS = {65536: [(8, 8, 2), (4, 8, 2), (8, 4, 1)], 32768: [(8, 4, 2), (4, 4, 2), (8, 8, 4)],
           16384: [(8, 2, 2), (8, 4, 4), (4, 4, 4), (8, 1, 1)]}
CONFIGS_BY_N_FLAT = [(n, w, c) for n, cfgs in CONFIGS.items() for w, c, _ in cfgs]
ROWS = {65536: 1024, 32768: 2048, 16384: 4096}


def rms_case(n: int, rows: int):
    """(x, dy, w, rstd, dx_ref, dw_ref): a bf16 backward case of rows x n and its float64 reference
    (llama casting, offset 0)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    x64, dy64, w64 = x.double(), dy.double(), w.double()
    r64 = rstd.double()[:, None]
    g64 = dy64 * w64
    dx_ref = r64 * g64 - x64 * r64 ** 3 * (g64 * x64).sum(-1, keepdim=True) / n
    dw_ref = (dy64 * x64 * r64).sum(0)
    return x, dy, w, rstd, dx_ref, dw_ref


def check_and_time(n: int, runs, dx_ref, dw_ref, floor_ms: float, rounds: int, timer) -> None:
    """Each (label, fn) of runs, fn() -> (dx, dw): one run checked against float64 (a run that raises is
    reported and dropped), then `rounds` rounds of timer medians of the survivors, in turn."""
    good = []
    for label, fn in runs:
        try:
            dx, dw = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        ex = ((dx.double() - dx_ref).abs().max() / dx_ref.abs().max()).item()
        ew = ((dw.double() - dw_ref).abs().max() / dw_ref.abs().max()).item()
        ok = ex < 1e-2 and ew < 1e-2 and not (dx.isnan().any() or dw.isnan().any())
        print(f"  {label}: dx err {ex:.1e}, dw err {ew:.1e} {'ok' if ok else 'WRONG'}", flush=True)
        good.append((label, fn))
    for rnd in range(rounds):
        for label, fn in good:
            ms = timer(fn, reps=15)
            print(f"  N={n} round {rnd}: {ms:.3f} ms  {floor_ms / ms:5.1%} of the one-read floor  {label}", flush=True)


def gpu_main(lengths, rounds, queued=False):
    from ce_case import copy_ms
    from tune_cross_entropy import event_ms, queued_ms
    timer = queued_ms if queued else event_ms  # session 10: queued (GPU time only; event_ms adds launch gaps)
    rms = importlib.import_module("fused_kernels.rms_norm")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    for n in lengths:
        rows = ROWS[n]
        x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, rows)
        copy = copy_ms(x, timer=timer)  # read + write of one tensor
        print(f"N={n} rows={rows}: copy {copy:.3f} ms; one-read backward moves 1.5 copies: "
              f"{1.5 * copy:.3f} ms", flush=True)
        runs = [("library split backward", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
        for warps, ctas, per_sm in CONFIGS[n]:
            runs.append((f"cluster warps={warps} ctas={ctas} per_sm={per_sm}",
                         lambda w_=warps, c=ctas, p=per_sm: launch(dy, x, w, rstd, w_, c, p, sms)))
        check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, timer)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--lengths", default="65536,32768,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queued", action="store_true", help="time GPU work only (tune_cross_entropy.queued_ms)")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
    else:
        gpu_main([int(v) for v in a.lengths.split(",")], a.rounds, a.queued)
