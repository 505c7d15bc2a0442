"""Experiment (session 16; the kernel change it times is stages.patch beside it, on top of b9dc125 — it lost
(exp_rms_bwd_stages.txt) and was not kept in the library): the long-row RMSNorm backward read once (fused_kernels/rms_norm_smem.py) with two
rows in shared memory (ClusterShape.stages = 2: the next row's copies stay in flight while this row's
partial dots are exchanged) against one (the table's today: the next row's copies start only after the
exchange), at the table's lengths; the split backward for reference. Each variant is checked against
float64 first, then timed queued (GPU time) in alternating rounds.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16 python3 \
        benchmarks/session16/exp_rms_bwd_stages.py      (GPU)
"""

from __future__ import annotations

from rms_bwd_harness import Shape, main

# per row length: the table's shape first, then two-stage shapes (64 KB of shared memory per CTA at 65536:
# 3 per SM; 16 warps spill under their register cap, kept to see what it costs). The script as run also
# timed the split backward (its lines in exp_rms_bwd_stages.txt); the shared harness leaves it out.
VARIANTS = {
    65536: [(Shape(8, 8, 4), None, {}), (Shape(8, 8, 3), None, {}), (Shape(8, 8, 3, 2), None, {}),
            (Shape(16, 8, 3, 2), None, {})],
    32768: [(Shape(4, 8, 6), None, {}), (Shape(4, 8, 6, 2), None, {}), (Shape(8, 8, 3, 2), None, {}),
            (Shape(8, 8, 4, 2), None, {})],
    49152: [(Shape(8, 8, 4), None, {}), (Shape(8, 8, 3, 2), None, {}), (Shape(8, 8, 4, 2), None, {})],
}

if __name__ == "__main__":
    main(VARIANTS, library=True)
