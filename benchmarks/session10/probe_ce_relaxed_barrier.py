"""Probe (session 10): how much of the split-row CE kernel's time is the release fence of its cluster
barrier? A timing bound only; the probe's results are NOT correct.

ncu (run_ncu_ce_split.sh, ncu_ce_stalls.txt) gives 0.93 cycles of "membar" stall per issued instruction
for the 4-CTA split kernel at V = 128256 (of 10.3 in all), and none for the unsplit kernel. Its one
fence is `barrier.cluster.arrive.release`. Release makes each thread wait until all its earlier stores
are performed, and those include the previous row's gradient, just issued.

The probe builds a copy of fused_kernels/cross_entropy_smem.py with `.relaxed` arrives. The partials
exchanged through global memory may then be read stale, so the loss and gradient may be wrong. It times
that copy against the library on the same inputs, with queued launches. The difference bounds what a
fence-free exchange could save, e.g. st.async into the peer CTAs' shared memory completing on an
mbarrier, which orders only its own bytes.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session10/probe_ce_relaxed_barrier.py
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")
smem = importlib.import_module("fused_kernels.cross_entropy_smem")

RELEASE = "barrier.cluster.arrive.release.aligned;"
RELAXED = "barrier.cluster.arrive.relaxed.aligned;"


def relaxed_module():
    src = open(smem.__file__).read()
    assert src.count(RELEASE) == 1, "the kernel's cluster barrier changed; update the probe"
    path = os.path.join(tempfile.mkdtemp(), "ce_smem_relaxed_probe.py")  # a real file: triton reads the source
    with open(path, "w") as f:
        f.write(src.replace(RELEASE, RELAXED))
    spec = importlib.util.spec_from_file_location("ce_smem_relaxed_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    from ce_case import ce_case, check_and_time, copy_ms
    from tune_cross_entropy import queued_ms
    relaxed = relaxed_module()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for v in (128256, 262144):
        case = ce_case(v, ref_rows=256, ignored=False)
        copy = copy_ms(case.x, timer=queued_ms)
        cfg = ce.launch_config(v, lambda c: True)
        grid = ce.grid_programs(cfg, case.n, case.x.device)
        print(f"V={v}: copy {copy:.3f} ms; {cfg}, grid {grid}", flush=True)

        def run(module):
            module.launch_ce_smem(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, warps=cfg.warps,
                                  ctas=cfg.ctas, grid=grid, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                  softcap=None, logit_scale=1.0)

        check_and_time(case, [("library (release arrive)", lambda: run(smem)),
                              ("PROBE relaxed arrive (results may be wrong)", lambda: run(relaxed))],
                       copy, rounds=3, timer=queued_ms)
        del case


if __name__ == "__main__":
    main()
