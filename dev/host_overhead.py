"""Python (host) cost of one call, per op and peer, and where it goes (a diagnosis).

    python dev/host_overhead.py [--profile] [--peers ours,liger,host_floor]   (GPU)
    python dev/host_overhead.py --cpu-stub [--profile]                          (no GPU)

For a 0.1–0.2 ms kernel the CPU's launch path can outlast the GPU work, and do_bench then measures
the CPU. This prints, for tiny inputs (the GPU is never the bottleneck): µs per forward, per
forward+backward, and (--profile) the top functions of a cProfile of fwd+bwd with autograd's
multithreading off, so that the backward runs on this thread and is profiled too.

--cpu-stub: on the CPU, with every Triton launch of ours and of the host-floor yardstick replaced by a
no-op (outputs are garbage): the Python our ops run around their launches, against an autograd node
that does nothing else, on any machine. The GPU host adds Triton's launcher and CUDA's per-launch cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

CPU_STUB = "--cpu-stub" in sys.argv
if CPU_STUB:  # before triton is imported: the kernels' modules load through the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_kernels import PEERS, _backward, cross_entropy_case, rms_norm_case, rope_case  # noqa: E402
from tune_common import host_us  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches() -> None:
    import bench_kernels
    from fused_kernels.ops import cross_entropy as ce
    from fused_kernels.ops import glu, rms_norm, rope

    for op in (rms_norm, rope, glu):
        op.launch = lambda *args, **kwargs: None

    def ce_launch(kernel, grid, args, meta):
        if kernel is ce._loss_epilogue_kernel:
            args[5].fill_(1)  # "targets in range": the CPU path reads it back and raises otherwise

    ce.launch = ce_launch
    bench_kernels._touch_kernel = _NoLaunch()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--peers", default="ours,host_floor" if CPU_STUB else "ours,liger")
    ap.add_argument("--cpu-stub", action="store_true", help="CPU, launches replaced by no-ops (see above)")
    a = ap.parse_args()
    device = torch.device("cpu" if CPU_STUB else "cuda")
    if CPU_STUB:
        _stub_launches()
    # CE at V = 16384 takes the shared-memory (Gluon) kernel on a GPU: its launch path against the Triton one
    cases = [rms_norm_case(64, 4096, ()), rope_case(1, 4, 2, 64, 128, ()), cross_entropy_case(64, 1000, ()),
             cross_entropy_case(64, 16384, ())]
    for case in cases:
        for peer in a.peers.split(","):
            try:
                fn = PEERS[peer](case.op)
            except Exception as exc:
                print(case.name, peer, "unavailable", exc)
                continue
            inp = case.make(device, 0)

            def fwd():
                return fn(*inp.args)

            def fwdbwd():
                for t in inp.leaves:
                    t.grad = None
                _backward(fn(*inp.args), inp.grad_out)

            with torch.no_grad():
                f_us = host_us(fwd)
            fb_us = host_us(fwdbwd)
            torch.autograd.set_multithreading_enabled(False)
            fb1_us = host_us(fwdbwd)
            print(f"{case.name:28s} {peer:8s} fwd(no_grad) {f_us:6.1f} us  fwd+bwd {fb_us:6.1f} us  "
                  f"(single-threaded autograd {fb1_us:6.1f} us)", flush=True)
            if a.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    fwdbwd()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
                lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
                print("\n".join("      " + ln[:150] for ln in lines[4:30]), flush=True)
            torch.autograd.set_multithreading_enabled(True)
            if not CPU_STUB:
                torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
