"""Experiment (session 17, prepared on the CPU; run in session 18 on df9b16d:
benchmarks/session18/exp_rms_dsmem.txt): rms_norm_smem's two kernels with the row exchange through the
cluster's shared memory (DSMEM) instead of global memory. It won (1024 x 65536 bf16, queued: forward
77.4-78.6 -> 74.6-74.7 µs, backward + dw sum 131.8-132.3 -> 120.3-121.8) and its kernels became the
library's in 153d4f8 (rms_norm_smem.exchange_ptx and the kernels' `_exchange`), so this file no longer
carries a copy of them. The version that ran, with its own kernels beside the library's global-exchange
ones: `git show df9b16d:benchmarks/session17/exp_rms_dsmem.py`.

What it compared: in the library then, a row's exchange was thread 0 of each CTA storing its partial in a
global slot (CTA 0's also the claimed row), thread 0's fence, one cluster barrier, then every thread
loading the CTAS partials and the claimed row from L2 (.cg): one L2 round trip on every row's path
before pass 2 could start its refills. The DSMEM exchange has thread 0 of each CTA write its partial
into every CTA's shared memory (mapa + st.shared::cluster into a static .shared array of the inline PTX
block), the same fence (fence.acq_rel.cluster is still MEMBAR.ALL.GPU in SASS) and barrier, then local
reads; the claimed row so read is a [CTAS] tensor, so pass 2 addresses its refills with [CTAS, 1, 1]
pointers and masked copies, and the loop's scalar row still comes from global memory after the barrier.

Run now, it times the library's kernels at the same shape with the same checks (and that the row
counter is back at zero afterwards):

    bash benchmarks/session17/call.sh exp_rms_dsmem                                      (GPU, ~30 s)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"), HERE]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from fused_kernels import cross_entropy_smem as _smem  # noqa: E402
from fused_kernels import rms_norm_smem as lib  # noqa: E402


def gpu_main(rounds: int) -> None:
    from exp_rms_knobs import N, ROWS, case, checked_backward, checked_forward, header, library_shapes, rms, timed
    t0 = time.time()
    sms = header()
    x, dy, w, rstd, y_ref, dx_ref, dw_ref = case()
    fshape, bshape, fgrid, bgrid = library_shapes(sms)
    y = torch.empty_like(x)
    r = torch.empty(ROWS, device="cuda")

    def forward():
        lib.launch_forward(x, w, y, r, shape=fshape, grid=fgrid, eps=1e-6, offset=0.0, casting_id=0)

    if checked_forward("library forward", forward, y, r, y_ref, rstd):
        timed([("library forward", forward)], rounds)
    dx = torch.empty_like(x)
    partial = torch.empty(bgrid, N, device="cuda")

    def backward():
        lib.launch_backward(dy, x, w, rstd, dx, partial, shape=bshape, grid=bgrid, offset=0.0, casting_id=0,
                            compute_dw=True)
        return rms._sum_partial_rows(partial, bgrid, w)

    if checked_backward("library backward + dw sum", backward, dx, partial, dx_ref, dw_ref):
        timed([("library backward + dw sum", backward)], rounds)
    print(f"claim counter after the runs: {int(_smem.claim_counter(x.device).item())} (0: every launch reset it)")
    print(f"done [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    gpu_main(ap.parse_args().rounds)
