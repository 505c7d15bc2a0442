"""Experiment (session 16; the knob is lead_fence.patch beside it, on top of 15f152a): the exchange's cluster
barrier with one fence per CTA (thread 0, which stored the CTA's partial dot and the claimed row, runs
fence.acq_rel.gpu; every thread arrives relaxed) against barrier.cluster.arrive.release in every thread
(a MEMBAR.ALL.GPU per warp, 11 % of the warps' stall cycles in ncu_rms_stalls_w_in_smem.txt).

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16 python3 \
        benchmarks/session16/exp_rms_bwd_fence.py      (GPU)
"""

from __future__ import annotations

from rms_bwd_harness import Shape, main

TABLE = {65536: Shape(8, 8, 4), 32768: Shape(4, 8, 6), 49152: Shape(8, 8, 4), 24576: Shape(4, 8, 6)}
VARIANTS = {n: [(shape, None, dict(lead_fence=f)) for f in (False, True)] for n, shape in TABLE.items()}

if __name__ == "__main__":
    main(VARIANTS)
