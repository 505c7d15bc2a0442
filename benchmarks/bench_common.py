"""Measurement plumbing shared by benchmarks/bench.py, bench_kernels.py and bench_e2e.py.

Benchmark-only code: nothing in the `autopatch` or `fused_kernels` packages imports it.

What it gives:
- `environment()`: GPU name, versions of every stack piece, date — stored with each result file.
- `measure_ceilings()`: the two ceilings every fraction is taken against, measured in the same run
  (a large device-to-device copy, bytes read + written; an 8192^3 bf16 matmul on random data).
- `bench_ms()`: `triton.testing.do_bench` median on CUDA (L2 flushed before every timed call by
  do_bench itself), a plain perf_counter median on the CPU (the dry run only).
- `peak_extra_bytes()`: the peak memory a call allocates beyond what its inputs and the gradients it
  leaves behind hold.
- `rel_err()`: ||a - b|| / ||b||, chunked so that 4 GiB tensors do not need 16 GiB of temporaries.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata as _md
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Iterable

import torch

MiB = 1024**2
GiB = 1024**3


def version_of(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit, with "+changes" when the tracked files differ from it. The device machine's
    copy of the tree can carry a stale .git (it said the session's first commit for every later call):
    there this reads "<old>+changes", and source_digest() is what identifies the code."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        commit = out.stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except Exception:  # no git or no .git on the device machine's copy
        return None


def source_digest() -> str:
    """sha256 (first 12 hex digits) of the library's Python sources (fused_kernels/, autopatch/), file
    names included: the same code gives the same digest on any machine, so a result can be matched to
    its commit here (python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_common;
    print(bench_common.source_digest())" after a checkout)."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for package in ("fused_kernels", "autopatch"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


# CUDA kernel kinds by name, for the step diagnoses: cuBLAS / CUTLASS GEMMs, SDPA's flash /
# memory-efficient / cuDNN attention, the fused Triton kernels (ours: _rms_norm_*, _rope_kernel, _glu_*,
# _ce_kernel, _scale_kernel; Liger's have the op in their names too), TRL 1.16's chunked LM head (its two
# Triton kernels, trl/kernels/chunked_logprob.py; the head's GEMMs count as gemm), the fused AdamW.
KERNEL_KINDS = (
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitkreduce")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("fused", ("_rms_norm", "rope", "glu", "_ce_", "cross_entropy", "_scale_kernel", "layer_norm", "gelu",
               "_combine_kernel", "_act_bwd", "_side_stats", "_partial_sum", "_dw_sum", "_loss_")),
    ("optimizer", ("adam", "multi_tensor")),
)
TRL_HEAD_KERNELS = frozenset({"_forward_kernel", "_backward_kernel"})


def kernel_kind(kernel_name: str) -> str:
    """gemm, attention, fused, trl_head, optimizer or other (see KERNEL_KINDS)."""
    if kernel_name in TRL_HEAD_KERNELS:
        return "trl_head"
    low = kernel_name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    """Everything a reader needs to know which machine and which stack produced the numbers."""
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": version_of("triton"),
        "transformers": version_of("transformers"),
        "liger_kernel": version_of("liger-kernel") or version_of("liger_kernel"),
        "cut_cross_entropy": version_of("cut-cross-entropy") or version_of("cut_cross_entropy"),
        "git_commit": _git_commit(),
        "source_digest": source_digest(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / GiB, 1),
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        env["gpu"] = None
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device, full: bool = False) -> None:
    """Return freed blocks to the device. A full gc.collect() costs ~0.5 s once transformers and
    dynamo are imported, so only the youngest generation is collected unless `full`."""
    gc.collect() if full else gc.collect(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def bench_ms(
    fn: Callable[[], object],
    device: torch.device,
    *,
    grad_to_none: Iterable[torch.Tensor] | None = None,
    min_reps: int = 10,
    max_ms: float = 1000.0,
) -> float:
    """Median milliseconds of fn(). On CUDA: triton's do_bench with warm-up and repeat windows sized
    from one timed call, so a 0.1 ms kernel gets hundreds of repeats and a 100 ms one about
    `min_reps` (the whole call stays near `max_ms` plus do_bench's own 6 estimation calls)."""
    grads = list(grad_to_none) if grad_to_none is not None else None
    if device.type != "cuda":
        times = []
        for _ in range(max(3, min(min_reps, 5))):
            if grads:
                for g in grads:
                    g.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if grads:
        for g in grads:
            g.grad = None
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    est = max(start.elapsed_time(end), 1e-3)
    rep = min(max(100.0, est * min_reps), max(max_ms, est * 3))
    warmup = min(max(25.0, est * 3), 300.0)
    try:
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median")
    except (TypeError, AssertionError):  # a triton without return_mode="median": the 0.5 quantile
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, quantiles=[0.5])
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def bench_after_setup_ms(
    setup: Callable[[], object],
    fn: Callable[[object], object],
    device: torch.device,
    *,
    grad_to_none: Iterable[torch.Tensor] | None = None,
    min_reps: int = 10,
    max_ms: float = 1000.0,
) -> float:
    """Median milliseconds of fn(setup()) counting only fn: the backward pass alone, with a fresh
    forward (setup) before every timed call, so no peer needs retain_graph (torch.compile's backward
    with donated buffers refuses it). Same method as do_bench: events around fn only, L2 flushed
    (a 256 MiB buffer zeroed) between setup and fn, warm-up calls first, the median of the rest."""
    grads = list(grad_to_none) if grad_to_none is not None else []

    def once(timed: bool):
        for g in grads:
            g.grad = None
        state = setup()
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn(state)
            return (time.perf_counter() - t0) * 1e3
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(state)
        end.record()
        del state
        return (start, end)

    def elapsed(r):
        if isinstance(r, float):
            return r
        r[1].synchronize()
        return r[0].elapsed_time(r[1])

    flush = torch.empty(256 * MiB, dtype=torch.int8, device=device) if device.type == "cuda" else None
    est = max(elapsed(once(True)), 1e-3)
    n_warm = max(1, min(int(25.0 / est), 20))
    n_rep = int(min(max(100.0, est * min_reps), max(max_ms, est * 3)) / est)
    n_rep = max(3, min(n_rep, 1000))
    if device.type != "cuda":
        n_warm, n_rep = 1, max(3, min(min_reps, 5))
    for _ in range(n_warm):
        elapsed(once(False))
    times = [once(True) for _ in range(n_rep)]
    return statistics.median(elapsed(t) for t in times)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storages(tensors: Iterable[torch.Tensor | None]) -> set[int]:
    return {_storage_key(t) for t in tensors if isinstance(t, torch.Tensor)}


def new_grad_bytes(leaves: Iterable[torch.Tensor], existing: set[int]) -> int:
    """Bytes held by the leaves' .grad tensors that did not exist before the call (a gradient written
    into an input's own buffer, as Liger's in-place backward does, costs nothing extra)."""
    seen: set[int] = set()
    total = 0
    for t in leaves:
        g = t.grad
        if g is None:
            continue
        key = _storage_key(g)
        if key in existing or key in seen:
            continue
        seen.add(key)
        total += g.untyped_storage().nbytes()
    return total


def peak_extra_bytes(
    call: Callable[[], object], device: torch.device, leaves: list[torch.Tensor], existing: set[int]
) -> tuple[int, object]:
    """Run call() once; return (peak allocated beyond the memory held before the call, minus the new
    gradients it leaves on `leaves`; the call's result). CUDA only: on the CPU returns (-1, result)."""
    if device.type != "cuda":
        return -1, call()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak - base - new_grad_bytes(leaves, existing), result


@torch.no_grad()
def rel_err(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """||out - ref|| / ||ref|| accumulated in float64 over 16M-element chunks (a 4 GiB bf16 gradient
    needs no 16 GiB of float temporaries); non-finite output gives inf."""
    if out.shape != ref.shape:
        return float("inf")
    a = out.detach().reshape(-1)
    b = ref.detach().reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=a.device)
    den = torch.zeros((), dtype=torch.float64, device=a.device)
    finite = torch.ones((), dtype=torch.bool, device=a.device)
    for i in range(0, a.numel(), chunk):
        ca = a[i : i + chunk].double()
        cb = b[i : i + chunk].double()
        finite &= torch.isfinite(ca).all()
        num += torch.sum((ca - cb) ** 2)
        den += torch.sum(cb**2)
    if not bool(finite):
        return float("inf")
    num_f, den_f = float(num), float(den)
    if den_f == 0.0:
        return num_f**0.5
    return (num_f / den_f) ** 0.5


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, on random data, in this run."""
    if device.type != "cuda":
        return {"copy_gbps": None, "matmul_tflops": None, "note": "no GPU: ceilings not measured"}
    gen = torch.Generator(device=device).manual_seed(1234)
    n_bytes = 4 * GiB
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), device, min_reps=20)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    mm_ms = bench_ms(lambda: a @ b, device, min_reps=50)
    del a, b
    free_memory(device)
    return {
        "copy_gbps": 2 * n_bytes / (copy_ms * 1e-3) / 1e9,
        "copy_bytes": 2 * n_bytes,
        "copy_ms": copy_ms,
        "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
        "matmul_shape": [n, n, n],
        "matmul_ms": mm_ms,
    }


def write_json(path: str, data: dict) -> None:
    """Write atomically, so a run killed at its time limit leaves the last complete file behind."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


class Deadline:
    """A wall-clock budget: `left()` seconds remain; `over()` once spent."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self, margin: float = 0.0) -> bool:
        return self.left() <= margin
