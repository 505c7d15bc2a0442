"""Experiment (session 10): the RMSNorm backward for rows of 16384 (4096 x 16384 bf16, the one RMSNorm
target at the line: 0.202 ms fwd+bwd GPU against <= 0.20) with each row read from HBM once and the next
row's copy in flight during the whole of this one.

Why: the library's backward at N = 16384 sweeps each row twice (0.139 ms queued, one-read floor 0.098).
Session 9's shared-memory design (benchmarks/session9/exp_rms_bwd_cluster.py, CTAS = 1) held one row
slot per CTA, refilled chunk by chunk during pass 2 as in cross_entropy_smem: with x, dy, w and the dw
accumulator in shared memory only one CTA fits an SM, nothing else overlaps its pass 1 and reductions,
and it took 0.175 ms. Here: one CTA per SM with TWO row slots (x and dy, bf16: 2 x 64 KB) and the dw
accumulator (fp32, 64 KB) in shared memory; w is read through L1 (32 KB, the same for every row). The
copy of row r + 2P is issued into the slot row r leaves as soon as row r is done, so a row's loads are
in flight through the whole of the previous row (cp.async groups: one per row, wait_group(1)).

Math (llama casting, offset o): g = dy·(w + o), dot = Σ_j g_j·x_j, c = rstd³·dot / N,
dx = rstd·g − x·c, dw = Σ_rows dy·x·rstd (per-program fp32 partial rows, summed by torch).
Bytes: x + dy read once, dx written once (3 · rows · N · 2), plus programs · N · 4 for dw partials.

    .venv/bin/python benchmarks/session10/exp_rms_bwd_double_buffer.py --compile-only   (CPU: builds?)
    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session10/exp_rms_bwd_double_buffer.py  (GPU)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"),
                os.path.join(ROOT, "benchmarks", "session9")]  # ce_case; exp_rms_bwd_cluster's harness
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

smem_ce = importlib.import_module("fused_kernels.cross_entropy_smem")  # layouts, slice offsets, cp.async
_async_load = smem_ce._async_load


@gluon.jit
def _load_row(xbuf, dybuf, x_ptr, dy_ptr, base, slot, offs, NCHUNK: gl.constexpr, CHUNK: gl.constexpr):
    for i in range(NCHUNK):
        _async_load(xbuf.index(slot * NCHUNK + i), x_ptr + base + i * CHUNK + offs)
        _async_load(dybuf.index(slot * NCHUNK + i), dy_ptr + base + i * CHUNK + offs)


@gluon.jit
def _rms_bwd_db_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, stride, offset,
                       N: gl.constexpr, WARPS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = T * 8
    NCHUNK: gl.constexpr = N // CHUNK  # the experiment takes N a multiple of CHUNK
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    xbuf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [2 * NCHUNK, 1, T, 8], SMEM)
    dybuf = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [2 * NCHUNK, 1, T, 8], SMEM)
    dwbuf = gl.allocate_shared_memory(gl.float32, [NCHUNK, 1, T, 8], SMEM)

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    offs = smem_ce.slice_offsets(1, T, REG)
    for i in range(NCHUNK):  # each thread only ever touches its own 8 columns of each chunk: no barrier
        dwbuf.index(i).store(gl.zeros([1, T, 8], gl.float32, REG))

    # two rows in flight from the start: one cp.async group per row (an empty group past the end)
    r = pid
    _load_row(xbuf, dybuf, x_ptr, dy_ptr, gl.minimum(r, n_rows - 1).to(gl.int64) * stride, 0, offs, NCHUNK, CHUNK)
    async_copy.commit_group()
    if r + n_prog < n_rows:
        _load_row(xbuf, dybuf, x_ptr, dy_ptr, (r + n_prog).to(gl.int64) * stride, 1, offs, NCHUNK, CHUNK)
    async_copy.commit_group()
    slot = 0
    while r < n_rows:
        row = r.to(gl.int64)
        rstd = gl.load(rstd_ptr + row)
        async_copy.wait_group(1)  # this row's group done; the next row's may still be in flight
        acc = gl.zeros([1, T], gl.float32, per_thread)
        for i in range(NCHUNK):
            xv = xbuf.index(slot * NCHUNK + i).load(REG).to(gl.float32)
            g = dybuf.index(slot * NCHUNK + i).load(REG).to(gl.float32) * \
                (gl.load(w_ptr + i * CHUNK + offs).to(gl.float32) + offset)
            acc += gl.sum(g * xv, 2)
        dot = gl.sum(gl.sum(acc, 1), 0)
        c = rstd * rstd * rstd * dot / N
        base = row * stride
        for i in range(NCHUNK):
            xv = xbuf.index(slot * NCHUNK + i).load(REG).to(gl.float32)
            dyv = dybuf.index(slot * NCHUNK + i).load(REG).to(gl.float32)
            g = dyv * (gl.load(w_ptr + i * CHUNK + offs).to(gl.float32) + offset)
            gl.store(dx_ptr + base + i * CHUNK + offs, (rstd * g - xv * c).to(dx_ptr.dtype.element_ty))
            dwb = dwbuf.index(i)
            dwb.store(dwb.load(REG) + dyv * xv * rstd)
        # the slot this row leaves takes the row after next
        if r + 2 * n_prog < n_rows:
            _load_row(xbuf, dybuf, x_ptr, dy_ptr, (r + 2 * n_prog).to(gl.int64) * stride, slot, offs, NCHUNK, CHUNK)
        async_copy.commit_group()
        r += n_prog
        slot = 1 - slot
    async_copy.wait_group(0)
    for i in range(NCHUNK):
        gl.store(dw_part_ptr + pid.to(gl.int64) * N + i * CHUNK + offs, dwbuf.index(i).load(REG))


def meta(n: int, warps: int) -> dict:
    reg, smem = smem_ce.layouts(warps, 1)
    return dict(N=n, WARPS=warps, REG=reg, SMEM=smem)


def launch(dy, x, w, rstd, warps, sms):
    n_rows, n = x.shape
    progs = min(n_rows, sms)
    dx = torch.empty_like(x)
    dw_part = torch.empty(progs, n, dtype=torch.float32, device=x.device)
    _rms_bwd_db_kernel[(progs,)](dy, x, w, rstd, dx, dw_part, n_rows, x.stride(0), 0.0, **meta(n, warps),
                                 num_warps=warps)
    return dx, dw_part.sum(0).to(w.dtype)


WARPS = (8, 16)


def compile_only(n: int):
    from check_sm90 import compile_sm90
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
           "dw_part_ptr": "*fp32", "n_rows": "i32", "stride": "i32", "offset": "fp32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a == "stride"]
    for warps in WARPS:
        res = compile_sm90(_rms_bwd_db_kernel, sig, meta(n, warps), aligned, warps, 1)
        print(f"N={n} warps={warps}: shared {res['shared']} B, regs {res['regs']}, local {res['local']}", flush=True)


def gpu_main(n: int, rows: int, rounds: int):
    from ce_case import copy_ms
    from exp_rms_bwd_cluster import check_and_time, rms_case
    from tune_cross_entropy import queued_ms
    rms = importlib.import_module("fused_kernels.rms_norm")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    x, dy, w, rstd, dx_ref, dw_ref = rms_case(n, rows)
    copy = copy_ms(x, timer=queued_ms)
    print(f"N={n} rows={rows}: copy {copy:.3f} ms; one-read backward moves 1.5 copies: {1.5 * copy:.3f} ms", flush=True)
    runs = [("library backward", lambda: rms._backward_impl(dy, x, w, rstd, 0.0, "llama", True))]
    runs += [(f"double-buffered smem warps={wp}", lambda wp=wp: launch(dy, x, w, rstd, wp, sms)) for wp in WARPS]
    check_and_time(n, runs, dx_ref, dw_ref, 1.5 * copy, rounds, queued_ms)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.compile_only:
        compile_only(a.n)
    else:
        gpu_main(a.n, a.rows, a.rounds)
