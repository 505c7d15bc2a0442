"""Tune fused_kernels.cross_entropy's launch shapes on the GPU (run once on the target GPU, e.g. an H200).

    TRITON_INTERPRET=0 python dev/tune_cross_entropy.py            (one command, <= ~90 s)
    options: --budget-s 80 (time for the search; the summary always prints) --rows 8192 --no-flce
    --flce-only --flce-shape 16384,2304,262144 --flce-chunks 256,512,1024 (the FLCE section alone, any shape)
    --sweep-kernel (the full grid; by default the table's entry and a few shapes near it)
    --vocabs 32000 (only these V)  --reps 7 (samples per candidate)
    --configs 4096x4x0x2x1,2048x4x0x3x0 (time exactly these launch shapes after the table's entry:
    block x warps x per_sm x stages x l2_hints, instead of the near-table list)
    --cpu-smoke: the same steps on tiny CPU tensors under the Triton interpreter (checks the script)

What is timed is the real thing: the forward kernel writing the loss and the gradient of 8192 bf16 rows
(what a training step runs; the backward is free when the upstream gradient is 1), CUDA-event medians,
against the floor of reading the logits once and writing the gradient once at the copy bandwidth
measured in the same run. Per V in 32000, 128256, 262144:
  stage 1  block × warps (spill-free on sm_90a, plus Liger's 32768 × 32) × programs per SM (0 = one per row)
  stage 2  the two best of stage 1 with pipelined block loops (stages 2, 3) and with L2 eviction hints
Then: the LAUNCH_TABLE rows to paste into fused_kernels/cross_entropy.py; the functional forward and
forward+backward with the winners (and Liger-Kernel's, when importable) against the floor; and the fused
linear cross entropy at 8192 x 4096 -> 128256 for a few chunk sizes against three bf16 GEMMs timed here.
A candidate that fails to compile or run is reported and skipped.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

SMOKE = "--cpu-smoke" in sys.argv
os.environ["TRITON_INTERPRET"] = "1" if SMOKE else "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fused_kernels  # noqa: E402

from fused_kernels.ops import cross_entropy as ce  # noqa: E402
from fused_kernels.ops import cross_entropy_config as ce_cfg  # noqa: E402
from fused_kernels.ops import fused_linear_cross_entropy as flce
LaunchConfig = ce_cfg.LaunchConfig

# V tuned -> the LAUNCH_TABLE bound its winner is pasted under.
VOCABS = {32000: 65536, 128256: 196608, 262144: math.inf}
BLOCK_WARPS = [(16384, 32), (8192, 16), (16384, 16), (8192, 8), (32768, 32)]
# The short search (default): shapes near the table's winners, all with the L2 hints.
# Fewer programs than one per row (per_sm < 1 as well): fewer rows in flight, so that a row's first-sweep
# blocks are still in L2 when its second sweep reads them again.
NEAR_TABLE = [LaunchConfig(b, w, p, st, True) for b, w, st in
              ((32768, 32, 1), (16384, 32, 1), (32768, 16, 1), (8192, 8, 2), (8192, 16, 1))
              for p in (0, 0.5, 1)] + [LaunchConfig(32768, 32, p, 1, True) for p in (0.25, 0.75)]
SWEEP_KERNEL = "--sweep-kernel" in sys.argv  # the full block × warps × per_sm grid, then stages and hints
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:  # tiny stand-ins: the script's steps, not its numbers
    VOCABS = {300: 65536, 700: 196608, 1100: math.inf}
    BLOCK_WARPS = [(256, 4), (1024, 4)]
    NEAR_TABLE = [LaunchConfig(128, 4, 0, 1, True), LaunchConfig(256, 4, 0.5, 2, True)]


def event_ms(fn, reps: int = 7, sleep_cycles: int = 0) -> float:
    """Median GPU time of fn() over `reps` calls, each bracketed by CUDA events (fn already warm).
    sleep_cycles > 0: the GPU first spins that long (torch.cuda._sleep) so that fn's launches queue up
    behind it, and the events bracket GPU work only (see queued_ms)."""
    times = []
    for _ in range(reps):
        if SMOKE:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_ms(fn, reps: int = 7) -> float:
    """event_ms behind a ~1 ms GPU spin: without it the events also time the host's launch gaps, which
    dominate kernels of ~0.1-0.3 ms launched from Python (several launches per call)."""
    return event_ms(fn, reps, sleep_cycles=2_000_000)


def bench(fn, reps: int = 20) -> float:
    return event_ms(fn, reps=2) if SMOKE else do_bench(fn, warmup=10, rep=60)


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


class Case:
    """Buffers for one V: bf16 logits (N, V), targets with 10 % ignored, the gradient and the rest."""

    def __init__(self, n: int, v: int, reps: int = 7):
        self.v, self.reps = v, reps  # reps: CUDA-event samples per candidate
        self.x = (torch.randn(n, v, device=DEVICE) * 2).to(torch.bfloat16)
        self.target = torch.randint(0, v, (n,), device=DEVICE)
        self.target[torch.rand(n, device=DEVICE) < 0.1] = -100
        self.grad = torch.empty_like(self.x)
        self.loss_rows = torch.empty(n, device=DEVICE)
        self.coef = torch.full((1,), 1.0 / n, device=DEVICE)
        self.flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def launch(self):
        ce.launch_ce(self.x, self.target, self.grad, self.loss_rows, self.coef, None, self.flag,
                     ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)

    def time(self, cfg: LaunchConfig) -> float:
        ce._CONFIG["force"] = cfg
        try:
            self.loss_rows.fill_(float("nan"))
            self.grad.fill_(float("nan"))
            self.launch()  # compiles on first use of these constexprs
            sync()
            self.check(cfg)
            return event_ms(self.launch, reps=2 if SMOKE else self.reps)
        finally:
            ce._CONFIG["force"] = None

    def check(self, cfg: LaunchConfig) -> None:
        """The first candidate's output is the reference (the table's entry, tested); every other
        candidate must give the same losses and gradient (bf16 rounding apart), and no NaN."""
        if not hasattr(self, "ref"):
            self.ref = (self.loss_rows.clone(), self.grad[:64].float().clone())
            return
        loss_ref, grad_ref = self.ref
        loss_err = ((self.loss_rows - loss_ref).abs().max() / loss_ref.abs().max()).item()
        grad_err = ((self.grad[:64].float() - grad_ref).abs().max() / grad_ref.abs().max()).item()
        if not (loss_err <= 1e-5 and grad_err <= 1e-2):  # NaN fails too
            raise AssertionError(f"{fmt(cfg)} differs from the table's kernel: loss {loss_err:.2e}, grad {grad_err:.2e}")


def fmt(cfg: LaunchConfig) -> str:
    return (f"LaunchConfig(block={cfg.block}, warps={cfg.warps}, per_sm={cfg.per_sm:g}, stages={cfg.stages}, "
            f"l2_hints={cfg.l2_hints})")


def search(case: Case, floor_ms: float, deadline: float,
           candidates: list[LaunchConfig]) -> list[tuple[float, LaunchConfig]]:
    results: list[tuple[float, LaunchConfig]] = []
    seen: set[LaunchConfig] = set()

    def run(cfg: LaunchConfig) -> None:
        if cfg in seen or time.monotonic() > deadline:
            return
        seen.add(cfg)
        try:
            ms = case.time(cfg)
        except Exception as exc:  # a candidate that does not compile or run: say so, go on
            print(f"    FAILED {fmt(cfg)}: {type(exc).__name__}: {str(exc)[:160]}")
            return
        results.append((ms, cfg))
        print(f"    {ms:7.3f} ms  {floor_ms / ms:6.1%} of floor  {fmt(cfg)}", flush=True)

    run(ce_cfg.launch_config(case.v))  # the table's entry first: the number to beat
    for cfg in candidates:
        run(cfg)
    if not SWEEP_KERNEL:
        return sorted(results, key=lambda r: r[0])
    per_sm_options = [0, 1, 2] + ([0.5] if case.v > 196608 else [])
    for block, warps in BLOCK_WARPS:
        for per_sm in per_sm_options:
            run(LaunchConfig(block, warps, per_sm))
    stage1 = sorted(results, key=lambda r: r[0])[:2]
    for _, cfg in stage1:
        for stages, hints in ((1, True), (2, False), (2, True), (3, True)):
            run(cfg._replace(stages=stages, l2_hints=hints))
    return sorted(results, key=lambda r: r[0])


def parse_configs(text: str) -> list[LaunchConfig]:
    """"8192x8x0x2x1,4096x4x0.5x3x0" -> LaunchConfigs (block x warps x per_sm x stages x l2_hints)."""
    out = []
    for item in filter(None, text.split(",")):
        block, warps, per_sm, stages, hints = item.split("x")
        out.append(LaunchConfig(int(block), int(warps), float(per_sm), int(stages), hints == "1"))
    return out


def liger_ce():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except Exception:
        return None
    return lambda logits, target: liger_cross_entropy(logits, target, ignore_index=-100)


def time_functional(name, fn, x, target, floor_ms) -> None:
    """do_bench medians of the forward (with the gradient: logits require grad) and of forward+backward."""
    leaf = x.detach().clone().requires_grad_()  # a peer may overwrite its input with the gradient

    def fwd():
        leaf.grad = None
        return fn(leaf, target)

    def step():
        fwd().backward()

    try:
        f_ms, s_ms = bench(fwd), bench(step)
    except Exception as exc:
        print(f"  {name}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
        return
    print(f"  {name:14s} fwd {f_ms:6.3f}  bwd {s_ms - f_ms:6.3f}  fwd+bwd {s_ms:6.3f} ms   "
          f"(floor {floor_ms:.3f}: {floor_ms / s_ms:.0%})")


def memory_allocated() -> int:
    return 0 if SMOKE else torch.cuda.memory_allocated()


def max_memory_allocated() -> int:
    return 0 if SMOKE else torch.cuda.max_memory_allocated()


def flce_section(h: int = 4096, v: int = 128256, n: int = 8192, chunks: tuple = (768, 1024, 2048)) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=DEVICE).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=DEVICE) * 0.02).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device=DEVICE)
    target[torch.rand(n, device=DEVICE) < 0.1] = -100
    with torch.no_grad():
        logits = torch.empty(n, v, device=DEVICE, dtype=torch.bfloat16)
        mm_ms = event_ms(lambda: torch.mm(hidden, weight.t(), out=logits), reps=5)
        del logits
    print(f"\nfused linear CE {n}x{h}->{v} bf16: one full-size GEMM {mm_ms:.2f} ms "
          f"({2 * n * h * v / mm_ms / 1e9:.0f} TFLOP/s); three: {3 * mm_ms:.2f} ms")

    # The chunk loop's three GEMMs alone, per chunk size (times scaled to all n rows): where the time
    # goes beyond three full-size GEMMs.
    with torch.no_grad():
        grad_w = torch.zeros_like(weight)
        for rows in (chunks if not SMOKE else (4,)):
            h_c = hidden[:rows]
            buf = torch.empty(rows, v, device=DEVICE, dtype=torch.bfloat16)
            dh = torch.empty(rows, h, device=DEVICE, dtype=torch.bfloat16)
            scale = n / rows
            t_logits = event_ms(lambda: torch.mm(h_c, weight.t(), out=buf), reps=5) * scale
            buf_t = torch.empty(v, rows, device=DEVICE, dtype=torch.bfloat16)
            t_logits_t = event_ms(lambda: torch.mm(weight, h_c.t(), out=buf_t), reps=5) * scale
            del buf_t
            buf.normal_().mul_(1e-4)
            t_dh = event_ms(lambda: torch.mm(buf, weight, out=dh), reps=5) * scale
            splits = {}
            for k in (2, 4):  # split-K over the vocabulary as a strided batched GEMM (more output tiles)
                if v % k == 0:
                    g3 = buf.view(rows, k, v // k).transpose(0, 1)
                    w3 = weight.view(k, v // k, h)
                    splits[k] = event_ms(lambda: torch.bmm(g3, w3).sum(0, dtype=torch.float32).to(dh.dtype), reps=5) * scale
            t_dw = event_ms(lambda: grad_w.addmm_(buf.t(), h_c), reps=5) * scale
            print(f"  GEMMs at chunk rows {rows}: logits {t_logits:.2f} (as W h^T: {t_logits_t:.2f}), grad_hidden "
                  f"{t_dh:.2f} (split-K bmm: {', '.join(f'{k}: {t:.2f}' for k, t in splits.items())}), grad_weight "
                  f"(addmm) {t_dw:.2f} ms; sum {t_logits + t_dh + t_dw:.2f} ms", flush=True)
            del buf, dh
        del grad_w

    def step():
        hidden.grad = None
        weight.grad = None
        fused_kernels.fused_linear_cross_entropy(hidden, weight, target).backward()

    default = flce.chunk_rows(n, v, 2)
    for rows in sorted({512, default, *chunks} if not SMOKE else {4, default}):
        flce._CONFIG["chunk_rows"] = rows
        try:
            step()
            sync()
            hidden.grad = None
            weight.grad = None
            if not SMOKE:
                torch.cuda.reset_peak_memory_stats()
            base = memory_allocated()
            ms = event_ms(step, reps=3)
            extra = max_memory_allocated() - base - (hidden.numel() + weight.numel()) * 2
            print(f"  chunk rows {rows:5d}{' (default)' if rows == default else '          '}: fwd+bwd {ms:6.2f} ms "
                  f"({3 * mm_ms / ms:.0%} of three GEMMs), peak beyond inputs+grads {extra / 2**20:5.0f} MiB")
        except Exception as exc:
            print(f"  chunk rows {rows}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            flce._CONFIG["chunk_rows"] = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=80.0, help="time for the search (the summary always prints)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--no-flce", action="store_true")
    ap.add_argument("--flce-only", action="store_true", help="only the fused linear CE section")
    ap.add_argument("--flce-shape", default="8192,4096,128256", help="rows,hidden,vocab of the FLCE section")
    ap.add_argument("--flce-chunks", default="768,1024,2048", help="chunk rows whose GEMMs are timed")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run under the Triton interpreter")
    ap.add_argument("--vocabs", default="", help="comma-separated V to tune (default: 32000,128256,262144)")
    ap.add_argument("--reps", type=int, default=7, help="CUDA-event samples per candidate (median)")
    ap.add_argument("--configs", default="", help="launch shapes to time, BLOCKxWARPSxPER_SMxSTAGESxHINTS,...")
    args = ap.parse_args()
    vocabs = VOCABS
    if args.vocabs:
        wanted = [int(v) for v in args.vocabs.split(",")]
        vocabs = {v: b for v, b in VOCABS.items() if v in wanted} or {v: math.inf for v in wanted}
    candidates = parse_configs(args.configs) or NEAR_TABLE
    t0 = time.monotonic()
    torch.manual_seed(0)
    if SMOKE:
        args.rows = min(args.rows, 6)
        ce._CONFIG["sm_count"] = 2
        bw = 1e9
        print(f"CPU smoke run under the Triton interpreter  torch {torch.__version__}  triton {triton.__version__}")
    else:
        src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = do_bench(lambda: dst.copy_(src))
        bw = 2 * src.numel() / (copy_ms * 1e-3)
        del src, dst
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}  triton {triton.__version__}  "
              f"copy {bw / 1e9:.0f} GB/s")
    n_flce, h_flce, v_flce = (int(t) for t in args.flce_shape.split(","))
    flce_args = (8, 1100, 10, (4,)) if SMOKE else (h_flce, v_flce, n_flce,
                                                    tuple(int(t) for t in args.flce_chunks.split(",")))
    if args.flce_only:
        flce_section(*flce_args)
        print(f"\ntotal {time.monotonic() - t0:.0f} s")
        return
    # Search budget shared by the three vocabularies; the FLCE section and the summary come after.
    search_budget = args.budget_s - (12.0 if not args.no_flce else 0.0)
    winners = {}
    for i, v in enumerate(vocabs):
        case = Case(args.rows, v, args.reps)
        floor_ms = 2 * case.x.numel() * 2 / bw * 1e3
        deadline = t0 + search_budget * (i + 1) / len(vocabs)
        print(f"\nV = {v}: {args.rows} rows bf16, forward writing the gradient; floor {floor_ms:.3f} ms "
              f"(table now: {fmt(ce_cfg.launch_config(v))})", flush=True)
        ranked = search(case, floor_ms, deadline, candidates)
        if ranked:
            winners[v] = (ranked[0][1], ranked[0][0], floor_ms)
            print("  best: " + "; ".join(f"{ms:.3f} ms {fmt(c)}" for ms, c in ranked[:3]))
        del case
        if not SMOKE:
            torch.cuda.empty_cache()

    print("\nLAUNCH_TABLE rows to paste into fused_kernels/cross_entropy.py (replacing the last three):")
    for v, bound in vocabs.items():
        if v in winners:
            cfg, ms, floor_ms = winners[v]
            bound_s = "math.inf" if bound == math.inf else str(bound)
            print(f"    ({bound_s}, {fmt(cfg)}),  # V={v}: {ms:.3f} ms, {floor_ms / ms:.0%} of floor")
    # The functional entry with the winners in place (eager autograd.Function, host checks included).
    table = dict(ce_cfg.LAUNCH_TABLE)
    for v, bound in vocabs.items():
        if v in winners:
            table[bound] = winners[v][0]
    ce_cfg.LAUNCH_TABLE = tuple(sorted(table.items()))
    liger = liger_ce()
    print("\nfunctional forward / backward with the winners (do_bench medians, ms):")
    for v in vocabs:
        case = Case(args.rows, v)
        floor_ms = 2 * case.x.numel() * 2 / bw * 1e3
        print(f" V = {v}")
        time_functional("ours", lambda x, t: fused_kernels.cross_entropy(x, t), case.x, case.target, floor_ms)
        if liger is not None:
            time_functional("liger", liger, case.x, case.target, floor_ms)
        del case
        if not SMOKE:
            torch.cuda.empty_cache()
    if not args.no_flce:
        flce_section(*flce_args)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
