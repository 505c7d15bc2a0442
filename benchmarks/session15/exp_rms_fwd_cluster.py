"""Experiment (session 15, prepared on the CPU: it compiles for sm_90a on triton 3.6 and 3.9; NOT yet run
on a GPU): the RMSNorm FORWARD for long rows (1024 x 65536 and 2048 x 32768 bf16) with each row read
from HBM once. The library's forward sweeps a long row twice (the second sweep from L2): 0.083 ms at
1024 x 65536 where a copy of x takes 0.066 (queued timing, benchmarks/session15/exp_rms_bwd_regs.txt).
The forward moves one copy (x read, y written); the aim is ~0.070 ms.

Built like ../session14/exp_rms_bwd_regs.py (the backward, whose claim=True shapes won on the H200),
with cross_entropy_smem's machinery (layouts, slice offsets, cluster barrier, row claiming):
  - a row is split over a thread-block cluster of CTAS CTAs (2, 4 or 8): CTA k owns slice k of each of
    the row's NCHUNK chunks (CHUNK = CTAS·32·WARPS·8 columns, 8 consecutive ones per thread; 1-8 chunks,
    so that 4-warp CTAs can take 65536), so a CTA always owns the same columns and may hold their
    weights in registers for the whole launch (W_REGS; otherwise they are read again per chunk, an L1
    hit: a CTA's slice of w is N·2/CTAS bytes);
  - the first IN_REGS chunks of x live in registers (plain loads, the next row's issued right after the
    chunk's y is stored), the rest arrive in shared memory by cp.async (after chunk k's y is stored,
    chunk k of a later row is copied into the same slot);
  - pass 1: Σ x² per thread, per CTA, written to one of the cluster's two exchange slots in global
    memory (used in turn), the next row claimed from a global counter (CTA 0's thread 0), one cluster
    barrier (release / acquire), then every CTA adds the CTAS partials (.cg loads, the same order
    everywhere: one rstd per row);
  - pass 2: y chunk by chunk; rstd[row] stored by CTA 0 of the cluster.
Variants (constexprs):
  - DEPTH 1 (the backward's scheme): the copy of row i+1 is issued during row i's pass 2, so it has only
    the rest of that pass to land before row i+1's pass 1 waits on it; other CTAs on the SM must hide the
    rest. DEPTH 2 (IN_REGS = 0): two rows ahead, into two halves of a buffer of twice the size (the
    forward's buffer is small: N·2/CTAS bytes per row), so a copy has a whole row's time to land.
  - EARLY_CLAIM: the next row is claimed at the top of the row instead of just before the barrier, so
    that the atomic's round trip (which the release barrier waits for) overlaps pass 1.
Triton 3.6 puts a CTA barrier (bar.sync) before and after each cp.async issued in pass 2 (its shared-
memory hazard analysis does not know that every thread reads only what it copied); 3.9 fewer. The CE
kernel lives with the same.

The row counter is never reset (a torch.zeros per launch would add a fill kernel, ~3 % of 0.07 ms): a
launch makes exactly n_rows + DEPTH·clusters claims (each row once, plus the DEPTH past the end that stop
each cluster), so with a counter per launch shape (Runner) the k-th launch finds it at k·that, and a
claim c stands for row c mod (n_rows + DEPTH·clusters). A library version would rather have the last
claimer reset it.

Math (rms_norm's forward, its module docstring): rstd = 1/sqrt(mean(x²) + eps) in fp32, xhat = x·rstd;
casting "llama" (0): y = w_eff·round_x(xhat), w_eff = offset + w in w's dtype (rounded there when
offset != 0), the product in fp32 rounded to y's dtype; "gemma" (1) / "none" (2): y = round_x(xhat·
(offset + float(w))); no weight: y = xhat. OFFSET is a constexpr (0.0 for most models).

    .venv/bin/python benchmarks/session15/exp_rms_fwd_cluster.py --compile-only [--sweep]   (CPU)
    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8 python3 benchmarks/session15/exp_rms_fwd_cluster.py  (GPU)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

smem_ce = importlib.import_module("fused_kernels.cross_entropy_smem")  # layouts, offsets, cluster barrier
_async_load = smem_ce._async_load
from fused_kernels.rms_norm_smem import _normalised, _offset_weight, _pick8  # noqa: E402
MAX_CHUNKS = 8  # w0-w7 below (held with W_REGS); chunks in shared memory have no such limit
MAX_IN_REGS = 4  # x0-x3 below


@gluon.jit
def _w_chunk(w_ptr, k: gl.constexpr, CHUNK: gl.constexpr, offs, OFFSET: gl.constexpr, CASTING: gl.constexpr):
    """Chunk k of this thread's weights, loaded from global memory, in the weight's dtype; for llama
    casting offset + weight rounded there as torch does. (rms_norm_smem's, as it was when this ran; since
    session 16 the library's reads w from shared memory.)"""
    return _offset_weight(gl.load(w_ptr + k * CHUNK + offs), OFFSET, CASTING)


_pick = _pick8  # a_k of eight (k a constexpr): the library's since session 17, the same code


@gluon.jit
def _x_chunk(k: gl.constexpr, IN_REGS: gl.constexpr, xbuf, stage, REG: gl.constexpr, x0, x1, x2, x3):
    """Chunk k of this CTA's slice of the row: a register chunk, or its shared-memory slot (slots
    stage + k - IN_REGS: stage is 0, or with DEPTH = 2 the row's half of the buffer)."""
    if k < IN_REGS:
        xk = _pick(k, x0, x1, x2, x3, x3, x3, x3, x3)
    else:
        xk = xbuf.index(stage + (k - IN_REGS)).load(REG)
    return xk


# y of a chunk in fp32, as rms_norm._normalised_output: the library's copy of session 15's helper since the
# forward moved into rms_norm_smem (session 17), the same code.
_y_chunk = _normalised


@gluon.jit
def _rms_fwd_cluster_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, partials_ptr, next_ptr, counter_ptr,
                            n_rows, stride_x, stride_y, eps,
                            OFFSET: gl.constexpr, CASTING: gl.constexpr, HAS_WEIGHT: gl.constexpr, N: gl.constexpr,
                            WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr,
                            IN_REGS: gl.constexpr, W_REGS: gl.constexpr, EARLY_CLAIM: gl.constexpr,
                            DEPTH: gl.constexpr):
    """Rows of x normalised into y (rstd into rstd_ptr) by a persistent grid of clusters of CTAS CTAs
    claiming rows from *counter_ptr (see the module docstring). DEPTH 1: a row's shared-memory chunks are
    copied in while the cluster writes the row before (the backward's scheme); DEPTH 2 (IN_REGS = 0):
    two rows ahead, into two halves of the buffer used in turn, so that a row's copy has a whole row's
    time to land."""
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK  # the host checks N % CHUNK == 0, 1 <= NCHUNK <= 8, IN_REGS <= 4
    NSMEM: gl.constexpr = NCHUNK - IN_REGS  # shared-memory chunks per row
    # A one-chunk buffer does not build on triton 3.6 (session 13): two slots at least (2-4 KB, maybe unused).
    NBUF: gl.constexpr = DEPTH * NSMEM if DEPTH * NSMEM > 1 else 2
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
    xbuf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NBUF, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)  # the cluster
    total = n_rows + DEPTH * gl.num_programs(0)  # claims per launch (the module docstring)
    ranks = gl.arange(0, CTAS, layout=per_cta)
    offs = smem_ce.slice_offsets(CTAS, T, REG)

    w0 = gl.zeros([CTAS, T, 8], w_ptr.dtype.element_ty, REG)  # held only with W_REGS
    w1 = w0
    w2 = w0
    w3 = w0
    w4 = w0
    w5 = w0
    w6 = w0
    w7 = w0
    if W_REGS and HAS_WEIGHT:
        w0 = _w_chunk(w_ptr, 0, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 1:
            w1 = _w_chunk(w_ptr, 1, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 2:
            w2 = _w_chunk(w_ptr, 2, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 3:
            w3 = _w_chunk(w_ptr, 3, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 4:
            w4 = _w_chunk(w_ptr, 4, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 5:
            w5 = _w_chunk(w_ptr, 5, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 6:
            w6 = _w_chunk(w_ptr, 6, CHUNK, offs, OFFSET, CASTING)
        if NCHUNK > 7:
            w7 = _w_chunk(w_ptr, 7, CHUNK, offs, OFFSET, CASTING)

    # Per cluster 4 row slots: next_ptr[4·pid] its first row, [4·pid + 1] its second (DEPTH 2), and
    # [4·pid + 2 + i % 2] the row claimed during row i, read by all after row i's barrier. A slot is
    # written again two rows later, after the barrier of the row between (the partials' scheme).
    smem_ce._claim_row(counter_ptr, next_ptr + 4 * pid)
    if DEPTH == 2:
        smem_ce._claim_row(counter_ptr, next_ptr + 4 * pid + 1)
    smem_ce._cluster_sync()
    r = gl.load(next_ptr + 4 * pid, cache_modifier=".cg") % total
    xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
    x0 = gl.zeros([CTAS, T, 8], x_ptr.dtype.element_ty, REG)  # register chunks (those past IN_REGS unused)
    x1 = x0
    x2 = x0
    x3 = x0
    if IN_REGS > 0:
        x0 = gl.load(xrow + offs)
    if IN_REGS > 1:
        x1 = gl.load(xrow + CHUNK + offs)
    if IN_REGS > 2:
        x2 = gl.load(xrow + 2 * CHUNK + offs)
    if IN_REGS > 3:
        x3 = gl.load(xrow + 3 * CHUNK + offs)
    for i in gl.static_range(IN_REGS, NCHUNK):
        _async_load(xbuf.index(i - IN_REGS), xrow + i * CHUNK + offs)
    async_copy.commit_group()
    r1 = r  # DEPTH 2: the row after r, its copy in flight into the buffer's second half
    if DEPTH == 2:
        r1 = gl.load(next_ptr + 4 * pid + 1, cache_modifier=".cg") % total
        if r1 < n_rows:
            x1row = x_ptr + r1.to(gl.int64) * stride_x
            for i in gl.static_range(NSMEM):
                _async_load(xbuf.index(NSMEM + i), x1row + (IN_REGS + i) * CHUNK + offs)
        async_copy.commit_group()

    parity = 0
    while r < n_rows:
        row = r.to(gl.int64)
        stage = 0
        if DEPTH == 2:
            stage = parity * NSMEM
        if EARLY_CLAIM:
            smem_ce._claim_row(counter_ptr, next_ptr + 4 * pid + 2 + parity)
        async_copy.wait_group(DEPTH - 1)  # this row's copies landed (DEPTH 2: the next row's may not have)
        # Pass 1: Σ x² per thread, then per CTA
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for k in gl.static_range(NCHUNK):
            xf = _x_chunk(k, IN_REGS, xbuf, stage, REG, x0, x1, x2, x3).to(gl.float32)
            acc = acc + gl.sum(xf * xf, 2)
        # Two slots per cluster, in turn: a CTA writes this slot again two rows later, after the barrier of
        # the row between, which every CTA reaches only after reading it.
        slot = partials_ptr + (2 * pid + parity) * CTAS
        gl.store(slot + ranks, gl.sum(acc, 1))
        if not EARLY_CLAIM:
            smem_ce._claim_row(counter_ptr, next_ptr + 4 * pid + 2 + parity)
        smem_ce._cluster_sync()
        ss = gl.load(slot, cache_modifier=".cg")
        for k in gl.static_range(1, CTAS):
            ss += gl.load(slot + k, cache_modifier=".cg")
        nxt = gl.load(next_ptr + 4 * pid + 2 + parity, cache_modifier=".cg") % total  # copied in during this row
        rstd = gl.rsqrt(ss / N + eps)
        gl.store(rstd_ptr + row + ranks * 0, gl.full([CTAS], 0.0, gl.float32, per_cta) + rstd, mask=ranks == 0)

        # Pass 2: y chunk by chunk; each consumed chunk takes the same chunk of row nxt (the last row:
        # registers re-read a valid row, harmlessly; shared-memory slots are left alone).
        yrow = y_ptr + row * stride_y
        nxrow = x_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * stride_x
        for k in gl.static_range(NCHUNK):
            xk = _x_chunk(k, IN_REGS, xbuf, stage, REG, x0, x1, x2, x3)
            if HAS_WEIGHT:
                if W_REGS:
                    wk = _pick(k, w0, w1, w2, w3, w4, w5, w6, w7)
                else:
                    wk = _w_chunk(w_ptr, k, CHUNK, offs, OFFSET, CASTING)
            else:
                wk = xk  # not read
            gl.store(yrow + k * CHUNK + offs, _y_chunk(xk, wk, rstd, OFFSET, CASTING, HAS_WEIGHT).to(
                y_ptr.dtype.element_ty))
            if k < IN_REGS:
                if k == 0:
                    x0 = gl.load(nxrow + offs)
                if k == 1:
                    x1 = gl.load(nxrow + CHUNK + offs)
                if k == 2:
                    x2 = gl.load(nxrow + 2 * CHUNK + offs)
                if k == 3:
                    x3 = gl.load(nxrow + 3 * CHUNK + offs)
            else:
                if nxt < n_rows:
                    _async_load(xbuf.index(stage + (k - IN_REGS)), nxrow + k * CHUNK + offs)
        async_copy.commit_group()
        if DEPTH == 2:
            r = r1
            r1 = nxt
        else:
            r = nxt
        parity = 1 - parity
    async_copy.wait_group(0)


def check_shape(n: int, warps: int, ctas: int, in_regs: int, depth: int = 1) -> None:
    chunk = ctas * 32 * warps * 8
    nchunk = n // chunk
    if ctas not in (2, 4, 8) or n % chunk or not 1 <= nchunk <= MAX_CHUNKS or \
            not 0 <= in_regs <= min(MAX_IN_REGS, nchunk) or depth not in (1, 2) or (depth == 2 and in_regs):
        raise ValueError(f"N={n} warps={warps} ctas={ctas} in_regs={in_regs} depth={depth}: a cluster of 2, 4 or 8 "
                         f"CTAs, N 1-{MAX_CHUNKS} chunks of {chunk} columns, <= {MAX_IN_REGS} of them in registers "
                         f"(none with depth 2), depth 1 or 2")


CASTING_ID = {"llama": 0, "gemma": 1, "none": 2}


def meta(n: int, cfg, offset: float = 0.0, casting: str = "llama", has_weight: bool = True) -> dict:
    """The kernel's constexprs for cfg = (warps, ctas, per_sm, in_regs, w_regs, early_claim, depth)."""
    warps, ctas, _per_sm, in_regs, w_regs, early, depth = cfg
    check_shape(n, warps, ctas, in_regs, depth)
    reg, smem = smem_ce.layouts(warps, ctas)
    return dict(OFFSET=float(offset), CASTING=CASTING_ID[casting], HAS_WEIGHT=has_weight, N=n, WARPS=warps, CTAS=ctas,
                REG=reg, SMEM=smem, IN_REGS=in_regs, W_REGS=w_regs, EARLY_CLAIM=early, DEPTH=depth)


class Runner:
    """One launch shape on fixed tensors: its outputs, exchange slots and row counter allocated once (the
    counter is never reset: claims are taken mod n_rows + depth·clusters, see the module docstring), so
    that a call is one kernel launch. cfg = (warps, ctas, per_sm, in_regs, w_regs, early_claim, depth)."""

    def __init__(self, x, w, cfg, sms, eps=1e-6, offset=0.0, casting="llama"):
        rms = importlib.import_module("fused_kernels.rms_norm")
        warps, ctas, per_sm = cfg[:3]
        n_rows, n = x.shape
        self.x, self.w, self.eps, self.warps, self.ctas = x, w, eps, warps, ctas
        self.clusters = min(n_rows, per_sm * sms // ctas)
        dev = x.device
        self.y = torch.empty(n_rows, n, dtype=rms.output_dtype(x.dtype, None if w is None else w.dtype, casting),
                             device=dev)
        self.rstd = torch.empty(n_rows, dtype=torch.float32, device=dev)
        self.partials = torch.empty(self.clusters * 2 * ctas, dtype=torch.float32, device=dev)
        self.next_rows = torch.empty(self.clusters * 4, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.meta = meta(n, cfg, offset, casting, w is not None)
        self.cap = smem_ce.register_cap(warps, per_sm)

    def __call__(self):
        x = self.x
        _rms_fwd_cluster_kernel[(self.clusters,)](
            x, x if self.w is None else self.w, self.y, self.rstd, self.partials, self.next_rows, self.counter,
            x.shape[0], x.stride(0), self.y.stride(0), self.eps, **self.meta,
            num_warps=self.warps, num_ctas=self.ctas, maxnreg=self.cap)
        return self.y, self.rstd


# (warps, ctas, per_sm, in_regs, w_regs, early_claim, depth) timed per row length: see --compile-only's
# table (benchmarks/session15/exp_rms_fwd_cluster_compile_t36.txt) for registers, spills and shared memory.
CONFIGS = {
    65536: [(8, 8, 4, 0, False, False, 1),  # the backward's winning shape, as the brief has it
            (8, 8, 4, 0, False, True, 1),  # the claim's atomic overlapping pass 1
            (8, 8, 6, 0, False, True, 1),  # more CTAs per SM (40 registers)
            (8, 8, 4, 2, False, True, 1),  # half the row in registers
            (4, 8, 8, 0, False, True, 1),  # 4 warps: 8 chunks of 8192
            (4, 8, 12, 0, False, True, 1),
            (8, 8, 4, 0, False, True, 2),  # copies two rows ahead
            (8, 8, 4, 0, True, True, 2),
            (8, 8, 6, 0, False, True, 2),
            (4, 8, 6, 0, False, True, 2)],
    32768: [(8, 8, 4, 0, False, False, 1),  # the brief's design: 2 chunks of 16384
            (8, 8, 4, 2, False, True, 1),  # the whole slice in registers, no shared memory
            (8, 8, 6, 2, False, True, 1),
            (4, 8, 8, 0, False, True, 1),  # the backward's winning cluster shape (4 chunks)
            (4, 8, 12, 0, False, True, 1),
            (8, 4, 4, 0, False, True, 1),
            (8, 8, 6, 0, False, True, 2),  # copies two rows ahead
            (4, 8, 8, 0, False, True, 2),
            (4, 8, 12, 0, False, True, 2)],
}
ROWS = {65536: 1024, 32768: 2048}


def _valid(n, cfg) -> bool:
    try:
        check_shape(n, cfg[0], cfg[1], cfg[3], cfg[6])
    except ValueError:
        return False
    return True


# --compile-only --sweep: the shapes looked at before choosing CONFIGS (those check_shape allows)
SWEEP = {n: [cfg for w, c, ps in shapes for p in ps for i in (0, 2, 4) for wr in (False, True) for d in (1, 2)
             for cfg in [(w, c, p, i, wr, False, d)] if _valid(n, cfg)]
         for n, shapes in ((65536, ((8, 8, (2, 3, 4, 6, 8)), (4, 8, (4, 6, 8, 12, 16)), (8, 4, (2, 3, 4, 6)))),
                           (32768, ((8, 8, (2, 4, 6, 8)), (8, 4, (2, 4, 6, 8)), (4, 8, (4, 8, 12, 16)),
                                    (4, 4, (4, 8, 12, 16)), (8, 2, (2, 3, 4, 6)))))}
# the other casting modes / weight options checked on the GPU (on the first config of the first length)
OPTIONS = (("gemma", 1.0, True), ("none", 0.0, True), ("llama", 1.0, True), ("llama", 0.0, False))


def _compile_one(n, cfg, sig, aligned, offset=0.0, casting="llama", has_weight=True):
    from check_sm90 import compile_sm90
    warps, ctas, per_sm = cfg[:3]
    cap = smem_ce.register_cap(warps, per_sm)
    return cap, compile_sm90(_rms_fwd_cluster_kernel, sig, dict(meta(n, cfg, offset, casting, has_weight),
                                                                 num_ctas=ctas, maxnreg=cap), aligned, warps, 1)


def label_of(cfg) -> str:
    return "warps={} ctas={} per_sm={} in_regs={} w_regs={} early={} depth={}".format(*cfg)


def compile_only(sweep: bool) -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "partials_ptr": "*fp32",
           "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32", "stride_x": "i32", "stride_y": "i32",
           "eps": "fp32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
    print(f"triton {triton.__version__}, sm_90a, bf16 x / w / y; spills = local + stack bytes per thread; "
          f"fit = CTAs per SM by shared memory (+1 KB each), registers and threads; * = in CONFIGS", flush=True)
    for n in CONFIGS:
        cfgs = list(dict.fromkeys((SWEEP[n] if sweep else []) + CONFIGS[n]))
        for cfg in cfgs:
            warps, per_sm = cfg[0], cfg[2]
            label = f"N={n} {label_of(cfg)}"
            mark = "*" if cfg in CONFIGS[n] else " "
            t0 = time.time()
            try:
                cap, res = _compile_one(n, cfg, sig, aligned)
            except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
                print(f"{mark} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            regs = -(-max(res["regs"], 1) // 8) * 8
            fit = min(233472 // (res["shared"] + 1024), 64 // warps, 65536 // (regs * 32 * warps))
            print(f"{mark} {label}: regs {res['regs']} (cap {cap}), spills {res['local'] + res['stack']} B, "
                  f"shared {res['shared']} B, fit {fit}{'' if fit >= per_sm else ' TOO FEW'} "
                  f"[{time.time() - t0:.1f} s]", flush=True)
        cfg = CONFIGS[n][0]  # the options' variants build too
        for casting, offset, has_weight in OPTIONS:
            cap, res = _compile_one(n, cfg, sig, aligned, offset, casting, has_weight)
            print(f"  N={n} {label_of(cfg)} casting={casting} offset={offset} weight={has_weight}: regs {res['regs']}, "
                  f"spills {res['local'] + res['stack']} B", flush=True)


def fwd_reference(x, w, eps, offset, casting):
    """(y, rstd) in float64 by rms_norm's forward semantics (llama: w_eff in w's dtype, xhat rounded to
    x's dtype before the product; the final rounding to y's dtype is left out)."""
    x64 = x.double()
    r64 = torch.rsqrt(x64.pow(2).mean(-1) + eps)
    xhat = x64 * r64[:, None]
    if w is None:
        return xhat, r64
    if casting == "llama":
        w_eff = (w.float() + offset).to(w.dtype).double()
        return w_eff * xhat.to(x.dtype).double(), r64
    return xhat * (offset + w.double()), r64


def fwd_case(n: int, rows: int):
    """(x, w, y_ref, rstd_ref): bf16 x (randn) and w (1 + 0.1 randn), llama casting, offset 0, eps 1e-6."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    y_ref, r_ref = fwd_reference(x, w, 1e-6, 0.0, "llama")
    return x, w, y_ref, r_ref


def check(label, fn, y_ref, r_ref, poison=None, y_lib=None, launches=2) -> bool:
    """fn() -> (y, rstd), checked against float64 `launches` times (the second launch finds the row
    counter where the first left it); poison: the runner whose outputs are filled with NaN first."""
    ok = True
    for _ in range(launches):
        if poison is not None:
            poison.y.fill_(float("nan"))
            poison.rstd.fill_(float("nan"))
        try:
            y, rstd = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            return False
        ey = ((y.double() - y_ref).abs().max() / y_ref.abs().max()).item()
        er = ((rstd.double() - r_ref).abs().max() / r_ref.abs().max()).item()
        nan = bool(y.isnan().any() or rstd.isnan().any())
        good = ey < 1e-2 and er < 1e-5 and not nan
        same = "" if y_lib is None else f", {(y == y_lib).double().mean().item():.4%} of y equal to the library's"
        print(f"  {label}: y err {ey:.1e}, rstd err {er:.1e}{', NaN' if nan else ''}{same} "
              f"{'ok' if good else 'WRONG'}", flush=True)
        ok = ok and good
    return ok


def check_options(n: int, cfg, sms: int) -> None:
    """The other casting modes, a weight offset and no weight, on one shape, against float64 (not the
    library's forward: each mode would cost it an autotuning run)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = 256
    x = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    for casting, offset, has_weight in OPTIONS:
        wt = w if has_weight else None
        y_ref, r_ref = fwd_reference(x, wt, 1e-6, offset, casting)
        tag = f"options casting={casting} offset={offset} weight={has_weight}"
        try:
            run = Runner(x, wt, cfg, sms, offset=offset, casting=casting)
        except Exception as e:  # noqa: BLE001
            print(f"  {tag}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        check(f"{tag} {label_of(cfg)}", run, y_ref, r_ref, poison=run)


def gpu_main(lengths, rounds) -> None:
    from ce_case import copy_ms
    from tune_cross_entropy import queued_ms
    rms = importlib.import_module("fused_kernels.rms_norm")
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for li, n in enumerate(lengths):
        rows = ROWS[n]
        x, w, y_ref, r_ref = fwd_case(n, rows)
        copy = copy_ms(x, timer=queued_ms)
        lib = lambda: rms._forward_impl(x, w, 1e-6, 0.0, "llama")  # noqa: E731
        y_lib = lib()[0]
        fwd = queued_ms(lib, reps=15)
        print(f"N={n} rows={rows}: copy {copy:.3f} ms; the library's forward {fwd:.3f} ms ({copy / fwd:.1%} of a copy)"
              f"; target ~0.070 ms at 65536  [{time.time() - t0:.0f} s]", flush=True)
        if li == 0:
            check_options(n, CONFIGS[n][0], sms)
        runs = []
        if check("library forward", lib, y_ref, r_ref, launches=1):
            runs.append(("library forward", lib))
        for cfg in CONFIGS[n]:
            try:
                run = Runner(x, w, cfg, sms)
            except Exception as e:  # noqa: BLE001
                print(f"  {label_of(cfg)}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if check(f"{label_of(cfg)} ({run.clusters} clusters)", run, y_ref, r_ref, poison=run, y_lib=y_lib):
                runs.append((label_of(cfg), run))
        print(f"  compiled and checked [{time.time() - t0:.0f} s]", flush=True)
        time_rounds(n, runs, copy, rounds, queued_ms)
        x = w = y_ref = r_ref = y_lib = runs = None
        torch.cuda.empty_cache()
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


def time_rounds(n, runs, copy, rounds, timer) -> None:
    """`rounds` rounds of timer medians of each (label, fn), in turn, as a fraction of a copy."""
    for rnd in range(rounds):
        for label, fn in runs:
            ms = timer(fn, reps=15)
            print(f"  N={n} round {rnd}: {ms:.3f} ms  {copy / ms:6.1%} of a copy  {label}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="with --compile-only: the wider SWEEP too")
    ap.add_argument("--lengths", default="65536,32768")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.compile_only:
        compile_only(a.sweep)
    else:
        gpu_main([int(v) for v in a.lengths.split(",")], a.rounds)
