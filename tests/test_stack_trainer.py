"""Hugging Face Trainer with autopatch: a tiny Llama trained 2 optimizer steps (batch 2, gradient
accumulation 2, variable-length padded batches with ignored labels) by tests/stack_worker.py.

  - plain, in this process (nothing patched, no kernel runs): the reference;
  - FUSED_KERNELS=all, the worker started by `accelerate launch --cpu` (a fresh process that imports
    nothing from autopatch, patched by the environment alone): same per-step losses and final parameters
    (float32: 1e-5 relative), the fused linear CE and the other kernels ran, so Trainer's
    num_items_in_batch (counted over both micro-batches) reached the fused loss. (Two ranks, DDP and
    FSDP2 under torchrun: tests/test_stack_launchers.py; accelerate with two GPUs: dev/two_gpu_check.sh);
  - autopatch.apply(trainer.model, **liger_kernel_config) in this process, with a config that takes
    the fused cross_entropy instead of the fused linear CE: the same again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stack_worker
from helpers import assert_close
from test_e2e_env import clean_env

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

REPO = Path(__file__).resolve().parents[1]
F32 = torch.float32
# What a user passes as TrainingArguments(liger_kernel_config=...): the fused CE on the full logits here,
# so the in-process run covers the other loss path than FUSED_KERNELS=all's fused linear CE.
LIGER_KERNEL_CONFIG = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": True,
                       "fused_linear_cross_entropy": False}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from autopatch import patching

    patching.restore_all()  # a plain reference whatever ran before in this process
    result = stack_worker.train_with_trainer(str(tmp_path_factory.mktemp("plain")))
    assert result["launches"] == {}, "the plain Trainer run must not touch the kernels"
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["accepts_loss_kwargs"], "Trainer must pass num_items_in_batch to the model"
    return result


def assert_same_training(got: dict, ref: dict, what: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]), f"{what}: {got['losses']} vs {ref['losses']}"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert_close(torch.tensor(a), torch.tensor(b), F32, f"{what}: loss of step {step}")
    assert set(got["params"]) == set(ref["params"])
    for name, value in ref["params"].items():
        assert_close(got["params"][name], value, F32, f"{what}: parameter {name} after training")


def test_trainer_under_accelerate_launch_patched_by_environment_alone(plain, tmp_path):
    out = tmp_path / "trainer.pt"
    # accelerate's launcher on the CPU starts the script as one child process with the environment
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    proc = subprocess.run(
        [*launch, str(REPO / "tests" / "stack_worker.py"), "trainer", str(out), str(tmp_path / "run")],
        env=clean_env(FUSED_KERNELS="all"), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    got = torch.load(out, weights_only=False)
    assert got["pid"] != os.getpid() and got["parent_pid"] != os.getpid(), "the worker is accelerate's child"
    assert_same_training(got, plain, "Trainer under accelerate launch, FUSED_KERNELS=all")
    assert got["accepts_loss_kwargs"], "the patched forward must keep the signature Trainer inspects"
    launches = got["launches"]
    # 2 steps x 2 micro-batches: every one through the fused linear CE, forward and backward
    assert launches.get("fused_linear_cross_entropy_fwd") == 4, launches
    assert launches.get("fused_linear_cross_entropy_bwd") == 4, launches
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert launches.get(f"{kernel}_fwd", 0) > 0 and launches.get(f"{kernel}_bwd", 0) > 0, (kernel, launches)
    patched = {r["kernel"] for r in got["records"] if r["patched"] and r["module"].endswith("modeling_llama")}
    assert patched >= {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"}, patched
    assert "autopatch: modeling_llama:" in proc.stderr
    # Trainer imports peft when it is installed, and peft imports Bloom's modeling module: patched and
    # recorded, but no line names a model the run does not build
    lines = [line for line in proc.stderr.splitlines() if line.startswith("autopatch: modeling_")]
    assert all(line.startswith("autopatch: modeling_llama:") for line in lines), lines
    if "transformers.models.bloom.modeling_bloom" in {r["module"] for r in got["records"]}:
        assert any(r["patched"] for r in got["records"] if r["module"].endswith("modeling_bloom"))


def test_trainer_model_with_apply_liger_kernel_config(plain, tmp_path):
    from autopatch import patching

    try:
        got = stack_worker.train_with_trainer(str(tmp_path), apply_config=LIGER_KERNEL_CONFIG)
    finally:
        patching.restore_all()
    assert_same_training(got, plain, "Trainer, autopatch.apply(trainer.model, **liger_kernel_config)")
    launches = got["launches"]
    assert launches.get("cross_entropy_fwd") == 4 and launches.get("cross_entropy_bwd") == 4, launches
    assert "fused_linear_cross_entropy_fwd" not in launches, "fused_linear_cross_entropy=False in the config"
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert launches.get(f"{kernel}_fwd", 0) > 0, (kernel, launches)


LIGER_TRAINER = """
import sys
sys.path.insert(0, {tests!r})
import stack_worker
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir={out!r}, use_cpu=True, report_to=[], save_strategy="no", max_steps=1,
                         per_device_train_batch_size=2, use_liger_kernel=True, disable_tqdm=True,
                         remove_unused_columns=False)
trainer = Trainer(model=stack_worker.tiny_llama(), args=args, train_dataset=stack_worker.VariableLengthDataset(),
                  data_collator=stack_worker.pad_collate)
print("TRAINING", file=sys.stderr, flush=True)
try:
    trainer.train()
except Exception as exc:  # Liger's own kernels on this CPU are not what this test is about
    print("liger training:", type(exc).__name__, file=sys.stderr)
"""


def test_trainer_use_liger_kernel_with_fused_kernels_all_says_who_wins(tmp_path):
    """TrainingArguments(use_liger_kernel=True) under FUSED_KERNELS=all: Trainer patches the built
    model's instances with Liger's code; before the first training forward one line says which layers
    run Liger's code and how to choose."""
    script = tmp_path / "liger_trainer.py"
    script.write_text(LIGER_TRAINER.format(tests=str(REPO / "tests"), out=str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, str(script)], env=clean_env(FUSED_KERNELS="all"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("autopatch:") and "Liger" in ln]
    assert len(lines) == 1, proc.stderr
    assert proc.stderr.index("TRAINING") < proc.stderr.index(lines[0])
    assert "Liger's code runs for " in lines[0] and "rms_norm (LlamaRMSNorm)" in lines[0], lines[0]
    assert "unset use_liger_kernel" in lines[0] and "AUTOPATCH_RMS_NORM=false" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
