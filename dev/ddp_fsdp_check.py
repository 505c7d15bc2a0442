"""One rank of a data-parallel training run of a small Llama-shaped model, for comparing the loss curve
of a plain run with one patched by the environment alone (FUSED_KERNELS=all and the start-up hook in
every rank). Nothing here imports autopatch: whether the ranks are patched is decided by how they are
started (see dev/two_gpu_check.sh and README "Using it with your stack").

    torchrun --nproc-per-node 2 dev/ddp_fsdp_check.py --parallel ddp  --out plain_ddp.json
    FUSED_KERNELS=all python -m autopatch run -m torch.distributed.run --nproc-per-node 2 \\
        dev/ddp_fsdp_check.py --parallel ddp --out patched_ddp.json
    python dev/ddp_fsdp_check.py --compare plain_ddp.json patched_ddp.json      # no torchrun

--parallel ddp        fp32 parameters in DistributedDataParallel; bf16 autocast (--dtype bf16)
--parallel fsdp       FSDP2: fully_shard on every decoder layer, then on the whole model (the root group
                      holds embed_tokens and lm_head: lm_head's weight is sharded at rest and gathered
                      for the forward); MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
--shard-lm-head       (fsdp) lm_head gets its own fully_shard unit as well: FSDP's hooks on it make the
                      fused linear CE step aside (lm_head and the loss run as the model defines them)

Every rank trains on its own stream of synthetic, learnable sequences (token t is followed by perm[t],
a fixed random permutation; the first tokens of each row are ignored: -100), AdamW with a linear
warm-up (--warmup) and cosine decay, gradient clipping at 1.0. Rank 0 writes JSON: the all-reduced mean
loss and the gradient norm per step, a fingerprint of
the final parameters, and per rank the Triton launches (fused_kernels.launch_counts()) and what
autopatch patched, or nothing when autopatch was not loaded. --device cpu runs the same on gloo (the
kernels then need TRITON_INTERPRET=1; tests/test_stack_launchers.py does that with --size tiny).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

# Multicast / NVLS stay off on the lent machines (see the device notes); set before torch loads NCCL.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = {
    # ~120M parameters, vocab 32000: the lm_head + loss is what the fused linear CE replaces
    "small": dict(model=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024),
                  batch=4, seq=512, data_vocab=4096),
    # for the CPU test (kernels in Triton's interpreter)
    "tiny": dict(model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
                 batch=1, seq=8, data_vocab=64),
}


def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    """The lr factor at `step`: linear warm-up, then cosine decay to 0 at `steps` (also the schedule of
    tests/test_stack_gpu.py)."""
    return min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def lr_schedule(optimizer, warmup: int, steps: int):
    """warmup_cosine as a scheduler: with a constant lr from step 0 the loss spiked near steps 17-23 and
    amplified rounding differences by orders of magnitude."""
    warmup = max(1, min(warmup, steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, steps))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--shard-lm-head", action="store_true", help="(fsdp) a fully_shard unit of its own for lm_head")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps before the cosine decay")
    p.add_argument("--max-seconds", type=float, default=240.0, help="stop training after this long (all ranks agree)")
    p.add_argument("--perturb", type=float, default=0.0,
                   help="multiply every initial weight by (1 + perturb * N(0, 1)), fixed noise (the control run)")
    p.add_argument("--out", help="JSON written by rank 0")
    p.add_argument("--compare", nargs=2, metavar=("PLAIN", "PATCHED"), help="compare two JSON results and exit")
    p.add_argument("--rtol", type=float, default=None, help="--compare: per-step loss tolerance |a-b| <= atol + rtol*|a| "
                   "(default: bf16 1e-2, fp32 1e-4)")
    p.add_argument("--atol", type=float, default=None, help="--compare: (default: bf16 1e-2, fp32 1e-4)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- training
def make_batch(perm: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    rows = torch.empty(batch, seq, dtype=torch.long)
    rows[:, 0] = torch.randint(0, perm.numel(), (batch,), generator=generator)
    for t in range(1, seq):
        rows[:, t] = perm[rows[:, t - 1]]
    labels = rows.clone()
    ignored = torch.randint(0, max(2, seq // 8), (batch,), generator=generator)
    for r in range(batch):
        labels[r, : int(ignored[r])] = -100
    return rows, labels


def build_model(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size]["model"], tie_word_embeddings=False, rms_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    return LlamaForCausalLM(config)


def wrap(model, args, device):
    if args.parallel == "ddp":
        model = model.to(device)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = model.to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    if args.shard_lm_head:
        fully_shard(model.lm_head, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fingerprint(model) -> dict:
    """Per parameter: its norm and its projection on a fixed random unit direction (float64), so two
    runs' final weights can be compared without shipping them."""
    out = {}
    for name, p in model.named_parameters():
        w = full(p.detach()).double().flatten().cpu()
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        r = torch.randn(w.numel(), generator=g, dtype=torch.float64)
        out[name] = [w.norm().item(), (w @ r).item() / math.sqrt(w.numel())]
    return out


def rank_report() -> dict:
    fused = sys.modules.get("fused_kernels")
    autopatch = sys.modules.get("autopatch")
    patched = sorted({f"{r.kernel}:{r.target}" for r in autopatch.applied() if r.patched}) if autopatch else []
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "autopatch_loaded": autopatch is not None,
        "patched": patched,
        "launches": dict(fused.launch_counts()) if fused is not None else {},
        "fused_kernels_env": os.environ.get("FUSED_KERNELS"),
    }


def train(args) -> int:
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:  # started without a launcher (or by one that starts a single process)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    size = SIZES[args.size]

    model = build_model(args.size)
    if args.perturb:
        # The control: the same plain training from weights moved by `perturb` (relative, fixed noise).
        # How far that moves the loss curve is the training's own sensitivity, the floor under which
        # no comparison of two runs can say anything.
        noise = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.0 + args.perturb * torch.randn(param.shape, generator=noise))
    train_model, inner = wrap(model, args, device)
    train_model.train()
    optimizer = torch.optim.AdamW(train_model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = lr_schedule(optimizer, args.warmup, args.steps)
    perm = torch.randperm(size["data_vocab"], generator=torch.Generator().manual_seed(1234))
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the stream
    autocast = args.parallel == "ddp" and args.dtype == "bf16"

    losses, grad_norms = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        ids, labels = (t.to(device) for t in make_batch(perm, size["batch"], size["seq"], data))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = train_model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(train_model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        stats = torch.stack([out.loss.detach().float(), full(norm).detach().float()])
        dist.all_reduce(stats)
        stats = (stats / world).tolist()
        losses.append(stats[0])
        grad_norms.append(stats[1])
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"[{args.parallel}] step {step:3d} loss {stats[0]:.5f} grad-norm {stats[1]:.4f}", flush=True)
        # stop early, all ranks together, when the time box is near
        over = torch.tensor([time.perf_counter() - start > args.max_seconds], dtype=torch.int32, device=device)
        dist.all_reduce(over)
        if over.item():
            if rank == 0:
                print(f"[{args.parallel}] time box {args.max_seconds} s reached after {step + 1} steps", flush=True)
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    prints = fingerprint(inner)
    reports = [None] * world
    dist.all_gather_object(reports, rank_report())
    if rank == 0 and args.out:
        import transformers

        result = {
            "parallel": args.parallel, "shard_lm_head": args.shard_lm_head, "dtype": args.dtype,
            "size": args.size, "world_size": world, "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "triton": _version("triton"), "python": sys.version.split()[0]},
            "steps_requested": args.steps, "steps": len(losses), "train_seconds": elapsed,
            "losses": losses, "grad_norms": grad_norms, "fingerprint": prints, "ranks": reports,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[{args.parallel}] {len(losses)} steps in {elapsed:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"wrote {args.out}", flush=True)
    # Every rank waits for rank 0's report before any tears its group down (the exit abort is handled by
    # exit_without_finalization, not by this barrier).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(math.isfinite(x) for x in losses) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _version(dist_name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------- compare
def compare(plain_path: str, patched_path: str, rtol=None, atol=None) -> dict:
    """Per-step loss agreement and how each run was patched; `ok` says whether it all holds."""
    with open(plain_path) as f:
        plain = json.load(f)
    with open(patched_path) as f:
        patched = json.load(f)
    bf16 = plain["dtype"] == "bf16"
    rtol = (1e-2 if bf16 else 1e-4) if rtol is None else rtol
    atol = (1e-2 if bf16 else 1e-4) if atol is None else atol
    n = min(len(plain["losses"]), len(patched["losses"]))
    diffs = [abs(a - b) for a, b in zip(plain["losses"][:n], patched["losses"][:n])]
    bad_steps = [i for i, (a, d) in enumerate(zip(plain["losses"], diffs)) if not d <= atol + rtol * abs(a)]
    gdiffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain["grad_norms"][:n], patched["grad_norms"][:n])]
    fp_rel = {}
    for name, (norm, proj) in plain["fingerprint"].items():
        other = patched["fingerprint"].get(name)
        if other is not None:
            fp_rel[name] = max(abs(norm - other[0]) / max(norm, 1e-12), abs(proj - other[1]) / max(norm, 1e-12))
    flce = "fused_linear_cross_entropy_fwd"
    patched_ranks = [r for r in patched["ranks"] if r["patched"] and r["launches"]]
    problems = []
    if n < plain["steps_requested"] or n < patched["steps_requested"]:
        problems.append(f"only {n} of {plain['steps_requested']} steps ran (time box)")
    if bad_steps:
        problems.append(f"loss differs beyond atol {atol} + rtol {rtol} at steps {bad_steps[:10]}")
    if any(r["launches"] for r in plain["ranks"]):
        problems.append("the plain run launched fused kernels")
    if len(patched_ranks) != patched["world_size"]:
        problems.append(f"only {len(patched_ranks)} of {patched['world_size']} ranks were patched and ran kernels")
    if not all(math.isfinite(x) for x in plain["losses"] + patched["losses"]):
        problems.append("a loss is not finite")
    summary = {
        "run": f"{patched['parallel']}{' +shard-lm-head' if patched.get('shard_lm_head') else ''} {patched['dtype']}",
        "ok": not problems, "problems": problems, "steps": n,
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "max_rel_loss_diff": max(d / max(abs(a), 1e-12) for d, a in zip(diffs, plain["losses"])) if diffs else None,
        "max_rel_grad_norm_diff": max(gdiffs) if gdiffs else None,
        "max_rel_param_fingerprint_diff": max(fp_rel.values()) if fp_rel else None,
        "loss_first_last": {"plain": [plain["losses"][0], plain["losses"][n - 1]] if n else None,
                            "patched": [patched["losses"][0], patched["losses"][n - 1]] if n else None},
        "train_seconds": {"plain": plain["train_seconds"], "patched": patched["train_seconds"]},
        "flce_launches_per_rank": [r["launches"].get(flce, 0) for r in patched["ranks"]],
        "launches_rank0": patched["ranks"][0]["launches"],
        "patched_rank0": patched["ranks"][0]["patched"],
        "versions": patched["versions"], "gpu": patched["gpu"], "tolerance": {"atol": atol, "rtol": rtol},
    }
    return summary


def main(argv=None) -> int:
    """--compare: the comparison's exit status. Otherwise a training rank, which never returns: it ends
    through exit_without_finalization."""
    args = parse_args(argv)
    if args.compare:
        summary = compare(*args.compare, rtol=args.rtol, atol=args.atol)
        print(json.dumps(summary, indent=1))
        return 0 if summary["ok"] else 1
    exit_without_finalization(train(args))


def exit_without_finalization(code: int) -> None:
    """End a training rank without interpreter finalization.

    destroy_process_group() does not end the gloo group's worker threads here (checked on torch 2.13:
    the pt_gloo_runloop threads still run after it, also after del of the model and gc.collect(); FSDP2's
    DeviceMesh (_pg_registry) and other module-level objects still hold the ProcessGroup). So they are
    alive while the interpreter finalizes, which is where a rank aborted ("terminate called without an
    active exception", ~1 run in 10 of the CPU launcher test, after its work and report were done): a C++
    thread that needs the GIL during finalization is made to exit and aborts the process (the mechanism
    of pytorch/pytorch#179291 and #190489). The rank runs its exit handlers (autopatch's report),
    flushes its streams and ends with os._exit: no finalization."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
