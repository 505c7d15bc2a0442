"""Probe (session 11, prepared, never run on a GPU): split CE rows without a thread-block cluster.

Why: a row too long for one SM's shared memory is split over a cluster of CTAS CTAs in the library
(fused_kernels/cross_entropy_smem.py). That reaches ~80 % of a copy at V = 128256, where the unsplit
kernel reaches 88 % at 32000. Only 92 clusters of 4 fit on the H200 at once (368 CTAs, not 396), and
every row ends at a cluster barrier whose release waits for the CTA's earlier gradient stores.
probe_ce_occupancy.py asks whether the occupancy is the cost; this is the design to try if it is.

Design ("lanes"): a persistent grid of ordinary CTAs (no cluster launch), grid a multiple of S. CTA pid
works in lane k = pid % S: slice k of every row (CTA k's slice of every chunk, as in the library), rows
claimed from the lane's own counter. Each row's S slices are therefore processed by S CTAs that may sit
anywhere on the GPU. They meet through global memory:
- each publishes its (max, Σ exp) as two 64-bit words (row+1) << 32 | fp32 bits, one relaxed store each,
  from one thread (a word's tag and value arrive together: no fence, nothing waits for the gradient
  stores);
- then it claims its lane's next row (so the claim's latency overlaps the wait);
- then every thread loads the row's 2·S words at once, again while any tag is not the row's, and
  combines them into lse; pass 2 and the prefetch of the next row are the library's.
The exchange buffer is zeroed per launch, so no tag is stale.

Progress: a CTA waits only for slices of its current row, and the only claim it holds besides is in its
own lane. Take the lowest row anyone waits on: each lane has either claimed that row, and its CTA will
publish (it waits only on rows not lower), or not yet, and then that lane's CTAs hold only lower rows,
which nobody waits on, so they finish and claim it. It needs one resident CTA per lane (S <= 8), not
co-scheduling of the whole grid.

Features: plain cross entropy (ignore_index, out-of-range flag, mean coefficient), no logit scale,
softcap, label smoothing, z-loss or row scale: enough to time the design against the library on the
benchmark's case.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/probe_ce_lanes.py
    .venv/bin/python benchmarks/session11/probe_ce_lanes.py --compile-only   (CPU: sm_90a builds)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session10"))
# (it puts the repository, scripts/ and session8/ on sys.path and sets TRITON_INTERPRET=0)
from probe_ce_relaxed_barrier import smem, smem_launch, time_variants  # noqa: E402
from ce_tagged_words import _load_word, _publish  # noqa: E402

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from fused_kernels.cross_entropy import _dlogits, _row_loss  # noqa: E402
from fused_kernels.cross_entropy_smem import LOG2E, _async_load, _stats_chunk, layouts, slice_offsets  # noqa: E402

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # triton 3.6 / 3.9 names


@gluon.jit
def _claim(counter_ptr, slot_ptr):
    # Thread 0: *slot = counter++ (relaxed: the claim orders nothing). The other threads read the slot
    # after the next CTA barrier.
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 t, got;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 lead, t, 0;\n\t"
        "@lead atom.relaxed.gpu.global.add.u32 got, [$1], 1;\n\t@lead st.global.u32 [$2], got;\n\t"
        "mov.u32 $0, 0;\n\t}",
        "=r,l,l", [counter_ptr, slot_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _all_tagged(words, tag):
    return gl.min(((words >> 32).to(gl.int32) == tag).to(gl.int32), 0)


@gluon.jit
def _values(words):
    return (words & 0xFFFFFFFF).to(gl.uint32).to(gl.float32, bitcast=True)


@gluon.jit
def _ce_lanes_kernel(
    x_ptr, x_stride, tgt_ptr, grad_ptr, grad_stride, loss_ptr, coef_ptr, flag_ptr,
    words_ptr, counters_ptr, slots_ptr, n_rows, ignore_index,
    V: gl.constexpr, WARPS: gl.constexpr, S: gl.constexpr, REG: gl.constexpr, SMEM: gl.constexpr,
    VEC_S: gl.constexpr,
):
    T: gl.constexpr = 32 * WARPS
    CHUNK: gl.constexpr = S * T * 8  # classes per chunk; this CTA holds T·8 of them (its lane's slice)
    NFULL: gl.constexpr = V // CHUNK
    TAIL: gl.constexpr = V % CHUNK != 0
    NCHUNK: gl.constexpr = NFULL + TAIL
    per_thread: gl.constexpr = gl.SliceLayout(2, REG)  # [1, T]
    one: gl.constexpr = gl.SliceLayout(1, per_thread)  # [1]
    buf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCHUNK, 1, T, 8], SMEM)

    pid = gl.program_id(0)
    lane = pid % S
    offs = slice_offsets(1, T, REG) + lane * (T * 8)
    tail = offs < V - NFULL * CHUNK
    at_lane = gl.arange(0, 1, layout=one) + lane
    lanes = gl.arange(0, S, layout=VEC_S)
    coef_all = gl.load(coef_ptr)
    slot_ptr = slots_ptr + pid

    _claim(counters_ptr + lane, slot_ptr)
    _cta_barrier()
    r = gl.load(slot_ptr, cache_modifier=".cg")
    first = x_ptr + gl.minimum(r, n_rows - 1).to(gl.int64) * x_stride
    for i in range(NFULL):
        _async_load(buf.index(i), first + i * CHUNK + offs)
    if TAIL:
        _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)
    async_copy.commit_group()

    while r < n_rows:
        row = r.to(gl.int64)
        y = gl.load(tgt_ptr + row).to(gl.int64)
        kept = y != ignore_index
        in_range = (y >= 0) & (y < V)
        gl.store(flag_ptr, 1, mask=kept & (~in_range))
        use = kept & in_range
        yc = gl.where(use, y, 0).to(gl.int32)
        zy = gl.load(x_ptr + row * x_stride + yc).to(gl.float32)
        c = gl.where(use, coef_all, 0.0)

        # Pass 1: this lane's share of the row's max and Σ exp2 (log2 units).
        async_copy.wait_group(0)
        m2 = gl.full([1, T], float("-inf"), gl.float32, per_thread)
        s = gl.full([1, T], 0.0, gl.float32, per_thread)
        sumz = gl.full([1, T], 0.0, gl.float32, per_thread)
        for i in range(NFULL):
            z = buf.index(i).load(REG).to(gl.float32)
            m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, False)
        if TAIL:
            z = buf.index(NFULL).load(REG).to(gl.float32)
            m2, s, sumz = _stats_chunk(gl.where(tail, z, float("-inf")), gl.where(tail, z, 0.0), m2, s, sumz, False)
        m_lane = gl.max(m2, 1)
        s_lane = gl.sum(s * gl.exp2(m2 - gl.expand_dims(m_lane, 1)), 1)

        # Exchange: publish, claim the lane's next row, then wait for the row's S shares.
        tag = r + 1
        slot = words_ptr + row * (2 * S)
        _publish(slot + at_lane, tag, m_lane)
        _publish(slot + S + at_lane, tag, s_lane)
        _claim(counters_ptr + lane, slot_ptr)
        wm = _load_word(slot + lanes)
        ws = _load_word(slot + S + lanes)
        while _all_tagged(wm, tag) * _all_tagged(ws, tag) == 0:
            wm = _load_word(slot + lanes)
            ws = _load_word(slot + S + lanes)
        _cta_barrier()  # thread 0's claim, stored before it, is visible to every thread after it
        nxt = gl.load(slot_ptr, cache_modifier=".cg")
        m_all = _values(wm)
        m_row = gl.max(m_all, 0)
        s_row = gl.sum(_values(ws) * gl.exp2(m_all - m_row), 0)
        lse2 = m_row + gl.log2(s_row)
        lse = lse2 / LOG2E
        gl.store(loss_ptr + row, gl.where(use, _row_loss(lse, zy, 0.0, 0.0, 0.0, 0.0, False), 0.0))

        # Pass 2: the gradient, chunk by chunk; each consumed slot takes the lane's next row's chunk.
        y_chunk = gl.where(use, yc // CHUNK, -1)
        nxt_row = x_ptr + nxt.to(gl.int64) * x_stride
        g_row = grad_ptr + row * grad_stride
        for i in range(NCHUNK):
            z = buf.index(i).load(REG).to(gl.float32)
            p = gl.exp2(z * LOG2E - lse2)
            if i == y_chunk:
                d = _dlogits(p, z, offs, yc - i * CHUNK, c, 0.0, c, 1.0, False)
            else:
                d = _dlogits(p, z, offs, -1, c, 0.0, c, 1.0, False, False)
            d = d.to(grad_ptr.dtype.element_ty)
            if i < NFULL:
                gl.store(g_row + i * CHUNK + offs, d)
                if nxt < n_rows:
                    _async_load(buf.index(i), nxt_row + i * CHUNK + offs)
            else:
                gl.store(g_row + i * CHUNK + offs, d, mask=tail)
                if nxt < n_rows:
                    _async_load(buf.index(i), nxt_row + i * CHUNK + offs, mask=tail)
        async_copy.commit_group()
        r = nxt
    async_copy.wait_group(0)


def constexprs(v: int, warps: int, lanes: int) -> dict:
    reg, smem_layout = layouts(warps, 1)
    return dict(V=v, WARPS=warps, S=lanes, REG=reg, SMEM=smem_layout,
                VEC_S=gl.BlockedLayout([1], [32], [warps], [0]))


def launch_ce_lanes(x, target, grad, loss_rows, coef, flag, *, warps: int, lanes: int, grid: int) -> None:
    n, v = x.shape
    assert grid % lanes == 0, "every lane needs the same number of CTAs"
    assert v >= lanes * 256 * warps, "every lane's slice needs one whole chunk (a finite max)"
    words = torch.zeros(n * 2 * lanes, dtype=torch.int64, device=x.device)
    counters = torch.zeros(lanes, dtype=torch.int32, device=x.device)
    slots = torch.empty(grid, dtype=torch.int32, device=x.device)
    _ce_lanes_kernel[(grid,)](x, x.stride(0), target, grad, grad.stride(0), loss_rows, coef, flag, words, counters,
                              slots, n, -100, **constexprs(v, warps, lanes), num_warps=warps)


# (V, lanes, warps, CTAs per SM): the library's split shapes (64 KB per CTA), and 8 lanes at 128256
# (32 KB per CTA: 6 would fit in shared memory, but 48 registers × 256 threads (triton 3.6) allow 5).
SHAPES = ((128256, 4, 8, 3), (128256, 8, 8, 5), (262144, 8, 8, 3))


def lanes_launch(lanes: int, warps: int, per_sm: int):
    """A launch of the lanes kernel on a case (time_variants' contract), per_sm CTAs per SM."""
    def launch(case, cfg, library_grid):
        grid = per_sm * torch.cuda.get_device_properties(case.x.device).multi_processor_count // lanes * lanes
        launch_ce_lanes(case.x, case.t, case.grad, case.loss, case.coef, case.flag, warps=warps, lanes=lanes, grid=grid)
    return launch


def main():
    for v in sorted({shape[0] for shape in SHAPES}):
        time_variants([("library (cluster)", smem_launch(smem))] +
                      [(f"lanes {lanes} x {warps} warps, {per_sm} CTAs per SM", lanes_launch(lanes, warps, per_sm))
                       for vv, lanes, warps, per_sm in SHAPES if vv == v], vocabs=(v,))


def compile_only():
    import check_sm90
    sig = {"x_ptr": "*bf16", "x_stride": "i32", "tgt_ptr": "*i64", "grad_ptr": "*bf16", "grad_stride": "i32",
           "loss_ptr": "*fp32", "coef_ptr": "*fp32", "flag_ptr": "*i32", "words_ptr": "*i64", "counters_ptr": "*i32",
           "slots_ptr": "*i32", "n_rows": "i32", "ignore_index": "i32"}
    aligned = [k for k in sig if k.endswith("_ptr")] + ["x_stride", "grad_stride"]
    for v, lanes, warps, per_sm in SHAPES:
        res = check_sm90.compile_sm90(_ce_lanes_kernel, sig, constexprs(v, warps, lanes), aligned, warps, 1)
        print(f"lanes V={v} S={lanes} warps={warps} ({per_sm}/SM): {res}", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
