"""Launchers start patched workers: `python -m autopatch run -m torch.distributed.run --nproc-per-node 2`
from a source checkout that is neither installed nor on PYTHONPATH (the base interpreter with this
environment's site-packages on PYTHONPATH: no .pth runs, as on a machine where the repository is only
copied; the way dev/two_gpu_check.sh starts its ranks). Two ranks on the CPU (gloo) train a tiny
Llama 2 steps under FSDP2 fully_shard with dev/ddp_fsdp_check.py (which imports nothing from
autopatch), kernels in Triton's interpreter: the launcher's sitecustomize must reach every rank.

Each rank must report autopatch loaded, the kernels patched and their launches; the all-reduced losses
must equal a plain single-process computation of the same two-rank step (mean loss of both ranks'
batches, AdamW, clipping): float32, 1e-5 relative.

The installed case (`FUSED_KERNELS=all torchrun ...`, the .pth in every process) is the one every fresh
process of the environment takes: tests/test_stack_trainer.py runs it under `accelerate launch`, and
dev/two_gpu_check.sh runs accelerate with two GPUs.
"""


from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_close
from test_e2e_env import clean_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "dev" / "ddp_fsdp_check.py"
STEPS = 2
SCRIPT_ARGS = ["--size", "tiny", "--dtype", "fp32", "--device", "cpu", "--steps", str(STEPS)]
EXPECTED_KERNELS = {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"}

pytestmark = pytest.mark.slow


def load_script():
    spec = importlib.util.spec_from_file_location("ddp_fsdp_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference_losses():
    """The two-rank training of the script, in one plain process: each step's loss is the mean of both
    ranks' losses and its gradient the mean of theirs (what DDP and FSDP all-reduce)."""
    from autopatch import patching

    patching.restore_all()
    check = load_script()
    size = check.SIZES["tiny"]
    model = check.build_model("tiny")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    schedule = check.lr_schedule(optimizer, check.parse_args([]).warmup, STEPS)
    perm = torch.randperm(size["data_vocab"], generator=torch.Generator().manual_seed(1234))
    streams = [torch.Generator().manual_seed(1000 + rank) for rank in range(2)]
    losses = []
    for _ in range(STEPS):
        per_rank = []
        for g in streams:
            ids, labels = check.make_batch(perm, size["batch"], size["seq"], g)
            per_rank.append(model(input_ids=ids, labels=labels, use_cache=False).loss)
        loss = sum(per_rank) / len(per_rank)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_launch(cmd: list, env: dict, cwd: Path, out: Path) -> dict:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def assert_ranks_patched(result: dict, reference: list, what: str) -> None:
    assert result["world_size"] == 2 and len(result["ranks"]) == 2, f"{what}: {result['ranks']}"
    assert len({r["pid"] for r in result["ranks"]}) == 2, f"{what}: two processes expected"
    for rank in result["ranks"]:
        assert rank["autopatch_loaded"], f"{what}: rank {rank['rank']} did not start autopatch"
        kernels = {p.split(":")[0] for p in rank["patched"]}
        assert kernels >= EXPECTED_KERNELS, f"{what}: rank {rank['rank']} patched {rank['patched']}"
        launches = rank["launches"]
        for kernel in EXPECTED_KERNELS:
            assert launches.get(f"{kernel}_fwd", 0) > 0 and launches.get(f"{kernel}_bwd", 0) > 0, \
                f"{what}: rank {rank['rank']} ran no {kernel}: {launches}"
        assert launches["fused_linear_cross_entropy_fwd"] == STEPS, f"{what}: {launches}"
    assert len(result["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(result["losses"], reference)):
        assert_close(torch.tensor(got), torch.tensor(want), torch.float32, f"{what}: loss of step {step}")


def uninstalled_interpreter() -> tuple[str, str]:
    """The base interpreter and a PYTHONPATH with this environment's site-packages: every dependency
    importable, but no .pth file of this environment runs (autopatch.pth, the editable install's)."""
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    if sys.prefix == sys.base_prefix or not base or not os.path.exists(base):
        pytest.skip("needs a virtual environment to stand for a machine where autopatch is not installed")
    return base, os.pathsep.join(site.getsitepackages())


def test_autopatch_run_reaches_torchrun_ranks_without_install(reference_losses, tmp_path):
    python, path = uninstalled_interpreter()
    out = tmp_path / "torchrun.json"
    env = clean_env(FUSED_KERNELS="all", PYTHONPATH=path)
    probe = subprocess.run([python, "-c", "import autopatch"], env=env, cwd=tmp_path, capture_output=True)
    assert probe.returncode != 0, "autopatch must not be importable outside the checkout for this test"
    # from the checkout, as `python -m autopatch` finds it in the working directory; the ranks run a script
    # in another folder, so they find autopatch only through the launcher
    cmd = [python, "-m", "autopatch", "run", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--parallel", "fsdp", *SCRIPT_ARGS, "--out", str(out)]
    result = run_launch(cmd, env, REPO, out)
    assert_ranks_patched(result, reference_losses, "autopatch run -m torch.distributed.run (fsdp)")
