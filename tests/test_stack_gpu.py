"""GPU checks of the training stack (run on a CUDA GPU, e.g. an H200, through scripts/gpu_check.sh).

  - Convergence: a small Llama trained 200 AdamW steps (warm-up 20 steps, cosine decay, gradient
    clipping at 1.0: see LR below) on learnable synthetic data (made here: token t
    is followed by perm[t], 10 % of tokens replaced by random ones), plain vs patched with every kernel
    (autopatch.apply(model, cross_entropy=True)), in fp32, in bf16 autocast over fp32 weights, and in
    pure bf16 weights. Compared: the per-step training loss, the final parameters and the eval logits
    and eval loss on a held-out batch. Tolerances (per step |Δloss| <= atol + rtol * |loss|):
        fp32            atol 2e-5, rtol 2e-5; parameters and eval logits 2e-4 relative (norm-wise)
        bf16 (both)     atol 1e-2, rtol 1e-2; parameters and eval logits 5e-2 relative; and the mean
                        distance of ours from a plain fp32 run at most 1.5x plain bf16's + atol
    (Liger-Kernel's convergence tests use atol 1e-2 / rtol 5e-2 per step in bf16.) The measured
    differences go to $OUT/stack_convergence.json when OUT is set. (Measured on the CPU, kernels in
    Triton's interpreter, a 2-layer tiny Llama, fp32, 200 steps: max |Δloss| 1e-6, parameters 1.6e-6.)
  - Two GPUs (skipped with fewer): a model split with device_map="auto" trains with the same loss and
    gradients patched as plain; every kernel run on tensors of cuda:1 while cuda:0 is current gives the
    same result as on cuda:0 (Triton launches on the current device unless the op switches). Both run in
    a child process, so that a kernel launched on the wrong device (an illegal memory access poisons the
    CUDA context) fails one test instead of every test after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ddp_fsdp_check import warmup_cosine  # noqa: E402  (the two-GPU script's schedule: one formula)

from helpers import rel_err

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")

TESTS = Path(__file__).resolve().parent
STEPS = 200
TOLERANCE = {  # precision -> (atol, rtol) per step, relative bound for parameters and eval logits
    "fp32": (2e-5, 2e-5, 2e-4),
    "bf16-autocast": (1e-2, 1e-2, 5e-2),
    "bf16": (1e-2, 1e-2, 5e-2),
}
# The schedule a real run would use (Trainer's defaults are similar: linear warm-up, decay, max_grad_norm
# 1.0). With a constant lr 1e-3, no warm-up and no clipping, the loss spiked near step 35 and two fp32
# runs of the *plain* model whose initial weights differ by 1e-6 (relative) were 1.1e-2 apart there; with
# this schedule the same two runs stay within 1.7e-5 for all 200 steps (CPU: scripts/schedule_sensitivity.py,
# which prints the largest per-step difference per schedule). Equality tests need a schedule on which rounding does not explode.
LR, WARMUP, CLIP = 1e-3, 20, 1.0


def lr_factor(step: int) -> float:
    return warmup_cosine(step, WARMUP, STEPS)


CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)


def small_llama(dtype=torch.float32, device="cuda", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def learnable_batch(perm, generator, batch=8, seq=128, noise=0.1, device="cuda"):
    """Token ids below perm.numel(): each follows perm[previous], except a `noise` fraction drawn at random."""
    n = perm.numel()
    rows = torch.empty(batch, seq, dtype=torch.long)
    rows[:, 0] = torch.randint(0, n, (batch,), generator=generator)
    for t in range(1, seq):
        rows[:, t] = perm[rows[:, t - 1]]
        swap = torch.rand(batch, generator=generator) < noise
        rows[swap, t] = torch.randint(0, n, (int(swap.sum()),), generator=generator)
    labels = rows.clone()
    labels[:, :4] = -100  # a prompt that is not trained on
    return rows.to(device), labels.to(device)


def train(model, precision: str) -> dict:
    import fused_kernels

    perm = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    autocast = precision == "bf16-autocast"
    before = fused_kernels.launch_counts()
    losses = []
    model.train()
    for _ in range(STEPS):
        ids, labels = learnable_batch(perm, data)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    model.eval()
    ids, labels = learnable_batch(perm, torch.Generator().manual_seed(99))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=labels)
    after = fused_kernels.launch_counts()
    return {
        "losses": torch.stack(losses).cpu().tolist(),
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "eval_logits": out.logits.float(),
        "eval_loss": out.loss.float().item(),
        "launches": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
    }


def write_result(name: str, entry: dict) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    path = Path(out) / "stack_convergence.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = entry
    path.write_text(json.dumps(data, indent=1))


@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_convergence_patched_vs_plain(precision):
    import autopatch
    from autopatch import patching

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    patching.restore_all()
    plain = train(small_llama(dtype), precision)
    assert plain["launches"] == {}
    try:
        model = small_llama(dtype)
        autopatch.apply(model, cross_entropy=True)
        patched = train(model, precision)
    finally:
        patching.restore_all()

    atol, rtol, rel = TOLERANCE[precision]
    diffs = [abs(a - b) for a, b in zip(patched["losses"], plain["losses"])]
    bad = [i for i, (d, ref) in enumerate(zip(diffs, plain["losses"])) if not d <= atol + rtol * abs(ref)]
    param_err = {n: rel_err(patched["params"][n], p) for n, p in plain["params"].items()}
    logits_err = rel_err(patched["eval_logits"], plain["eval_logits"])
    entry = {
        "steps": STEPS, "loss_first_last_plain": [plain["losses"][0], plain["losses"][-1]],
        "loss_first_last_patched": [patched["losses"][0], patched["losses"][-1]],
        "max_abs_loss_diff": max(diffs), "step_of_max": diffs.index(max(diffs)),
        "max_param_rel_err": max(param_err.values()), "eval_logits_rel_err": logits_err,
        "eval_loss": [plain["eval_loss"], patched["eval_loss"]], "tolerance": [atol, rtol, rel],
        "launches": patched["launches"], "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
    }
    if precision != "fp32":
        # Besides step-by-step equality with plain bf16: does ours track the exact (fp32) training as
        # closely as transformers' own bf16 code does? The yardstick: a plain fp32 run from the same
        # start. (With a constant lr and no warm-up, a loss spike near step 35 drove two bf16 runs
        # 0.65 apart; this criterion was what still held there.)
        truth = train(small_llama(torch.float32), "fp32")
        ours_dev = [abs(a - b) for a, b in zip(patched["losses"], truth["losses"])]
        theirs_dev = [abs(a - b) for a, b in zip(plain["losses"], truth["losses"])]
        entry.update({
            "mean_abs_dev_from_fp32": {"ours": sum(ours_dev) / STEPS, "plain": sum(theirs_dev) / STEPS},
            "eval_loss_fp32": truth["eval_loss"],
            "param_rel_err_vs_fp32": {
                "ours": max(rel_err(patched["params"][n], p) for n, p in truth["params"].items()),
                "plain": max(rel_err(plain["params"][n], p) for n, p in truth["params"].items())},
        })
    write_result(precision, entry)

    assert plain["losses"][-1] < 0.5 * plain["losses"][0], f"the plain model did not learn: {entry}"
    for kernel in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
        assert patched["launches"].get(f"{kernel}_fwd", 0) >= STEPS, (kernel, patched["launches"])
    assert patched["launches"].get("cross_entropy_fwd", 0) >= 1, "eval loss on full logits: fused CE"
    if precision == "fp32":
        assert not bad, f"{precision}: loss differs beyond atol {atol} + rtol {rtol} at steps {bad[:10]}: {entry}"
        worst = max(param_err, key=param_err.get)
        assert param_err[worst] <= rel, f"{precision}: parameter {worst} rel err {param_err[worst]:.3e} > {rel}"
        assert logits_err <= rel, f"{precision}: eval logits rel err {logits_err:.3e} > {rel}"
        assert abs(patched["eval_loss"] - plain["eval_loss"]) <= atol + rtol * abs(plain["eval_loss"]), entry
        return
    # bf16: every step within atol 1e-2 + rtol 1e-2 (Liger's convergence tests: rtol 5e-2), and the final
    # parameters and eval logits within 5e-2 (H200, this schedule: steps 4.2e-3 / 2.5e-3 at most,
    # parameters 1.0e-2 / 1.9e-2, logits 2.5e-3 / 3.5e-3 for bf16-autocast / bf16)
    assert not bad, f"{precision}: loss differs beyond atol {atol} + rtol {rtol} at steps {bad[:10]}: {entry}"
    worst = max(param_err, key=param_err.get)
    assert param_err[worst] <= rel, f"{precision}: parameter {worst} rel err {param_err[worst]:.3e} > {rel}"
    assert logits_err <= rel, f"{precision}: eval logits rel err {logits_err:.3e} > {rel}"
    # and ours tracks exact (fp32) training about as closely as transformers' own bf16 code does
    dev = entry["mean_abs_dev_from_fp32"]
    assert dev["ours"] <= 1.5 * dev["plain"] + atol, f"{precision}: ours strays further from fp32 training: {entry}"
    pe = entry["param_rel_err_vs_fp32"]
    assert pe["ours"] <= 1.5 * pe["plain"] + 1e-2, f"{precision}: parameters further from fp32: {entry}"
    assert abs(patched["eval_loss"] - truth["eval_loss"]) <= 2 * abs(plain["eval_loss"] - truth["eval_loss"]) + atol + rtol * truth["eval_loss"], entry


# ------------------------------------------------------------------------------------------ two GPUs
def run_child(body: str, timeout: int = 240) -> dict:
    """Run `body` (which prints one JSON line last) in a fresh interpreter with the tests importable."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@two_gpus
def test_every_kernel_on_the_second_gpu():
    result = run_child("""
        import json, torch, fused_kernels as fk
        from helpers import rel_err
        torch.cuda.set_device(0)
        g = torch.Generator().manual_seed(0)
        def rnd(*shape):
            return torch.randn(*shape, generator=g)
        x, w = rnd(64, 256), rnd(256)
        gate, up = rnd(64, 512), rnd(64, 512)
        q, k, cos, sin = rnd(2, 4, 16, 64), rnd(2, 2, 16, 64), rnd(2, 16, 64), rnd(2, 16, 64)
        logits, target = rnd(64, 1000), torch.randint(0, 1000, (64,), generator=g)
        hidden, weight = rnd(64, 256), rnd(1000, 256)
        cases = {
            "rms_norm": (lambda x, w: fk.rms_norm(x, w), (x, w)),
            "swiglu": (fk.swiglu, (gate, up)),
            "geglu": (fk.geglu, (gate, up)),
            "rope": (lambda q, k, c, s: fk.rope(q, k, c, s), (q, k, cos, sin)),
            "cross_entropy": (lambda l, t: fk.cross_entropy(l, t), (logits, target)),
            "fused_linear_cross_entropy": (lambda h, w, t: fk.fused_linear_cross_entropy(h, w, t), (hidden, weight, target)),
        }
        def run(fn, args, device):
            args = [a.to(device).requires_grad_(a.is_floating_point()) for a in args]
            out = fn(*args)
            outs = out if isinstance(out, tuple) else (out,)
            sum((o.float() * torch.linspace(0.5, 1.5, o.numel(), device=device).view(o.shape)).sum() for o in outs).backward()
            torch.cuda.synchronize(device)
            return [o.detach().cpu() for o in outs] + [a.grad.cpu() for a in args if a.grad is not None]
        errors = {}
        for name, (fn, args) in cases.items():
            ref = run(fn, args, "cuda:0")
            got = run(fn, args, "cuda:1")  # cuda:0 stays the current device
            assert torch.cuda.current_device() == 0
            errors[name] = max(rel_err(a, b) for a, b in zip(got, ref))
            print(name, errors[name], flush=True)
        print(json.dumps(errors))
    """)
    bad = {k: v for k, v in result.items() if not v <= 1e-5}
    assert not bad, f"kernels on cuda:1 (cuda:0 current) differ from cuda:0: {bad}"


@two_gpus
def test_device_map_auto_split_over_two_gpus(tmp_path):
    result = run_child(f"""
        import json, torch
        import autopatch, fused_kernels
        from helpers import rel_err
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained({str(tmp_path)!r})
        size = sum(p.numel() * 4 for p in LlamaForCausalLM(config).parameters())
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.float32, device_map="auto",
                                                     max_memory={{0: int(0.5 * size), 1: 4 * size}},
                                                     attn_implementation="sdpa")
        devices = sorted({{str(d) for d in model.hf_device_map.values()}})
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 4096, (2, 64), generator=g).to("cuda:0")
        labels = ids.clone(); labels[:, :5] = -100
        def step():
            model.zero_grad(set_to_none=True)
            model.train()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            return loss.detach().float().cpu(), {{n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}}
        plain_loss, plain_grads = step()
        before = fused_kernels.launch_counts()
        autopatch.apply(model, cross_entropy=True)
        loss, grads = step()
        after = fused_kernels.launch_counts()
        print(json.dumps({{
            "devices": devices, "param_devices": sorted({{str(p.device) for p in model.parameters()}}),
            "loss_rel_err": rel_err(loss, plain_loss),
            "max_grad_rel_err": max(rel_err(grads[n], g) for n, g in plain_grads.items()),
            "launches": {{k: after[k] - before.get(k, 0) for k in after}},
        }}))
    """)
    assert result["param_devices"] == ["cuda:0", "cuda:1"], f"the model was not split: {result}"
    assert result["loss_rel_err"] <= 1e-5 and result["max_grad_rel_err"] <= 1e-5, result
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert result["launches"].get(f"{kernel}_fwd", 0) > 0, result
