"""End-to-end training-step benchmark: tokens/s and peak memory of whole models, per peer.

Each (model, peer) runs in a fresh Python process (`--worker`): Liger's apply_liger_kernel_to_* and
our patches swap attributes on transformers' classes and modules for the whole process, and
torch.compile caches, so sharing one process would leak one peer's patches into the next.

Models (random weights from a config; nothing is downloaded), bf16 parameters, sdpa attention,
torch.optim.AdamW(fused=True), labels = input ids (the model shifts them):
  qwen3_0.6b         28 layers, hidden 1024, intermediate 3072, 16 heads / 8 kv heads, head_dim 128,
                     vocab 151936, tied embeddings; batch 8 x 2048
  llama3_8b_4layers  Llama-3-8B shape cut to 4 layers: hidden 4096, intermediate 14336, 32 / 8 heads,
                     vocab 128256; batch 4 x 4096
  qwen3_moe_30b_a3b_6layers  Qwen3-30B-A3B shape cut to 6 layers: hidden 2048, 128 experts (8 per token)
                     of width 768, 32 / 4 heads of 128, vocab 151936; batch 4 x 4096
  deepseek_v3_6layers  DeepSeek-V3 style cut to fit: hidden 2048, MLA, one dense layer then 5 MoE layers
                     of 256 experts (8 active, width 512) + 1 shared, sigmoid group routing, routed
                     scaling 2.5, vocab 129280; batch 4 x 4096
  qwen2_5_vl_3b      Qwen2.5-VL-3B shape: text 36 x 2048 (vocab 151936, tied), vision 32 x 1280; one 448 x 448
                     image (256 tokens) per sequence; batch 4 x 4096
  gemma3_4b          Gemma-3-4B shape: text 34 x 2560 (vocab 262208), SigLIP 27 x 1152 at 896 x 896 pooled to
                     256 tokens; one image per sequence; batch 4 x 4096
  tiny_llama, tiny_qwen2_5_vl   the CPU dry runs (batch 2 x 32, 2 x 16 with a 4-token image)
Peers: hf_eager, torch_compile (torch.compile(model), or each decoder layer with --compile-mode
layers), liger (rope, rms_norm, swiglu, fused_linear_cross_entropy), ours
(autopatch.apply(model, rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)),
ours_compile (ours, then torch.compile), ours_keep_input (ours with the rules' memory trade-offs off:
RMSNorm keeps its input, the gated MLP keeps act(gate)·up, the library's behaviour before those trade-offs; for A/B of speed and memory).

Per run: a few warm-up steps (they include compilation), then timed steps; tokens/s from the median
step; peak = torch.cuda.max_memory_allocated over the timed steps (weights, AdamW state, activations:
the whole training footprint); the loss of the first step (same seed, so the same weights and batch
for every peer: a peer whose first loss differs is computing something else).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # the repository root: autopatch and fused_kernels without an install
    sys.path.insert(1, ROOT)

MODELS = {
    "qwen3_0.6b": {
        "model_type": "qwen3",
        "config": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
        "batch": 8, "seq": 2048,
    },
    "llama3_8b_4layers": {
        "model_type": "llama",
        "config": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=False),
        "batch": 4, "seq": 4096,
    },
    # mixtures of experts: transformers' experts modules (grouped_mm by default) against fused experts
    "qwen3_moe_30b_a3b_6layers": {
        "model_type": "qwen3_moe",
        "config": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                       num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=6, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
        "batch": 4, "seq": 4096,
    },
    "deepseek_v3_6layers": {  # one dense layer, then shared expert + 256 routed (8 active), sigmoid group routing
        "model_type": "deepseek_v3",
        "config": dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=512, n_routed_experts=256,
                       num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                       num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                       vocab_size=129280, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
        "batch": 4, "seq": 4096,
        "liger": {"rope": False},  # Liger's DeepSeek-V3 entry has no RoPE kernel (its default)
    },
    # vision-language: one image per sequence, its tokens inside the 4 x 4096 (labels -100 on them)
    "qwen2_5_vl_3b": {  # Qwen2.5-VL-3B shape: text 36 x 2048, vision 32 x 1280; a 448 x 448 image = 256 tokens
        "model_type": "qwen2_5_vl", "kind": "image_text",
        "config": dict(
            text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                             num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                             rms_norm_eps=1e-6, tie_word_embeddings=True,
                             rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31]),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
            tie_word_embeddings=True),
        "image": dict(form="qwen_grid", grid=(1, 32, 32), patch_values=3 * 2 * 14 * 14, tokens=256),
        "batch": 4, "seq": 4096,
    },
    "gemma3_4b": {  # Gemma-3-4B shape: text 34 x 2560, SigLIP 27 x 1152 at 896 x 896 pooled to 256 tokens
        "model_type": "gemma3", "kind": "image_text",
        "config": dict(
            text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                             query_pre_attn_scalar=256, max_position_embeddings=131072),
            vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                               image_size=896, patch_size=14),
            mm_tokens_per_image=256, image_token_index=262144, boi_token_index=255999, eoi_token_index=256000),
        "image": dict(form="square", size=896, tokens=256, token_type_ids=True),
        "batch": 4, "seq": 4096,
    },
    "tiny_qwen2_5_vl": {  # the CPU dry run of the image-text path
        "model_type": "qwen2_5_vl", "kind": "image_text",
        "config": dict(
            text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2,
                               spatial_merge_size=2, temporal_patch_size=2, window_size=4, out_hidden_size=32,
                               fullatt_block_indexes=[1]),
            image_token_id=90, video_token_id=93, vision_start_token_id=91, vision_end_token_id=92),
        "image": dict(form="qwen_grid", grid=(1, 4, 4), patch_values=3 * 2 * 2 * 2, tokens=4),
        "batch": 2, "seq": 16,
    },
    "tiny_llama": {
        "model_type": "llama",
        "config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
        "batch": 2, "seq": 32,
    },
}
PEERS = ("hf_eager", "torch_compile", "liger", "ours", "ours_env", "ours_compile", "ours_keep_input")
OUR_TOGGLES = dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, causal_mask=True)


# ----------------------------------------------------------------------------------------------------
# Worker: one model, one peer, one process
# ----------------------------------------------------------------------------------------------------


def _build_model(spec, device, torch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if spec.get("kind") == "image_text" else AutoModelForCausalLM
    cfg = AutoConfig.for_model(spec["model_type"], **spec["config"])
    cfg.use_cache = False
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:
        pass
    with torch.device(device):
        try:
            model = auto.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:  # older transformers spell it torch_dtype
            model = auto.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.to(device=device, dtype=torch.bfloat16).train()


def make_batches(spec, device, torch, gen, count: int = 2) -> list[dict]:
    """`count` training batches of the spec's form: token ids (labels = ids; the model shifts them), and
    for image-text models one image per sequence: its placeholder tokens after 16 text tokens (fewer in a
    short dry-run sequence; labels -100 there) and pixels of the tower's form."""
    text = spec["config"].get("text_config", spec["config"])
    vocab, batch, seq = text["vocab_size"], spec["batch"], spec["seq"]
    out = []
    for _ in range(count):
        if spec.get("kind") != "image_text":
            ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
            out.append({"input_ids": ids, "labels": ids})
            continue
        image, cfg = spec["image"], spec["config"]
        specials = [v for k, v in cfg.items() if k.endswith("token_id") or k.endswith("token_index")]
        top = min(specials) if specials and min(specials) < vocab else vocab  # text ids below every special id
        ids = torch.randint(0, top, (batch, seq), device=device, generator=gen)
        image_id = cfg.get("image_token_id", cfg.get("image_token_index"))
        n = image["tokens"]
        start = min(16, (seq - n) // 2)
        ids[:, start:start + n] = image_id
        labels = ids.masked_fill(ids == image_id, -100)
        inputs = {"input_ids": ids, "labels": labels}
        if image["form"] == "qwen_grid":
            t, h, w = image["grid"]
            inputs["pixel_values"] = torch.randn(batch * t * h * w, image["patch_values"], device=device,
                                                 generator=gen, dtype=torch.bfloat16)
            inputs["image_grid_thw"] = torch.tensor([[t, h, w]] * batch, device=device)
        else:
            inputs["pixel_values"] = torch.randn(batch, 3, image["size"], image["size"], device=device,
                                                 generator=gen, dtype=torch.bfloat16)
        if image.get("token_type_ids"):
            inputs["token_type_ids"] = (ids == image_id).long()
        out.append(inputs)
    return out


def _apply_liger(spec):
    import liger_kernel.transformers as lt

    fn = getattr(lt, f"apply_liger_kernel_to_{spec['model_type']}")
    kwargs = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    kwargs.update(spec.get("liger", {}))
    accepted = inspect.signature(fn).parameters  # Gemma 3's takes geglu and layer_norm, not swiglu: its defaults
    fn(**{k: v for k, v in kwargs.items() if k in accepted})
    return fn.__name__


def _compile(model, mode, torch):
    if mode == "layers":
        for layer in model.model.layers:
            layer.compile()
        return model
    return torch.compile(model)


def _record_patches(info: dict, records) -> None:
    recs = [r.as_dict() if hasattr(r, "as_dict") else str(r) for r in (records or [])]
    info["patched"] = sorted({f"{r['kernel']}:{r['target']}" for r in recs if isinstance(r, dict) and r.get("patched")})
    info["not_patched"] = sorted({f"{r['kernel']}:{r['target']}: {r.get('reason', '')}"[:200]
                                  for r in recs if isinstance(r, dict) and not r.get("patched")})


def peer_model(spec, peer: str, device, torch, compile_mode: str = "model"):
    """(model, info): the model of `spec` as `peer` trains it (Liger's class patches before it is built,
    autopatch after, torch.compile last); info holds the parameter count and what was patched. Used by
    worker, dev/step_diagnosis.py and experiments, so that every script runs a peer the
    same way."""
    info = {}
    if peer == "liger":
        info["liger_applied"] = _apply_liger(spec)  # class-level patch, before the model exists
    if peer == "ours_env":  # FUSED_KERNELS=all set by the driver
        info["started_by"] = start_hooks_from_environment()
    model = _build_model(spec, device, torch)
    info["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    if peer == "ours_env":
        import autopatch

        _record_patches(info, autopatch.applied())
    elif peer.startswith("ours"):
        import autopatch

        if peer == "ours_keep_input":  # A/B: the memory trade-offs of the rules off (norms keep x, MLPs keep h)
            from autopatch.rules import glu_mlp, rms_norm

            rms_norm.KEEP = "input"
            glu_mlp.FUSE_DOWN_PROJ = False

        _record_patches(info, autopatch.apply(model, **OUR_TOGGLES))
    if peer.endswith("compile"):
        model = _compile(model, compile_mode, torch)
    return model, info


def worker(model_key: str, peer: str, steps: int, warmup: int, device_name: str, compile_mode: str) -> dict:
    import torch

    spec = MODELS[model_key]
    device = torch.device(device_name)
    batch, seq = spec["batch"], spec["seq"]
    res = {"model": model_key, "peer": peer, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
           "status": "ok", "compile_mode": compile_mode if "compile" in peer else None}
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model, info = peer_model(spec, peer, device, torch, compile_mode)
    res.update(info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=(device.type == "cuda"))
    gen = torch.Generator(device=device).manual_seed(1)
    batches = make_batches(spec, device, torch, gen)

    def step(i):
        loss = model(**batches[i % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    warm_s = []
    for i in range(warmup):
        t0 = time.perf_counter()
        losses.append(float(step(i)))
        warm_s.append(time.perf_counter() - t0)
    res["warmup_step_s"] = warm_s
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        res["allocated_before_timed_gib"] = torch.cuda.memory_allocated() / 2**30
        try:
            res["live_between_steps"] = _live_beyond_params_and_state(model, opt)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not cost the measurement
            res["live_between_steps"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        timed_losses = []
        host_ms = []
        alloc_before = _allocator_counts(torch)
        for i in range(steps):
            c0 = time.process_time()
            starts[i].record()
            timed_losses.append(step(warmup + i))
            ends[i].record()
            host_ms.append((time.process_time() - c0) * 1e3)
        torch.cuda.synchronize()
        step_ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        # The caching allocator's cudaMalloc / cudaFree calls and out-of-memory retries (each retry frees
        # the cache and synchronises) during the timed steps: nonzero marks a step slowed by the allocator.
        alloc_after = _allocator_counts(torch)
        res["allocator_during_timed"] = {k: alloc_after[k] - alloc_before[k] for k in alloc_after}
        # CPU time of the whole process (the autograd engine runs the backward in its own thread) while
        # each step was being issued: close to step_ms means the step waits on Python's launches, not on
        # the GPU (a full launch queue also blocks the host, so this is an upper bound on the host work).
        res["host_cpu_ms"] = host_ms
        res["host_cpu_ms_median"] = statistics.median(host_ms)
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        step_ms, timed_losses = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            timed_losses.append(step(warmup + i))
            step_ms.append((time.perf_counter() - t0) * 1e3)
    losses += [float(x) for x in timed_losses]
    res["step_ms"] = step_ms
    res["step_ms_median"] = statistics.median(step_ms)
    res["tokens_per_s"] = batch * seq / (res["step_ms_median"] * 1e-3)
    res["loss_first"] = losses[0]
    res["loss_last"] = losses[-1]
    res["losses"] = losses
    res["finite"] = all(x == x and abs(x) != float("inf") for x in losses)
    res["wall_s"] = time.perf_counter() - t_start
    return res


def _allocator_counts(torch) -> dict:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                               "num_sync_all_streams")}


# ----------------------------------------------------------------------------------------------------
# Driver: one subprocess per (model, peer), inside a time budget
# ----------------------------------------------------------------------------------------------------


def plan(tiny: bool, models=None, peers=None) -> list[tuple[str, str]]:
    """Cheapest and most telling runs first, so a budget cut drops compile peers, not the baselines."""
    if tiny:
        order = [("tiny_llama", p) for p in ("hf_eager", "ours", "liger", "ours_keep_input")]
        order += [("tiny_qwen2_5_vl", p) for p in ("hf_eager", "ours_env")]
    else:
        q, l = "qwen3_0.6b", "llama3_8b_4layers"
        order = [(q, "hf_eager"), (q, "ours"), (q, "liger"), (l, "hf_eager"), (l, "ours"), (l, "liger"),
                 (q, "torch_compile"), (q, "ours_compile"), (l, "torch_compile"), (l, "ours_compile"),
                 (q, "ours_keep_input"), (l, "ours_keep_input")]
        for other in ("qwen3_moe_30b_a3b_6layers", "deepseek_v3_6layers"):
            order += [(other, "hf_eager"), (other, "ours"), (other, "liger")]
        for other in ("qwen2_5_vl_3b", "gemma3_4b"):  # every kernel, from the environment alone
            order += [(other, "hf_eager"), (other, "ours_env"), (other, "liger"), (other, "ours_keep_input")]
    if models:
        order = [o for o in order if o[0] in models]
    if peers:
        order = [o for o in order if o[1] in peers]
    return order


def start_hooks_from_environment() -> str:
    """In a worker whose driver set FUSED_KERNELS: how our import hooks started. Installed, the .pth
    started them at interpreter start; run from a checkout, autopatch.enable() starts the same hooks."""
    if "autopatch._startup" in sys.modules:
        return ".pth (FUSED_KERNELS=all)"
    import autopatch

    autopatch.enable()
    return "autopatch.enable() (no .pth: not installed)"


def worker_env(fused_kernels: str | None = None) -> dict:
    """The environment of a peer's worker: none of our variables, except FUSED_KERNELS=`fused_kernels`."""
    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
    if fused_kernels is not None:
        env["FUSED_KERNELS"] = fused_kernels
    return env


def run_json_worker(cmd: list, labels: dict, timeout_s: float, fused_kernels: str | None = None) -> dict:
    """Run `cmd` + ["--result", PATH] in a fresh process (its own process group, killed whole at the
    timeout) and return the JSON it wrote to PATH, or `labels` with the status and the log's tail. The
    worker sees none of our variables, except FUSED_KERNELS=`fused_kernels` when given."""
    fd, path = tempfile.mkstemp(prefix="bench_worker_", suffix=".json")
    os.close(fd)
    t0 = time.perf_counter()
    env = worker_env(fused_kernels)
    proc = subprocess.Popen([*cmd, "--result", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and its compile workers: our own process group
        log, _ = proc.communicate()
        timed_out = True
    wall = time.perf_counter() - t0
    res = None
    try:
        with open(path) as f:
            text = f.read()
        res = json.loads(text) if text.strip() else None
    except (OSError, json.JSONDecodeError):
        res = None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    tail = "\n".join((log or "").strip().splitlines()[-15:])
    if res is None:
        res = {**labels,
               "status": "timeout" if timed_out else "crashed",
               "error": (f"no result within {timeout_s:.0f} s" if timed_out else f"exit code {proc.returncode}"),
               "log_tail": tail[-2000:]}
    elif res.get("status") != "ok":
        res["log_tail"] = tail[-2000:]
    res["process_wall_s"] = wall
    return res


def _run_worker(model_key, peer, args, timeout_s) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "bench_e2e.py"), "--worker", "--model", model_key, "--peer", peer,
           "--steps", str(args.e2e_steps), "--warmup", str(args.e2e_warmup), "--device", args.device,
           "--compile-mode", args.compile_mode]
    # Only ours_env sees a FUSED_KERNELS setting: the other peers run with none of our variables.
    return run_json_worker(cmd, {"model": model_key, "peer": peer}, timeout_s,
                           fused_kernels="all" if peer == "ours_env" else None)


def run_e2e(args, deadline, on_done=None) -> list[dict]:
    results = []
    for model_key, peer in plan(args.tiny, args.e2e_models, args.e2e_peers):
        left = deadline.left()
        if left < 20:
            results.append({"model": model_key, "peer": peer, "status": "skipped", "error": "e2e time budget spent"})
            continue
        print(f"[e2e] {model_key} / {peer}  ({left:.0f} s left)", flush=True)
        res = _run_worker(model_key, peer, args, timeout_s=min(left, args.e2e_run_cap_s))
        results.append(res)
        if res.get("status") == "ok":
            print(f"      {res['tokens_per_s'] / 1e3:.1f}k tok/s, peak {res.get('peak_gib', float('nan')):.1f} GiB, "
                  f"step {res['step_ms_median']:.1f} ms (host CPU {res.get('host_cpu_ms_median', float('nan')):.1f} ms), "
                  f"loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}, {res['process_wall_s']:.0f} s", flush=True)
            if res.get("step_ms"):
                print(f"      steps {min(res['step_ms']):.1f}-{max(res['step_ms']):.1f} ms; allocator during them: "
                      f"{res.get('allocator_during_timed', '-')}", flush=True)
        else:
            print(f"      {res['status']}: {res.get('error', '')[:300]}", flush=True)
        _ratios(results)  # after every run: a run cut short by the time limit still has its ratios
        if on_done:
            on_done(results)
    return results


def param_and_state_addresses(model, opt) -> set[int]:
    """Storage addresses of the model's parameters, their gradients and the optimizer's state: what a
    training run keeps between steps by design (dev/step_diagnosis.py leaves these out too)."""
    import torch

    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    known |= {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()
              if isinstance(v, torch.Tensor)}
    return known


def _live_beyond_params_and_state(model, opt, top: int = 6) -> dict:
    """CUDA tensors alive between steps that are neither parameters, their grads, nor optimizer
    state, found through the garbage collector: whatever a patched model keeps from one step to
    the next (memory_allocated minus these, minus params and state, is allocator-internal: cuBLAS
    workspaces and the like)."""
    import gc

    import torch

    known = param_and_state_addresses(model, opt)
    found: dict[int, tuple] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or not obj.is_cuda:
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - fake/meta tensors, lazy wrappers
            continue
        ptr = storage.data_ptr()
        if ptr in known or ptr in found:
            continue
        found[ptr] = (storage.nbytes(), tuple(obj.shape), str(obj.dtype))
    biggest = sorted(found.values(), reverse=True)[:top]
    return {"bytes": sum(b for b, _, _ in found.values()), "count": len(found),
            "largest": [{"bytes": b, "shape": list(sh), "dtype": dt} for b, sh, dt in biggest]}


def _ratios(results: list[dict]) -> None:
    by_model: dict[str, dict[str, dict]] = {}
    for r in results:
        if r.get("status") == "ok":
            by_model.setdefault(r["model"], {})[r["peer"]] = r
    for peers in by_model.values():
        eager = peers.get("hf_eager")
        for p, r in peers.items():
            if eager:
                r["speedup_vs_hf_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
            others = [q["tokens_per_s"] for n, q in peers.items() if n != p and not n.startswith("ours")]
            if others:
                r["speed_ratio_to_best_peer"] = r["tokens_per_s"] / max(others)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="internal: run one model/peer and write --result")
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--peer", choices=PEERS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile-mode", choices=("model", "layers"), default="model")
    ap.add_argument("--result", help="where the worker writes its JSON")
    a = ap.parse_args(argv)
    if not a.worker:
        ap.error("run benchmarks/bench.py --parts e2e; this entry point is the per-run worker")
    try:
        res = worker(a.model, a.peer, a.steps, a.warmup, a.device, a.compile_mode)
    except BaseException as exc:  # recorded, not raised: the driver reads the file
        import torch

        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        res = {"model": a.model, "peer": a.peer, "status": "oom" if oom else "error",
               "error": f"{type(exc).__name__}: {str(exc)[:500]}",
               "traceback": traceback.format_exc(limit=8)[-3000:]}
        print(res["traceback"], file=sys.stderr)
    with open(a.result, "w") as f:
        json.dump(res, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
