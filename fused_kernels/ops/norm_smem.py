"""The row norms' long rows with each row read from HBM once, a row split over a thread-block cluster:
RMSNorm's backward and forward (the "cluster" path of fused_kernels.rms_norm, whose `plan()` decides when
it runs: CLUSTER_BACKWARD_SHAPES / CLUSTER_FORWARD_SHAPES there) and LayerNorm's backward (the "cluster
backward" path of fused_kernels.layer_norm, its CLUSTER_BACKWARD_SHAPES); 16-bit x, dy and weight, an
H100/H200. Where the Triton backward cannot hold a row whole it reads x and dy two or three times, and
the Triton forward of rows of 65536 sweeps each row twice (the second time from L2); these kernels read
them once. Written in Gluon with the cluster primitives of fused_kernels._gpu (layouts, cluster barrier,
row claiming).

Math: rms_norm's backward (its module docstring), from the input (keep="input"); per row, r = rstd:
    w_eff = offset + w  ("llama": in w's dtype, as torch adds it; otherwise fp32)
    xhat = x·r,  g = dy·w_eff ("llama": rounded to x's dtype),  c = Σ_j g_j·xhat_j / N
    dx = r·(g − xhat·c),  dw = Σ_rows dy·h  (h = round_x(xhat) for "llama", xhat otherwise), fp32.
LayerNorm's (layer_norm's module docstring; CENTERED, casting "none", no offset): per row, m = mean,
    xhat = (x − m)·r,  g = dy·w (dy without a weight),  c = Σ g·xhat / N,  a = Σ g / N
    dx = r·(g − a − xhat·c),  dw = Σ_rows dy·xhat,  db = Σ_rows dy, fp32;
the same kernel with the second sum a exchanged beside c (exchange_ptx's parts = 2) and db's sums
beside dw's (8·NCHUNK more registers a thread).

Kernel: a row is split over a thread-block cluster of CTAS CTAs (on as many SMs); CTA k owns slice k
of each of the row's NCHUNK chunks (CHUNK = CTAS·32·WARPS·8 columns; each thread the same 8
consecutive columns of every chunk), so a CTA always owns the same columns and keeps their fp32 dw
sums in registers for the whole launch (8·NCHUNK per thread), and its slice of w in shared memory,
copied once with the first row. Per row:
  - x and dy arrive in shared memory by cp.async, issued while the cluster's previous row was being
    written (HBM read once, no register staging), one allocation per chunk (Triton's barrier pass
    orders accesses per allocation: one buffer for all chunks put a CTA barrier after every copy) and
    one cp.async group per chunk, so pass 1 starts on the first chunks while the last still arrive;
  - pass 1: each CTA's thread 0 writes its partial Σ g·xhat into one of two slots (used in turn) in
    the shared memory of every CTA of the cluster, and alone fences; then one cluster barrier (every
    thread arrives relaxed, waits with acquire: a release arrive made each thread wait for its own dx
    stores of the row before) and every CTA adds all CTAS of them from its own shared memory
    (exchange_ptx). The cluster's next row was claimed at the top of the row (an atomic whose round
    trip overlaps pass 1) and travels with the partials (and through global memory for the loop's
    scalar row, needed only at the end of pass 2);
  - pass 2: dx chunk by chunk from shared memory, dw += dy·h in registers, and as each chunk is
    consumed the cp.async of the same chunk of the cluster's next row is issued into its slot.
Clusters claim rows from a global counter (a cluster the GPU cannot hold at first finds them taken;
the launch's last claim sets it back to zero, so a stream keeps one: _gpu.claim_counter): which rows a
cluster's dw partial row sums differs from run to run, so dw's rounding does too; under
torch.use_deterministic_algorithms(True) rms_norm and layer_norm plan their Triton backwards instead. w stays in shared
memory, not registers: registers buy CTAs per SM (the launch caps ptxas at the registers that let per_sm
CTAs share an SM, _gpu.register_cap); read from global memory twice per row instead, it mostly missed
L1 and the wait on L2 became the kernel's largest stall.

Bytes moved (rows × N, B bytes per element): x and dy read once, dx written once (3·rows·N·B, the floor),
w once per CTA, plus one fp32 dw (and LayerNorm's db) partial row per cluster, written once and summed by
rms_norm._dw_sum_kernel (layer_norm._partial_sum_kernel), and LayerNorm's mean with rstd, 8 bytes a row.

The forward (_rms_fwd_smem_kernel) is the same scheme with x and w in shared memory: per row, Σx² over
the CTA's chunks, the exchange, then y chunk by chunk, each chunk's buffer refilled with the cluster's
next row as it is written. Bytes: x read once, y written once, w once per CTA. y and rstd do not depend
on which cluster claims a row: deterministic.

What the launches need (rms_norm.cluster_launch and layer_norm.backward_cluster check it before planning
this path, with _gpu.cluster_refusal and _gpu.cluster_grid): Gluon and real
kernels, a CUDA device of compute capability >= 9.0 (clusters), x, dy and the weight of one 16-bit
dtype, row strides a multiple of 8 elements and 16-byte aligned bases (16-byte copies), N whole chunks
of the shape (MIN_CHUNKS-MAX_CHUNKS in the backward, FORWARD_CHUNKS in the forward; the launch checks
that). There is no CPU interpreter for Gluon: dev/check_sm90.py compiles these kernels for sm_90a
on the CPU (a test in tests/test_rms_norm.py runs it), the gpu tests run them.
"""

from __future__ import annotations

import functools

import torch

from fused_kernels import _gpu
from fused_kernels._gpu import ClusterShape  # the launch shapes (each op's plan() picks them)
from fused_kernels._launch import launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - an older Triton: the split backward serves every length
    gluon = None

VEC = _gpu.VEC  # 16-bit columns per thread per chunk: one 16-byte cp.async
# The chunk counts a launch takes. Backward: dw0-dw3 in the kernel, and a one-chunk shared buffer does
# not build with every Triton. Forward: 8 chunks (its x0-x7), the only count rms_norm dispatches to it.
MIN_CHUNKS, MAX_CHUNKS = 2, 4
FORWARD_CHUNKS = (8, 8)

if gluon is not None:

    @gluon.jit
    def _offset_weight(w, OFFSET: gl.constexpr, CASTING: gl.constexpr):
        """w as the llama casting uses it: offset + w rounded to w's dtype, as torch adds them (OFFSET a
        constexpr: with 0 nothing is added per use); other castings add the offset in fp32 (_terms)."""
        if CASTING == 0 and OFFSET != 0.0:
            w = (w.to(gl.float32) + OFFSET).to(w.dtype)
        return w

    @gluon.jit
    def _w_chunk(wbuf, k: gl.constexpr, OFFSET: gl.constexpr, CASTING: gl.constexpr, REG: gl.constexpr):
        """Chunk k of this thread's weights in the weight's dtype, from shared memory (_offset_weight)."""
        return _offset_weight(wbuf.index(k).load(REG), OFFSET, CASTING)

    @gluon.jit
    def _terms(x, dy, w, mean, rstd, OFFSET: gl.constexpr, CASTING: gl.constexpr, CENTERED: gl.constexpr,
               HAS_WEIGHT: gl.constexpr):
        """(xhat, g = dL/dxhat, dy) in fp32 for a chunk: RMSNorm's as rms_norm._grad_terms, LayerNorm's
        (CENTERED: xhat = (x − mean)·rstd, g = dy·w in fp32, or dy without a weight) as layer_norm's."""
        dyf = dy.to(gl.float32)
        g = dyf
        if HAS_WEIGHT:
            w_eff = w.to(gl.float32)
            if CASTING != 0 and OFFSET != 0.0:
                w_eff = w_eff + OFFSET
            g = dyf * w_eff
            if CASTING == 0:
                g = g.to(x.dtype).to(gl.float32)
        xf = x.to(gl.float32)
        if CENTERED:
            xf = xf - mean
        return xf * rstd, g, dyf

    @gluon.jit
    def _chunk_terms(k: gl.constexpr, x0, x1, x2, x3, dy0, dy1, dy2, dy3, wbuf, mean, rstd, OFFSET: gl.constexpr,
                     CASTING: gl.constexpr, CENTERED: gl.constexpr, HAS_WEIGHT: gl.constexpr, REG: gl.constexpr):
        """(x, xhat, g, dy) of chunk k from the shared buffers (_terms; w from wbuf with a weight)."""
        x = _pick(k, x0, x1, x2, x3).load(REG)
        w = x  # not read without a weight
        if HAS_WEIGHT:
            w = _w_chunk(wbuf, k, OFFSET, CASTING, REG)
        xhat, g, dyf = _terms(x, _pick(k, dy0, dy1, dy2, dy3).load(REG), w, mean, rstd, OFFSET, CASTING, CENTERED,
                              HAS_WEIGHT)
        return x, xhat, g, dyf

    @gluon.jit
    def _pick(k: gl.constexpr, a0, a1, a2, a3):
        v = a0
        if k == 1:
            v = a1
        if k == 2:
            v = a2
        if k == 3:
            v = a3
        return v

    @gluon.jit
    def _pick8(k: gl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
        """a_k of eight (k a constexpr)."""
        if k < 4:
            v = _pick(k, a0, a1, a2, a3)
        else:
            v = _pick(k - 4, a4, a5, a6, a7)
        return v

    @gluon.jit
    def _chunk_buffer(dtype: gl.constexpr, k: gl.constexpr, NCHUNK: gl.constexpr, first, CTAS: gl.constexpr,
                      T: gl.constexpr, SMEM: gl.constexpr):
        """Chunk k's buffer: an allocation of its own (k < NCHUNK), so that Triton's barrier pass does not
        order one chunk's copies after another chunk's reads; `first` stands in for chunks past NCHUNK."""
        buf = first
        if k < NCHUNK:
            buf = gl.allocate_shared_memory(dtype, [CTAS, T, 8], SMEM)
        return buf

    @gluon.jit
    def _chunk_arrived(k: gl.constexpr, NCHUNK: gl.constexpr):
        """Before chunk k is read in pass 1: wait for its own cp.async group (one per chunk), so pass 1
        starts on the first chunks while the last are still arriving."""
        async_copy.wait_group(NCHUNK - 1 - k)

    @gluon.jit
    def _cta_value(v):
        """A [CTAS] value (one element per CTA) as [CTAS, 1, 1], to broadcast over a chunk."""
        return gl.expand_dims(gl.expand_dims(v, 1), 2)

    @gluon.jit
    def _exchange(part, parity, got, counter_ptr, claimed_ptr, last_claim, PTX: gl.constexpr):
        """(Σ over the cluster's CTAs of `part` and the row claimed for the cluster, both [CTAS, 1, 1];
        the claimed row again as a scalar, loaded from claimed_ptr): exchange_ptx's block (PTX) on every
        thread, after CTA 0's thread 0 publishes the claim `got` (_gpu.claim_issue) in *claimed_ptr
        for the loop's scalar row, which only the end of pass 2 needs (and its reset of the counter)."""
        _gpu.claim_publish(counter_ptr, claimed_ptr, got, last_claim)
        total, row = gl.inline_asm_elementwise(PTX, "=r,=r,r,r,r", [part.to(gl.int32, bitcast=True), parity, got],
                                               dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
        return (_cta_value(total.to(gl.float32, bitcast=True)), _cta_value(row),
                gl.load(claimed_ptr, cache_modifier=".cg"))

    @gluon.jit
    def _exchange_two(part_a, part_b, parity, got, counter_ptr, claimed_ptr, last_claim, PTX: gl.constexpr):
        """_exchange of two partial sums at once (PTX: exchange_ptx(CTAS, parts=2)): (Σ part_a, Σ part_b,
        the claimed row), the sums and row as [CTAS, 1, 1], and the claimed row again as a scalar."""
        _gpu.claim_publish(counter_ptr, claimed_ptr, got, last_claim)
        total_a, total_b, row = gl.inline_asm_elementwise(
            PTX, "=r,=r,=r,r,r,r,r",
            [part_a.to(gl.int32, bitcast=True), part_b.to(gl.int32, bitcast=True), parity, got],
            dtype=(gl.int32, gl.int32, gl.int32), is_pure=False, pack=1)
        return (_cta_value(total_a.to(gl.float32, bitcast=True)), _cta_value(total_b.to(gl.float32, bitcast=True)),
                _cta_value(row), gl.load(claimed_ptr, cache_modifier=".cg"))

    @gluon.jit
    def _norm_bwd_smem_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, next_ptr,
                              counter_ptr, n_rows, stride_dy, stride_x, stride_dx,
                              OFFSET: gl.constexpr, CASTING: gl.constexpr, CENTERED: gl.constexpr,
                              HAS_WEIGHT: gl.constexpr, COMPUTE_DW: gl.constexpr, COMPUTE_DB: gl.constexpr,
                              N: gl.constexpr, WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr,
                              SMEM: gl.constexpr, PTX: gl.constexpr):
        """dx of the rows a cluster claims, and the cluster's fp32 partial rows of dw (COMPUTE_DW) into
        dw_part_ptr[cluster] and of db = Σ dy (COMPUTE_DB) into db_part_ptr[cluster]. RMSNorm, or LayerNorm
        with CENTERED (mean_ptr: the row means; Σ g is exchanged beside Σ g·xhat). REG / SMEM:
        _gpu.layouts(WARPS, CTAS); PTX: exchange_ptx(CTAS, 2 if CENTERED else 1)."""
        T: gl.constexpr = 32 * WARPS
        CHUNK: gl.constexpr = CTAS * T * 8
        NCHUNK: gl.constexpr = N // CHUNK  # the host checks N % CHUNK == 0 and MIN_CHUNKS <= NCHUNK <= MAX_CHUNKS
        per_thread: gl.constexpr = gl.SliceLayout(2, REG)
        x_t: gl.constexpr = x_ptr.dtype.element_ty
        dy_t: gl.constexpr = dy_ptr.dtype.element_ty
        x0 = gl.allocate_shared_memory(x_t, [CTAS, T, 8], SMEM)
        x1 = _chunk_buffer(x_t, 1, NCHUNK, x0, CTAS, T, SMEM)
        x2 = _chunk_buffer(x_t, 2, NCHUNK, x0, CTAS, T, SMEM)
        x3 = _chunk_buffer(x_t, 3, NCHUNK, x0, CTAS, T, SMEM)
        dy0 = gl.allocate_shared_memory(dy_t, [CTAS, T, 8], SMEM)
        dy1 = _chunk_buffer(dy_t, 1, NCHUNK, dy0, CTAS, T, SMEM)
        dy2 = _chunk_buffer(dy_t, 2, NCHUNK, dy0, CTAS, T, SMEM)
        dy3 = _chunk_buffer(dy_t, 3, NCHUNK, dy0, CTAS, T, SMEM)
        # w's slice, copied once with the first row: read from global memory twice per row it mostly
        # missed L1, and waiting for L2 became the kernel's largest stall
        if HAS_WEIGHT:
            wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)
        else:
            wbuf = x0  # not read without a weight

        pid = gl.program_id(0)  # the cluster
        offs = _gpu.slice_offsets(CTAS, T, REG)
        dw0 = gl.zeros([CTAS, T, 8], gl.float32, REG)
        dw1 = dw0
        dw2 = dw0
        dw3 = dw0
        db0 = dw0
        db1 = dw0
        db2 = dw0
        db3 = dw0

        # next_ptr[3·pid]: the cluster's first row; next_ptr[3·pid + 1 + parity]: the row after this one
        last_claim = n_rows + gl.num_programs(0) - 1  # _claim_row: each row once, one past the end per cluster
        _gpu.claim_row(counter_ptr, next_ptr + 3 * pid, last_claim)
        _gpu.cluster_sync()
        r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
        xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
        dyrow = dy_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_dy
        for k in gl.static_range(NCHUNK):
            if HAS_WEIGHT:
                _gpu.async_load(wbuf.index(k), w_ptr + k * CHUNK + offs)
            _gpu.async_load(_pick(k, x0, x1, x2, x3), xrow + k * CHUNK + offs)
            _gpu.async_load(_pick(k, dy0, dy1, dy2, dy3), dyrow + k * CHUNK + offs)
            async_copy.commit_group()  # one group per chunk: _chunk_arrived

        parity = 0
        while r < n_rows:
            row = r.to(gl.int64)
            got = _gpu.claim_issue(counter_ptr)  # the row after this one, published at the exchange
            rstd = gl.load(rstd_ptr + row)
            mean = 0.0
            if CENTERED:
                mean = gl.load(mean_ptr + row)
            acc = gl.zeros([CTAS, T], gl.float32, per_thread)
            acc_g = acc
            for k in gl.static_range(NCHUNK):
                _chunk_arrived(k, NCHUNK)
                _x, xhat, g, _dyf = _chunk_terms(k, x0, x1, x2, x3, dy0, dy1, dy2, dy3, wbuf, mean, rstd, OFFSET,
                                                 CASTING, CENTERED, HAS_WEIGHT, REG)
                acc = acc + gl.sum(g * xhat, 2)
                if CENTERED:
                    acc_g = acc_g + gl.sum(g, 2)
            # The CTAs' partial sums meet in every CTA's shared memory (exchange_ptx); the refills of
            # pass 2 address the claimed row from there too ([CTAS, 1, 1], masked past the last row).
            claimed = next_ptr + 3 * pid + 1 + parity
            if CENTERED:
                dot, g_sum, nxt_row, nxt = _exchange_two(gl.sum(acc, 1), gl.sum(acc_g, 1), parity, got, counter_ptr,
                                                         claimed, last_claim, PTX)
                g_mean = g_sum / N
            else:
                dot, nxt_row, nxt = _exchange(gl.sum(acc, 1), parity, got, counter_ptr, claimed, last_claim, PTX)
            c = dot / N
            dxrow = dx_ptr + row * stride_dx
            nbase = gl.minimum(nxt_row, n_rows - 1).to(gl.int64)
            nxrow = x_ptr + nbase * stride_x
            ndyrow = dy_ptr + nbase * stride_dy
            more = (offs * 0 + nxt_row) < n_rows
            for k in gl.static_range(NCHUNK):
                x, xhat, g, dyf = _chunk_terms(k, x0, x1, x2, x3, dy0, dy1, dy2, dy3, wbuf, mean, rstd, OFFSET,
                                               CASTING, CENTERED, HAS_WEIGHT, REG)
                if CENTERED:
                    g = g - g_mean
                gl.store(dxrow + k * CHUNK + offs, (rstd * (g - xhat * c)).to(dx_ptr.dtype.element_ty))
                if COMPUTE_DW:
                    if CASTING == 0:
                        xhat = xhat.to(x.dtype).to(gl.float32)
                    dwk = _pick(k, dw0, dw1, dw2, dw3) + dyf * xhat
                    dw0 = dwk if k == 0 else dw0  # k is a constexpr: one of these takes dwk
                    dw1 = dwk if k == 1 else dw1
                    dw2 = dwk if k == 2 else dw2
                    dw3 = dwk if k == 3 else dw3
                if COMPUTE_DB:
                    dbk = _pick(k, db0, db1, db2, db3) + dyf
                    db0 = dbk if k == 0 else db0
                    db1 = dbk if k == 1 else db1
                    db2 = dbk if k == 2 else db2
                    db3 = dbk if k == 3 else db3
                # this chunk of the cluster's next row, into the buffer just read
                _gpu.async_load(_pick(k, x0, x1, x2, x3), nxrow + k * CHUNK + offs, mask=more)
                _gpu.async_load(_pick(k, dy0, dy1, dy2, dy3), ndyrow + k * CHUNK + offs, mask=more)
                async_copy.commit_group()  # one group per chunk: _chunk_arrived
            r = nxt
            parity = 1 - parity
        async_copy.wait_group(0)
        if COMPUTE_DW:
            part = dw_part_ptr + pid.to(gl.int64) * N
            for k in gl.static_range(NCHUNK):
                gl.store(part + k * CHUNK + offs, _pick(k, dw0, dw1, dw2, dw3))
        if COMPUTE_DB:
            part = db_part_ptr + pid.to(gl.int64) * N
            for k in gl.static_range(NCHUNK):
                gl.store(part + k * CHUNK + offs, _pick(k, db0, db1, db2, db3))

    @gluon.jit
    def _normalised(x, w, rstd, OFFSET: gl.constexpr, CASTING: gl.constexpr, HAS_WEIGHT: gl.constexpr):
        """y of a chunk in fp32 (stored in y's dtype), as rms_norm._normalised_output; w from _w_chunk."""
        y = x.to(gl.float32) * rstd
        if HAS_WEIGHT:
            if CASTING == 0:
                y = w.to(gl.float32) * y.to(x.dtype).to(gl.float32)
            else:
                w_eff = w.to(gl.float32)
                if OFFSET != 0.0:
                    w_eff = w_eff + OFFSET
                y = y * w_eff
        return y

    @gluon.jit
    def _rms_fwd_smem_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, next_ptr, counter_ptr,
                             n_rows, stride_x, stride_y, eps,
                             OFFSET: gl.constexpr, CASTING: gl.constexpr, HAS_WEIGHT: gl.constexpr, N: gl.constexpr,
                             WARPS: gl.constexpr, CTAS: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr,
                             PTX: gl.constexpr):
        """y and rstd of the rows a cluster claims: the backward's scheme (module docstring) with one
        pass over x's chunks for Σx², the exchange, then y chunk by chunk."""
        T: gl.constexpr = 32 * WARPS
        CHUNK: gl.constexpr = CTAS * T * 8
        NCHUNK: gl.constexpr = N // CHUNK  # the host checks N % CHUNK == 0 and FORWARD_CHUNKS
        per_thread: gl.constexpr = gl.SliceLayout(2, REG)
        per_cta: gl.constexpr = gl.SliceLayout(1, per_thread)
        x_t: gl.constexpr = x_ptr.dtype.element_ty
        x0 = gl.allocate_shared_memory(x_t, [CTAS, T, 8], SMEM)
        x1 = _chunk_buffer(x_t, 1, NCHUNK, x0, CTAS, T, SMEM)
        x2 = _chunk_buffer(x_t, 2, NCHUNK, x0, CTAS, T, SMEM)
        x3 = _chunk_buffer(x_t, 3, NCHUNK, x0, CTAS, T, SMEM)
        x4 = _chunk_buffer(x_t, 4, NCHUNK, x0, CTAS, T, SMEM)
        x5 = _chunk_buffer(x_t, 5, NCHUNK, x0, CTAS, T, SMEM)
        x6 = _chunk_buffer(x_t, 6, NCHUNK, x0, CTAS, T, SMEM)
        x7 = _chunk_buffer(x_t, 7, NCHUNK, x0, CTAS, T, SMEM)
        wbuf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NCHUNK, CTAS, T, 8], SMEM)

        pid = gl.program_id(0)  # the cluster
        ranks = _cta_value(gl.arange(0, CTAS, layout=per_cta))  # [CTAS, 1, 1]
        offs = _gpu.slice_offsets(CTAS, T, REG)

        last_claim = n_rows + gl.num_programs(0) - 1
        _gpu.claim_row(counter_ptr, next_ptr + 3 * pid, last_claim)
        _gpu.cluster_sync()
        r = gl.load(next_ptr + 3 * pid, cache_modifier=".cg")
        xrow = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * stride_x
        for k in gl.static_range(NCHUNK):
            if HAS_WEIGHT:
                _gpu.async_load(wbuf.index(k), w_ptr + k * CHUNK + offs)
            _gpu.async_load(_pick8(k, x0, x1, x2, x3, x4, x5, x6, x7), xrow + k * CHUNK + offs)
            async_copy.commit_group()  # one group per chunk: _chunk_arrived

        parity = 0
        while r < n_rows:
            row = r.to(gl.int64)
            got = _gpu.claim_issue(counter_ptr)  # the row after this one, published at the exchange
            acc = gl.zeros([CTAS, T], gl.float32, per_thread)
            for k in gl.static_range(NCHUNK):
                _chunk_arrived(k, NCHUNK)
                xf = _pick8(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG).to(gl.float32)
                acc = acc + gl.sum(xf * xf, 2)
            ss, nxt_row, nxt = _exchange(gl.sum(acc, 1), parity, got, counter_ptr, next_ptr + 3 * pid + 1 + parity,
                                         last_claim, PTX)
            rstd = gl.rsqrt(ss / N + eps)  # [CTAS, 1, 1]
            gl.store(rstd_ptr + row + ranks * 0, rstd, mask=ranks == 0)
            yrow = y_ptr + row * stride_y
            nxrow = x_ptr + gl.minimum(nxt_row, n_rows - 1).to(gl.int64) * stride_x
            more = (offs * 0 + nxt_row) < n_rows
            for k in gl.static_range(NCHUNK):
                xk = _pick8(k, x0, x1, x2, x3, x4, x5, x6, x7).load(REG)
                wk = xk  # not read without a weight
                if HAS_WEIGHT:
                    wk = _w_chunk(wbuf, k, OFFSET, CASTING, REG)
                gl.store(yrow + k * CHUNK + offs,
                         _normalised(xk, wk, rstd, OFFSET, CASTING, HAS_WEIGHT).to(y_ptr.dtype.element_ty))
                # this chunk of the cluster's next row, into the buffer just read
                _gpu.async_load(_pick8(k, x0, x1, x2, x3, x4, x5, x6, x7), nxrow + k * CHUNK + offs, mask=more)
                async_copy.commit_group()  # one group per chunk: _chunk_arrived
            r = nxt
            parity = 1 - parity
        async_copy.wait_group(0)


def _chunk_range(forward: bool) -> tuple[int, int]:
    """The chunk counts a kernel takes: MIN_CHUNKS..MAX_CHUNKS for the backward, FORWARD_CHUNKS for the forward."""
    return FORWARD_CHUNKS if forward else (MIN_CHUNKS, MAX_CHUNKS)


def _whole_chunks(n_cols: int, shape: ClusterShape, forward: bool = False) -> bool:
    """Whether n_cols is whole chunks of shape's, as many as the kernel takes (_chunk_range)."""
    lo, hi = _chunk_range(forward)
    return n_cols % shape.chunk == 0 and lo <= n_cols // shape.chunk <= hi


def buffer_bytes(n_cols: int, shape: ClusterShape, element_size: int, forward: bool = False) -> int:
    """Shared memory of one CTA: its slice of x, of w and (backward) of dy."""
    return (2 if forward else 3) * (n_cols // shape.ctas) * element_size


# The casting id LayerNorm's backward runs with: fp32 terms, nothing rounded between (rms_norm's "none").
LAYER_NORM_CASTING = 2

# Words of each CTA's exchange slots (exchange_ptx) per parity: `parts` runs of CTAS partials, then the
# claimed row (LayerNorm's two sums over 8 CTAs: 17 words).
EXCHANGE_WORDS = 32


@functools.lru_cache(maxsize=None)  # every launch asks (_launch_meta): one string per cluster size
def exchange_ptx(ctas: int, parts: int = 1) -> str:
    """The row exchange of a cluster of `ctas` CTAs for `parts` partial sums per CTA, one inline PTX block
    run by every thread (Gluon 3.6 has no address of another CTA's shared memory, so the slots are a
    static .shared array of the block, two parities of EXCHANGE_WORDS words). Operands: the sums
    $0..$(parts-1) and the claimed row $parts out; then in the parts (f32 bits), the parity, the row:
      thread 0 of each CTA stores part p in word p·ctas + rank of the parity's slot of every CTA of the
      cluster (mapa + st.shared::cluster), CTA 0's also the claimed row in word parts·ctas;
      thread 0 fences; one cluster barrier (arrive relaxed, wait acquire); every thread then adds the
      ctas values of each part in its own slot in rank order (the same sums in every CTA) and reads the row.
    A CTA writes a slot again two rows later, after the barrier of the row between, which every CTA
    reaches only after reading it. Against a global slot read back with .cg loads this takes an L2 round
    trip off every row's path to pass 2."""
    if ctas < 1 or parts < 1 or parts * ctas + 1 > EXCHANGE_WORDS:
        raise ValueError(f"norm_smem: {parts} partial sums from a cluster of {ctas} CTAs do not fit the exchange "
                         f"slots ({EXCHANGE_WORDS} words: parts x CTAs + 1)")
    part_in = [f"${parts + 1 + p}" for p in range(parts)]
    parity, got = f"${2 * parts + 1}", f"${2 * parts + 2}"
    lines = ["{", f".shared .align 16 .b32 xch[{2 * EXCHANGE_WORDS}];", ".reg .pred lead, lead0;",
             ".reg .b32 tid, rank, base, mine, rowslot, ra;", ".reg .f32 acc, v;",
             "mov.u32 tid, %tid.x;", "setp.eq.u32 lead, tid, 0;", "mov.u32 rank, %cluster_ctarank;",
             "setp.eq.and.u32 lead0, rank, 0, lead;", "mov.u32 base, xch;",
             f"mad.lo.u32 base, {parity}, {4 * EXCHANGE_WORDS}, base;", "mad.lo.u32 mine, rank, 4, base;",
             f"add.u32 rowslot, base, {4 * parts * ctas};"]
    for q in range(ctas):
        lines.append(f"@lead mapa.shared::cluster.u32 ra, mine, {q};")
        lines += [f"@lead st.shared::cluster.b32 [ra+{4 * p * ctas}], {part_in[p]};" for p in range(parts)]
    for q in range(ctas):
        lines += [f"@lead0 mapa.shared::cluster.u32 ra, rowslot, {q};", f"@lead0 st.shared::cluster.b32 [ra], {got};"]
    lines += ["@lead fence.acq_rel.cluster;", "barrier.cluster.arrive.relaxed.aligned;",
              "barrier.cluster.wait.acquire.aligned;"]
    for p in range(parts):
        lines.append(f"ld.shared.f32 acc, [base+{4 * p * ctas}];")
        for q in range(1, ctas):
            lines += [f"ld.shared.f32 v, [base+{4 * (p * ctas + q)}];", "add.f32 acc, acc, v;"]
        lines.append(f"mov.b32 ${p}, acc;")
    lines += [f"ld.shared.b32 ${parts}, [rowslot];", "}"]
    return "\n\t".join(lines)


def _launch_meta(n_cols: int, shape: ClusterShape, forward: bool, parts: int = 1) -> dict:
    """The constexprs and launch options both kernels share."""
    if not _whole_chunks(n_cols, shape, forward):
        lo, hi = _chunk_range(forward)
        raise ValueError(f"norm_smem: N = {n_cols} must be {lo}-{hi} whole chunks of {shape.chunk} columns for "
                         f"{shape} in the {'forward' if forward else 'backward'}")
    reg, smem = _gpu.layouts(shape.warps, shape.ctas)
    return dict(N=n_cols, WARPS=shape.warps, CTAS=shape.ctas, REG=reg, SMEM=smem, PTX=exchange_ptx(shape.ctas, parts),
                num_warps=shape.warps, num_ctas=shape.ctas, maxnreg=_gpu.register_cap(shape.warps, shape.per_sm))


def _claim_scratch(grid: int, device: torch.device):
    """(claimed rows, row counter) of a launch: each cluster's first row and the two rows claimed after
    (in turn), and the stream's self-resetting counter."""
    return torch.empty(grid * 3, dtype=torch.int32, device=device), _gpu.claim_counter(device)


def kernel_constexprs(n_cols: int, shape: ClusterShape, *, offset: float, casting_id: int, compute_dw: bool,
                      centered: bool = False, has_weight: bool = True, compute_db: bool = False) -> dict:
    """_norm_bwd_smem_kernel's constexprs and launch options (the launch, and dev/check_sm90.py): RMSNorm's
    by default, LayerNorm's with centered (casting_id 2, offset 0: fp32 terms, as layer_norm computes)."""
    return dict(_launch_meta(n_cols, shape, False, 2 if centered else 1), OFFSET=float(offset), CASTING=casting_id,
                CENTERED=centered, HAS_WEIGHT=has_weight, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db)


def forward_constexprs(n_cols: int, shape: ClusterShape, *, offset: float, casting_id: int, has_weight: bool) -> dict:
    """_rms_fwd_smem_kernel's constexprs and launch options."""
    return dict(_launch_meta(n_cols, shape, True), OFFSET=float(offset), CASTING=casting_id, HAS_WEIGHT=has_weight)


def _dx_row_stride(dx: torch.Tensor, n_cols: int) -> int:
    """The row stride of dx, the op's contiguous output of x's shape (any number of dimensions): n_cols.
    (Its stride(0) is the row's only for 2-D x: a (batch, seq, N) dx steps seq·N there.)"""
    if not dx.is_contiguous():
        raise ValueError(f"norm_smem: dx must be contiguous (the op allocates it); got strides {dx.stride()}")
    return n_cols


def launch_backward(dy2, x2, weight, rstd, dx, partial, *, shape: ClusterShape, grid: int, offset: float,
                    casting_id: int, compute_dw: bool) -> None:
    """RMSNorm: dx (contiguous, written in place) and, with compute_dw, grid fp32 dw partial rows into
    partial[:grid]."""
    n_rows, n_cols = x2.shape
    next_rows, counter = _claim_scratch(grid, x2.device)
    launch(_norm_bwd_smem_kernel, (grid,),
           (dy2, x2, weight, rstd, rstd, dx, partial, partial, next_rows, counter, n_rows, dy2.stride(0), x2.stride(0),
            _dx_row_stride(dx, n_cols)),
           kernel_constexprs(n_cols, shape, offset=offset, casting_id=casting_id, compute_dw=compute_dw))


def launch_layer_norm_backward(dy2, x2, weight, mean, rstd, dx, dw_partial, db_partial, *, shape: ClusterShape,
                               grid: int, compute_dw: bool, compute_db: bool) -> None:
    """LayerNorm: dx (contiguous, written in place) and grid fp32 partial rows of dw (compute_dw, into
    dw_partial[:grid]) and of db (compute_db, db_partial[:grid]); weight may be None."""
    n_rows, n_cols = x2.shape
    next_rows, counter = _claim_scratch(grid, x2.device)
    launch(_norm_bwd_smem_kernel, (grid,),
           (dy2, x2, x2 if weight is None else weight, mean, rstd, dx, dw_partial, db_partial, next_rows, counter,
            n_rows, dy2.stride(0), x2.stride(0), _dx_row_stride(dx, n_cols)),
           kernel_constexprs(n_cols, shape, offset=0.0, casting_id=LAYER_NORM_CASTING, compute_dw=compute_dw,
                             centered=True, has_weight=weight is not None, compute_db=compute_db))


def launch_forward(x2, weight, y2, rstd, *, shape: ClusterShape, grid: int, eps: float, offset: float,
                   casting_id: int) -> None:
    """y2 (2-D rows, written in place) and rstd (one fp32 per row) of x2's rows."""
    n_rows, n_cols = x2.shape
    next_rows, counter = _claim_scratch(grid, x2.device)
    launch(_rms_fwd_smem_kernel, (grid,),
           (x2, x2 if weight is None else weight, y2, rstd, next_rows, counter, n_rows, x2.stride(0),
            y2.stride(0), float(eps)),
           forward_constexprs(n_cols, shape, offset=offset, casting_id=casting_id, has_weight=weight is not None))
