"""Experiment (session 8): cross entropy at V <= 32768 with the row held in shared memory (Gluon).

Each program (a few warps) owns one row buffer of NCHUNK chunks in shared memory. The row is copied in
with cp.async (read from HBM once); pass 1 reads it from shared memory for the per-thread online max and
sum-exp (one exp per class plus one per 8-class vector), a CTA reduction gives lse; pass 2 reads it again,
writes the gradient, and as each chunk is consumed issues the cp.async of the same chunk of the program's
next row into the slot it just read, so loads stay in flight through the whole row. Several programs per
SM overlap their phases. DRAM traffic: one read + one write of the logits (the copy floor).

Why: Triton's tensor model keeps a row in registers (one 32-warp program per SM, phases serialised,
session 5 / 7 / 8 exp_ce_pipelined) or sweeps it twice through L2 (30 % over the floor, session 7 ncu).

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session8/exp_ce_smem.py            (GPU)
    .venv/bin/python benchmarks/session8/exp_ce_smem.py --compile-only                  (CPU: sm_90 compile)
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

VEC = 8  # bf16 per thread per chunk: one 16-byte cp.async / ld.shared


@gluon.jit
def _ce_smem_kernel(x_ptr, stride, tgt_ptr, grad_ptr, loss_ptr, coef_ptr, n_rows, V, ignore_index,
                    NCHUNK: gl.constexpr, PREFETCH: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
    T: gl.constexpr = 32 * num_warps
    CHUNK: gl.constexpr = T * 8
    reg: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    thread_l: gl.constexpr = gl.SliceLayout(1, reg)
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    buf = gl.allocate_shared_memory(gl.bfloat16, [NCHUNK, T, 8], smem_l)

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    offs = gl.expand_dims(gl.arange(0, T, layout=thread_l), 1) * 8 + \
        gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, reg)), 0)
    coef_all = gl.load(coef_ptr)

    # First row of this program.
    row_ptr = x_ptr + pid.to(gl.int64) * stride
    for i in range(NCHUNK):
        cols = i * CHUNK + offs
        _async_load(buf.index(i), row_ptr + cols, mask=(cols < V) & (pid < n_rows))
    async_copy.commit_group()

    for r in range(pid, n_rows, n_prog):
        row = r.to(gl.int64)
        y = gl.load(tgt_ptr + row).to(gl.int32)
        kept = y != ignore_index
        yc = gl.where(kept, y, 0)
        zy = gl.load(x_ptr + row * stride + yc).to(gl.float32)
        async_copy.wait_group(0)
        m = gl.full([T], float("-inf"), gl.float32, thread_l)
        s = gl.full([T], 0.0, gl.float32, thread_l)
        for i in range(NCHUNK):
            cols = i * CHUNK + offs
            z = gl.where(cols < V, buf.index(i).load(reg).to(gl.float32), float("-inf"))
            m_new = gl.maximum(m, gl.max(z, 1))
            s = s * gl.exp(m - m_new) + gl.sum(gl.exp(z - gl.expand_dims(m_new, 1)), 1)
            m = m_new
        m_row = gl.max(m, 0)
        s_row = gl.sum(s * gl.exp(m - m_row), 0)
        lse = m_row + gl.log(s_row)
        gl.store(loss_ptr + row, gl.where(kept, lse - zy, 0.0))
        c = gl.where(kept, coef_all, 0.0)
        nxt = r + n_prog
        nxt_ptr = x_ptr + nxt.to(gl.int64) * stride
        g_ptr = grad_ptr + row * stride
        for i in range(NCHUNK):
            cols = i * CHUNK + offs
            z = buf.index(i).load(reg).to(gl.float32)
            d = c * gl.exp(z - lse)
            d = gl.where(cols == y, d - c, d)
            gl.store(g_ptr + cols, d.to(gl.bfloat16), mask=cols < V)
            if PREFETCH:
                _async_load(buf.index(i), nxt_ptr + cols, mask=(cols < V) & (nxt < n_rows))
        if not PREFETCH:
            for i in range(NCHUNK):
                cols = i * CHUNK + offs
                _async_load(buf.index(i), nxt_ptr + cols, mask=(cols < V) & (nxt < n_rows))
        async_copy.commit_group()
    async_copy.wait_group(0)


LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _ce_smem2_kernel(x_ptr, stride, tgt_ptr, grad_ptr, loss_ptr, coef_ptr, n_rows, ignore_index,
                     V: gl.constexpr, PREFETCH: gl.constexpr, FOLD_COEF: gl.constexpr, FINE: gl.constexpr,
                     num_warps: gl.constexpr):
    """v2: fewer instructions per class. Full chunks carry no masks (one masked tail chunk); the
    target's -c is applied only in the chunk that holds it (a uniform branch); exponentials are
    exp2 of one FMA; FOLD_COEF: c·exp(z - lse) = exp2(z·log2e - (lse·log2e - log2 c)) (c >= 0)."""
    T: gl.constexpr = 32 * num_warps
    CHUNK: gl.constexpr = T * 8
    NFULL: gl.constexpr = V // CHUNK
    TAIL: gl.constexpr = V % CHUNK != 0
    NCHUNK: gl.constexpr = NFULL + TAIL
    reg: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    thread_l: gl.constexpr = gl.SliceLayout(1, reg)
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    buf = gl.allocate_shared_memory(gl.bfloat16, [NCHUNK, T, 8], smem_l)

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    offs = gl.expand_dims(gl.arange(0, T, layout=thread_l), 1) * 8 + \
        gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, reg)), 0)
    tail_mask = offs < V - NFULL * CHUNK
    coef_all = gl.load(coef_ptr)

    row_ptr = x_ptr + pid.to(gl.int64) * stride
    if FINE:  # one commit group per chunk: pass 1 waits for its chunk only
        for j in gl.static_range(NCHUNK):
            if j < NFULL:
                _async_load(buf.index(j), row_ptr + j * CHUNK + offs, mask=offs < (pid < n_rows) * CHUNK)
            else:
                _async_load(buf.index(j), row_ptr + j * CHUNK + offs, mask=tail_mask & (pid < n_rows))
            async_copy.commit_group()
    else:
        if pid < n_rows:
            for i in range(NFULL):
                _async_load(buf.index(i), row_ptr + i * CHUNK + offs)
            if TAIL:
                _async_load(buf.index(NFULL), row_ptr + NFULL * CHUNK + offs, mask=tail_mask)
        async_copy.commit_group()

    for r in range(pid, n_rows, n_prog):
        row = r.to(gl.int64)
        y = gl.load(tgt_ptr + row).to(gl.int32)
        kept = y != ignore_index
        yc = gl.where(kept, y, 0)
        zy = gl.load(x_ptr + row * stride + yc).to(gl.float32)
        m2 = gl.full([T], float("-inf"), gl.float32, thread_l)  # running max, in log2 units
        s = gl.full([T], 0.0, gl.float32, thread_l)
        if FINE:
            for k in gl.static_range(NFULL):
                async_copy.wait_group(NCHUNK - 1 - k)
                z2 = buf.index(k).load(reg).to(gl.float32) * LOG2E
                m_new = gl.maximum(m2, gl.max(z2, 1))
                s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 1)), 1)
                m2 = m_new
            async_copy.wait_group(0)
        else:
            async_copy.wait_group(0)
            for i in range(NFULL):
                z2 = buf.index(i).load(reg).to(gl.float32) * LOG2E
                m_new = gl.maximum(m2, gl.max(z2, 1))
                s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 1)), 1)
                m2 = m_new
        if TAIL:
            z2 = gl.where(tail_mask, buf.index(NFULL).load(reg).to(gl.float32) * LOG2E, float("-inf"))
            m_new = gl.maximum(m2, gl.max(z2, 1))
            s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 1)), 1)
            m2 = m_new
        m_row = gl.max(m2, 0)
        s_row = gl.sum(s * gl.exp2(m2 - m_row), 0)
        lse2 = m_row + gl.log2(s_row)  # log2 Σ exp(z)
        lse = lse2 / LOG2E
        gl.store(loss_ptr + row, gl.where(kept, lse - zy, 0.0))
        c = gl.where(kept, coef_all, 0.0)
        if FOLD_COEF:
            k2 = lse2 - gl.log2(c)  # c = 0: +inf, every exp2 gives 0
        else:
            k2 = lse2
        y_chunk = gl.where(kept, y // CHUNK, -1)
        nxt = r + n_prog
        nxt_ptr = x_ptr + nxt.to(gl.int64) * stride
        g_ptr = grad_ptr + row * stride
        for i in range(NCHUNK):
            x = buf.index(i).load(reg).to(gl.float32)
            d = gl.exp2(x * LOG2E - k2)
            if not FOLD_COEF:
                d = c * d
            if i == y_chunk:
                d = gl.where(offs == y - i * CHUNK, d - c, d)
            if i < NFULL:
                gl.store(g_ptr + i * CHUNK + offs, d.to(gl.bfloat16))
            else:
                gl.store(g_ptr + i * CHUNK + offs, d.to(gl.bfloat16), mask=tail_mask)
            if PREFETCH:
                if nxt < n_rows:
                    if i < NFULL:
                        _async_load(buf.index(i), nxt_ptr + i * CHUNK + offs)
                    else:
                        _async_load(buf.index(i), nxt_ptr + i * CHUNK + offs, mask=tail_mask)
                if FINE:
                    async_copy.commit_group()
        if not PREFETCH:
            if nxt < n_rows:
                for i in range(NFULL):
                    _async_load(buf.index(i), nxt_ptr + i * CHUNK + offs)
                if TAIL:
                    _async_load(buf.index(NFULL), nxt_ptr + NFULL * CHUNK + offs, mask=tail_mask)
        if not FINE:
            async_copy.commit_group()
    async_copy.wait_group(0)


def launch2(x, t, grad, loss, coef, warps, per_sm, prefetch, sms, fold=0, fine=0):
    n, v = x.shape
    progs = min(n, per_sm * sms)
    return _ce_smem2_kernel[(progs,)](x, x.stride(0), t, grad, loss, coef, n, -100, V=v, PREFETCH=prefetch,
                                      FOLD_COEF=fold, FINE=fine, num_warps=warps)


def launch(x, t, grad, loss, coef, warps, per_sm, prefetch, sms):
    n, v = x.shape
    chunk = 32 * warps * VEC
    nchunk = triton.cdiv(v, chunk)
    progs = min(n, per_sm * sms)
    return _ce_smem_kernel[(progs,)](x, x.stride(0), t, grad, loss, coef, n, v, -100, NCHUNK=nchunk,
                                     PREFETCH=prefetch, UNROLL=0, num_warps=warps)


def compile_only2():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    import re, subprocess, tempfile
    for warps, prefetch, fold in ((8, 1, 0), (8, 0, 0), (8, 1, 1)):
        sig = {"x_ptr": "*bf16", "stride": "i32", "tgt_ptr": "*i64", "grad_ptr": "*bf16", "loss_ptr": "*fp32",
               "coef_ptr": "*fp32", "n_rows": "i32", "ignore_index": "i32",
               "V": "constexpr", "PREFETCH": "constexpr", "FOLD_COEF": "constexpr", "FINE": "constexpr",
               "num_warps": "constexpr"}
        fn = _ce_smem2_kernel
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in
                 ("x_ptr", "stride", "tgt_ptr", "grad_ptr", "loss_ptr", "coef_ptr")}
        src = GluonASTSource(fn, sig, {"V": 32000, "PREFETCH": prefetch, "FOLD_COEF": fold, "FINE": 1, "num_warps": warps}, attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)[0]
        print(f"v2 warps={warps} prefetch={prefetch} fold={fold} shared={k.metadata.shared} {regs} "
              f"sass lines {sass.count(chr(10))} BAR {sass.count('BAR.SYNC')} MUFU {sass.count('MUFU')}")
        if os.environ.get("DUMP_SASS"):
            open(f"/tmp/smem2_{warps}_{prefetch}_{fold}.sass", "w").write(sass)


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    for warps in (4, 8):
        nchunk = triton.cdiv(32000, 32 * warps * VEC)
        sig = {"x_ptr": "*bf16", "stride": "i32", "tgt_ptr": "*i64", "grad_ptr": "*bf16", "loss_ptr": "*fp32",
               "coef_ptr": "*fp32", "n_rows": "i32", "V": "i32", "ignore_index": "i32",
               "NCHUNK": "constexpr", "PREFETCH": "constexpr", "UNROLL": "constexpr", "num_warps": "constexpr"}
        fn = _ce_smem_kernel
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in
                 ("x_ptr", "stride", "tgt_ptr", "grad_ptr", "loss_ptr", "coef_ptr", "V")}
        src = GluonASTSource(fn, sig, {"NCHUNK": nchunk, "PREFETCH": 1, "UNROLL": 0, "num_warps": warps}, attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = k.asm["ptx"]
        import re, subprocess, tempfile
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        print(re.search(r"REG:(\d+)", usage)[0])
        print(f"warps={warps} nchunk={nchunk} shared={k.metadata.shared} cp.async={ptx.count('cp.async.cg')} "
              f"bar.sync={ptx.count('bar.sync')} ld.shared.v4={ptx.count('ld.shared.v4')} "
              f"st.global.v4={ptx.count('st.global.v4')} n_regs? see cubin")


def ncu_main(spec: str):
    from fused_kernels.cross_entropy import launch_ce
    n, v = 8192, 32000
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = (torch.randn((n, v), device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    coef = torch.full((1,), 1.0 / n, device="cuda")
    grad, loss = torch.empty_like(x), torch.empty(n, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    runs = [lambda: launch_ce(x, t, grad, loss, coef, None, flag, ignore_index=-100, label_smoothing=0.0,
                              z_loss=0.0, softcap=None)]
    for item in spec.split(","):
        w, p, f, *v2 = (int(a) for a in item.split("x"))
        if v2:  # WxPxFxFOLD: the v2 kernel
            runs.append(lambda w=w, p=p, f=f, v2=v2: launch2(x, t, grad, loss, coef, w, p, f, sms, *v2))
        else:
            runs.append(lambda w=w, p=p, f=f: launch(x, t, grad, loss, coef, w, p, f, sms))
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def gpu_main(rounds: int, vocabs, configs):
    from ce_case import ce_case, copy_ms, poison, table_launch
    from ce_case import check as ce_check
    from tune_cross_entropy import event_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    for v in vocabs:
        case = ce_case(v)
        x, t, grad, loss, coef = case.x, case.t, case.grad, case.loss, case.coef

        def check(label):
            ce_check(case, label)

        copy = copy_ms(x, reps=31)
        print(f"V={v}: copy of the logits {copy:.3f} ms (read once, write once)")
        runs = [("table", lambda case=case: table_launch(case), False)]
        fit = (232448 - 2048) // (v * 2 + 1024)  # programs whose row buffer fits in an SM's shared memory
        for warps, per_sm, prefetch, fold, *fine in configs:
            if per_sm > fit:
                continue

            fine = fine[0] if fine else 0

            def smem2(warps=warps, per_sm=per_sm, prefetch=prefetch, fold=fold, fine=fine):
                return launch2(x, t, grad, loss, coef, warps, per_sm, prefetch, sms, fold, fine)
            runs.append((f"smem2 warps={warps} per_sm={per_sm} prefetch={prefetch} fold={fold} fine={fine}",
                         smem2, True))
        good = []
        for label, fn, is_gluon in runs:
            poison(case)
            try:
                k = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (an experiment: report and go on)
                print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            extra = f" regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared}" if is_gluon else ""
            check(label + extra)
            good.append((label, fn))
        for rnd in range(rounds):
            for label, fn in good:
                ms = event_ms(fn, reps=31)
                print(f"  V={v} round {rnd}: {ms:.3f} ms  {copy / ms:5.1%} of copy  {label}", flush=True)
        del x, grad, case


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocabs", default="32000")
    ap.add_argument("--configs", default="8x3x1x0,8x3x0x0,8x3x1x1,16x2x1x1,8x2x1x1,16x1x1x1,32x1x1x1",
                    help="WARPSxPER_SMxPREFETCHxFOLD,... (v2 kernel)")
    ap.add_argument("--ncu", default="", help="WARPSxPER_SMxPREFETCH,...: one launch each (and the table's) "
                    "between cudaProfilerStart/Stop, for ncu --profile-from-start off")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
        compile_only2()
    elif a.ncu:
        ncu_main(a.ncu)
    else:
        gpu_main(a.rounds, [int(v) for v in a.vocabs.split(",")],
                 [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")])
