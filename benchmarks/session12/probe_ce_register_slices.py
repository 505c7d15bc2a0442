"""Probe (session 12, prepared, compile-checked; run in session 13: benchmarks/session13/
probe_ce_register_slices_h200.txt): split CE rows with part of each CTA's slice held in registers, so
that more CTAs (rows) fit per SM. It won and is now part of the library (LaunchConfig.in_registers in
fused_kernels/cross_entropy*.py); its replacements match the library's source as of 6d68732 only, so
run it at that commit.

Why (benchmarks/session12/README.md): the split-row kernel sits at ~80 % of a copy at V = 128256. About
4 of the 7.5 points it loses against the unsplit kernel are occupancy. A 4-CTA cluster's CTAs each hold
a 64 KB slice in shared memory, 3 fit per SM, and only 92 clusters (368 CTAs, 92 rows) run at once.
Holding the first NR chunks of each slice in registers (NR·8 16-bit classes per thread) makes the
shared-memory buffer smaller, so more CTAs fit per SM, if ptxas is held to the registers that many CTAs
leave (maxnreg, a launch option):
- 8-CTA clusters of 4 warps at 128256: 16 chunks of 2 KB per CTA. NR = 4 leaves 24 KB of shared
  memory, so 8 CTAs per SM fit at 64 registers: one whole row in flight per SM (132 rows, against 92).
- 4-CTA clusters of 8 warps at 128256: 16 chunks of 4 KB. NR = 3 leaves 52 KB, so 4 CTAs per SM fit
  at 64 registers (~123+ rows).
- 8-CTA clusters of 8 warps at 262144: NR = 3, 4 CTAs per SM (66 clusters, against 49).
Compiled for sm_90a on triton 3.6 (probe_ce_register_slices_compile_t36.txt): 64 registers, no spills
for plain CE. With every optional term it spills 72–168 bytes. Triton 3.9 spills 16–40 bytes even for
plain CE.

The register part arrives by plain loads, issued for the next row right after its gradient is written
at the start of pass 2. The loads therefore overlap the rest of pass 2 and the next row's exchange.
The register chunks are always full chunks (NR <= NFULL at these shapes); the tail stays in shared
memory.

Generated from the library's source by checked replacements (as the other CE probes), so every
optional term stays; the cluster exchange is the library's.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session12/probe_ce_register_slices.py
    PYTHONPATH=/tmp/t36 .venv/bin/python benchmarks/session12/probe_ce_register_slices.py --compile-only
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "session10"))
# (it puts the repository, scripts/, session8/ and session10/ on sys.path and sets TRITON_INTERPRET=0)
from probe_ce_relaxed_barrier import _module_from, _replace_once, smem, smem_launch, time_variants  # noqa: E402

import torch  # noqa: E402

REPLACEMENTS = (
    # NR register chunks (the first NR of every slice, NR <= 4), each a [CTAS, T, 8] tensor in layout REG
    ("""        SMEM: gl.constexpr,
    ):""", """        SMEM: gl.constexpr, NR: gl.constexpr,
    ):"""),
    ("gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)",
     "gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK - NR, CTAS, T, 8], SMEM)"),
    # the first row: the register chunks by plain loads, the rest by cp.async into the smaller buffer
    ("""        for i in range(NFULL):
            _async_load(buf.index(i), first + i * CHUNK + offs)
        if TAIL:
            _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)""",
     """        r0 = gl.load(first + offs)
        r1 = r0
        r2 = r0
        r3 = r0
        if NR > 1:
            r1 = gl.load(first + CHUNK + offs)
        if NR > 2:
            r2 = gl.load(first + 2 * CHUNK + offs)
        if NR > 3:
            r3 = gl.load(first + 3 * CHUNK + offs)
        for i in range(NR, NFULL):
            _async_load(buf.index(i - NR), first + i * CHUNK + offs)
        if TAIL:
            _async_load(buf.index(NFULL - NR), first + NFULL * CHUNK + offs, mask=tail)"""),
    # pass 1 starts with the register chunks
    ("""            for i in range(NFULL):
                z = _capped(buf.index(i).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)""",
     """            z = _capped(r0, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            if NR > 1:
                z = _capped(r1, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            if NR > 2:
                z = _capped(r2, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            if NR > 3:
                z = _capped(r3, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            for i in range(NR, NFULL):
                z = _capped(buf.index(i - NR).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)"""),
    ("""            if TAIL:
                z = _capped(buf.index(NFULL).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(""",
     """            if TAIL:
                z = _capped(buf.index(NFULL - NR).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk("""),
    # pass 2: each register chunk's gradient, then its load of the next row; then the smem chunks
    ("""            for i in range(NCHUNK):
                z = _capped(buf.index(i).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)""",
     """            # the last row: a harmless re-read
            nxt_c = x_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * x_stride
            r0 = _register_chunk_grad(r0, 0, g_row, nxt_c, offs, CHUNK, lse2, y_chunk, yc, coef_p, coef_u, coef_y,
                                      logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if NR > 1:
                r1 = _register_chunk_grad(r1, 1, g_row, nxt_c, offs, CHUNK, lse2, y_chunk, yc, coef_p, coef_u,
                                          coef_y, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if NR > 2:
                r2 = _register_chunk_grad(r2, 2, g_row, nxt_c, offs, CHUNK, lse2, y_chunk, yc, coef_p, coef_u,
                                          coef_y, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if NR > 3:
                r3 = _register_chunk_grad(r3, 3, g_row, nxt_c, offs, CHUNK, lse2, y_chunk, yc, coef_p, coef_u,
                                          coef_y, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            for i in range(NR, NCHUNK):
                z = _capped(buf.index(i - NR).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)"""),
    ("""                    gl.store(g_row + i * CHUNK + offs, d)
                    if nxt < n_rows:
                        _async_load(buf.index(i), nxt_row + i * CHUNK + offs)""",
     """                    gl.store(g_row + i * CHUNK + offs, d)
                    if nxt < n_rows:
                        _async_load(buf.index(i - NR), nxt_row + i * CHUNK + offs)"""),
    ("""                    if nxt < n_rows:
                        _async_load(buf.index(i), nxt_row + i * CHUNK + offs, mask=tail)""",
     """                    if nxt < n_rows:
                        _async_load(buf.index(i - NR), nxt_row + i * CHUNK + offs, mask=tail)"""),
    # launch side: NR and the register cap from module globals the probe sets per variant
    ("""                WARPS=warps, CTAS=ctas, REG=reg, SMEM=smem)""",
     """                WARPS=warps, CTAS=ctas, REG=reg, SMEM=smem, NR=REGISTER_CHUNKS)"""),
    ("num_warps=warps, num_ctas=ctas),",
     "num_warps=warps, num_ctas=ctas, **({'maxnreg': MAXNREG} if MAXNREG else {})),"),
)
HELPERS_AFTER = "    @gluon.jit\n    def _ce_smem_kernel("
HELPERS = '''    @gluon.jit
    def _register_chunk_grad(r, k: gl.constexpr, g_row, nxt_c, offs, CHUNK: gl.constexpr, lse2, y_chunk, yc,
                             coef_p, coef_u, coef_y, logit_scale, softcap, HAS_SCALE: gl.constexpr,
                             HAS_SOFTCAP: gl.constexpr):
        """Pass 2 for register chunk k (always a full chunk): its gradient stored, then the same chunk of
        the program's next row loaded into its registers (returned)."""
        z = _capped(r, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        p = gl.exp2(z * LOG2E - lse2)
        if k == y_chunk:
            d = _dlogits(p, z, offs, yc - k * CHUNK, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP)
        else:
            d = _dlogits(p, z, offs, -1, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP, False)
        gl.store(g_row + k * CHUNK + offs, d.to(g_row.dtype.element_ty))
        return gl.load(nxt_c + k * CHUNK + offs)

'''
LAYOUT_AFTER = "def kernel_constexprs("
LAYOUT = """REGISTER_CHUNKS = 1  # the first chunks of every slice held in registers; set per variant by the probe
MAXNREG = None  # registers per thread ptxas may use (a launch option), so that per_sm CTAs fit


"""


def register_cap(warps: int, per_sm: int) -> int:
    """The registers per thread that let per_sm CTAs of `warps` warps share an SM's 65536 (units of 8)."""
    return 65536 // (per_sm * 32 * warps) // 8 * 8


def register_module(nr: int, maxnreg=None):
    src = open(smem.__file__).read()
    for old, new in REPLACEMENTS:
        src = _replace_once(src, old, new)
    src = _replace_once(src, HELPERS_AFTER, HELPERS + HELPERS_AFTER)
    src = _replace_once(src, LAYOUT_AFTER, LAYOUT + LAYOUT_AFTER)
    module = _module_from(f"ce_smem_register_{nr}_{maxnreg}", src)
    module.REGISTER_CHUNKS, module.MAXNREG = nr, maxnreg
    return module


# (V, CTAs per cluster, warps, register chunks, CTAs per SM): see the docstring's arithmetic
SHAPES = ((128256, 8, 4, 4, 8), (128256, 4, 8, 3, 4), (262144, 8, 8, 3, 4))


def main():
    for v in sorted({s[0] for s in SHAPES}):
        variants = [("library", smem_launch(smem))]
        for vv, ctas, warps, nr, per_sm in SHAPES:
            if vv != v:
                continue
            module = register_module(nr, register_cap(warps, per_sm))

            def launch(case, cfg, library_grid, module=module, ctas=ctas, warps=warps, per_sm=per_sm):
                grid = per_sm * torch.cuda.get_device_properties(case.x.device).multi_processor_count // ctas
                module.launch_ce_smem(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, warps=warps,
                                      ctas=ctas, grid=grid, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                      softcap=None, logit_scale=1.0)
            variants.append((f"{nr} register chunks, {ctas} CTAs x {warps} warps, {per_sm} per SM", launch))
        time_variants(variants, vocabs=(v,))


def compile_only():
    """Registers, spills and shared memory for sm_90a at SHAPES, with and without the optional terms."""
    import check_sm90
    sig, aligned = check_sm90.ce_smem_signature("bf16")
    for v, ctas, warps, nr, per_sm in SHAPES:
        module = register_module(nr, register_cap(warps, per_sm))
        for extras in (False, True):
            flags = dict(module.kernel_constexprs(v, warps, ctas, has_scale=extras, has_softcap=extras,
                                                  has_ls=extras, has_row_scale=extras), num_ctas=ctas,
                         maxnreg=module.MAXNREG)
            res = check_sm90.compile_sm90(module._ce_smem_kernel, sig, flags, aligned, warps, 1)
            fit_regs = 65536 // (max(res["regs"], 1) * 32 * warps)
            fit_smem = (228 * 1024) // (res["shared"] + 1024)
            print(f"V={v} ctas={ctas} warps={warps} NR={nr} maxnreg={module.MAXNREG} options {extras}: {res}; CTAs "
                  f"per SM by registers {fit_regs}, by shared memory {fit_smem} (wanted {per_sm})", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
