"""Experiment (session 16; the knob is refill.patch beside it, on top of 15f152a): when the long-row RMSNorm
backward copies the next row into shared memory. REFILL 0 (the library): chunk by chunk as pass 2 consumes
them, one CTA barrier each (Triton's barrier pass orders the copy after every thread's read); 1: all at
the end of pass 2, one barrier; 2: right after pass 1, which keeps the row in registers for pass 2 (the
next row is claimed one row earlier, so it is known then), so the copies overlap the exchange too.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16 python3 \
        benchmarks/session16/exp_rms_bwd_refill.py      (GPU)
"""

from __future__ import annotations

from rms_bwd_harness import Shape, main

VARIANTS = {
    65536: [(Shape(8, 8, 4), None, dict(refill=r)) for r in (0, 1, 2)]
    + [(Shape(8, 8, 3), None, dict(refill=2)), (Shape(16, 8, 2), None, dict(refill=2))],
    32768: [(Shape(4, 8, 6), None, dict(refill=r)) for r in (0, 1, 2)],
    49152: [(Shape(8, 8, 4), None, dict(refill=r)) for r in (0, 1)],
}

if __name__ == "__main__":
    main(VARIANTS)
