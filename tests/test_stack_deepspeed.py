"""DeepSpeed ZeRO-3: the fused linear cross entropy on a partitioned lm_head.

Under ZeRO-3 `lm_head.weight` is an empty tensor outside lm_head's own forward (DeepSpeed's hooks
gather it only while the module runs), so the fused loss runs as lm_head's forward for one call
(autopatch.rules._zero3.run_through_module) and a head it cannot gather that way runs as
the model defines it, with one notice.

  - a partitioned-parameter stand-in (the ds_id / ds_status / ds_numel attributes DeepSpeed sets, the
    data empty outside the module's call, a pre-forward hook from a "deepspeed" module that gathers
    it): the fused loss runs inside the gather and matches the plain model, loss and gradients; the
    same stand-in without DeepSpeed's hook falls back, one notice, the same loss;
  - real DeepSpeed (optional: the `deepspeed` extra), when it is installed: ZeRO-3 and ZeRO-2 at world
    size 1 on the CPU (gloo) in a subprocess, 2 optimizer steps of a tiny Llama, plain and with every
    kernel patched: the same losses and final parameters within the float32 bound, and the fused
    linear cross entropy ran on every step; and the HF Trainer with `deepspeed=` (ZeRO-3), plain and
    patched by FUSED_KERNELS=all alone, the same logged losses.

    python tests/test_stack_deepspeed.py STAGE[-cuda] OUT.pt         (the subprocesses' entry points)
    python tests/test_stack_deepspeed.py trainer OUT.pt OUTPUT_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import stack_worker  # noqa: E402

F32 = torch.float32


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _gathering_hook(weight, full, entered):
    def gather(module, args):
        entered.append(True)
        weight.data = full  # what DeepSpeed's fetch does: the full tensor while the module runs
    gather.__module__ = "deepspeed.runtime.zero.parameter_offload"
    return gather


def _partition_stand_in(model, with_hook: bool):
    """Make lm_head.weight look partitioned: DeepSpeed's attributes, empty data outside lm_head's call."""
    weight = model.lm_head.weight
    full = weight.data
    weight.ds_id, weight.ds_status, weight.ds_numel = 7, "NOT_AVAILABLE", full.numel()
    weight.data = torch.empty(0, dtype=full.dtype)
    entered: list = []
    if with_hook:
        model.lm_head.register_forward_pre_hook(_gathering_hook(weight, full, entered))
    return full, entered


def test_zero3_stand_in_runs_the_fused_loss_inside_the_gather(capsys):
    import autopatch
    import fused_kernels
    from autopatch import patching
    from helpers import assert_close

    model = stack_worker.tiny_llama()
    model.train()
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    try:
        autopatch.apply(model)
        full, entered = _partition_stand_in(model, with_hook=True)
        before = fused_kernels.launch_counts().get("fused_linear_cross_entropy_fwd", 0)
        out = model(input_ids=ids, labels=labels)
        assert fused_kernels.launch_counts().get("fused_linear_cross_entropy_fwd", 0) == before + 1
        assert entered == [True], "the fused loss must run inside lm_head's call, where its hooks gather"
        out.loss.backward()
        assert_close(out.loss, ref.loss, F32, "loss on the gathered weight")
        for name, g in ref_grads.items():
            assert_close(model.get_parameter(name).grad, g, F32, f"grad {name}")
        assert "lm_head.forward" not in str(vars(model.lm_head).keys()) and "forward" not in vars(model.lm_head)
    finally:
        patching.restore_all()
    assert "ZeRO-3" not in capsys.readouterr().err


def test_zero3_stand_in_without_a_deepspeed_hook_falls_back_with_one_notice(capsys):
    import autopatch
    import fused_kernels
    from autopatch import patching
    from autopatch.session import current
    from helpers import assert_close

    model = stack_worker.tiny_llama()
    model.train()
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels).loss
    current().reset_runs()  # its notices are once per session
    try:
        autopatch.apply(model)
        full, _ = _partition_stand_in(model, with_hook=False)
        model.lm_head.weight.data = full  # the model's own head: here, as if its own gather had run
        before = fused_kernels.launch_counts().get("fused_linear_cross_entropy_fwd", 0)
        losses = [model(input_ids=ids, labels=labels).loss for _ in range(2)]
        assert fused_kernels.launch_counts().get("fused_linear_cross_entropy_fwd", 0) == before
        for loss in losses:
            assert_close(loss, ref, F32, "the model's own head and loss")
    finally:
        patching.restore_all()
    err = capsys.readouterr().err
    assert err.count("ZeRO-3 partitioned parameter but has no DeepSpeed hook to gather it") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_zero_plain_vs_patched(stage, tmp_path):
    _zero_plain_vs_patched(stage, "cpu", tmp_path)


@pytest.mark.gpu
def test_deepspeed_zero3_plain_vs_patched_on_the_gpu(tmp_path):
    """The same comparison on one GPU (NCCL, world size 1: ZeRO-3 still partitions every parameter),
    the kernels compiled for the GPU rather than interpreted."""
    _zero_plain_vs_patched(3, "cuda", tmp_path)


def _zero_plain_vs_patched(stage: int, device: str, tmp_path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional test dependency (pip install -e .[deepspeed])")
    from helpers import assert_close
    from test_e2e_env import clean_env

    out = tmp_path / "ds.pt"
    extra = {} if device == "cpu" else {"TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(Path(__file__)), f"{stage}-{device}", str(out)],
                          env=clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                                        MASTER_PORT=str(29500 + os.getpid() % 500 + stage), **extra),
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = torch.load(out, weights_only=False)
    plain, patched = got["plain"], got["patched"]
    assert len(plain["losses"]) == 2 and all(torch.isfinite(torch.tensor(plain["losses"])))
    for step, (a, b) in enumerate(zip(patched["losses"], plain["losses"]), 1):
        assert_close(torch.tensor(a), torch.tensor(b), F32, f"ZeRO-{stage} loss of step {step}")
    for name, value in plain["params"].items():
        assert value.numel() > 0, f"{name}: gathered parameter is empty"
        assert_close(patched["params"][name], value, F32, f"ZeRO-{stage} parameter {name} after training")
    assert plain["launches"] == {}, plain["launches"]
    launches = patched["launches"]
    assert launches.get("fused_linear_cross_entropy_fwd") == 2 and launches.get("fused_linear_cross_entropy_bwd") == 2, \
        launches
    for kernel in ("rms_norm", "rope", "swiglu"):
        assert launches.get(f"{kernel}_fwd", 0) > 0 and launches.get(f"{kernel}_bwd", 0) > 0, (kernel, launches)


@pytest.mark.slow
def test_hf_trainer_deepspeed_zero3_patched_by_environment_alone(tmp_path):
    """TrainingArguments(deepspeed=ZeRO-3 config), 2 optimizer steps of gradient accumulation 2: plain,
    then a fresh process with FUSED_KERNELS=all: the same logged losses, the fused linear cross
    entropy on every micro-batch (Trainer's num_items_in_batch reaching it)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional test dependency (pip install -e .[deepspeed])")
    from helpers import assert_close
    from test_e2e_env import clean_env

    runs = {}
    for name, extra in (("plain", {}), ("patched", {"FUSED_KERNELS": "all"})):
        out = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, str(Path(__file__)), "trainer", str(out), str(tmp_path / name)],
                              env=clean_env(PYTHONPATH=str(REPO), MASTER_PORT=str(29100 + os.getpid() % 400), **extra),
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{name} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        runs[name] = torch.load(out, weights_only=False)
    plain, patched = runs["plain"], runs["patched"]
    assert len(plain["losses"]) == 2 and plain["launches"] == {}, plain
    for step, (a, b) in enumerate(zip(patched["losses"], plain["losses"]), 1):
        assert_close(torch.tensor(a), torch.tensor(b), F32, f"Trainer ZeRO-3 loss of step {step}")
    launches = patched["launches"]
    assert launches.get("fused_linear_cross_entropy_fwd") == 4 and launches.get("fused_linear_cross_entropy_bwd") == 4, \
        launches


def _train_hf_trainer_zero3(output_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, max_steps=2,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="constant",
        seed=0, dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, deepspeed=config,
    )
    from helpers import loss_logger

    log = loss_logger()
    trainer = Trainer(model=stack_worker.tiny_llama(), args=args, train_dataset=stack_worker.VariableLengthDataset(),
                      data_collator=stack_worker.pad_collate, callbacks=[log])
    trainer.train()
    return {"losses": log.losses, "launches": stack_worker.launches()}


def _train_zero(stage: int, patch: bool, device: str) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    model = stack_worker.tiny_llama().to(device)
    if patch:
        import autopatch

        autopatch.apply(model, **{k: True for k in ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    fused = sys.modules.get("fused_kernels")
    before = dict(fused.launch_counts()) if fused else {}
    losses = []
    for step in range(2):
        ids, labels = _batch(seed=step)
        out = engine(input_ids=ids.to(device), labels=labels.to(device))
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
    after = dict(fused.launch_counts()) if fused else {}
    params = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None, enabled=stage == 3):
            params[name] = p.detach().cpu().clone()
    return {"losses": losses, "params": params,
            "launches": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}


def main(argv: list[str]) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29561")
    if argv[0] == "trainer":
        torch.save(_train_hf_trainer_zero3(argv[2]), argv[1])
        return 0
    stage, _, device = argv[0].partition("-")
    stage, device, out = int(stage), device or "cpu", argv[1]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    plain = _train_zero(stage, patch=False, device=device)
    patched = _train_zero(stage, patch=True, device=device)
    torch.save({"plain": plain, "patched": patched}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
