"""Experiment (session 16, prepared on the CPU: it compiles for sm_90a on triton 3.6 and 3.9; NOT yet run on a
GPU): session 15's long-row RMSNorm forward split over a cluster (../session15/exp_rms_fwd_cluster.py:
0.082 ms at best at 1024 x 65536, the library's two-sweep forward 0.081, a copy 0.065) with the two
changes that took the long-row backward from 0.155 to 0.134 ms this session:
  - w's slice in shared memory, copied once with the first row (session 15 read it from global memory
    per chunk, twice per row in the backward an L1 hit only 30 % of the time);
  - one shared allocation per chunk of x (rms_norm_smem._chunk_buffer), so that Triton's barrier pass
    does not put a CTA barrier after every chunk's copy.
Otherwise session 15's DEPTH 1 scheme (its EARLY_CLAIM off): a row split over CTAS CTAs, x's chunks copied in by cp.async while
the cluster writes the row before, Σx² exchanged through two slots per cluster and one cluster barrier,
rows claimed from a counter that a launch never resets (claims taken mod n_rows + clusters; Runner).
Shared memory per CTA: 2 · N / CTAS · 2 bytes (32 KB at 65536 over 8 CTAs: at most 6 per SM).

    .venv/bin/python benchmarks/session16/exp_rms_fwd_wsmem.py --compile-only      (CPU)
    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session15 python3 \
        benchmarks/session16/exp_rms_fwd_wsmem.py                                  (GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"),
                os.path.join(ROOT, "benchmarks", "session15")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

import exp_rms_fwd_cluster as s15  # noqa: E402  (session 15: case, checks, _y_chunk, _pick, Runner)
from fused_kernels import cross_entropy_smem as smem_ce  # noqa: E402
from fused_kernels.rms_norm_smem import _chunk_buffer, _w_chunk  # noqa: E402  (the backward's helpers)

_pick = s15._pick


@gluon.jit
def _exchange(slot, ranks, part, counter_ptr, claimed_ptr, CTAS: gl.constexpr):
    """The library's exchange as this experiment ran it (session 16, before session 17's thread-0 fence and
    early claim): each CTA stores its part in `slot`, CTA 0 claims a row, one cluster barrier (release /
    acquire), every CTA adds the CTAS parts in the same order."""
    gl.store(slot + ranks, part)
    smem_ce._claim_row(counter_ptr, claimed_ptr)
    smem_ce._cluster_sync()
    total = gl.load(slot, cache_modifier=".cg")
    for k in gl.static_range(1, CTAS):
        total += gl.load(slot + k, cache_modifier=".cg")
    return total, gl.load(claimed_ptr, cache_modifier=".cg")


@gluon.jit
def _x_buffers(dtype: gl.constexpr, NCHUNK: gl.constexpr, CTAS: gl.constexpr, T: gl.constexpr, SMEM: gl.constexpr):
    b0 = gl.allocate_shared_memory(dtype, [CTAS, T, 8], SMEM)
    return (b0, _chunk_buffer(dtype, 1, NCHUNK, b0, CTAS, T, SMEM), _chunk_buffer(dtype, 2, NCHUNK, b0, CTAS, T, SMEM),
            _chunk_buffer(dtype, 3, NCHUNK, b0, CTAS, T, SMEM), _chunk_buffer(dtype, 4, NCHUNK, b0, CTAS, T, SMEM),
            _chunk_buffer(dtype, 5, NCHUNK, b0, CTAS, T, SMEM), _chunk_buffer(dtype, 6, NCHUNK, b0, CTAS, T, SMEM),
            _chunk_buffer(dtype, 7, NCHUNK, b0, CTAS, T, SMEM))


@gluon.jit
def _rms_fwd_wsmem_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, partials_ptr, next_ptr, counter_ptr,
                          n_rows, stride_x, stride_y, eps,
                          OFFSET: gl.constexpr, CASTING: gl.constexpr, HAS_WEIGHT: gl.constexpr, N: gl.constexpr,
                          WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr):
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = CTAS * T * 8
    NCHUNK: gl.constexpr = N // CHUNK  # the host checks 2 <= NCHUNK <= 8 and N % CHUNK == 0
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_buffers(x_ptr.dtype.element_ty, NCHUNK, CTAS, T, SMEM)
    wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)

    pid = gl.program_id(0)
    total = n_rows + gl.num_programs(0)  # claims per launch: each row once, plus one past the end per cluster
    ranks = gl.arange(0, CTAS, layout=per_cta)
    offs = smem_ce.slice_offsets(CTAS, T, REG)

    smem_ce._claim_row(counter_ptr, next_ptr + 3 * pid)
    smem_ce._cluster_sync()
    r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg") % total
    xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
    for k in gl.static_range(NCHUNK):
        if HAS_WEIGHT:
            smem_ce._async_load(wbuf.index(k), w_ptr + k * CHUNK + offs)
        smem_ce._async_load(_pick(k, x0, x1, x2, x3, x4, x5, x6, x7), xrow + k * CHUNK + offs)
    async_copy.commit_group()

    parity = 0
    while r < n_rows:
        row = r.to(gl.int64)
        async_copy.wait_group(0)
        acc = gl.zeros([CTAS, T], gl.float32, per_thread)
        for k in gl.static_range(NCHUNK):
            xf = _pick(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG).to(gl.float32)
            acc = acc + gl.sum(xf * xf, 2)
        # two slots per cluster in turn, and the claimed row (taken mod total: the counter is never reset)
        ss, nxt = _exchange(partials_ptr + (2 * pid + parity) * CTAS, ranks, gl.sum(acc, 1), counter_ptr,
                            next_ptr + 3 * pid + 1 + parity, CTAS)
        nxt = nxt % total
        rstd = gl.rsqrt(ss / N + eps)
        gl.store(rstd_ptr + row + ranks * 0, gl.full([CTAS], 0.0, gl.float32, per_cta) + rstd, mask=ranks == 0)
        yrow = y_ptr + row * stride_y
        nxrow = x_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * stride_x
        for k in gl.static_range(NCHUNK):
            xk = _pick(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG)
            wk = xk  # not read without a weight
            if HAS_WEIGHT:
                wk = _w_chunk(wbuf, k, OFFSET, CASTING, REG)
            gl.store(yrow + k * CHUNK + offs,
                     s15._y_chunk(xk, wk, rstd, OFFSET, CASTING, HAS_WEIGHT).to(y_ptr.dtype.element_ty))
            if nxt < n_rows:
                smem_ce._async_load(_pick(k, x0, x1, x2, x3, x4, x5, x6, x7), nxrow + k * CHUNK + offs)
        async_copy.commit_group()
        r = nxt
        parity = 1 - parity
    async_copy.wait_group(0)


# (warps, ctas, per_sm): 32 KB of shared memory per CTA at 65536, 16 KB at 32768. The row is claimed just
# before the barrier, as in the backward (session 15: claiming at the top of the row made no difference)
CONFIGS = {
    65536: [(8, 8, 4), (8, 8, 6), (4, 8, 6), (16, 8, 3)],
    32768: [(4, 8, 6), (4, 8, 8), (4, 8, 12), (8, 8, 6), (8, 4, 6)],
}


def meta(n, cfg, offset=0.0, casting="llama", has_weight=True) -> dict:
    warps, ctas, _per_sm = cfg
    chunk = ctas * 32 * warps * 8
    if n % chunk or not 2 <= n // chunk <= 8:
        raise ValueError(f"N={n}: 2-8 chunks of {chunk} columns for {cfg}")
    reg, smem = smem_ce.layouts(warps, ctas)
    return dict(OFFSET=float(offset), CASTING=s15.CASTING_ID[casting], HAS_WEIGHT=has_weight, N=n, WARPS=warps,
                CTAS=ctas, REG=reg, SMEM=smem)


class Runner(s15.Runner):
    """Session 15's Runner (outputs, slots and a never-reset counter allocated once) for this kernel."""

    def __init__(self, x, w, cfg, sms, eps=1e-6, offset=0.0, casting="llama"):
        warps, ctas, per_sm = cfg
        super().__init__(x, w, (warps, ctas, per_sm, 0, False, False, 1), sms, eps, offset, casting)
        self.meta = meta(x.shape[1], cfg, offset, casting, w is not None)

    def __call__(self):
        x = self.x
        _rms_fwd_wsmem_kernel[(self.clusters,)](
            x, x if self.w is None else self.w, self.y, self.rstd, self.partials, self.next_rows, self.counter,
            x.shape[0], x.stride(0), self.y.stride(0), self.eps, **self.meta,
            num_warps=self.warps, num_ctas=self.ctas, maxnreg=self.cap)
        return self.y, self.rstd


def compile_only() -> None:
    from check_sm90 import compile_sm90
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "partials_ptr": "*fp32",
           "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32", "stride_x": "i32", "stride_y": "i32",
           "eps": "fp32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
    print(f"triton {triton.__version__}, sm_90a", flush=True)
    for n, cfgs in CONFIGS.items():
        for cfg in cfgs:
            for casting, offset, has_weight in (("llama", 0.0, True),) + s15.OPTIONS:
                warps, ctas, per_sm = cfg
                cap = smem_ce.register_cap(warps, per_sm)
                res = compile_sm90(_rms_fwd_wsmem_kernel, sig,
                                   dict(meta(n, cfg, offset, casting, has_weight), num_ctas=ctas, maxnreg=cap),
                                   aligned, warps, 1)
                fit = min(233472 // (res["shared"] + 1024), 64 // warps)
                print(f"N={n} {cfg} {casting} offset={offset} weight={has_weight}: regs {res['regs']} (cap {cap}), "
                      f"spills {res['local'] + res['stack']} B, shared {res['shared']} B, fit {fit}"
                      f"{'' if fit >= per_sm else ' TOO FEW'}", flush=True)


def gpu_main(rounds: int) -> None:
    import importlib

    from ce_case import copy_ms
    from tune_cross_entropy import queued_ms
    rms = importlib.import_module("fused_kernels.rms_norm")
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}",
          flush=True)
    for n, cfgs in CONFIGS.items():
        x, w, y_ref, r_ref = s15.fwd_case(n, s15.ROWS[n])
        copy = copy_ms(x, timer=queued_ms)
        lib = lambda: rms._forward_impl(x, w, 1e-6, 0.0, "llama")  # noqa: E731
        y_lib = lib()[0]
        print(f"N={n}: copy {copy:.3f} ms", flush=True)
        runs = [("library forward", lib)] if s15.check("library forward", lib, y_ref, r_ref, launches=1) else []
        for i, cfg in enumerate(cfgs):
            if i == 0:  # the other casting modes, an offset and no weight, against float64
                g = torch.Generator(device="cuda").manual_seed(1)
                xs = torch.randn(256, n, device="cuda", generator=g).to(torch.bfloat16)
                ws = (0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
                for casting, offset, has_weight in s15.OPTIONS:
                    wt = ws if has_weight else None
                    run = Runner(xs, wt, cfg, sms, offset=offset, casting=casting)
                    s15.check(f"options {casting} offset={offset} weight={has_weight} {cfg}", run,
                              *s15.fwd_reference(xs, wt, 1e-6, offset, casting), poison=run)
            run = Runner(x, w, cfg, sms)
            if s15.check(f"{cfg} ({run.clusters} clusters)", run, y_ref, r_ref, poison=run, y_lib=y_lib):
                runs.append((str(cfg), run))
        s15.time_rounds(n, runs, copy, rounds, queued_ms)
        x = w = y_ref = r_ref = y_lib = runs = None
        torch.cuda.empty_cache()
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    compile_only() if a.compile_only else gpu_main(a.rounds)
