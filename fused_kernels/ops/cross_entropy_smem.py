"""Cross entropy with each row held in shared memory: the GPU path of fused_kernels.cross_entropy for
rows that fit and that the Triton kernel would sweep twice (16-bit logits, 8192 < V <= 262144 on an
H100/H200). Written in Gluon, Triton's lower-level language, because Triton's tensor language keeps a
row in registers or sweeps it twice through L2.

Math: exactly cross_entropy's (its module docstring), with the same Triton helpers (fused_kernels._row_loss:
capped, dlogits, row_loss); only where the row lives differs.

Kernel: a persistent grid of `per_sm` CTAs per SM (each a few warps). With CTAS = 1 a CTA owns whole
rows r = pid, pid + P, ...; with CTAS > 1 a thread-block cluster of CTAS CTAs (on as many SMs) owns a
row, CTA k holding slice k of every chunk, and clusters claim rows from a global counter. Each CTA
owns one buffer in shared memory for its share of a row (ceil(V / CHUNK) chunks of CHUNK = 256·warps·
CTAS classes; each thread copies and reads the same 16 bytes of every chunk).
  - The row arrives by cp.async (HBM read once, no register staging).
  - Pass 1 reads it from shared memory: a per-thread online max and Σ exp (one exp2 per class, one
    per 8-class vector to rescale), Σ z for label smoothing, then a CTA reduction. A split row's CTAs
    then write their partials to one of the cluster's two slots in global memory (used in turn), meet
    at one cluster barrier (release / acquire) and each combines all of them into lse (Triton 3.6's
    Gluon cannot reduce across the cluster's shared memory).
  - Pass 2 reads it again and writes ∂loss/∂x chunk by chunk. The target's term is applied only in the
    chunk that holds it (a uniform branch, no per-class compare elsewhere), and as each chunk is
    consumed the cp.async of the same chunk of the program's next row is issued into its slot, so
    loads stay in flight through the whole row.
  - z_y is read from global memory before anything is written (and before the cluster barrier), so
    the gradient may overwrite the logits in place (fused_linear_cross_entropy); a program's next row
    is a different row.
Several CTAs per SM overlap their phases (one loads while another computes). More of them hide more
latency, and shared memory is what limits them: with IN_REGS > 0 the first IN_REGS chunks of each
CTA's share live in registers instead (plain loads, the next row's issued right after each chunk's
gradient is stored), the buffer shrinks by as much, and the launch caps ptxas at the registers that
let per_sm CTAs share an SM (maxnreg = 65536 / (per_sm · threads); a few bytes spill with the optional
terms). At V = 128256 that is 8 CTAs of 4 warps per SM, 132 rows in flight instead of 92.

Bytes moved, 8192 × 32000 bf16: read 524 MB + write 524 MB, the copy floor; the two-sweep Triton
kernel moves more through HBM when its second sweep misses L2. With softcap the kernel is bound by the
special-function units (exp2 and a reciprocal for tanh in both passes) rather than by memory.

When it runs: cross_entropy.plan() decides (its paths "smem", "smem-split", "smem-registers"): a CUDA
device of compute capability >= 8.0 (cp.async; 9.0 for clusters) with Gluon importable, not the
interpreter, 16-bit logits and gradient, row strides a multiple of 16 elements and 16-byte aligned
bases (16-byte copies), the gradient wanted (without it the Triton kernel reads each row once anyway),
and per_sm row buffers fitting one SM's shared memory (programs_that_fit) with the chunks in registers
allowed (registers_allowed; both in cross_entropy_config). There is no CPU interpreter for Gluon: the CPU suite compiles this kernel
for sm_90 (dev/check_sm90.py, from tests/test_cross_entropy.py), the GPU tests check its numbers.
The cluster barrier, row claiming, layouts and copies are fused_kernels._gpu's.
"""

from __future__ import annotations

import torch
import triton

from fused_kernels import _gpu
from fused_kernels._launch import launch
from fused_kernels._row_loss import capped, dlogits, row_loss
# the row buffers' sizes, which plan() also reads to decide where a shape fits
from fused_kernels.ops.cross_entropy_config import (_SMEM_SLACK, MAX_IN_REGISTERS, MIN_SHARED_CHUNKS, buffer_bytes,
                                                    chunk_classes, programs_that_fit, registers_allowed)

try:  # Gluon ships with Triton >= 3.4; the CPU interpreter does not run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - an older Triton: the table's Triton kernel serves every V
    gluon = None

VEC = _gpu.VEC  # 16-bit classes per thread per chunk: one 16-byte cp.async and one 16-byte shared-memory read

if gluon is not None:
    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _stats_chunk(z, z_sum, m2, s, sumz, HAS_LS: gl.constexpr):
        """One chunk of pass 1 for each thread's 8 classes: the running max m2 (log2 units), Σ exp2
        rescaled to it, and Σ z (z_sum: z with masked classes 0) for label smoothing."""
        z2 = z * LOG2E
        m_new = gl.maximum(m2, gl.max(z2, 2))
        s = s * gl.exp2(m2 - m_new) + gl.sum(gl.exp2(z2 - gl.expand_dims(m_new, 2)), 2)
        if HAS_LS:
            sumz += gl.sum(z_sum, 2)
        return m_new, s, sumz

    @gluon.jit
    def _chunk_grad(x, i, CHUNK: gl.constexpr, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y, logit_scale, softcap,
                    HAS_SCALE: gl.constexpr, HAS_SOFTCAP: gl.constexpr, grad_ptr):
        """Pass 2 for chunk i of the row (x: its 16-bit logits in registers): ∂loss/∂x in the gradient's
        dtype. The target's term only in the chunk that holds it (a uniform branch)."""
        z = capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        p = gl.exp2(z * LOG2E - lse2)
        if i == y_chunk:
            d = dlogits(p, z, offs, yc - i * CHUNK, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP)
        else:
            d = dlogits(p, z, offs, -1, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP, False)
        return d.to(grad_ptr.dtype.element_ty)

    @gluon.jit
    def _stats_full(x, m2, s, sumz, logit_scale, softcap, HAS_SCALE: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                    HAS_LS: gl.constexpr):
        """_stats_chunk for a full chunk of 16-bit logits x (no masked classes)."""
        z = capped(x, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        return _stats_chunk(z, z, m2, s, sumz, HAS_LS)

    @gluon.jit
    def _register_chunk(x, k: gl.constexpr, g_row, nxt_row, CHUNK: gl.constexpr, offs, y_chunk, yc, lse2, coef_p,
                        coef_u, coef_y, logit_scale, softcap, HAS_SCALE: gl.constexpr, HAS_SOFTCAP: gl.constexpr):
        """Pass 2 for register chunk k (a full chunk, logits x): its gradient stored, then the same chunk of
        the program's next row loaded and returned (it takes x's registers)."""
        gl.store(g_row + k * CHUNK + offs, _chunk_grad(x, k, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y,
                                                       logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, g_row))
        return gl.load(nxt_row + k * CHUNK + offs)

    @gluon.jit
    def _ce_smem_kernel(
        x_ptr, x_stride, tgt_ptr, grad_ptr, grad_stride, loss_ptr, coef_ptr, row_scale_ptr, flag_ptr,
        partials_ptr, next_ptr, counter_ptr,
        n_rows, ignore_index, logit_scale, softcap, label_smoothing, z_loss,
        V: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_LS: gl.constexpr,
        HAS_ROW_SCALE: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr,
        SMEM: gl.constexpr, IN_REGS: gl.constexpr,
    ):
        """Rows of a program (CTAS = 1) or of a cluster of CTAS CTAs: loss_i into loss_ptr[row],
        coef·row_scale_i·∂loss_i/∂x into the gradient row (see the module docstring). REG / SMEM:
        `_gpu.layouts(WARPS, CTAS)`. IN_REGS (0-4, <= NFULL): the first chunks of every slice held in
        registers (r0-r3) instead of shared memory."""
        T: gl.constexpr = 32 * WARPS  # threads of one CTA
        CHUNK: gl.constexpr = CTAS * T * 8  # classes per chunk: 8 per thread of the cluster
        NFULL: gl.constexpr = V // CHUNK  # unmasked chunks, then one masked tail chunk if V % CHUNK
        TAIL: gl.constexpr = V % CHUNK != 0
        NCHUNK: gl.constexpr = NFULL + TAIL
        per_thread: gl.constexpr = gl.SliceLayout(2, REG)  # [CTAS, T]
        per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)  # [CTAS]: one value per CTA
        buf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK - IN_REGS, CTAS, T, 8], SMEM)

        pid = gl.program_id(0)  # the cluster's index when CTAS > 1
        n_prog = gl.num_programs(0)
        ranks = gl.arange(0, CTAS, layout=per_cta)
        offs = _gpu.slice_offsets(CTAS, T, REG)
        tail = offs < V - NFULL * CHUNK
        inv_v = 1.0 / V
        coef_all = gl.load(coef_ptr)
        if HAS_SCALE:
            coef_all = coef_all * logit_scale  # ∂z/∂x = s (times the softcap factor)

        if CTAS == 1:
            r = pid  # rows pid, pid + P, ...: the grid is what fits the GPU at once
        else:
            # Clusters claim every row from the counter (next_ptr[3·pid] holds the cluster's first row,
            # next_ptr[3·pid + 1 + parity] the row claimed after its current one): a cluster the GPU
            # cannot hold at first runs when others finish and finds the rows taken, instead of holding
            # one back.
            _gpu.claim_row(counter_ptr, next_ptr + 3 * pid, n_rows + n_prog - 1)
            _gpu.cluster_sync()
            r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
        first = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * x_stride
        if IN_REGS > 0:  # the register chunks by plain loads (r1-r3 unused below IN_REGS = 4)
            r0 = gl.load(first + offs)
            r1 = r0
            r2 = r0
            r3 = r0
            if IN_REGS > 1:
                r1 = gl.load(first + CHUNK + offs)
            if IN_REGS > 2:
                r2 = gl.load(first + 2 * CHUNK + offs)
            if IN_REGS > 3:
                r3 = gl.load(first + 3 * CHUNK + offs)
        for i in range(IN_REGS, NFULL):
            _gpu.async_load(buf.index(i - IN_REGS), first + i * CHUNK + offs)
        if TAIL:
            _gpu.async_load(buf.index(NFULL - IN_REGS), first + NFULL * CHUNK + offs, mask=tail)
        async_copy.commit_group()

        parity = 0  # split rows: which of the cluster's two exchange slots this row uses
        while r < n_rows:
            row = r.to(gl.int64)
            y = gl.load(tgt_ptr + row).to(gl.int64)
            kept = y != ignore_index
            in_range = (y >= 0) & (y < V)
            gl.store(flag_ptr, 1, mask=kept & (~in_range))  # out-of-range target: flagged, row ignored
            use = kept & in_range
            yc = gl.where(use, y, 0).to(gl.int32)
            zy = capped(gl.load(x_ptr + row * x_stride + yc), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            c = gl.where(use, coef_all, 0.0)
            if HAS_ROW_SCALE:
                c = c * gl.load(row_scale_ptr + row)

            # Pass 1: per-thread online max (log2 units) and Σ exp2, then each CTA's share of the row.
            async_copy.wait_group(0)
            m2 = gl.full([CTAS, T], float("-inf"), gl.float32, per_thread)
            s = gl.full([CTAS, T], 0.0, gl.float32, per_thread)
            sumz = gl.full([CTAS, T], 0.0, gl.float32, per_thread)
            if IN_REGS > 0:
                m2, s, sumz = _stats_full(r0, m2, s, sumz, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
            if IN_REGS > 1:
                m2, s, sumz = _stats_full(r1, m2, s, sumz, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
            if IN_REGS > 2:
                m2, s, sumz = _stats_full(r2, m2, s, sumz, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
            if IN_REGS > 3:
                m2, s, sumz = _stats_full(r3, m2, s, sumz, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, HAS_LS)
            for i in range(IN_REGS, NFULL):
                m2, s, sumz = _stats_full(buf.index(i - IN_REGS).load(REG), m2, s, sumz, logit_scale, softcap,
                                          HAS_SCALE, HAS_SOFTCAP, HAS_LS)
            if TAIL:
                z = capped(buf.index(NFULL - IN_REGS).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(gl.where(tail, z, float("-inf")), gl.where(tail, z, 0.0), m2, s, sumz,
                                           HAS_LS)
            m_cta = gl.max(m2, 1)
            s_cta = gl.sum(s * gl.exp2(m2 - gl.expand_dims(m_cta, 1)), 1)
            z_cta = gl.sum(sumz, 1)
            if CTAS == 1:
                m_row = gl.max(m_cta, 0)
                s_row = gl.sum(s_cta, 0)
                z_row = gl.sum(z_cta, 0)
                nxt = r + n_prog
            else:
                # The CTAs' shares meet in global memory, in one of the cluster's two slots (used in turn),
                # behind one cluster barrier; then every CTA combines them all. A CTA writes a slot again two
                # rows later, after the barrier of the row between, which every CTA reaches only after
                # reading it (release / acquire); the loads are .cg (L2), so no stale L1 line.
                slot = partials_ptr + (2 * pid + parity) * (3 * CTAS)
                gl.store(slot + ranks, m_cta)
                gl.store(slot + CTAS + ranks, s_cta)
                if HAS_LS:
                    gl.store(slot + 2 * CTAS + ranks, z_cta)
                _gpu.claim_row(counter_ptr, next_ptr + 3 * pid + 1 + parity, n_rows + n_prog - 1)
                _gpu.cluster_sync()
                m_row = gl.load(slot, cache_modifier=".cg")
                for k in gl.static_range(1, CTAS):
                    m_row = gl.maximum(m_row, gl.load(slot + k, cache_modifier=".cg"))
                s_row = 0.0
                z_row = 0.0
                for k in gl.static_range(CTAS):
                    s_row += gl.load(slot + CTAS + k, cache_modifier=".cg") * \
                        gl.exp2(gl.load(slot + k, cache_modifier=".cg") - m_row)
                    if HAS_LS:
                        z_row += gl.load(slot + 2 * CTAS + k, cache_modifier=".cg")
                nxt = gl.load(next_ptr + 3 * pid + 1 + parity, cache_modifier=".cg")
            lse2 = m_row + gl.log2(s_row)
            lse = lse2 / LOG2E
            loss = row_loss(lse, zy, z_row, inv_v, label_smoothing, z_loss, HAS_LS)
            gl.store(loss_ptr + row, gl.where(use, loss, 0.0))

            # Pass 2: the gradient, chunk by chunk; each consumed chunk (registers or slot) takes the same
            # chunk of the program's next row (the last row: a harmless re-read of a valid row).
            coef_p = c * (1.0 + 2.0 * z_loss * lse)
            coef_u = c * label_smoothing * inv_v
            coef_y = c * (1.0 - label_smoothing)
            y_chunk = gl.where(use, yc // CHUNK, -1)
            nxt_row = x_ptr + nxt.to(gl.int64) * x_stride
            g_row = grad_ptr + row * grad_stride
            if IN_REGS > 0:
                nxt_kept = x_ptr + gl.minimum(nxt, n_rows - 1).to(gl.int64) * x_stride
                r0 = _register_chunk(r0, 0, g_row, nxt_kept, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y,
                                     logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if IN_REGS > 1:
                r1 = _register_chunk(r1, 1, g_row, nxt_kept, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y,
                                     logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if IN_REGS > 2:
                r2 = _register_chunk(r2, 2, g_row, nxt_kept, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y,
                                     logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            if IN_REGS > 3:
                r3 = _register_chunk(r3, 3, g_row, nxt_kept, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u, coef_y,
                                     logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            for i in range(IN_REGS, NCHUNK):
                d = _chunk_grad(buf.index(i - IN_REGS).load(REG), i, CHUNK, offs, y_chunk, yc, lse2, coef_p, coef_u,
                                coef_y, logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP, grad_ptr)
                if i < NFULL:
                    gl.store(g_row + i * CHUNK + offs, d)
                    if nxt < n_rows:
                        _gpu.async_load(buf.index(i - IN_REGS), nxt_row + i * CHUNK + offs)
                else:
                    gl.store(g_row + i * CHUNK + offs, d, mask=tail)
                    if nxt < n_rows:
                        _gpu.async_load(buf.index(i - IN_REGS), nxt_row + i * CHUNK + offs, mask=tail)
            async_copy.commit_group()
            r = nxt
            parity = 1 - parity
        async_copy.wait_group(0)


def available() -> bool:
    """Gluon importable and real kernels (not the interpreter)."""
    return _gpu.gluon_available()


def kernel_constexprs(v: int, warps: int, ctas: int, *, has_scale: bool, has_softcap: bool, has_ls: bool,
                      has_row_scale: bool, in_registers: int = 0) -> dict:
    """_ce_smem_kernel's constexprs (launch_ce_smem, and dev/check_sm90.py, which compiles the same
    kernels for sm_90a)."""
    if in_registers < 0 or not registers_allowed(v, warps, ctas, in_registers):
        raise ValueError(f"cross_entropy_smem: in_registers={in_registers} must lie in 0..{MAX_IN_REGISTERS}, cover "
                         f"only full chunks of {chunk_classes(warps, ctas)} classes and leave {MIN_SHARED_CHUNKS} "
                         f"chunks in shared memory (V = {v}: {triton.cdiv(v, chunk_classes(warps, ctas))} chunks)")
    reg, smem = _gpu.layouts(warps, ctas)
    return dict(V=v, HAS_SCALE=has_scale, HAS_SOFTCAP=has_softcap, HAS_LS=has_ls, HAS_ROW_SCALE=has_row_scale,
                WARPS=warps, CTAS=ctas, REG=reg, SMEM=smem, IN_REGS=in_registers)


def launch_ce_smem(x, target, grad, loss_rows, coef, row_scale, flag, *, warps: int, ctas: int, grid: int,
                   ignore_index: int, label_smoothing: float, z_loss: float, softcap, logit_scale: float,
                   in_registers: int = 0, per_sm: float = 1) -> None:
    """cross_entropy.launch_ce's contract, on this kernel: `grid` programs of `warps` warps
    (cross_entropy.grid_programs), each a cluster of `ctas` CTAs splitting a row when ctas > 1; with
    in_registers > 0 the first chunks of each slice live in registers, and ptxas is held to the
    registers that let per_sm CTAs share an SM (_gpu.register_cap)."""
    n, v = x.shape
    rs = row_scale if row_scale is not None else coef  # never read without HAS_ROW_SCALE
    if ctas > 1:  # per cluster: two exchange slots of partials, its first row and two claimed rows; the counter
        partials = torch.empty(grid * 2 * 3 * ctas, dtype=torch.float32, device=x.device)
        next_rows = torch.empty(grid * 3, dtype=torch.int32, device=x.device)
        counter = _gpu.claim_counter(x.device)
    else:  # never touched
        partials, next_rows, counter = coef, flag, flag
    launch(
        _ce_smem_kernel, (grid,),
        (x, x.stride(0), target, grad, grad.stride(0), loss_rows, coef, rs, flag, partials, next_rows, counter, n,
         ignore_index, float(logit_scale), float(softcap if softcap is not None else 1.0), float(label_smoothing),
         float(z_loss)),
        dict(kernel_constexprs(v, warps, ctas, has_scale=logit_scale != 1.0, has_softcap=softcap is not None,
                               has_ls=label_smoothing > 0.0, has_row_scale=row_scale is not None,
                               in_registers=in_registers),
             num_warps=warps, num_ctas=ctas, **({"maxnreg": _gpu.register_cap(warps, per_sm)} if in_registers else {})),
    )
