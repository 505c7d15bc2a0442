"""Experiment (session 16, after ncu_rms_stalls.txt: barrier, membar and L2-latency stalls dominate the long-row
backward): the library's rms_norm_smem kernel with two knobs (knobs.patch beside it, on top of probe.patch):
W_IN_SMEM, the CTA's slice of w copied into shared memory once (it was read from global memory twice per
row, an L1 hit only 30 % of the time); CHUNK_BUFFERS, one shared allocation per chunk, so that Triton's
barrier pass does not put a CTA barrier after every chunk's copy. Checked against float64, then timed
queued in alternating rounds.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16 python3 \
        benchmarks/session16/exp_rms_bwd_knobs.py      (GPU)
"""

from __future__ import annotations

from rms_bwd_harness import Shape, main

KNOBS = [{}, dict(w_in_smem=True), dict(chunk_buffers=True), dict(w_in_smem=True, chunk_buffers=True)]
VARIANTS = {
    65536: [(Shape(8, 8, 4), None, k) for k in KNOBS] + [(Shape(8, 8, 3), None, KNOBS[3])],
    32768: [(Shape(4, 8, 6), None, k) for k in KNOBS] + [(Shape(8, 8, 4), None, KNOBS[3])],
    49152: [(Shape(8, 8, 4), None, k) for k in (KNOBS[0], KNOBS[3])],
    24576: [(Shape(4, 8, 6), None, k) for k in (KNOBS[0], KNOBS[3])],
}

if __name__ == "__main__":
    main(VARIANTS, library=True)
