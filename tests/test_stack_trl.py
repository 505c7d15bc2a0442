"""TRL's trainers with autopatch, for real: tiny models from configs, an offline word-level tokenizer,
2 optimizer steps of batch 2 on sequences of at most 16 tokens, float32, CPU.

For each of SFTTrainer (plain and with a PEFT LoRA adapter), DPOTrainer, KTOTrainer, GRPOTrainer (a
reward function, transformers' own generation, no vLLM) and DistillationTrainer: a plain run in this
process, then the same run with every kernel patched (autopatch.apply on the trainer's model, as
FUSED_KERNELS=all would patch it), and the logged losses and metrics must agree within the float32
bound. TRL 1.16 computes every one of these losses through its own chunked LM head
(`add_fused_lm_head`, `model(..., fused_lm_head=True)`; distillation: `chunked_divergence`), so our
fused linear cross entropy cannot run there; the tests assert what did run (RMSNorm, RoPE, SwiGLU
launches) and that the report says the loss kernel was bypassed and by whom. One subprocess runs SFT
with FUSED_KERNELS=all and AUTOPATCH_REPORT, patched by the environment alone, for the exit report and
its stderr line.

    python tests/test_stack_trl.py sft OUT.pt OUTPUT_DIR     (the subprocess's entry point)
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e .[test])")
pytest.importorskip("datasets", reason="TRL's trainers take datasets.Dataset")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

pytestmark = pytest.mark.slow

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
# every kernel the loss and layer rules know, as FUSED_KERNELS=all turns them on
ALL_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": True,
               "fused_linear_cross_entropy": True, "causal_mask": True}


# --------------------------------------------------------------------------- model, tokenizer, data
def tokenizer():
    """A word-level tokenizer over WORDS (ids 3..42), built in memory: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def tiny_model(arch: str = "qwen2", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(**TINY, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(config).float()


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def dataset(kind: str):
    from datasets import Dataset

    rng = random.Random(kind)
    n = 8
    if kind == "sft":
        return Dataset.from_dict({"text": [sentence(rng, 4, 12) for _ in range(n)]})
    prompts = [sentence(rng, 2, 5) for _ in range(n)]
    if kind == "dpo":
        return Dataset.from_dict({"prompt": prompts, "chosen": [sentence(rng, 2, 6) for _ in range(n)],
                                  "rejected": [sentence(rng, 2, 6) for _ in range(n)]})
    if kind == "kto":
        return Dataset.from_dict({"prompt": prompts, "completion": [sentence(rng, 2, 6) for _ in range(n)],
                                  "label": [i % 2 == 0 for i in range(n)]})
    return Dataset.from_dict({"prompt": prompts})  # grpo, distillation: completions are generated


def reward_w7(completions, **kwargs):
    """GRPO's reward: how often the completion says w7 (any real number works; this one varies)."""
    return [float(str(c).split().count("w7")) + 0.1 * len(str(c).split()) for c in completions]


def common_args(output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, max_steps=2,
                per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="constant", seed=0, data_seed=0,
                dataloader_num_workers=0, disable_tqdm=True, bf16=False, fp16=False)


def make_trainer(kind: str, output_dir: str, callbacks: list):
    import trl

    tok = tokenizer()
    args = common_args(output_dir)
    if kind in ("sft", "sft_lora"):
        peft_config = None
        if kind == "sft_lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                     task_type="CAUSAL_LM")
        return trl.SFTTrainer(model=tiny_model("qwen2"), args=trl.SFTConfig(**args, max_length=16),
                              train_dataset=dataset("sft"), processing_class=tok, callbacks=callbacks,
                              peft_config=peft_config)
    if kind == "dpo":
        return trl.DPOTrainer(model=tiny_model("llama"), ref_model=tiny_model("llama", seed=1),
                              args=trl.DPOConfig(**args, max_length=16), train_dataset=dataset("dpo"),
                              processing_class=tok, callbacks=callbacks)
    if kind == "kto":
        from trl.trainer.kto_trainer import KTOConfig, KTOTrainer

        return KTOTrainer(model=tiny_model("qwen2"), ref_model=tiny_model("qwen2", seed=1),
                          args=KTOConfig(**args, max_length=16), train_dataset=dataset("kto"),
                          processing_class=tok, callbacks=callbacks)
    if kind == "grpo":
        return trl.GRPOTrainer(model=tiny_model("qwen2"), reward_funcs=reward_w7,
                               args=trl.GRPOConfig(**args, num_generations=2, max_completion_length=4,
                                                   generation_batch_size=2, use_vllm=False),
                               train_dataset=dataset("grpo"), processing_class=tok, callbacks=callbacks)
    if kind == "distillation":
        return trl.DistillationTrainer(model=tiny_model("qwen2"), teacher_model=tiny_model("qwen2", seed=1),
                                       args=trl.DistillationConfig(**args, max_completion_length=4, use_vllm=False),
                                       train_dataset=dataset("distillation"), processing_class=tok,
                                       callbacks=callbacks)
    raise ValueError(f"unknown trainer kind {kind!r}")


def launches() -> dict:
    fused = sys.modules.get("fused_kernels")
    return dict(fused.launch_counts()) if fused is not None else {}


def train(kind: str, output_dir: str, patch: bool = False) -> dict:
    """2 optimizer steps of TRL's `kind` trainer; with `patch`, autopatch.apply(trainer.model) with every
    kernel on before training. Returns the logged metrics of each step and the launches during training."""
    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def __init__(self):
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    log = Log()
    trainer = make_trainer(kind, output_dir, [log])
    if patch:
        import autopatch

        autopatch.apply(trainer.model, **ALL_KERNELS)
    before = launches()
    trainer.train()
    after = launches()
    return {"logs": log.logs,
            "launches": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}


# --------------------------------------------------------------------------- comparison
# metrics that are not a function of the model's numbers (time, throughput, counters)
NOT_NUMERIC = {"learning_rate", "epoch", "num_tokens", "step_time"}
RTOL = 1e-5  # the float32 bound of the stack tests (tests/helpers.py REL_TOL); absolute below 1


def assert_same_logs(got: list[dict], ref: list[dict], what: str) -> None:
    assert len(ref) == 2, f"{what}: expected 2 logged steps, got {ref}"
    assert len(got) == len(ref), f"{what}: {len(got)} logged steps vs {len(ref)} plain"
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert set(a) == set(b), f"{what}, step {step}: metrics {sorted(a)} vs plain {sorted(b)}"
        assert math.isfinite(b["loss"]), f"{what}, step {step}: plain loss {b['loss']}"
        for key in sorted(b):
            if key in NOT_NUMERIC or "time" in key or "per_second" in key:
                continue
            x, y = a[key], b[key]
            assert not math.isnan(x) and not math.isnan(y), f"{what}, step {step}: {key} is NaN ({x} vs {y})"
            assert abs(x - y) <= RTOL * max(1.0, abs(y)), f"{what}, step {step}: {key} {x!r} vs plain {y!r}"


def assert_layer_kernels_ran(launched: dict, what: str) -> None:
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert launched.get(f"{kernel}_fwd", 0) > 0 and launched.get(f"{kernel}_bwd", 0) > 0, (what, kernel, launched)


# --------------------------------------------------------------------------- the tests
KINDS = ["sft", "sft_lora", "dpo", "kto", "grpo", "distillation"]


@pytest.mark.parametrize("kind", KINDS)
def test_trl_trainer_plain_vs_all_kernels(kind, tmp_path):
    from autopatch import patching, report, session

    patching.restore_all()  # a plain reference whatever ran before in this process
    plain = train(kind, str(tmp_path / "plain"))
    assert plain["launches"] == {}, f"{kind}: the plain run must not touch the kernels: {plain['launches']}"
    session.current().reset_runs()
    import fused_kernels

    fused_kernels.reset_launch_counts()  # the run counts are per process: start them here (tests count differences)
    try:
        patched = train(kind, str(tmp_path / "patched"), patch=True)
        state = {"runs": report.runs(), "trained": dict(session.current().trained), "bypassed": report.bypassed()}
    finally:
        patching.restore_all()
        session.current().reset_runs()
    assert_same_logs(patched["logs"], plain["logs"], f"TRL {kind}, every kernel patched")
    assert_layer_kernels_ran(patched["launches"], f"TRL {kind}")
    # TRL's own head computes the loss: our fused linear CE is patched but never runs, and the report says why
    assert "fused_linear_cross_entropy_fwd" not in patched["launches"], patched["launches"]
    bypass = state["bypassed"].get("fused_linear_cross_entropy", "")
    assert bypass.startswith("TRL's own"), (kind, state)
    assert state["trained"]["optimizer_steps"] == 2, state
    assert state["runs"]["fused_linear_cross_entropy"]["calls"] == 0, state
    assert state["runs"]["rms_norm"]["calls"] > 0, state


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
    env.update(PYTHONPATH=str(REPO), TRITON_INTERPRET="1", **extra)
    return env


def test_trl_sft_patched_by_environment_alone_reports_what_ran(tmp_path):
    report_file = tmp_path / "report.json"
    out = tmp_path / "sft.pt"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "sft", str(out), str(tmp_path / "run")],
        env=_clean_env(FUSED_KERNELS="all", AUTOPATCH_REPORT=str(report_file)),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    got = torch.load(out, weights_only=False)
    assert_layer_kernels_ran(got["launches"], "TRL SFT under FUSED_KERNELS=all")
    data = json.loads(report_file.read_text())
    runs = data["runs"]
    assert runs["fused_linear_cross_entropy"]["calls"] == 0, runs
    assert runs["rms_norm"]["calls"] > 0 and runs["swiglu"]["calls"] > 0, runs
    assert data["trained"]["optimizer_steps"] == 2, data["trained"]
    assert data["bypassed"]["fused_linear_cross_entropy"].startswith("TRL's own"), data["bypassed"]
    assert any(r["kernel"] == "fused_linear_cross_entropy" and r["patched"] for r in data["records"]), data["records"]
    lines = [ln for ln in proc.stderr.splitlines() if "never ran" in ln]
    assert len(lines) == 1, proc.stderr
    assert "fused_linear_cross_entropy" in lines[0] and "TRL's own" in lines[0], lines[0]


def test_trl_sft_strict_mode_stops_on_the_bypass(tmp_path, monkeypatch):
    """AUTOPATCH_STRICT treats a patched loss that TRL's head replaces like a kernel left alone: apply()
    finds TRL's forward on the model and stops before training, with the override named."""
    from autopatch import patching, report, session
    from autopatch.session import StrictModeError

    session.current().reset_runs()
    monkeypatch.setenv("AUTOPATCH_STRICT", "1")  # apply() reads it
    try:
        with pytest.raises(StrictModeError) as err:
            train("sft", str(tmp_path / "strict"), patch=True)
        assert report.exit_verdict() is None, "the exception said it; the exit check stays quiet"
    finally:
        session.current().strict = False
        patching.restore_all()
        session.current().reset_runs()
    message = str(err.value)
    # TRL's fused head sets the model's forward on the instance: apply() finds it before training starts
    assert message.startswith("AUTOPATCH_STRICT: fused_linear_cross_entropy on Qwen2ForCausalLM was replaced after "
                              "autopatch patched it: trl."), message
    assert "_fused_forward runs instead" in message, message
    assert "AUTOPATCH_MODELS__qwen2__FUSED_LINEAR_CROSS_ENTROPY=false" in message, message


def main(argv: list[str]) -> int:
    kind, out, output_dir = argv
    result = train(kind, output_dir)
    torch.save(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
