"""Experiment (session 8, prepared on the CPU; not yet run on a GPU): cross entropy for rows too long for
one SM (V = 128256: 256 KB in bf16), each row split over a cluster of CTAS CTAs (Hopper thread-block
clusters), each CTA holding its share of every chunk in its own shared memory.

The kernel is fused_kernels/cross_entropy_smem.py's, plain CE only (no options), with every register
and shared-memory layout also tiled over the CTAs of the cluster (cga_layout: CTA k holds the k-th
slice of each chunk), so that:
  - each CTA copies, reads and writes only its slice (16-byte cp.async per thread, as before);
  - the row's max and sum-exp reductions (gl.max / gl.sum over the slice layout) cross the cluster,
    which Gluon lowers to distributed shared memory (mapa, ld.shared::cluster, barrier.cluster);
  - with 64 KB per CTA, three CTAs of three different clusters share an SM and overlap their phases,
    as the one-SM kernel does at V = 32000 (83-85 % of a copy there).
gl.program_id(0) is the cluster's index when num_ctas > 1 (Triton launches grid x num_ctas CTAs).

    .venv/bin/python benchmarks/session8/exp_ce_cluster.py --compile-only      (CPU: does it build?)
    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session8/exp_ce_cluster.py  (GPU: check + time)

Compiles with Triton 3.9 for sm_90a (--compile-only): 64 KB of shared memory per CTA at V = 128256 with
4 CTAs and at 262144 with 8, 16-byte cp.async, the row reductions through ld.shared::cluster and
barrier.cluster; gl.program_id is ctaid.x >> log2(CTAS), the cluster's index.
Open questions for the GPU run: whether Triton 3.6 (the H200 image) builds it (`layouts` tries both
spellings of CTA tiling: cga_layout, or the older ctas_per_cga / cta_split_num / cta_order); whether the
cross-CTA reductions, twice per row, cost less than the second read they save.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ce_case
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
LOG2E = gl.constexpr(1.4426950408889634)


def _cta_bases(ctas: int, rank: int, dim: int) -> list:
    """cga_layout bases: CTA id bit b steps the CTA tile index along `dim` by 2**b."""
    bases = []
    for b in range(ctas.bit_length() - 1):
        basis = [0] * rank
        basis[dim] = 1 << b
        bases.append(basis)
    return bases


def _tiled(make, ctas: int):
    """A layout split over `ctas` CTAs along dim 0 (of 2), in this Gluon's spelling: cga_layout (Triton
    3.9) or ctas_per_cga / cta_split_num / cta_order (older releases)."""
    try:
        return make(cga_layout=_cta_bases(ctas, 2, 0))
    except TypeError:
        return make(ctas_per_cga=[ctas, 1], cta_split_num=[ctas, 1], cta_order=[1, 0])


def layouts(warps: int, ctas: int):
    reg = _tiled(lambda **k: gl.BlockedLayout([1, 8], [32, 1], [warps, 1], [1, 0], **k), ctas)
    smem = _tiled(lambda **k: gl.SwizzledSharedLayout(1, 1, 1, [1, 0], **k), ctas)
    return reg, smem


@gluon.jit
def _ce_cluster_kernel(x_ptr, x_stride, tgt_ptr, grad_ptr, loss_ptr, coef_ptr, n_rows, ignore_index,
                       V: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr,
                       reg: gl.constexpr, smem: gl.constexpr):
    T: gl.constexpr = 32 * WARPS * CTAS  # threads of the cluster; a chunk is T x 8 classes
    CHUNK: gl.constexpr = T * 8
    NFULL: gl.constexpr = V // CHUNK
    TAIL: gl.constexpr = V % CHUNK != 0
    NCHUNK: gl.constexpr = NFULL + TAIL
    per_thread: gl.constexpr = gl.SliceLayout(1, reg)
    buf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK, T, 8], smem)
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    offs = gl.expand_dims(gl.arange(0, T, layout=per_thread), 1) * 8 + \
        gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, reg)), 0)
    tail = offs < V - NFULL * CHUNK
    coef_all = gl.load(coef_ptr)

    first = x_ptr + pid.to(gl.int64) * x_stride
    for i in range(NFULL):
        _async_load(buf.index(i), first + i * CHUNK + offs)
    if TAIL:
        _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)
    async_copy.commit_group()

    for r in range(pid, n_rows, n_prog):
        row = r.to(gl.int64)
        y = gl.load(tgt_ptr + row).to(gl.int32)
        use = (y != ignore_index) & (y >= 0) & (y < V)
        yc = gl.where(use, y, 0)
        zy = gl.load(x_ptr + row * x_stride + yc).to(gl.float32)
        c = gl.where(use, coef_all, 0.0)
        async_copy.wait_group(0)
        m2 = gl.full([T], float("-inf"), gl.float32, per_thread)
        s = gl.full([T], 0.0, gl.float32, per_thread)
        for i in range(NCHUNK):
            z2 = buf.index(i).load(reg).to(gl.float32) * LOG2E
            if i == NFULL:
                z2 = gl.where(tail, z2, float("-inf"))
            m_new = gl.maximum(m2, gl.max(z2, 1))
            s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 1)), 1)
            m2 = m_new
        m_row = gl.max(m2, 0)  # across the cluster
        lse2 = m_row + gl.log2(gl.sum(s * gl.exp2(m2 - m_row), 0))  # across the cluster
        lse = lse2 / LOG2E
        gl.store(loss_ptr + row, gl.where(use, lse - zy, 0.0))
        y_chunk = gl.where(use, yc // CHUNK, -1)
        nxt = r + n_prog
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
    async_copy.wait_group(0)


def meta(v: int, warps: int, ctas: int) -> dict:
    reg, smem = layouts(warps, ctas)
    return dict(V=v, WARPS=warps, CTAS=ctas, reg=reg, smem=smem)


def launch(x, t, grad, loss, coef, warps, ctas, clusters):
    n, v = x.shape
    return _ce_cluster_kernel[(min(n, clusters),)](x, x.stride(0), t, grad, loss, coef, n, -100,
                                                   **meta(v, warps, ctas), num_warps=warps, num_ctas=ctas)


def compile_only():
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"x_ptr": "*bf16", "x_stride": "i32", "tgt_ptr": "*i64", "grad_ptr": "*bf16", "loss_ptr": "*fp32",
           "coef_ptr": "*fp32", "n_rows": "i32", "ignore_index": "i32", "V": "constexpr", "WARPS": "constexpr",
           "CTAS": "constexpr", "reg": "constexpr", "smem": "constexpr"}
    fn = _ce_cluster_kernel
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in
             ("x_ptr", "x_stride", "tgt_ptr", "grad_ptr", "loss_ptr", "coef_ptr")}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for v, warps, ctas in ((128256, 8, 4), (151936, 8, 8), (262144, 8, 8)):
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
    from ce_case import ce_case, check_and_time
    from fused_kernels.cross_entropy import launch_ce
    from tune_cross_entropy import event_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    for v in vocabs:
        case = ce_case(v, ref_rows=512)  # float64 of all rows would need 34 GB at V = 262144
        x, t, grad, loss, coef, flag = case.x, case.t, case.grad, case.loss, case.coef, case.flag
        copy_dst = torch.empty_like(x)
        copy_ms = event_ms(lambda: copy_dst.copy_(x), reps=15)
        print(f"V={v}: copy {copy_ms:.3f} ms")

        def table():
            launch_ce(x, t, grad, loss, coef, None, flag, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                      softcap=None)
        runs = [("table", table)]
        for warps, ctas, per_sm in configs:
            clusters = per_sm * sms // ctas
            runs.append((f"cluster warps={warps} ctas={ctas} per_sm={per_sm}",
                         lambda w=warps, c=ctas, k=clusters: launch(x, t, grad, loss, coef, w, c, k)))
        check_and_time(case, runs, copy_ms, rounds)
        del x, grad, copy_dst, case


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--vocabs", default="128256,262144")
    ap.add_argument("--configs", default="8x4x3,8x8x3,4x8x3,8x4x2", help="WARPSxCTASxPER_SM,...")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
    else:
        gpu_main([int(v) for v in a.vocabs.split(",")],
                 [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")], a.rounds)
