"""TRL's SFT, DPO and GRPO trainers, end to end: tokens/s and peak memory per peer, each peer in a fresh process.

    python benchmarks/bench_trl.py --out trl.json [--trainers sft,dpo,grpo] [--models qwen3_0.6b,llama3_2_3b]
                                   [--peers trl,trl_liger,trl_ours]
    python benchmarks/bench_trl.py --device cpu --models tiny_llama --steps 1 --warmup 1    (the CPU dry run)
    python benchmarks/bench_trl.py ... --profile-steps 2    (then where those steps' GPU time goes)

What runs (TRL 1.16's configs' defaults otherwise: gradient checkpointing on, AdamW fused, bf16 on a
GPU): random weights from benchmarks/bench_e2e.py's model configs, built on the device; random data with
batch × seq policy tokens a step:
  sft  pre-tokenized sequences of the model's length (no tokenization, no packing), batch of them;
  dpo  batch // 2 pairs of text over an offline word-level tokenizer of the model's vocabulary (a word a
       token): a prompt of seq / 2 words, chosen and rejected completions of seq / 2 words each, so each
       step runs 2 × (batch // 2) sequences of seq tokens through the policy (and the reference model,
       TRL's copy of it, without gradients);
  grpo one prompt of seq − seq/64 words a step, batch completions of seq/64 tokens generated for it by
       transformers' generate (no vLLM), a reward from its words: batch × seq tokens through
       the loss. Generation is timed apart (`generation_ms`) and left out of tokens/s, which counts the
       scoring, the loss's forward and backward and AdamW (`train_ms` = step − generation).
Peers:
  trl        plain TRL;
  trl_liger  SFTConfig(use_liger_kernel=True);
  trl_ours   FUSED_KERNELS=all in the worker's environment, nothing imported by it (autopatch installed
             as a wheel runs from its .pth; from a checkout, autopatch.enable() starts the same hooks).
A callback times each optimizer step with CUDA events (forward, backward and AdamW; the data loader's
host work between steps is outside) after `warmup` untimed steps, and resets the peak-memory counter
there. The first logged loss must agree across peers (same seed, same weights, same batches). Each timed
step also records the time Python's garbage collector took in it (`gc_ms`) and its full collections.
With --profile-steps N, N more steps run after the timed ones under torch.profiler (CUDA kernels only):
per step, the kernels' summed time by kind (GEMM, attention, fused, TRL's head, optimizer, other; see
bench_common.kernel_kind), the step's CUDA-event time, and the gap (the GPU waiting for the host).
What a fused-kernel library can change is the fused and other kinds and the gap; GEMMs, attention and
TRL's head stay whoever patches the model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)
if HERE not in sys.path:
    sys.path.insert(1, HERE)

import bench_e2e  # noqa: E402  (model configs, model building, patch records, the worker runner)

PEERS = ("trl", "trl_liger", "trl_ours")
TRAINERS = ("sft", "dpo", "grpo")
MODELS = dict(bench_e2e.MODELS)
MODELS["qwen3_0.6b"] = dict(MODELS["qwen3_0.6b"], batch=4, seq=4096)
MODELS["llama3_2_3b"] = {  # Llama-3.2-3B shape
    "model_type": "llama",
    "config": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
    "batch": 4, "seq": 4096,
}
DEFAULT_MODELS = ("qwen3_0.6b", "llama3_2_3b")


def _tokenizer(vocab: int = 3):
    """A word-level tokenizer built in memory: <pad> 0, <eos> 1, <unk> 2, then the words w3 ... w{vocab-1},
    a token each (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _words(gen, n: int, vocab: int, torch) -> str:
    return " ".join(f"w{i}" for i in torch.randint(3, vocab, (n,), generator=gen).tolist())


def _even_words(completions, **kwargs):
    """GRPO's reward: how many of the completion's words have an even id (any real number works; this one
    varies between completions, so the advantages and the gradients are not zero)."""
    return [float(sum(1 for w in str(c).split() if w[1:].isdigit() and int(w[1:]) % 2 == 0)) for c in completions]


def _timed_generation(trainer, cuda: bool, torch) -> list:
    """Wrap GRPO's generation (`_generate`) so that its time is recorded (ms, one entry a call)."""
    times, generate = [], trainer._generate

    def timed(prompts):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(prompts)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    trainer._generate = timed
    return times


def _trainer(kind: str, model, spec: dict, rows: int, common: dict, timer, torch):
    """The TRL trainer of `kind` on random data of the spec's shape (see the module docstring)."""
    import trl
    from datasets import Dataset

    vocab, batch, seq = spec["config"]["vocab_size"], spec["batch"], spec["seq"]
    gen = torch.Generator().manual_seed(1)
    if kind == "sft":
        ids = torch.randint(3, vocab, (rows * batch, seq), generator=gen).tolist()
        config = trl.SFTConfig(**common, per_device_train_batch_size=batch, max_length=seq)
        return trl.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": ids}),
                              processing_class=_tokenizer(), callbacks=[timer])
    pairs, half = max(1, batch // 2), seq // 2
    n = rows * pairs
    data = Dataset.from_dict({
        "prompt": [_words(gen, half, vocab, torch) for _ in range(n)],
        # a leading space so that prompt + completion tokenizes as the prompt's tokens, then the completion's;
        # the trailing <eos> (one of the completion's words) keeps TRL from appending another
        "chosen": [" " + _words(gen, half - 1, vocab, torch) + " <eos>" for _ in range(n)],
        "rejected": [" " + _words(gen, half - 1, vocab, torch) + " <eos>" for _ in range(n)],
    })
    if kind == "grpo":
        # short completions: decoding them token by token is outside the timed part, yet sets the wall clock
        completion = max(2, seq // 64)
        data = Dataset.from_dict({"prompt": [_words(gen, seq - completion, vocab, torch) for _ in range(rows)]})
        config = trl.GRPOConfig(**common, per_device_train_batch_size=batch, num_generations=batch,
                                steps_per_generation=1, max_completion_length=completion, use_vllm=False)
        return trl.GRPOTrainer(model=model, reward_funcs=_even_words, args=config, train_dataset=data,
                               processing_class=_tokenizer(vocab), callbacks=[timer])
    config = trl.DPOConfig(**common, per_device_train_batch_size=pairs, max_length=seq)
    torch.manual_seed(0)  # the reference: the policy's starting weights (TRL would load it from a Hub name)
    ref = bench_e2e._build_model(spec, next(model.parameters()).device, torch).eval().requires_grad_(False)
    return trl.DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data,
                          processing_class=_tokenizer(vocab), callbacks=[timer])


def _step_timer(warmup: int, steps: int, profile_steps: int, torch, cuda: bool):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """CUDA-event (or wall, on the CPU) time of each optimizer step; the peak-memory counter reset
        when the first timed step begins; every logged loss and gradient norm; after the timed steps,
        `profile_steps` more under torch.profiler (their times go to profiled_ms, not step_ms)."""

        def __init__(self):
            self.step_ms, self.losses, self.grad_norms, self._begin, self.step = [], [], [], None, 0
            self.profiled_ms, self.profiler = [], None
            # Python's garbage collector during each timed step: ms spent collecting and how many of the
            # collections were full (generation 2), to tell a slow step's collection from other host work
            self.gc_ms, self.gc_full, self._gc = [], [], {"start": 0.0, "ms": 0.0, "full": 0}
            gc.callbacks.append(self._on_gc)

        def _on_gc(self, phase, info):
            if phase == "start":
                self._gc["start"] = time.perf_counter()
            else:
                self._gc["ms"] += (time.perf_counter() - self._gc["start"]) * 1e3
                self._gc["full"] += info.get("generation") == 2

        def on_train_end(self, args, state, control, **kw):
            gc.callbacks.remove(self._on_gc)

        def on_step_begin(self, args, state, control, **kw):
            if self.step == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if self.step == warmup + steps and profile_steps:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
                self.profiler = profile(activities=activities)
                self.profiler.__enter__()
            self._gc.update(ms=0.0, full=0)
            if cuda:
                self._begin = torch.cuda.Event(enable_timing=True)
                self._begin.record()
            else:
                self._begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                end.synchronize()
                ms = self._begin.elapsed_time(end)
            else:
                ms = (time.perf_counter() - self._begin) * 1e3
            if warmup + steps > self.step >= warmup:
                self.step_ms.append(ms)
                self.gc_ms.append(self._gc["ms"])
                self.gc_full.append(self._gc["full"])
            elif self.step >= warmup + steps:
                self.profiled_ms.append(ms)
                if self.step == warmup + steps + profile_steps - 1:
                    self.profiler.__exit__(None, None, None)
            self.step += 1

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
            if logs and "grad_norm" in logs:  # GRPO's on-policy loss is 0 by construction; its gradient is not
                self.grad_norms.append(float(logs["grad_norm"]))

    return StepTimer()


def _kernel_breakdown(profiler, step_ms: list, torch) -> dict:
    """The profiled steps' CUDA kernels, per step: ms by kind, the total, launches, the gap between the
    step's CUDA-event time and its kernels' time (idle GPU: host work, syncs), the 15 longest kernels."""
    from bench_common import kernel_kind

    n = len(step_ms)
    kernels: dict = {}
    for ev in profiler.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(ev.name, [0.0, 0])
            entry[0] += (getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)) / 1e3 / n
            entry[1] += 1
    by_kind: dict = {}
    for name, (ms, _count) in kernels.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + ms
    total = sum(by_kind.values())
    step = statistics.median(step_ms)
    return {"profiled_step_ms": step, "kernel_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernel_ms_total": total, "idle_ms": step - total,
            "kernel_launches": sum(c for _ms, c in kernels.values()) / n,
            "top_kernels_ms": [(name[:90], ms, c / n) for name, (ms, c) in
                               sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]]}


def worker(kind: str, model_key: str, peer: str, steps: int, warmup: int, device_name: str, out_dir: str,
           profile_steps: int = 0) -> dict:
    import torch

    spec = MODELS[model_key]
    batch, seq = spec["batch"], spec["seq"]
    tokens = 2 * max(1, batch // 2) * seq if kind == "dpo" else batch * seq
    res = {"trainer": kind, "model": model_key, "peer": peer, "batch": batch, "seq": seq, "tokens_per_step": tokens,
           "status": "ok"}
    if peer == "trl_ours":
        res["started_by"] = bench_e2e.start_hooks_from_environment()
    import trl

    res["trl"] = trl.__version__
    cuda = device_name == "cuda"
    device = torch.device(device_name)
    torch.manual_seed(0)
    model = bench_e2e._build_model(spec, device, torch)
    total_steps = warmup + steps + profile_steps
    common = dict(output_dir=out_dir, max_steps=total_steps, learning_rate=1e-5, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
                  disable_tqdm=True, use_cpu=not cuda, bf16=cuda, use_liger_kernel=peer == "trl_liger")
    timer = _step_timer(warmup, steps, profile_steps, torch, cuda)
    t0 = time.perf_counter()
    trainer = _trainer(kind, model, spec, total_steps, common, timer, torch)
    generation_ms = _timed_generation(trainer, cuda, torch) if kind == "grpo" else None
    trainer.train()
    res["wall_s"] = time.perf_counter() - t0
    if peer == "trl_ours":
        import autopatch

        bench_e2e._record_patches(res, autopatch.applied())
        res["runs"] = {f"{r.kernel}:{r.target}": r.runs for r in autopatch.applied() if r.patched and r.runs}
    if cuda:
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["step_ms"] = timer.step_ms
    res["gc_ms"], res["gc_full_collections"] = timer.gc_ms, timer.gc_full
    res["step_ms_median"] = statistics.median(timer.step_ms)
    timed_ms = timer.step_ms
    if generation_ms is not None:  # one generation a step (steps_per_generation=1)
        if len(generation_ms) != total_steps:
            raise RuntimeError(f"expected one generation a step, got {len(generation_ms)} in {total_steps} steps")
        res["generation_ms"] = generation_ms[warmup:warmup + steps]
        res["generation_ms_median"] = statistics.median(res["generation_ms"])
        timed_ms = res["train_ms"] = [s - g for s, g in zip(timer.step_ms, res["generation_ms"])]
        res["train_ms_median"] = statistics.median(timed_ms)
    res["tokens_per_s"] = tokens / (statistics.median(timed_ms) * 1e-3)
    if profile_steps:
        # GRPO: the profiled steps include their generation (its kernels count as other / gemm / attention)
        res["profile"] = _kernel_breakdown(timer.profiler, timer.profiled_ms, torch)
        if generation_ms is not None:
            res["profile"]["generation_ms"] = generation_ms[warmup + steps:]
    res["losses"] = timer.losses
    res["grad_norms"] = timer.grad_norms
    res["loss_first"] = timer.losses[0] if timer.losses else None
    res["finite"] = all(x == x and abs(x) != float("inf") for x in timer.losses)
    return res


def _run(kind: str, model_key: str, peer: str, args, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--trainer", kind, "--model", model_key, "--peer", peer,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
           "--profile-steps", str(args.profile_steps)]
    return bench_e2e.run_json_worker(cmd, {"trainer": kind, "model": model_key, "peer": peer}, timeout_s,
                                     fused_kernels="all" if peer == "trl_ours" else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="trl.json")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="steps after the timed ones under torch.profiler: where the GPU time goes")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all runs")
    ap.add_argument("--worker", action="store_true", help="internal: one model and peer, JSON to --result")
    ap.add_argument("--trainer", choices=TRAINERS)
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--peer", choices=PEERS)
    ap.add_argument("--result")
    a = ap.parse_args(argv)
    if a.worker:
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                res = worker(a.trainer, a.model, a.peer, a.steps, a.warmup, a.device, out_dir, a.profile_steps)
            except Exception as exc:  # noqa: BLE001 - the driver reads the reason from the JSON
                import traceback

                kind = "oom" if "out of memory" in str(exc).lower() else "error"
                res = {"trainer": a.trainer, "model": a.model, "peer": a.peer, "status": kind, "error": f"{type(exc).__name__}: {exc}"[:600],
                       "traceback": traceback.format_exc()[-3000:]}
        with open(a.result, "w") as f:
            json.dump(res, f)
        return 0 if res["status"] == "ok" else 1
    for name, known in (("--trainers", TRAINERS), ("--models", MODELS), ("--peers", PEERS)):
        bad = [v for v in getattr(a, name[2:]).split(",") if v and v not in known]
        if bad:
            ap.error(f"{name}: unknown {', '.join(bad)}; known: {', '.join(sorted(known))}")
    import torch
    from bench_common import environment, write_json

    start = time.perf_counter()
    results = []
    runs = [(k, m, p) for k in a.trainers.split(",") if k for m in a.models.split(",") if m
            for p in a.peers.split(",") if p]
    for kind, model_key, peer in runs:
        left = a.budget_s - (time.perf_counter() - start)
        if left < 20:
            results.append({"trainer": kind, "model": model_key, "peer": peer, "status": "skipped",
                            "error": "time budget spent"})
            continue
        print(f"[trl] {kind} {model_key} / {peer}  ({left:.0f} s left)", flush=True)
        res = _run(kind, model_key, peer, a, left)
        results.append(res)
        if res["status"] == "ok":
            print(f"      {res['tokens_per_s'] / 1e3:.1f}k tok/s, peak {res.get('peak_gib', float('nan')):.1f} GiB, "
                  f"step {res['step_ms_median']:.1f} ms, loss {res['loss_first']}", flush=True)
            slowest = max(range(len(res["step_ms"])), key=res["step_ms"].__getitem__)
            print(f"      steps {min(res['step_ms']):.0f}..{res['step_ms'][slowest]:.0f} ms, the slowest with "
                  f"{res['gc_ms'][slowest]:.0f} ms of garbage collection; {sum(res['gc_full_collections'])} full "
                  f"collections in the timed steps", flush=True)
            if "profile" in res:
                pr = res["profile"]
                print(f"      profiled step {pr['profiled_step_ms']:.1f} ms: kernels {pr['kernel_ms_total']:.1f} ms "
                      f"({pr['kernel_launches']:.0f} launches), idle {pr['idle_ms']:.1f} ms; "
                      + ", ".join(f"{k} {v:.1f}" for k, v in pr["kernel_ms"].items()), flush=True)
        else:
            print(f"      {res['status']}: {res.get('error', '')[:300]}", flush=True)
        write_json(a.out, {"meta": environment(torch.device(a.device)), "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
