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

Generated from the library's source (text replacements checked to apply once, as the other CE
probes): the kernel is the library's with CTAS = 1 (one CTA's layouts) and LANES slices per chunk, its
cluster claim and exchange replaced; every optional term (scale, softcap, label smoothing with a third
word per lane, z-loss, row scale) stays. The helpers are ce_tagged_words.py's.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/probe_ce_lanes.py
    .venv/bin/python benchmarks/session11/probe_ce_lanes.py --compile-only   (CPU: sm_90a builds)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session10"))
# (it puts the repository, scripts/, session8/ and session10/ on sys.path and sets TRITON_INTERPRET=0)
from probe_ce_relaxed_barrier import (  # noqa: E402
    _module_from, _replace_block, _replace_once, smem, smem_launch, time_variants)

import torch  # noqa: E402

REPLACEMENTS = (
    # LANES slices per chunk, each CTA holding its lane's slice (CTAS = 1: one CTA's layouts)
    ("""        SMEM: gl.constexpr,
    ):""", """        SMEM: gl.constexpr, LANES: gl.constexpr, VEC_S: gl.constexpr,
    ):"""),
    ("CHUNK: gl.constexpr = CTAS * T * 8", "CHUNK: gl.constexpr = LANES * T * 8"),
    ("""        offs = slice_offsets(CTAS, T, REG)
""", """        lane = pid % LANES
        offs = slice_offsets(CTAS, T, REG) + lane * (T * 8)
        at_lane = ranks + lane
        lanes = gl.arange(0, LANES, layout=VEC_S)
        slot_ptr = next_ptr + pid  # the CTA's claimed row (partials_ptr: the words, counter_ptr: a counter per lane)
"""),
)
# The first row: claimed from the lane's counter (replaces the block from its first line to its last).
FIRST_ROW = ("        if CTAS == 1:\n            r = pid", """            r = gl.load(next_ptr + n_rows + pid, cache_modifier=".cg")
""", """        _claim_to_slot(counter_ptr + lane, slot_ptr)
        _cta_barrier()
        r = gl.load(slot_ptr, cache_modifier=".cg")
""")
# The exchange: publish, claim the lane's next row, wait for the row's words (replaces both branches).
EXCHANGE = ("            if CTAS == 1:\n                m_row = gl.max(m_cta, 0)", """                nxt = gl.load(next_ptr + row, cache_modifier=".cg")
""", """            slot = partials_ptr + row * (3 * LANES)
            tag = r + 1
            _publish(slot + at_lane, tag, m_cta)
            _publish(slot + LANES + at_lane, tag, s_cta)
            if HAS_LS:
                _publish(slot + 2 * LANES + at_lane, tag, z_cta)
            _claim_to_slot(counter_ptr + lane, slot_ptr)
            # (every word re-read and re-checked per spin: a check of a word read once outside the loop,
            # as a first version did for the absent label-smoothing words, never turns true)
            wm = _load_word(slot + lanes)
            ws = _load_word(slot + LANES + lanes)
            ready = _all_tagged(wm, tag) * _all_tagged(ws, tag)
            wz = wm
            if HAS_LS:
                wz = _load_word(slot + 2 * LANES + lanes)
                ready = ready * _all_tagged(wz, tag)
            while ready == 0:
                wm = _load_word(slot + lanes)
                ws = _load_word(slot + LANES + lanes)
                ready = _all_tagged(wm, tag) * _all_tagged(ws, tag)
                if HAS_LS:
                    wz = _load_word(slot + 2 * LANES + lanes)
                    ready = ready * _all_tagged(wz, tag)
            _cta_barrier()  # thread 0's claim, stored before it, is visible to every thread after it
            nxt = gl.load(slot_ptr, cache_modifier=".cg")
            m_all = _values(wm)
            m_row = gl.max(m_all, 0)
            s_row = gl.sum(_values(ws) * gl.exp2(m_all - m_row), 0)
            z_row = gl.sum(_values(wz), 0)  # used with HAS_LS only
""")
HELPERS_AFTER = "    @gluon.jit\n    def _ce_smem_kernel("
HELPERS = ("    from ce_tagged_words import (  # noqa: F401\n"
           "        _all_tagged, _claim_to_slot, _cta_barrier, _load_word, _publish, _values)\n\n")


def lanes_module():
    src = open(smem.__file__).read()
    for old, new in REPLACEMENTS:
        src = _replace_once(src, old, new)
    src = _replace_block(src, *FIRST_ROW)
    src = _replace_block(src, *EXCHANGE)
    src = _replace_once(src, HELPERS_AFTER, HELPERS + HELPERS_AFTER)
    return _module_from("ce_smem_lanes_probe", src)


def lanes_constexprs(module, v: int, warps: int, lanes: int, **options) -> dict:
    from triton.experimental.gluon import language as gl
    return dict(module.kernel_constexprs(v, warps, 1, **options), LANES=lanes,
                VEC_S=gl.BlockedLayout([1], [32], [warps], [0]))


def launch_ce_lanes(module, x, target, grad, loss_rows, coef, row_scale, flag, *, warps: int, lanes: int, grid: int,
                    ignore_index: int, label_smoothing: float, z_loss: float, softcap, logit_scale: float) -> None:
    """launch_ce_smem's contract on the lanes kernel: `grid` CTAs (a multiple of lanes)."""
    n, v = x.shape
    assert grid % lanes == 0, "every lane needs the same number of CTAs"
    assert v >= lanes * 256 * warps, "every lane's slice needs one whole chunk (a finite max)"
    words = torch.zeros(n * 3 * lanes, dtype=torch.int64, device=x.device)  # zeroed: no stale tag
    slots = torch.empty(grid, dtype=torch.int32, device=x.device)
    counters = torch.zeros(lanes, dtype=torch.int32, device=x.device)
    rs = row_scale if row_scale is not None else coef  # never read without HAS_ROW_SCALE
    module._ce_smem_kernel[(grid,)](
        x, x.stride(0), target, grad, grad.stride(0), loss_rows, coef, rs, flag, words, slots, counters, n,
        ignore_index, float(logit_scale), float(softcap if softcap is not None else 1.0), float(label_smoothing),
        float(z_loss),
        **lanes_constexprs(module, v, warps, lanes, has_scale=logit_scale != 1.0, has_softcap=softcap is not None,
                           has_ls=label_smoothing > 0.0, has_row_scale=row_scale is not None),
        num_warps=warps)


# (V, lanes, warps, CTAs per SM): the library's split shapes (64 KB per CTA), and 8 lanes at 128256
# (32 KB per CTA: 6 would fit in shared memory, but 48 registers × 256 threads (triton 3.6) allow 5).
SHAPES = ((128256, 4, 8, 3), (128256, 8, 8, 5), (262144, 8, 8, 3))


def lanes_launch(module, lanes: int, warps: int, per_sm: int):
    """A launch of the lanes kernel on a case (time_variants' contract), per_sm CTAs per SM."""
    def launch(case, cfg, library_grid):
        grid = per_sm * torch.cuda.get_device_properties(case.x.device).multi_processor_count // lanes * lanes
        launch_ce_lanes(module, case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, warps=warps,
                        lanes=lanes, grid=grid, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                        logit_scale=1.0)
    return launch


def main():
    module = lanes_module()
    for v in sorted({shape[0] for shape in SHAPES}):
        time_variants([("library (cluster)", smem_launch(smem))] +
                      [(f"lanes {lanes} x {warps} warps, {per_sm} CTAs per SM",
                        lanes_launch(module, lanes, warps, per_sm))
                       for vv, lanes, warps, per_sm in SHAPES if vv == v], vocabs=(v,))


def compile_only():
    """The lanes kernel for sm_90a at SHAPES, with and without the optional terms."""
    import check_sm90
    module = lanes_module()
    sig, aligned = check_sm90.ce_smem_signature("bf16", "*i64")
    for v, lanes, warps, per_sm in SHAPES:
        for extras in (False, True):
            flags = lanes_constexprs(module, v, warps, lanes, has_scale=extras, has_softcap=extras, has_ls=extras,
                                     has_row_scale=extras)
            res = check_sm90.compile_sm90(module._ce_smem_kernel, sig, flags, aligned, warps, 1)
            print(f"lanes V={v} S={lanes} warps={warps} ({per_sm}/SM) options {extras}: {res}", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
