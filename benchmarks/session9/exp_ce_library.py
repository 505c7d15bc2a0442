"""Experiment (session 9): the library's cross-entropy launch (fused_kernels.cross_entropy.launch_ce) per
vocabulary size, as SMEM_TABLE picks it, against LAUNCH_TABLE's Triton kernel and other shared-memory
shapes (forced), checked against float64 and timed against a copy of the logits. 8192 rows bf16, no
ignored rows (as scripts/bench.py), CUDA-event medians of the forward kernel writing the gradient.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session9/exp_ce_library.py [--vocabs ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")  # the module (the package exports the function)

# extra shared-memory shapes to try per V: (warps, per_sm, ctas)
EXTRA = {65536: [(8, 3, 2), (16, 1, 2)], 100000: [(8, 3, 4)], 151936: [(8, 4, 8), (8, 5, 8), (8, 2, 4)],
         128256: [(4, 6, 8)], 262144: [(4, 3, 8)]}


def main(vocabs, rounds, queued=False):
    from ce_case import ce_case, check_and_time, copy_ms
    from tune_cross_entropy import event_ms, queued_ms
    timer = queued_ms if queued else event_ms  # session 10: queued (GPU time only; event_ms adds launch gaps)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for v in vocabs:
        case = ce_case(v, ref_rows=256, ignored=False)
        copy = copy_ms(case.x, timer=timer)
        print(f"V={v}: copy {copy:.3f} ms", flush=True)
        shapes = [("library", None), ("table", ce.launch_config(v))]
        shapes += [(f"smem warps={w} per_sm={p} ctas={c}", ce.LaunchConfig(block=256 * w, warps=w, per_sm=p, smem=True,
                                                                            ctas=c)) for w, p, c in EXTRA.get(v, [])]
        runs = []
        for label, force in shapes:
            def run(force=force, case=case):
                ce._CONFIG["force"] = force
                try:
                    ce.launch_ce(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, ignore_index=-100,
                                 label_smoothing=0.0, z_loss=0.0, softcap=None)
                finally:
                    ce._CONFIG["force"] = None
            runs.append((f"library {ce.launch_config(v, lambda c: True)}" if force is None else label, run))
        check_and_time(case, runs, copy, rounds, timer)
        del case, runs


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", default="16384,32000,50304,65536,100000,128256,151936,262144")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queued", action="store_true", help="time GPU work only (tune_cross_entropy.queued_ms)")
    a = ap.parse_args()
    main([int(v) for v in a.vocabs.split(",")], a.rounds, a.queued)
