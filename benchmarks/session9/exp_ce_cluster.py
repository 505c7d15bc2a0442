"""Experiment (session 9): cross entropy for rows too long for one SM (V = 128256: 256 KB in bf16), each
row split over a cluster of CTAS CTAs, each CTA holding its slice of every chunk in its own shared memory.

Session 8's version (`../session8/exp_ce_cluster.py`) reduced the row's max and sum-exp with a plain
gl.max / gl.sum over a layout split across the cluster. Triton 3.9 lowers that through distributed shared
memory; Triton 3.6 (the H200 image) asserts in ReduceOpToLLVM ("isReduceWithinCTA"):
`exp_ce_cluster_v1_triton36.txt`. This version never reduces across CTAs:
  - tensors are [CTAS, Tc, 8] (Tc = 32 x WARPS threads of one CTA, 8 classes each), split over the
    cluster along dim 0, so CTA k holds the k-th slice of each chunk of the row (contiguous);
  - the row's partial (max, sum-exp) reduce over dims 2 and 1: within a CTA, one value per CTA ([CTAS]);
  - the partials go to a global scratch slot of their own per row (no slot is ever read twice, so no
    stale L1 line), a cluster barrier (release / acquire) orders them, and every CTA reads all CTAS
    partials back as scalars and combines them.
One barrier per row. Everything else is the session-8 kernel: cp.async of the row into shared memory,
pass 1 from shared memory, pass 2 writes the gradient and prefetches the next row's chunk.

    .venv/bin/python benchmarks/session9/exp_ce_cluster.py --compile-only      (CPU: does it build?)
    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session9/exp_ce_cluster.py  (GPU: check + time)
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "session8"))  # ce_case
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _cluster_sync_asm():
    # barrier.cluster with release / acquire semantics: orders each CTA's global stores before the others'
    # later loads. Inline PTX because older Gluon has no cluster barrier builtin.
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                              "\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _claim_next_row(counter_ptr, slot_ptr, n_prog):
    # Thread 0 of CTA 0 of the cluster claims the next row for all: *slot = n_prog + counter++. Inline
    # PTX: Gluon's own atomic broadcasts its result to every thread through shared memory, which in a
    # cluster costs two more cluster barriers per row.
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 who, got;\n\tmov.u32 who, %cluster_ctarank;\n\t"
        "mov.u32 got, %tid.x;\n\tor.b32 who, who, got;\n\tsetp.eq.u32 lead, who, 0;\n\t"
        "@lead atom.global.add.u32 got, [$1], 1;\n\t@lead add.u32 got, got, $3;\n\t"
        "@lead st.global.u32 [$2], got;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,l,r", [counter_ptr, slot_ptr, n_prog], dtype=gl.int32, is_pure=False, pack=1)


def _cta_bases(ctas: int, rank: int) -> list:
    """cga_layout bases: CTA id bit b steps the CTA tile index along dim 0 by 2**b."""
    return [[1 << b] + [0] * (rank - 1) for b in range(ctas.bit_length() - 1)]


def layouts(warps: int, ctas: int):
    reg = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [1, warps, 1], [2, 1, 0], cga_layout=_cta_bases(ctas, 3))
    smem = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0], cga_layout=_cta_bases(ctas, 3))
    return reg, smem


@gluon.jit
def _ce_cluster_kernel(x_ptr, x_stride, tgt_ptr, grad_ptr, loss_ptr, coef_ptr, scratch_ptr, next_ptr, counter_ptr,
                       n_rows, ignore_index, V: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr,
                       reg: gl.constexpr, smem: gl.constexpr, DYNAMIC: gl.constexpr):
    # DYNAMIC: after its first row (its cluster index), a cluster takes the next unclaimed row from
    # counter_ptr (zeroed before the launch), so clusters that are not resident at first claim nothing
    # late; else rows are strided by the grid, which must then be at most the resident clusters.
    TC: gl.constexpr = 32 * WARPS  # threads of one CTA
    CHUNK: gl.constexpr = CTAS * TC * 8  # classes per chunk, over the cluster
    NFULL: gl.constexpr = V // CHUNK
    TAIL: gl.constexpr = V % CHUNK != 0
    NCHUNK: gl.constexpr = NFULL + TAIL
    per_thread: gl.constexpr = gl.SliceLayout(2, reg)  # [CTAS, TC]
    per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)  # [CTAS], one value per CTA
    buf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK, CTAS, TC, 8], smem)
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    k3 = gl.expand_dims(gl.expand_dims(gl.arange(0, CTAS, layout=per_cta), 1), 2)
    t3 = gl.expand_dims(gl.expand_dims(gl.arange(0, TC, layout=gl.SliceLayout(0, per_thread)), 0), 2)
    j3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, reg))), 0), 1)
    offs = k3 * (TC * 8) + t3 * 8 + j3  # [CTAS, TC, 8]
    tail = offs < V - NFULL * CHUNK
    ranks = gl.arange(0, CTAS, layout=per_cta)
    coef_all = gl.load(coef_ptr)

    first = x_ptr + pid.to(gl.int64) * x_stride
    for i in range(NFULL):
        _async_load(buf.index(i), first + i * CHUNK + offs)
    if TAIL:
        _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)
    async_copy.commit_group()

    r = pid
    while r < n_rows:
        row = r.to(gl.int64)
        y = gl.load(tgt_ptr + row).to(gl.int32)
        use = (y != ignore_index) & (y >= 0) & (y < V)
        yc = gl.where(use, y, 0)
        zy = gl.load(x_ptr + row * x_stride + yc).to(gl.float32)
        c = gl.where(use, coef_all, 0.0)
        async_copy.wait_group(0)
        m2 = gl.full([CTAS, TC], float("-inf"), gl.float32, per_thread)
        s = gl.full([CTAS, TC], 0.0, gl.float32, per_thread)
        for i in range(NCHUNK):
            z2 = buf.index(i).load(reg).to(gl.float32) * LOG2E
            if i == NFULL:
                z2 = gl.where(tail, z2, float("-inf"))
            m_new = gl.maximum(m2, gl.max(z2, 2))
            s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 2)), 2)
            m2 = m_new
        # this CTA's partial of the row, then the exchange through global memory
        m_cta = gl.max(m2, 1)
        s_cta = gl.sum(s * gl.exp2(m2 - gl.expand_dims(m_cta, 1)), 1)
        slot = scratch_ptr + row * (2 * CTAS)
        gl.store(slot + ranks, m_cta)
        gl.store(slot + CTAS + ranks, s_cta)
        if DYNAMIC:
            _claim_next_row(counter_ptr, next_ptr + row, n_prog)
        _cluster_sync_asm()
        if DYNAMIC:
            nxt = gl.load(next_ptr + row, cache_modifier=".cg")
        else:
            nxt = r + n_prog
        m_row = gl.load(slot, cache_modifier=".cg")
        for k in gl.static_range(1, CTAS):
            m_row = gl.maximum(m_row, gl.load(slot + k, cache_modifier=".cg"))
        s_row = 0.0
        for k in gl.static_range(CTAS):
            s_row += gl.load(slot + CTAS + k, cache_modifier=".cg") * \
                gl.exp2(gl.load(slot + k, cache_modifier=".cg") - m_row)
        lse2 = m_row + gl.log2(s_row)
        lse = lse2 / LOG2E
        gl.store(loss_ptr + row, gl.where(use, lse - zy, 0.0))
        y_chunk = gl.where(use, yc // CHUNK, -1)
        nxt_row = x_ptr + nxt.to(gl.int64) * x_stride
        g_row = grad_ptr + row * x_stride
        for i in range(NCHUNK):
            d = c * gl.exp2(buf.index(i).load(reg).to(gl.float32) * LOG2E - lse2)
            if i == y_chunk:
                d = gl.where(offs == yc - i * CHUNK, d - c, d)
            if i < NFULL:
                gl.store(g_row + i * CHUNK + offs, d.to(grad_ptr.dtype.element_ty))
                if nxt < n_rows:
                    _async_load(buf.index(i), nxt_row + i * CHUNK + offs)
            else:
                gl.store(g_row + i * CHUNK + offs, d.to(grad_ptr.dtype.element_ty), mask=tail)
                if nxt < n_rows:
                    _async_load(buf.index(i), nxt_row + i * CHUNK + offs, mask=tail)
        async_copy.commit_group()
        r = nxt
    async_copy.wait_group(0)


def meta(v: int, warps: int, ctas: int, dynamic: bool = True) -> dict:
    reg, smem = layouts(warps, ctas)
    return dict(V=v, WARPS=warps, CTAS=ctas, reg=reg, smem=smem, DYNAMIC=dynamic)


def launch(x, t, grad, loss, coef, scratch, nxt, warps, ctas, clusters, dynamic):
    n, v = x.shape
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    return _ce_cluster_kernel[(min(n, clusters),)](x, x.stride(0), t, grad, loss, coef, scratch, nxt, counter, n,
                                                   -100, **meta(v, warps, ctas, dynamic), num_warps=warps,
                                                   num_ctas=ctas)


def compile_only():
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"x_ptr": "*bf16", "x_stride": "i32", "tgt_ptr": "*i64", "grad_ptr": "*bf16", "loss_ptr": "*fp32",
           "coef_ptr": "*fp32", "scratch_ptr": "*fp32", "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32", "ignore_index": "i32", "V": "constexpr",
           "WARPS": "constexpr", "CTAS": "constexpr", "reg": "constexpr", "smem": "constexpr", "DYNAMIC": "constexpr"}
    fn = _ce_cluster_kernel
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in
             ("x_ptr", "x_stride", "tgt_ptr", "grad_ptr", "loss_ptr", "coef_ptr", "scratch_ptr", "next_ptr",
              "counter_ptr")}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for v, warps, ctas in ((128256, 8, 4), (151936, 8, 8), (262144, 8, 8), (128256, 16, 2)):
        k = triton.compile(GluonASTSource(fn, sig, meta(v, warps, ctas), attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_ctas": ctas})
        ptx = k.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)[0]
        print(f"V={v} warps={warps} ctas={ctas}: shared {k.metadata.shared} B per CTA, {regs}, "
              f"cp.async.cg.16 {ptx.count('cp.async.cg.shared.global [')}, ld.shared::cluster "
              f"{ptx.count('ld.shared::cluster')}, barrier.cluster {ptx.count('barrier.cluster')}, "
              f"st.global.v4 {ptx.count('st.global.v4')}", flush=True)


def gpu_main(vocabs, configs, rounds):
    from ce_case import ce_case, check_and_time, copy_ms, table_launch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    for v in vocabs:
        # float64 of all rows would need 34 GB at V = 262144; no ignored rows, as in scripts/bench.py
        case = ce_case(v, ref_rows=512, ignored=False)
        x, t, grad, loss, coef = case.x, case.t, case.grad, case.loss, case.coef
        scratch = torch.empty(x.shape[0] * 16, device="cuda")
        nxt = torch.empty(x.shape[0], dtype=torch.int32, device="cuda")
        copy = copy_ms(x)
        print(f"V={v}: copy {copy:.3f} ms")
        runs = [("table", lambda case=case: table_launch(case))]
        for warps, ctas, per_sm, n_clusters, dynamic in configs:
            clusters = n_clusters or per_sm * sms // ctas
            runs.append((f"cluster warps={warps} ctas={ctas} per_sm={per_sm} clusters={clusters} "
                         f"{'dynamic' if dynamic else 'strided'}",
                         lambda w=warps, c=ctas, k=clusters, d=dynamic: launch(x, t, grad, loss, coef, scratch, nxt,
                                                                               w, c, k, d)))
        check_and_time(case, runs, copy, rounds)
        del x, grad, case


def parse_config(text: str) -> tuple:
    """WARPSxCTASxPER_SM[@CLUSTERS][s]: a trailing s strides rows by the grid instead of claiming them."""
    strided = text.endswith("s")
    shape, _, clusters = text.rstrip("s").partition("@")
    return (*(int(x) for x in shape.split("x")), int(clusters) if clusters else 0, not strided)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--vocabs", default="128256,262144")
    ap.add_argument("--configs", default="8x4x3,8x8x3,4x8x3,16x2x1,8x4x2", help="WARPSxCTASxPER_SM[@CLUSTERS][s],... (CLUSTERS: the grid, default PER_SM x SMs / CTAS; "
                    "s: rows strided by the grid, else claimed from a counter)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
    else:
        gpu_main([int(v) for v in a.vocabs.split(",")],
                 [parse_config(c) for c in a.configs.split(",")], a.rounds)
