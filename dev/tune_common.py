"""Timing helpers shared by dev/tune_rms_norm.py and dev/tune_rope.py (GPU only).

Three different times matter for a 0.1 ms kernel, and the tune scripts report each:
- kernel time: `graph_ms` replays a CUDA graph of several calls, so no Python runs between kernels and
  what is measured is the GPU's time alone (what the floor is compared with);
- dispatch time: `triton.testing.do_bench` of the functional call, as benchmarks/bench.py measures it; when the
  Python per call (custom-op dispatch, autograd, Triton's launcher) outlasts the GPU work queued ahead of
  it, the GPU idles and this exceeds the kernel time;
- host time: `host_us`, the Python cost of one call on a tiny input (the GPU is never the bottleneck).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import triton
from triton.testing import do_bench


def copy_gbps(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured now."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def graph_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """GPU time of one fn() call: `reps` calls captured in a CUDA graph and replayed (median over
    triton.testing.do_bench replays, divided by reps). fn must already be warm (compiled, autotuned)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    ms = do_bench(graph.replay) / reps
    del graph
    return ms


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Python microseconds per fn() call, measured on inputs small enough that the GPU keeps up (on
    a machine without CUDA: the CPU time of the calls, e.g. host_overhead.py --cpu-stub)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def pct(floor_ms: float, ms: float) -> str:
    return f"{floor_ms / ms:6.1%}" if ms > 0 else "   n/a"


def config_str(cfg) -> str:
    """A triton.Config in one short line (its kwargs, warps, stages)."""
    if cfg is None:
        return "-"
    kwargs = " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
    return f"{kwargs} warps={cfg.num_warps} stages={cfg.num_stages}"


def autotune_timings(tuned) -> list[tuple[float, object]]:
    """(median ms, config) of every candidate the autotuner timed in its latest tuning, fastest first."""
    timings = getattr(tuned, "configs_timings", None) or {}
    out = []
    for cfg, t in timings.items():
        out.append((t[0] if isinstance(t, (list, tuple)) else float(t), cfg))
    return sorted(out, key=lambda r: r[0])


def header(device: torch.device) -> float:
    """Print the machine and stack; return the copy bandwidth in GB/s."""
    gbps = copy_gbps(device)
    print(f"{torch.cuda.get_device_name(device)}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {gbps:.0f} GB/s")
    return gbps
