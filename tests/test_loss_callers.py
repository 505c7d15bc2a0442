"""Who passes the fused linear cross entropy over (autopatch.rules._loss_callers), on a tiny Llama with
a peft LoRA adapter (hidden 64, 2 layers, vocab 128, r=4), float32, CPU, kernels in Triton's interpreter.

Reads of lm_head that compute no logits must not be reported as a bypass: weight tying while a model
is built in training mode (a config's model, and from_pretrained's), peft's wrapping
(target_modules="all-linear" reads get_output_embeddings()), get_output_embeddings(), parameter
counting, state_dict(), moving devices, a log line reading lm_head each step. A loop that computes
its logits from lm_head itself and steps the optimizer is named, with its function.

In this process the loss rule alone is patched; one subprocess runs Hugging Face Trainer with
FUSED_KERNELS=all, AUTOPATCH_STRICT and AUTOPATCH_REPORT (patched by the environment alone) and must
report the fused loss as run, not bypassed, with the plain run's losses.

    python tests/test_loss_callers.py OUT.json OUTPUT_DIR      (the subprocess's entry point)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

pytest.importorskip("peft", reason="peft is a test dependency (pip install -e .[test])")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

pytestmark = pytest.mark.slow

FLCE = "fused_linear_cross_entropy"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
BATCH, SEQ, STEPS = 2, 12, 2


# --------------------------------------------------------------------------- shared with the subprocess
def tiny_lora_llama(target_modules, tie: bool = True):
    """A tiny Llama built from a config (so in training mode, as from_pretrained builds it: a tied head
    is tied while training is on) wrapped by get_peft_model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=tie, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def harmless_reads(model) -> int:
    """What training scripts do with a model before training: none of it computes logits."""
    model.print_trainable_parameters()
    head = model.get_output_embeddings()
    assert head is model.base_model.model.lm_head
    model.to("cpu")
    n = sum(p.numel() for p in model.parameters())
    n += len(model.state_dict()) + len(list(model.named_parameters()))
    return n + head.out_features


def batches(n: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train_with_trainer(output_dir: str) -> dict:
    """Trainer, STEPS optimizer steps of batch BATCH over a q_proj/v_proj LoRA adapter; the logged losses."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    model = tiny_lora_llama(["q_proj", "v_proj"])
    harmless_reads(model)
    log = Losses()
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                             max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
                             lr_scheduler_type="constant", seed=0, data_seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=batches(), callbacks=[log]).train()
    return {"losses": log.losses}


# --------------------------------------------------------------------------- in this process
@pytest.fixture
def patched_session(restore_patches):
    """The loss rule on modeling_llama (the fused linear CE only), optimizer steps counted, a fresh run."""
    import importlib

    from autopatch import runtime
    from autopatch.rules import loss as loss_rule
    from autopatch.session import current

    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    records = loss_rule.RULE.patch_module(llama, current(), lambda kernel: kernel == FLCE)
    assert any(r.patched and r.kernel == FLCE for r in records), records
    session = current()
    assert runtime.watch_training(session), "torch's global optimizer step hook must count the steps"
    session.reset_runs()
    yield session
    session.reset_runs()


def _fused_launches() -> int:
    import fused_kernels

    return fused_kernels.launch_counts().get("fused_linear_cross_entropy_fwd", 0)


def _optimizer(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_harmless_reads_in_training_are_not_a_bypass(patched_session, capsys):
    model = tiny_lora_llama("all-linear")  # tying and peft's all-linear read lm_head from this frame
    assert model.training and model.base_model.model.lm_head.weight is model.get_input_embeddings().weight
    harmless_reads(model)
    assert patched_session.bypassed == {}, "reads that compute nothing, before training"
    opt = _optimizer(model)
    before = _fused_launches()
    data = batches()
    for step in range(3):
        batch = {k: torch.stack([b[k] for b in data[2 * step:2 * step + 2]]) for k in ("input_ids", "labels")}
        loss = model(**batch).loss
        loss.backward()
        # a log line that reads lm_head every step, beside the loss that goes through the patched forward
        norm = model.base_model.model.lm_head.weight.norm().item()
        assert torch.isfinite(loss) and norm > 0
        opt.step()
        opt.zero_grad()
    assert _fused_launches() - before == 3, "the fused linear CE computed every step's loss"
    assert patched_session.trained["optimizer_steps"] == 3
    assert patched_session.bypassed == {}, patched_session.bypassed
    assert "bypass" not in capsys.readouterr().err


def train_from_own_logits(model, steps: int, session) -> list:
    """A loop that takes its logits from lm_head itself: the backbone, then lm_head, then the loss."""
    base = model.base_model.model
    opt = _optimizer(model)
    data = batches()
    seen = []
    for step in range(steps):
        ids = torch.stack([b["input_ids"] for b in data[2 * step:2 * step + 2]])
        hidden = base.model(input_ids=ids).last_hidden_state
        logits = base.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append(dict(session.bypassed))
    return seen


def test_logits_from_lm_head_in_the_loop_is_named(patched_session):
    model = tiny_lora_llama(["q_proj", "v_proj"])
    harmless_reads(model)
    before = _fused_launches()
    seen = train_from_own_logits(model, 3, patched_session)
    assert _fused_launches() == before, "the loop never calls the patched forward with labels"
    # one read proves nothing; the read after an optimizer step without the patched forward does
    assert seen[0] == {}, seen[0]
    entry = patched_session.bypassed.get(FLCE)
    assert entry is not None, seen
    assert entry["why"] == (f"{__name__}.train_from_own_logits read lm_head in training outside the model's forward, "
                            "and an optimizer step passed without the model's forward being called with labels"), entry
    assert entry["target"] == "LlamaForCausalLM" and entry["model_type"] == "llama" and not entry["certain"], entry


def test_own_logits_after_fused_steps_are_named_too(patched_session):
    """The fused loss ran for a while, then the loop switched to its own logits: that is said."""
    model = tiny_lora_llama(["q_proj", "v_proj"], tie=False)
    opt = _optimizer(model)
    batch = {k: torch.stack([b[k] for b in batches()[:2]]) for k in ("input_ids", "labels")}
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert patched_session.bypassed == {}
    train_from_own_logits(model, 3, patched_session)
    assert "train_from_own_logits read lm_head" in patched_session.bypassed[FLCE]["why"], patched_session.bypassed


def test_trl_sft_with_peft_names_trls_head_not_its_adapter_check(restore_patches, tmp_path):
    """SFTTrainer's __init__ reads get_output_embeddings() (it refuses an adapter on lm_head): that read
    computes nothing. The loss is TRL's own fused head's (add_fused_lm_head), and the report says so."""
    pytest.importorskip("trl")
    import importlib

    import test_stack_trl
    from autopatch import runtime
    from autopatch.rules import loss as loss_rule
    from autopatch.session import current

    qwen2 = importlib.import_module("transformers.models.qwen2.modeling_qwen2")
    assert any(r.patched for r in loss_rule.RULE.patch_module(qwen2, current(), lambda kernel: kernel == FLCE))
    session = current()
    runtime.watch_training(session)
    session.reset_runs()
    try:
        trainer = test_stack_trl.make_trainer("sft_lora", str(tmp_path), [])
        assert trainer.model.training
        assert session.bypassed == {}, "the adapter check in SFTTrainer.__init__ computes nothing"
        trainer.train()
        entry = dict(session.bypassed.get(FLCE, {}))
    finally:
        session.reset_runs()
    assert entry.get("why", "").startswith("TRL's own fused LM head computed the loss"), entry
    assert entry["certain"] and entry["target"] == "Qwen2ForCausalLM", entry


# --------------------------------------------------------------------------- the subprocess
def test_trainer_with_peft_under_fused_kernels_all_reports_the_fused_loss_ran(tmp_path):
    from autopatch import patching
    from test_e2e_env import clean_env

    patching.restore_all()  # a plain reference whatever ran before in this process
    plain = train_with_trainer(str(tmp_path / "plain"))
    assert len(plain["losses"]) == STEPS and all(torch.isfinite(torch.tensor(plain["losses"])))

    out, report_file = tmp_path / "patched.json", tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), str(out), str(tmp_path / "patched")],
        env=clean_env(FUSED_KERNELS="all", AUTOPATCH_STRICT="true", AUTOPATCH_REPORT=report_file),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(report_file.read_text())
    assert report["bypassed"] == {}, report["bypassed"]
    assert report["runs"][FLCE]["calls"] == STEPS, report["runs"][FLCE]
    assert report["trained"]["optimizer_steps"] == STEPS, report["trained"]
    assert report["runs"]["lora_input"]["calls"], report["runs"]  # the adapter's own rule ran too
    assert "never ran" not in proc.stderr and "bypass" not in proc.stderr, proc.stderr
    got = json.loads(out.read_text())["losses"]
    assert len(got) == STEPS, got
    for step, (a, b) in enumerate(zip(got, plain["losses"]), 1):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {step}: loss {a!r} under FUSED_KERNELS=all vs plain {b!r}"


def main(argv: list[str]) -> int:
    out, output_dir = argv
    Path(out).write_text(json.dumps(train_with_trainer(output_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
