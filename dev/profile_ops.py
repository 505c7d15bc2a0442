"""Where the time of one forward+backward goes, per op and peer (GPU only; a diagnosis, not a benchmark).

    python dev/profile_ops.py [--only rms_norm,rope] [--peers ours,liger] [--out profile.json]

For each main-table case of benchmarks/bench_kernels.py and each peer it prints:
  - wall: the do_bench median of fwd+bwd, as bench.py measures it (L2 flushed before every call);
  - gpu: the sum of the CUDA kernels' own durations in one fwd+bwd (torch.profiler, 5 calls averaged);
    wall − gpu is time the GPU spent idle, waiting for Python (launch overhead) or for a host sync;
  - host: Python µs of one fwd+bwd call (CPU time between the call's start and its last launch);
  - every kernel of one fwd+bwd with its mean duration and count per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_common import bench_ms, free_memory  # noqa: E402
from bench_kernels import PEERS, _backward, kernel_times, real_cases  # noqa: E402


def profile_one(case, peer: str, device, reps: int = 5) -> dict:
    fn = PEERS[peer](case.op)
    inp = case.make(device, 0)
    leaves, go, args = inp.leaves, inp.grad_out, inp.args

    def fwdbwd():
        _backward(fn(*args), go)

    for _ in range(3):  # compile, autotune
        for t in leaves:
            t.grad = None
        fwdbwd()
    torch.cuda.synchronize()
    wall = bench_ms(fwdbwd, device, grad_to_none=leaves)
    # Host time: the GPU is kept busy by a long sleep kernel first, so the CPU never waits on it.
    host = []
    for _ in range(5):
        for t in leaves:
            t.grad = None
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        fwdbwd()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    kernels = kernel_times(fwdbwd, device, leaves, calls=reps)
    gpu_us = sum(v[0] for v in kernels.values())
    del inp, leaves, go, args
    free_memory(device, full=True)
    return {
        "wall_ms": wall, "gpu_ms": gpu_us / 1e3, "host_us": sorted(host)[len(host) // 2],
        "kernels": sorted(([n[:90], round(us, 1), count] for n, (us, count) in kernels.items()), key=lambda r: -r[1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="rms_norm 16384x4096,rms_norm 65536x1024,rope,swiglu,cross_entropy 8192x128256")
    ap.add_argument("--peers", default="ours,liger,torch_compile")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda")
    wanted = [s.strip() for s in a.only.split(",") if s.strip()]
    cases = [c for c in real_cases() if any(c.name.startswith(w) for w in wanted)]
    seen = set()
    results = {}
    for case in cases:
        if case.name in seen:
            continue
        seen.add(case.name)
        for peer in a.peers.split(","):
            try:
                r = profile_one(case, peer, device)
            except Exception as exc:  # a peer not installed, an OOM
                print(f"{case.name:32s} {peer:14s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            results[f"{case.name} | {peer}"] = r
            print(f"{case.name:32s} {peer:14s} wall {r['wall_ms']:.3f} ms  gpu {r['gpu_ms']:.3f} ms  "
                  f"host {r['host_us']:.0f} us", flush=True)
            for name, us, count in r["kernels"]:
                print(f"      {us:9.1f} us  x{count:<4g} {name}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
