"""Experiment (session 16; the CLAIM_AHEAD knob was in the library at 15f152a and left at e64590b): the long-row RMSNorm backward read once with w in shared memory and one buffer
per chunk (the library now; exp_rms_bwd_knobs.txt) and CLAIM_AHEAD (the row after next claimed right
after a row's barrier and published at the next one, so the atomic's round trip is off the path to the
barrier), per table shape and a few more; the grid sized to the clusters that fit at once (62 at 65536,
ncu) rather than per_sm x SMs / 8 (66); then _dw_sum_kernel's shapes at 62-66 partial rows of 65536
(6.3 us in the table's profile, a quarter of a wave).

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8:$PWD/benchmarks/session9:$PWD/benchmarks/session16 python3 \
        benchmarks/session16/exp_rms_bwd_ahead.py      (GPU)
"""

from __future__ import annotations

import torch
import triton

from rms_bwd_harness import Shape, main, rms

VARIANTS = {  # (shape, grid or None, knobs)
    65536: [(Shape(8, 8, 4), None, dict(claim_ahead=False)), (Shape(8, 8, 4), None, dict(claim_ahead=True)),
            (Shape(8, 8, 4), 62, dict(claim_ahead=False)), (Shape(16, 8, 2), None, dict(claim_ahead=False)),
            (Shape(16, 8, 2), None, dict(claim_ahead=True)), (Shape(16, 8, 3), None, dict(claim_ahead=False))],
    32768: [(Shape(4, 8, 6), None, dict(claim_ahead=a)) for a in (False, True)]
    + [(Shape(8, 8, 4), None, dict(claim_ahead=False))],
    49152: [(Shape(8, 8, 4), None, dict(claim_ahead=a)) for a in (False, True)],
    24576: [(Shape(4, 8, 6), None, dict(claim_ahead=a)) for a in (False, True)],
}
DW_SUM_SHAPES = [(128, 16, 2), (64, 16, 2), (64, 16, 4), (128, 16, 4), (256, 16, 4), (128, 32, 4), (64, 32, 4),
                 (32, 64, 8), (64, 64, 8), (256, 8, 2), (512, 8, 4), (128, 8, 1), (32, 32, 4), (32, 16, 2)]


def dw_sum(rounds=3):
    """_dw_sum_kernel's shapes (BLOCK_N, PARTS, warps) on 62 and 66 fp32 partial rows of 65536."""
    from tune_cross_entropy import queued_ms
    w = torch.ones(65536, device="cuda", dtype=torch.bfloat16)
    for parts in (62, 66):
        partial = torch.randn(parts, 65536, device="cuda")
        ref = partial.double().sum(0)
        for block_n, rows, warps in DW_SUM_SHAPES:
            dw = torch.empty_like(w)

            def fn():
                rms.launch(rms._dw_sum_kernel, (triton.cdiv(65536, block_n),), (partial, dw, parts, 65536),
                           dict(BLOCK_N=block_n, PARTS=rows, num_warps=warps))
            fn()
            err = ((dw.double() - ref).abs().max() / ref.abs().max()).item()
            times = [queued_ms(fn, reps=15) for _ in range(rounds)]
            print(f"dw_sum parts={parts} (BLOCK_N, PARTS, warps)=({block_n}, {rows}, {warps}): err {err:.1e} "
                  f"{' '.join(f'{t * 1e3:.2f}' for t in times)} us", flush=True)


if __name__ == "__main__":
    main(VARIANTS, library=True)
    dw_sum()
