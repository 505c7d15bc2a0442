"""Python (host) cost of one call, per op and peer, and where it goes (GPU only; a diagnosis).

    python scripts/host_overhead.py [--profile]

For a 0.1–0.2 ms kernel the CPU's launch path can outlast the GPU work, and do_bench then measures
the CPU. This prints, for tiny inputs (the GPU is never the bottleneck): µs per forward, per
forward+backward, and (--profile) the top functions of a cProfile of fwd+bwd with autograd's
multithreading off, so that the backward runs on this thread and is profiled too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import PEERS, _backward, cross_entropy_case, rms_norm_case, rope_case  # noqa: E402
from tune_common import host_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--peers", default="ours,liger")
    a = ap.parse_args()
    device = torch.device("cuda")
    cases = [rms_norm_case(64, 4096, ()), rope_case(1, 4, 2, 64, 128, ()), cross_entropy_case(64, 1000, ())]
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
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
