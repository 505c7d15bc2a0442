"""End to end: tiny Llama, Qwen3, Gemma2, Mistral and Phi3 trained one step in fresh processes that
import nothing from autopatch (tests/e2e_worker.py), plain and patched, compared on loss, eval loss,
logits and every parameter gradient (float32 inputs: 1e-5 relative), with the Triton launches that
prove the kernels ran. Patched three ways: FUSED_KERNELS=all alone; `python -m autopatch run` with an
env file turning one kernel off and a per-model override; `autopatch.apply(model)` (in the plain
process, after every plain measurement).

Three subprocesses, each paying for torch + transformers + triton start-up, kernels in the
interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_close

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "e2e_worker.py"
MODELS = ("llama", "qwen3", "gemma2", "mistral", "phi3", "qwen3_moe")
MLP_KERNEL = {"gemma2": "geglu"}  # the others gate with SiLU
MLP_LAUNCHES = {"qwen3_moe": "moe_experts"}  # its MLPs are experts: the swiglu kernel's key, the experts op

pytestmark = pytest.mark.slow


def clean_env(**extra) -> dict:
    """This environment without any autopatch variable, TRITON_INTERPRET=1, and this checkout on
    PYTHONPATH (so the workers import the autopatch under test, wherever the environment's editable
    install points); `extra` last, a PYTHONPATH there replacing ours."""
    env = {k: v for k, v in os.environ.items()
           if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_") and k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(REPO)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_worker(tmp_path: Path, name: str, args: list, env: dict, prefix=()) -> dict:
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, *prefix, str(WORKER), str(out), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} worker failed:\n{proc.stdout}\n{proc.stderr}"
    data = torch.load(out, weights_only=False)
    data["stderr"] = proc.stderr
    return data


@pytest.fixture(scope="module")
def plain_and_applied(tmp_path_factory):
    """One process: every model plain, then llama again after autopatch.apply(model)."""
    data = run_worker(tmp_path_factory.mktemp("plain"), "plain", ["--apply", "llama"], clean_env())
    for name in MODELS:
        assert data["models"][name]["launches"] == {}, "the plain run must not touch the kernels"
    return data


@pytest.fixture(scope="module")
def plain(plain_and_applied):
    return plain_and_applied["models"]


def assert_same_training(got: dict, ref: dict, what: str) -> None:
    dt = torch.float32
    assert_close(got["loss"], ref["loss"], dt, f"{what}: loss")
    assert_close(got["eval_loss"], ref["eval_loss"], dt, f"{what}: eval loss")
    assert_close(got["logits"], ref["logits"], dt, f"{what}: logits")
    assert set(got["grads"]) == set(ref["grads"]), f"{what}: not the same parameters have gradients"
    assert len(ref["grads"]) == ref["n_params"], f"{what}: every parameter must get a gradient"
    for param, grad in ref["grads"].items():
        assert_close(got["grads"][param], grad, dt, f"{what}: grad {param}")


def ran(launches: dict, kernel: str) -> bool:
    return launches.get(f"{kernel}_fwd", 0) > 0


def patched_kernels(records: list, model: str) -> set[str]:
    return {r["kernel"] for r in records if r["patched"] and r["module"].endswith(f".modeling_{model}")}


def test_fused_kernels_all_matches_plain(plain, tmp_path):
    data = run_worker(tmp_path, "env", [], clean_env(FUSED_KERNELS="all"))
    for name in MODELS:
        got = data["models"][name]
        assert_same_training(got, plain[name], f"FUSED_KERNELS=all {name}")
        launches = got["launches"]
        mlp = MLP_KERNEL.get(name, "swiglu")
        for kernel in ("rms_norm", "rope", MLP_LAUNCHES.get(name, mlp), "fused_linear_cross_entropy"):
            assert ran(launches, kernel) and launches.get(f"{kernel}_bwd", 0) > 0, f"{name}: {kernel} {launches}"
        assert ran(launches, "cross_entropy"), f"{name}: eval loss on full logits goes through cross_entropy"
        assert patched_kernels(data["records"], name) >= {"rms_norm", "rope", mlp, "fused_linear_cross_entropy"}
        assert f"autopatch: modeling_{name}: rms_norm (" in data["stderr"]


def test_run_with_env_file_and_per_model_override(plain, tmp_path):
    envfile = tmp_path / "kernels.env"
    envfile.write_text("FUSED_KERNELS=all\nAUTOPATCH_ROPE=false\nAUTOPATCH_MODELS__mistral__RMS_NORM=false\n")
    data = run_worker(tmp_path, "run", ["--models", "llama,mistral"], clean_env(),
                      prefix=("-m", "autopatch", "run", "--env-file", str(envfile)))
    for name in ("llama", "mistral"):
        got = data["models"][name]
        assert_same_training(got, plain[name], f"autopatch run {name}")
        assert not ran(got["launches"], "rope"), f"{name}: rope is off in the env file"
        assert ran(got["launches"], "swiglu") and ran(got["launches"], "fused_linear_cross_entropy")
        assert "rope" not in patched_kernels(data["records"], name)
    assert ran(data["models"]["llama"]["launches"], "rms_norm")
    assert not ran(data["models"]["mistral"]["launches"], "rms_norm"), "per-model override: no rms_norm for mistral"
    assert "rms_norm" not in patched_kernels(data["records"], "mistral")


def test_apply_matches_plain(plain_and_applied):
    plain = plain_and_applied["models"]
    got = plain_and_applied["applied"]["llama"]
    assert_same_training(got, plain["llama"], "autopatch.apply(model)")
    launches = got["launches"]
    for kernel in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
        assert ran(launches, kernel), f"apply: {kernel} {launches}"
    assert not ran(launches, "cross_entropy"), "apply() leaves cross_entropy off by default, as HF/Liger do"
    records = plain_and_applied["records"]
    # causal_mask and masked_attention: ours, on by default in apply(); the one wraps LlamaModel.forward,
    # the other marks the module for the SDPA registry's wrapper (eager numbers unchanged)
    assert patched_kernels(records, "llama") == {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy",
                                                 "causal_mask", "masked_attention"}
    assert not [r for r in records if not r["module"].endswith(".modeling_llama")], "apply() touches llama only"
