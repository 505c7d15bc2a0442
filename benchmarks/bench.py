"""Benchmark: our fused kernels and patched models against their peers, on one GPU, in one run.

    python3 benchmarks/bench.py --out bench.json                       # kernels, then end-to-end
    BENCH_PARTS=kernels python3 benchmarks/bench.py --out bench.json   # or --parts kernels / e2e
    python3 benchmarks/bench.py --table bench.json                     # print the tables of a result file
    python3 benchmarks/bench.py --merge k.json e.json --out benchmarks/h200.json   # join two calls' results
    TRITON_INTERPRET=1 python3 benchmarks/bench.py --device cpu --tiny --out /tmp/b.json   # CPU dry run

Parts (each inside its own wall-clock budget; what the budget does not reach is recorded as skipped):
  kernels  bench_kernels.py: RMSNorm, RoPE, SwiGLU, cross entropy, fused linear CE; the README table's
           rows first, then the sweeps (RMSNorm hidden 1k-64k at fixed bytes, CE vocab 32k-256k,
           FLCE memory over tokens and vocab). Peers: HF eager, torch.compile, Liger-Kernel, Cut-CE, ours.
  e2e      bench_e2e.py: training-step tokens/s and peak memory, Qwen3-0.6B shape and Llama-3-8B shape cut
           to 4 layers; peers HF eager, torch.compile, Liger, ours, ours + torch.compile.
Ceilings (copy GB/s, bf16 matmul TFLOP/s) are measured first, in the same process.

The JSON (written again after every case, so a run cut short keeps what it measured) holds: meta (GPU,
versions, date, arguments), ceilings, kernels (per case: floor per mode, per peer and mode ms / peak MiB /
GB/s or TFLOP/s / fraction of ceiling / ratio to the best other peer, relative error vs HF eager), e2e.
Liger-Kernel and Cut-CE are optional, benchmark-only: carried as wheels to the GPU machine, never
dependencies of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root: fused_kernels, autopatch without install


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Benchmark fused kernels and patched models against peers.")
    ap.add_argument("--out", default="bench.json", help="result JSON path")
    ap.add_argument("--parts", default=os.environ.get("BENCH_PARTS", "kernels,e2e"),
                    help="comma list of kernels,e2e (env BENCH_PARTS)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run (needs TRITON_INTERPRET=1)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and the tiny model: checks the harness")
    ap.add_argument("--kernel-budget-s", type=float, default=float(os.environ.get("BENCH_KERNEL_BUDGET_S", 240)))
    ap.add_argument("--e2e-budget-s", type=float, default=float(os.environ.get("BENCH_E2E_BUDGET_S", 200)))
    ap.add_argument("--e2e-run-cap-s", type=float, default=float(os.environ.get("BENCH_E2E_RUN_CAP_S", 240)),
                    help="longest one model/peer run may take (env BENCH_E2E_RUN_CAP_S)")
    ap.add_argument("--only", default=os.environ.get("BENCH_ONLY", ""),
                    help="comma list of substrings: kernel cases whose name contains one (e.g. 'rms_norm,flce')")
    ap.add_argument("--modes", default=os.environ.get("BENCH_MODES", ""),
                    help="comma list of fwd,bwd,fwdbwd to measure per kernel case (default all; env BENCH_MODES)")
    ap.add_argument("--peers", default=os.environ.get("BENCH_PEERS", ""),
                    help="comma list of kernel peers to run (hf_eager always runs: it is the reference)")
    ap.add_argument("--e2e-models", default=os.environ.get("BENCH_E2E_MODELS", ""), help="comma list")
    ap.add_argument("--e2e-peers", default=os.environ.get("BENCH_E2E_PEERS", ""), help="comma list")
    ap.add_argument("--e2e-steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    ap.add_argument("--e2e-warmup", type=int, default=None, help="warm-up steps (default 3; 1 with --tiny)")
    ap.add_argument("--compile-mode", choices=("model", "layers"), default=os.environ.get("BENCH_COMPILE_MODE", "model"),
                    help="e2e torch.compile peers: the whole model, or each decoder layer (compiles faster)")
    ap.add_argument("--cpu-compile", action="store_true", help="also run the torch.compile peer on the CPU dry run")
    ap.add_argument("--table", metavar="JSON", help="print the tables of an existing result file and exit")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="merge result files of separate calls (e.g. one with kernels, one with e2e) into --out")
    a = ap.parse_args(argv)

    def split(s):
        return [x.strip() for x in s.split(",") if x.strip()]

    a.parts = split(a.parts)
    bad = set(a.parts) - {"kernels", "e2e"}
    if bad:
        ap.error(f"--parts: unknown part(s) {sorted(bad)}; valid: kernels, e2e")
    a.only, a.peers, a.modes = split(a.only), split(a.peers), split(a.modes)
    bad = set(a.modes) - {"fwd", "bwd", "fwdbwd"}
    if bad:
        ap.error(f"--modes: unknown mode(s) {sorted(bad)}; valid: fwd, bwd, fwdbwd")
    if a.e2e_steps is None:
        a.e2e_steps = 2 if a.tiny else 10
    if a.e2e_warmup is None:
        a.e2e_warmup = 1 if a.tiny else 3
    a.e2e_models, a.e2e_peers = split(a.e2e_models), split(a.e2e_peers)
    return a


# ----------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------

KERNEL_PEER_ORDER = ("hf_eager", "torch_compile", "liger", "cutce", "cutce_exact", "ours", "host_floor")


def _cell(r: dict, mode: str) -> str:
    if not r:
        return "-"
    if r.get("status") != "ok":
        return (r.get("status") or "err")[:7]
    m = r.get("modes", {}).get(mode, {})
    if "ms" not in m:
        return "err" if "error" in m else "-"
    mib = m.get("peak_mib")
    return f"{m['ms']:.3f}" + (f"/{mib:.0f}" if mib is not None else "")


def _gpu_cell(r, mode):
    if not r or r.get("status") != "ok":
        return "-"
    g = r.get("modes", {}).get(mode, {}).get("gpu_ms")
    return "-" if g is None else f"{g:.3f}"


def format_tables(data: dict, mode: str = "fwdbwd") -> str:
    lines = []
    meta, ceil = data.get("meta", {}), data.get("ceilings", {})
    lines.append(f"GPU {meta.get('gpu')} | torch {meta.get('torch')} | triton {meta.get('triton')} | "
                 f"transformers {meta.get('transformers')} | liger {meta.get('liger_kernel')} | "
                 f"cut-ce {meta.get('cut_cross_entropy')} | {meta.get('date_utc')}")
    if ceil.get("copy_gbps"):
        lines.append(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s")
    kernels = data.get("kernels") or []
    if kernels:
        peers = [p for p in KERNEL_PEER_ORDER if any(p in k.get("peers", {}) for k in kernels)]
        lines.append(f"\nkernels, {mode}: ms/peak MiB beyond inputs+grads; ours/best = our time over the best peer's")
        head = f"{'case':36s} {'floor':>7s} " + " ".join(f"{p[:14]:>14s}" for p in peers) + f" {'ours/best':>9s} {'%ceil':>6s}"
        lines.append(head)
        for k in kernels:
            if "skipped" in k:
                lines.append(f"{k['case'][:36]:36s} skipped: {k['skipped']}")
                continue
            if mode not in k.get("modes", []):
                continue
            floor = k.get("floor", {}).get(mode, {}).get("ms")
            floor_s = "-" if floor is None else f"{floor:.3f}"
            row = f"{k['case'][:36]:36s} {floor_s:>7s} "
            row += " ".join(f"{_cell(k['peers'].get(p), mode):>14s}" for p in peers)
            best = k.get("best", {}).get(mode, {})
            ratio = best.get("ours_ratio")
            ours = k["peers"].get("ours", {}).get("modes", {}).get(mode, {})
            frac = ours.get("frac_ceiling")
            row += f" {'-' if ratio is None else f'{ratio:.2f}':>9s} {'-' if frac is None else f'{100 * frac:.0f}%':>6s}"
            lines.append(row)
        if any("gpu_ms" in (p.get("modes", {}).get(mode, {})) for k in kernels for p in k.get("peers", {}).values()):
            lines.append(f"\nkernels, {mode}, GPU time only (kernel durations summed; no launch gaps): ms")
            lines.append(f"{'case':36s} {'floor':>7s} " + " ".join(f"{p[:14]:>14s}" for p in peers) + f" {'%ceil':>6s}")
            for k in kernels:
                if "skipped" in k or mode not in k.get("modes", []):
                    continue
                floor = k.get("floor", {}).get(mode, {}).get("ms")
                row = f"{k['case'][:36]:36s} {'-' if floor is None else f'{floor:.3f}':>7s} "
                row += " ".join(f"{_gpu_cell(k['peers'].get(p), mode):>14s}" for p in peers)
                frac = k["peers"].get("ours", {}).get("modes", {}).get(mode, {}).get("gpu_frac_ceiling")
                row += f" {'-' if frac is None else f'{100 * frac:.0f}%':>6s}"
                lines.append(row)
    e2e = data.get("e2e") or []
    if e2e:
        lines.append("\nend to end (training step): k tok/s, peak GiB; speed-up vs HF eager")
        for r in e2e:
            name = f"{r.get('model')} / {r.get('peer')}"
            if r.get("status") == "ok":
                lines.append(f"  {name:40s} {r['tokens_per_s'] / 1e3:7.1f}k tok/s  {r.get('peak_gib', float('nan')):6.1f} GiB"
                             f"  x{r.get('speedup_vs_hf_eager', float('nan')):.2f}  loss0 {r.get('loss_first', float('nan')):.4f}")
            else:
                lines.append(f"  {name:40s} {r.get('status')}: {str(r.get('error', ''))[:90]}")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """One result from several calls: kernel cases and e2e runs from each file (a later file's entry
    replaces an earlier one of the same case or model/peer), ceilings and meta from the first file with
    kernels, every file's meta kept under meta.sources."""
    out: dict = {"meta": {}, "ceilings": {}, "kernels": [], "e2e": []}
    kernels: dict = {}
    e2e: dict = {}
    sources = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        sources.append(dict(d.get("meta", {}), file=os.path.basename(path)))
        if d.get("kernels") and not out["ceilings"]:
            out["ceilings"] = d.get("ceilings", {})
            out["meta"] = dict(d.get("meta", {}))
        for k in d.get("kernels") or []:
            kernels[k["case"]] = k
        for r in d.get("e2e") or []:
            e2e[(r.get("model"), r.get("peer"))] = r
    if not out["meta"] and sources:
        out["meta"] = dict(sources[0])
    out["meta"]["sources"] = sources
    out["kernels"] = list(kernels.values())
    out["e2e"] = list(e2e.values())
    return out


# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.merge:
        from bench_common import write_json

        data = merge(a.merge)
        write_json(a.out, data)
        print(format_tables(data))
        return 0
    if a.table:
        with open(a.table) as f:
            data = json.load(f)
        print(format_tables(data, "fwdbwd"))
        return 0

    import torch

    from bench_common import Deadline, environment, measure_ceilings, write_json

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.py: no CUDA device; for a CPU dry run pass --device cpu --tiny with TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench.py: TRITON_INTERPRET is on; unset it (or set 0) to time real kernels", file=sys.stderr)
        return 2
    if device.type == "cpu" and not a.tiny:
        print("bench.py: --device cpu only runs with --tiny (the interpreter takes ~1 ms per program)",
              file=sys.stderr)
        return 2

    t0 = time.monotonic()
    data = {"meta": environment(device), "ceilings": {}, "kernels": [], "e2e": []}
    data["meta"]["args"] = {k: v for k, v in vars(a).items() if k != "table"}

    def save(*_):
        data["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_json(a.out, data)

    print(f"[bench] {data['meta'].get('gpu') or device} parts={','.join(a.parts)}", flush=True)
    if "kernels" in a.parts:
        from bench_kernels import run_kernels

        deadline = Deadline(a.kernel_budget_s)
        data["ceilings"] = measure_ceilings(device)
        c = data["ceilings"]
        if c.get("copy_gbps"):
            print(f"[bench] ceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s",
                  flush=True)
        save()

        def on_case(results):
            data["kernels"] = results
            save()

        data["kernels"] = run_kernels(device, data["ceilings"], deadline, a.tiny, only=a.only, peers=a.peers,
                                      on_case_done=on_case, cpu_compile=a.cpu_compile, modes=a.modes)
        save()
        print(f"[bench] kernels done in {a.kernel_budget_s - deadline.left():.0f} s", flush=True)
    if "e2e" in a.parts:
        from bench_e2e import run_e2e

        deadline = Deadline(a.e2e_budget_s)

        def on_e2e(results):
            data["e2e"] = results
            save()

        data["e2e"] = run_e2e(a, deadline, on_done=on_e2e)
        save()
        print(f"[bench] e2e done in {a.e2e_budget_s - deadline.left():.0f} s", flush=True)
    print()
    print(format_tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
