"""Long context on one GPU: the longest sequence a training step holds, per peer, found by bisection.

    python benchmarks/bench_long_context.py --out benchmarks/results/<gpu>-long-context.json
    python benchmarks/bench_long_context.py --merge run1.json run2.json --out merged.json --plot longest.png

At batch 1, a step is forward, backward and optimizer step on random token ids (labels = ids). Models
(random weights from a config; nothing is downloaded), bf16, sdpa attention, gradient checkpointing on
for every peer (HF's own, non-reentrant), built the way users build (`with torch.device("cuda")`):
  llama3.1_8b_lora   Llama-3.1-8B shape (32 layers, hidden 4096, 14336, 32/8 heads, vocab 128256), bf16
                     base frozen, LoRA r=16 on every linear layer (peft), AdamW over the adapters
  llama3.2_3b_full   Llama-3.2-3B shape (28 layers, hidden 3072, 8192, 24/8 heads, vocab 128256, tied),
                     every parameter trained with AdamW
  tiny_llama         2 layers of hidden 64: the CPU dry run
Peers: hf (plain transformers), liger (apply_liger_kernel_to_llama: rope, rms_norm, swiglu,
fused_linear_cross_entropy), ours (FUSED_KERNELS=all through the import hooks, as a user runs it), and
ours with what lets it go further, set in the trial's environment as a user sets it:
  ours_offload        + AUTOPATCH_OFFLOAD=<--offload, default auto> (saved activations in host memory)
  ours_tiled          + AUTOPATCH_TILED_MLP_TOKENS=<--tiled-mlp-tokens, default 8192> (the tiled MLP)
  ours_offload_tiled  both
  ours_offload_tiled_qblocks  both, and causal attention in query blocks (AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS=
                     <--query-block-tokens, default 8192>: flash's backward buffers per block, not per sequence)

Each trial (model, peer, length) runs in a fresh process; an out-of-memory step is a failed trial.
The search doubles the length from --start until a trial fails, then bisects to --granularity.

Depth cut (--layers K, fewer than the model's): a full-depth step at long lengths can outrun the
device's per-command limit, so a trial measures the peak of the model cut to K (at least 3) and to K+1 layers at
that length; the per-layer increment (weights, gradients, optimizer state and the layer's saved
activations at that length) times the layers left out is added: the reported peak of a cut trial is
that estimate, and the trial fits when it is under the GPU's memory. With host offload the bytes sent
to the host are extrapolated the same way; what would pass the host's cap (MemAvailable less the
offloader's margin, where the offloader keeps tensors on the GPU) is added to the GPU estimate. `cut_layers` says so in the JSON;
--cross-check L runs length L both ways (full depth and cut).

Per trial, after a warm-up step of 4096 tokens with the same optimizer (so that AdamW's moments are
resident through the measured step, as in every step of a run after its first; trials recorded without
`adamw_moments_resident` had a fresh optimizer per step, which makes them only at its step): peak GPU
memory (torch.cuda.max_memory_allocated after reset_peak_memory_stats), peak host memory (ru_maxrss),
the step's wall time, tokens/s, and what the step sent to the host (trials before
`adamw_moments_resident` counted the warm-up's too: their host estimate is up to ~1 GiB high). --steps-at-length
2 times the second step at the length (the first also makes the offload's exact-size host buffers: page
faults and cudaHostRegister of every byte). The JSON lists every trial and, per model and peer, the
longest length that fit; --table prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from bench_e2e import run_json_worker  # noqa: E402  (one fresh process per trial, killed whole at timeout)

MODELS = {
    "llama3.1_8b_lora": {
        "config": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 21,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
        "lora_r": 16,
    },
    "llama3.2_3b_full": {
        "config": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 21,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
        "lora_r": None,
    },
    "tiny_llama": {
        "config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=1 << 16,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
        "lora_r": 4,
    },
}
MIN_CUT = 3  # the shallowest depth cut that holds a full depth's steady state (see main())
WARMUP_TOKENS = 4096  # a short step before the measured one (Triton compiles, cuBLAS picks its kernels)
PEERS = ("hf", "liger", "ours", "ours_offload", "ours_tiled", "ours_offload_tiled", "ours_offload_tiled_qblocks")
# peer -> the variables its trial runs under (values from --offload / --tiled-mlp-tokens)
PEER_VARIABLES = {
    "ours_offload": ("AUTOPATCH_OFFLOAD",),
    "ours_tiled": ("AUTOPATCH_TILED_MLP_TOKENS",),
    "ours_offload_tiled": ("AUTOPATCH_OFFLOAD", "AUTOPATCH_TILED_MLP_TOKENS"),
    "ours_offload_tiled_qblocks": ("AUTOPATCH_OFFLOAD", "AUTOPATCH_TILED_MLP_TOKENS",
                                   "AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS"),
}
LIGER_TOGGLES = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


# ----------------------------------------------------------------------------------------------------
# One trial: one model (at some depth), one peer, one length, in its own process
# ----------------------------------------------------------------------------------------------------


def build(model_key: str, peer: str, layers: int | None, device, torch):
    """The model as `peer` trains it: Liger's class patches before it is built; ours from the import
    hooks (FUSED_KERNELS=all in the worker's environment), started here when not installed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = MODELS[model_key]
    if peer == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(**LIGER_TOGGLES)
    elif peer.startswith("ours") and "autopatch._startup" not in sys.modules:
        import autopatch

        autopatch.enable()
    config = dict(spec["config"])
    if layers:
        config["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model("llama", **config)
    cfg.use_cache = False
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "offload" in peer:
        # as start-up does for every model built under AUTOPATCH_OFFLOAD (once per model)
        from autopatch import offload, session

        offload.install(model, session.current(), session.current().settings)
    if spec["lora_r"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"],
                                                 target_modules="all-linear", lora_dropout=0.0))
    return model.train()


def make_optimizer(model, device, torch):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")


def one_step(model, seq: int, device, torch, opt) -> dict:
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = float(loss)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = {"loss": value, "step_s": seconds, "tokens_per_s": seq / seconds}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["capacity_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return out


def cap_memory(gib: float, device, torch) -> None:
    """Make the allocator fail past `gib` (torch.cuda.set_per_process_memory_fraction): a smaller card of
    the same architecture played on a larger one (an H100's 79.2 GiB on an H200); the trial judges fits
    against `gib` too."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def _offloader(model):
    """The offloader build() installed (on the base model, under peft's wrappers)."""
    from autopatch.offload import offloader_of

    return next(filter(None, map(offloader_of, model.modules())), None)


def _host_room() -> int:
    from autopatch import offload  # the offload peers only: the others' processes stay free of autopatch

    return offload.host_room() or 0


def _add_host_estimate(res: dict, steps: list, layers: int, full: int, cap: int) -> None:
    """Host offload at full depth: the bytes sent to the host grow by one layer's checkpoint per layer
    (from the cut at K and K + 1). The offloader never asks the host for more than `cap`, MemAvailable
    less its margin taken before the trial's first step (after it, the process's own cached pinned
    buffers count as used); past that, tensors stay on the GPU: that overflow is added to the GPU estimate."""
    # in page-locked host memory as the offloader counts it against the cap (offload.host_copy_bytes)
    sent = [step["offload"].get("pinned_bytes", step["offload"]["offloaded_bytes"]) for step in steps]
    need = sent[0] + (full - layers) * (sent[1] - sent[0])
    overflow = max(need - cap, 0)
    res.update(host_offload_gib=need / 2**30, host_cap_gib=cap / 2**30, host_overflow_gib=overflow / 2**30,
               peak_gib=res["peak_gib"] + overflow / 2**30)


def trial(model_key: str, peer: str, seq: int, layers: int | None, device_name: str,
          capacity_gib: float | None = None, steps_at_length: int = 1) -> dict:
    """Peak memory and time of a step at `seq` as a training run's second and later steps take it: one
    optimizer per model, its AdamW moments made by the warm-up step, so that they are resident through
    the measured step's forward and backward (a fresh optimizer would make them only at its step, after
    the activations are gone, and a first step's peak would leave them out). `steps_at_length` steps
    at `seq`: the time is the last one's (the first at a length also pays for what is made once per
    length: the offload's host buffers, the allocator's blocks), the peak the highest. With `layers` (a
    cut), the full depth's peak estimated from the cut at `layers` and `layers + 1` (see the module
    docstring)."""
    import torch

    host_cap = _host_room() if "offload" in peer else 0  # before this process pins any host memory
    device = torch.device(device_name)
    if capacity_gib and device.type == "cuda":
        cap_memory(capacity_gib, device, torch)
    full = MODELS[model_key]["config"]["num_hidden_layers"]
    res = {"model": model_key, "peer": peer, "seq": seq, "status": "ok"}
    if device.type == "cuda":  # per trial: a merged file may hold trials of two cards
        res["gpu"] = torch.cuda.get_device_name(device)
    depths = [layers, layers + 1] if layers and layers < full else [None]
    steps = []
    for depth in depths:
        torch.manual_seed(0)
        model = build(model_key, peer, depth, device, torch)
        opt = make_optimizer(model, device, torch)
        # compiles the kernels (the measured step's time is a step's) and makes the optimizer's moments
        one_step(model, min(seq, WARMUP_TOKENS), device, torch, opt)
        offloader = _offloader(model) if "offload" in peer else None
        runs = []
        for _ in range(max(1, steps_at_length)):
            before = dict(offloader.stats) if offloader is not None else {}
            runs.append(one_step(model, seq, device, torch, opt))
        steps.append(dict(runs[-1], steps_s=[r["step_s"] for r in runs]))
        if "peak_gib" in runs[0]:
            steps[-1]["peak_gib"] = max(r["peak_gib"] for r in runs)
        if offloader is not None:  # what the last step sent to the host (its stats count from the start), or why nothing
            steps[-1]["offload"] = dict({k: v - before[k] for k, v in offloader.stats.items()},
                                        off_reason=offloader.off_reason)
        del model, offloader, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res.update(steps[0], adamw_moments_resident=True)
    if capacity_gib and "capacity_gib" in res:
        res["capacity_gib"] = capacity_gib
    if len(steps) == 2 and "peak_gib" in steps[0]:
        per_layer = steps[1]["peak_gib"] - steps[0]["peak_gib"]
        res.update(cut_layers=layers, full_layers=full, per_layer_gib=per_layer,
                   measured_peak_gib=steps[0]["peak_gib"],
                   peak_gib=steps[0]["peak_gib"] + (full - layers) * per_layer)
        if "offload" in steps[0] and "offload" in steps[1]:
            _add_host_estimate(res, steps, layers, full, host_cap)
    if "peak_gib" in res and res["peak_gib"] > res["capacity_gib"]:
        res["status"] = "oom"
        res["error"] = f"estimated full-depth peak {res['peak_gib']:.1f} GiB > {res['capacity_gib']:.1f} GiB"
    res["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if peer.startswith("ours"):  # what the trial's autopatch read from its environment
        from autopatch import session

        settings = session.current().settings
        res["settings"] = {k: getattr(settings, k, None) for k in ("offload", "tiled_mlp_tokens", "attention_query_block_tokens")}
    return res


# ----------------------------------------------------------------------------------------------------
# The search, in the driver
# ----------------------------------------------------------------------------------------------------


def run_trial(model_key, peer, seq, args) -> dict:
    values = {"AUTOPATCH_OFFLOAD": getattr(args, "offload", "auto"),
              "AUTOPATCH_TILED_MLP_TOKENS": str(getattr(args, "tiled_mlp_tokens", 8192)),
              "AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS": str(getattr(args, "query_block_tokens", 8192))}
    variables = [f"{name}={values[name]}" for name in PEER_VARIABLES.get(peer, ())]
    # env(1) sets the peer's variables for the trial's own interpreter (the worker's environment
    # carries none of ours), so autopatch's start-up reads them as it reads a user's
    cmd = (["env", *variables] if variables else []) + [
        sys.executable, os.path.abspath(__file__), "--trial", "--model", model_key, "--peer", peer,
        "--seq", str(seq), "--device", args.device]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if getattr(args, "capacity_gib", None):
        cmd += ["--capacity-gib", str(args.capacity_gib)]
    if getattr(args, "steps_at_length", 1) > 1:
        cmd += ["--steps-at-length", str(args.steps_at_length)]
    res = run_json_worker(cmd, {"model": model_key, "peer": peer, "seq": seq}, args.trial_timeout_s,
                          fused_kernels="all" if peer.startswith("ours") else None)
    print(f"[long-context] {model_key} {peer} {seq}: {res.get('status')} "
          f"{res.get('peak_gib', float('nan')):.1f} GiB {res.get('step_s', float('nan')):.1f} s", flush=True)
    return res


def cross_check(model_key, peer, seq, args) -> dict:
    """Length `seq` at full depth and cut to --layers: the measured peak against the cut's estimate."""
    full = run_trial(model_key, peer, seq, argparse.Namespace(**{**vars(args), "layers": None}))
    cut = run_trial(model_key, peer, seq, args)
    out = {"model": model_key, "peer": peer, "seq": seq, "full": full, "cut": cut}
    if "peak_gib" in full and "peak_gib" in cut:
        out["estimate_over_measured"] = cut["peak_gib"] / full["peak_gib"]
    print(f"[long-context] cross-check {model_key} {peer} {seq}: full {full.get('peak_gib', float('nan')):.2f} GiB, "
          f"cut estimate {cut.get('peak_gib', float('nan')):.2f} GiB", flush=True)
    return out


def longest(model_key, peer, args, trials: list, saved=lambda: None) -> int:
    """The longest length that fit, by doubling from --start, then bisection to --granularity;
    `saved()` after each trial (a time box that kills the search keeps what was measured)."""
    fits = lambda r: r.get("status") == "ok"  # noqa: E731
    good, bad, seq = 0, None, args.start
    while seq <= args.max_seq:
        res = run_trial(model_key, peer, seq, args)
        trials.append(res)
        saved()
        if not fits(res):
            bad = seq
            break
        good, seq = seq, seq * 2
    if bad is None:
        return good
    while bad - good > args.granularity:
        mid = (good + bad) // 2 // args.granularity * args.granularity
        if mid in (good, bad):
            break
        res = run_trial(model_key, peer, mid, args)
        trials.append(res)
        saved()
        good, bad = (mid, bad) if fits(res) else (good, mid)
    return good


def longest_rows(trials: list[dict]) -> list[dict]:
    """Per model and peer, the longest length that fit and the shortest that failed above it (None: no
    longer length was tried), from the trials."""
    rows = {}
    for t in sorted(trials, key=lambda t: (t["model"], t["peer"], t["seq"])):
        model, peer, seq = t["model"], t["peer"], t["seq"]
        row = rows.setdefault((model, peer), {"model": model, "peer": peer, "longest": 0, "first_failed": None})
        if t.get("status") == "void":  # a trial found unsound afterwards (its void_reason says why): kept, not counted
            continue
        if t.get("status") == "ok":
            row["longest"] = max(row["longest"], seq)
        elif row["first_failed"] is None or seq < row["first_failed"]:
            row["first_failed"] = seq
    for row in rows.values():  # a length that fit above one that failed: the failure was not memory's
        if row["first_failed"] is not None and row["first_failed"] < row["longest"]:
            row["first_failed"] = None
    return list(rows.values())


MOMENTS_VOID = ("AdamW's moments were not resident through this step (a fresh optimizer per step made them at its "
                "optimizer step, after the activations were gone); superseded by this model and peer's trials with them")


def _void_without_moments(trials) -> None:
    """Where a model and peer have trials with AdamW's moments resident (`adamw_moments_resident`), its
    trials from before (a fresh optimizer per step: a first step's peak) are void, their status kept
    in `measured_status`: the two kinds differ by the moments (12 GiB for the 3B full fine-tune) and
    one bound must not mix them."""
    trials = list(trials)
    current = {(t["model"], t["peer"]) for t in trials if t.get("adamw_moments_resident")}
    for t in trials:
        if (t["model"], t["peer"]) in current and not t.get("adamw_moments_resident") and t["status"] != "void":
            t.update(measured_status=t["status"], status="void", void_reason=MOMENTS_VOID)


def merge(files: list[str]) -> dict:
    """Several runs' JSON as one: every trial (a later run's trial of the same model, peer and length
    replaces an earlier one; trials without AdamW's moments resident are void where their model and
    peer have some with them), the longest fit per model and peer recomputed from the trials."""
    trials: dict = {}
    checks: list = []
    environment = None
    for path in files:
        with open(path) as f:
            data = json.load(f)
        environment = environment or data["environment"]
        for t in data["trials"]:
            trials[(t["model"], t["peer"], t["seq"])] = t
        checks.extend(data.get("cross_checks", []))
    _void_without_moments(trials.values())
    return {"environment": environment, "trials": list(trials.values()),
            "longest": longest_rows(list(trials.values())), "cross_checks": checks}


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def tokens_label(n: int) -> str:
    """32768 -> "32K"; a length that is not a multiple of 1024 as it is (500000 -> "500,000")."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def cards(data: dict) -> str:
    """The GPUs the trials ran on and the memory they were held to (a merged file may hold two cards;
    an H200's trials capped to an H100's memory say so)."""
    trials = [t for t in data.get("trials", []) if t.get("gpu")]
    if not trials:
        return (data.get("environment") or {}).get("gpu", "")
    names = " and ".join(sorted({t["gpu"] for t in trials}))
    caps = {round(t["capacity_gib"], 1) for t in trials if "capacity_gib" in t}
    return f"{names}, each held to {caps.pop()} GiB" if len(caps) == 1 else names


def plot(data: dict, path: str) -> None:
    """Bars: the longest length that fit per peer, per model (log scale); an open bound drawn hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in data["longest"]})
    fig, axes = plt.subplots(len(models), 1, figsize=(7, 1.2 + 0.5 * len(data["longest"])), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        rows = [r for r in data["longest"] if r["model"] == model and r["longest"]]
        names = [r["peer"] for r in rows]
        bars = ax.barh(names, [r["longest"] for r in rows], color="#4c72b0")
        for bar, r in zip(bars, rows):
            open_bound = r.get("first_failed") is None
            if open_bound:
                bar.set_hatch("//")
            ax.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2,
                    f"{'≥' if open_bound else ''}{tokens_label(r['longest'])}", va="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlim(left=8192, right=max(r["longest"] for r in rows) * 4)
        ax.set_title(f"{model}: longest sequence a training step holds (batch 1)", fontsize=9)
    fig.suptitle(f"{cards(data)}; hatched: no longer length was tried", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(data: dict) -> str:
    lines = ["| model | peer | longest fit (tokens) | tokens/s there | peak GiB there | host peak GiB there "
             "| to host GiB (full depth) |", "|---|---|---|---|---|---|---|"]
    for row in data["longest"]:
        at = next((t for t in data["trials"] if t["model"] == row["model"] and t["peer"] == row["peer"]
                   and t["seq"] == row["longest"] and t.get("status") == "ok"), {})
        bound = "≥" if row.get("first_failed", 0) is None else ""
        lines.append(f"| {row['model']} | {row['peer']} | {bound}{row['longest']} | {at.get('tokens_per_s', 0):.0f} | "
                     f"{at.get('peak_gib', float('nan')):.1f} | {at.get('host_peak_gib', float('nan')):.1f} | "
                     f"{at.get('host_offload_gib', 0):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trial", action="store_true", help="internal: one trial, written to --result")
    ap.add_argument("--model", default=None, help=f"one of {', '.join(MODELS)} (trial)")
    ap.add_argument("--models", default="llama3.1_8b_lora,llama3.2_3b_full")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--peer", choices=PEERS)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--layers", type=int, default=None, help="depth cut (see the docstring)")
    ap.add_argument("--start", type=int, default=8192)
    ap.add_argument("--granularity", type=int, default=4096)
    ap.add_argument("--max-seq", type=int, default=1 << 20)
    ap.add_argument("--trial-timeout-s", type=float, default=300)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--capacity-gib", type=float, default=None,
                    help="judge fits against this many GiB and make the allocator fail past them (a 79.2 GiB "
                         "H100 played on an H200); the JSON's capacity_gib says it")
    ap.add_argument("--steps-at-length", type=int, default=1,
                    help="steps at each length; the time is the last one's (the first at a length also makes the "
                         "offload's host buffers): 2 for a training run's step time")
    ap.add_argument("--offload", default="auto", choices=("auto", "true"), help="AUTOPATCH_OFFLOAD of the offload peers")
    ap.add_argument("--tiled-mlp-tokens", type=int, default=8192, help="AUTOPATCH_TILED_MLP_TOKENS of the tiled peers")
    ap.add_argument("--query-block-tokens", type=int, default=8192,
                    help="AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS of the qblocks peer")
    ap.add_argument("--cross-check", type=int, default=None, metavar="L",
                    help="instead of the search: length L at full depth and cut to --layers, per model and peer")
    ap.add_argument("--result")
    ap.add_argument("--out")
    ap.add_argument("--table", help="print the table of a results JSON")
    ap.add_argument("--merge", nargs="+", help="results JSONs to merge into --out")
    ap.add_argument("--plot", help="with --table or --merge: draw the longest length per peer into this PNG")
    a = ap.parse_args(argv)
    if a.layers is not None and a.layers < MIN_CUT:
        ap.error(f"--layers {a.layers}: a cut needs at least {MIN_CUT} layers (with LoRA the first layer's input is "
                 "peft's embedding leaf, which stays on the GPU, so a 2-layer cut prefetches no checkpoint in the "
                 f"backward and the extrapolation adds one checkpoint per layer left out); use --layers {MIN_CUT}")
    if a.merge:
        data = merge(a.merge)
        if a.out:
            _write(a.out, data)
    elif a.table:
        with open(a.table) as f:
            data = json.load(f)
    if a.merge or a.table:
        print(table(data))
        if a.plot:
            plot(data, a.plot)
        return 0
    if a.trial:
        try:
            res = trial(a.model, a.peer, a.seq, a.layers, a.device, a.capacity_gib, a.steps_at_length)
        except BaseException as exc:  # recorded, not raised: the driver reads the file
            import torch

            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            res = {"model": a.model, "peer": a.peer, "seq": a.seq, "status": "oom" if oom else "error",
                   "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            if not oom:
                res["traceback"] = traceback.format_exc(limit=8)[-3000:]
        with open(a.result, "w") as f:
            json.dump(res, f, default=str)
        return 0
    from bench_common import environment

    import torch

    data = {"environment": environment(torch.device(a.device)), "layers_cut": a.layers, "trials": [], "longest": []}

    def saved() -> None:
        data["longest"] = longest_rows(data["trials"])
        if a.out:
            _write(a.out, data)

    if a.cross_check:
        data["cross_checks"] = []
        for model_key in a.models.split(","):
            for peer in a.peers.split(","):
                data["cross_checks"].append(cross_check(model_key, peer, a.cross_check, a))
                saved()
    else:
        for model_key in a.models.split(","):
            for peer in a.peers.split(","):
                longest(model_key, peer, a, data["trials"], saved)
    saved()
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
