"""Where a training step's GPU time and memory go (GPU only; a diagnosis, not a benchmark).

    python dev/step_diagnosis.py [--model llama3_8b_4layers] [--peers hf_eager,ours] [--out d.json]
    python dev/step_diagnosis.py --model gemma3_4b --peers liger,ours_env    (image-text: the benchmark's batches)

For each peer (one subprocess each; the models and peers of benchmarks/bench_e2e.py), after three warm-up
steps:
  - memory kept between steps: with the CUDA allocator's history recorded from the start, every block
    still allocated that is not a parameter or optimizer state, with the innermost Python frames
    outside torch that allocated it. What a patched run keeps beyond the plain one raises every peak.
    Then the tensors with autograd history that one more step leaves behind with the cyclic garbage
    collector off (a reference cycle holding activations shows here; 0 is right);
  - time: torch.profiler over two steps. CUDA kernel time by kind (GEMM, attention, fused, optimizer,
    other), and the step's wall time. GEMM + attention is the step's floor for any fused-kernel
    library that leaves those to cuBLAS and SDPA; wall minus kernel time is the GPU waiting for Python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def _our_frames(frames, keep: int = 4) -> list[str]:
    """The innermost `keep` Python frames outside torch (where our code or the model allocated), as
    file:line:function; for a block allocated from C++ alone (a cuBLAS workspace), its first C++ frames."""
    py = [f for f in frames if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]]
    chosen = py[:keep] if py else frames[:2]
    return [f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')}:{f.get('name')}" for f in chosen]


def worker(model_key: str, peer: str) -> dict:
    import torch

    import bench_e2e

    spec = bench_e2e.MODELS[model_key]
    device = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    torch.manual_seed(0)
    model, _info = bench_e2e.peer_model(spec, peer, device, torch)  # compiled peers: the whole model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    # the benchmark's own batches: token ids, and for image-text models the pixels and image placeholders
    batch = bench_e2e.make_batches(spec, device, torch, torch.Generator(device=device).manual_seed(1), count=1)[0]
    for _ in range(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    known = bench_e2e.param_and_state_addresses(model, opt) | {
        t.untyped_storage().data_ptr() for t in batch.values() if isinstance(t, torch.Tensor)}
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated" or b["address"] in known:
                continue
            blocks.append({"bytes": b["size"], "frames": _our_frames(b.get("frames", []))})
    blocks.sort(key=lambda b: -b["bytes"])
    res = {"model": model_key, "peer": peer, "allocated_gib": torch.cuda.memory_allocated() / 2**30,
           "unknown_bytes": sum(b["bytes"] for b in blocks), "unknown_blocks": len(blocks), "largest": blocks[:12],
           **{k: _info[k] for k in ("patched", "not_patched", "liger_applied", "started_by") if k in _info}}
    res.update(_profile_steps(model, opt, batch, torch))
    return res


def _graph_tensors_after_a_step(step, torch) -> int:
    """Tensors with autograd history still alive after one more step run with Python's cyclic garbage
    collector off: anything a reference cycle keeps from a finished step (the FLCE call's cycle kept
    the final hidden states this way). 0 is right; the step's own graph is gone once it returns."""
    import gc

    gc.collect()
    gc.disable()
    try:
        step()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)
    finally:
        gc.enable()


def _profile_steps(model, opt, batch, torch, steps: int = 2) -> dict:
    from bench_common import kernel_kind
    from bench_kernels import kernel_times

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    kernels = kernel_times(step, batch["input_ids"].device, [], calls=steps)  # name -> [µs per step, launches per step]
    by_kind: dict[str, float] = {}
    for name, (us, _n) in kernels.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + us / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    return {"graph_tensors_after_step": _graph_tensors_after_a_step(step, torch),
            "step_ms": start.elapsed_time(end) / steps,
            "kernel_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernel_ms_total": sum(by_kind.values()),
            "kernel_launches": sum(n for _us, n in kernels.values()),
            "top_kernels_ms": [(name[:90], us / 1e3, n) for name, (us, n) in top]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3_8b_4layers")
    ap.add_argument("--peers", default="hf_eager,ours")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", default="")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.worker)))
        return 0
    import bench_e2e

    results = []
    for peer in a.peers.split(","):
        env = bench_e2e.worker_env("all" if peer == "ours_env" else None)  # as bench_e2e runs each peer
        proc = subprocess.run([sys.executable, __file__, "--model", a.model, "--worker", peer],
                              capture_output=True, text=True, timeout=300, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            results.append({"peer": peer, "error": proc.stderr[-1500:]})
            print(f"{peer}: FAILED\n{proc.stderr[-1500:]}")
            continue
        r = json.loads(lines[-1])
        results.append(r)
        print(f"{a.model} / {peer}: allocated {r['allocated_gib']:.3f} GiB; beyond params and optimizer state: "
              f"{r['unknown_bytes'] / 2**20:.1f} MiB in {r['unknown_blocks']} blocks")
        for b in r["largest"]:
            print(f"    {b['bytes'] / 2**20:9.2f} MiB  {' <- '.join(b['frames'])}")
        print(f"  tensors with autograd history left by a step (gc off; 0 is right): {r['graph_tensors_after_step']}")
        print(f"  step {r['step_ms']:.1f} ms; CUDA kernels {r['kernel_ms_total']:.1f} ms in {r['kernel_launches']:.0f} "
              "launches: " + ", ".join(f"{k} {v:.1f}" for k, v in r["kernel_ms"].items()))
        for name, ms, n in r["top_kernels_ms"]:
            print(f"    {ms:8.2f} ms  x{n:<5.0f} {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
