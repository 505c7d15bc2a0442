"""Hub kernels on a CUDA GPU with transformers 5.25 + kernels 0.19.1, offline (HF_HUB_OFFLINE=1): a tiny
Llama saved with save_pretrained and loaded with from_pretrained(device_map="cuda") (default use_kernels: transformers'
default mapping kernelizes RMSNorm and rotary_pos_emb, and in inference SiLU). LOCAL_KERNELS points
kernels-community/liger-kernels, kernels-community/rotary and kernels-community/activation at a stand-in
repository each test writes (torch-cuda variant), so nothing is fetched (offline, a default repository
without a stand-in fails the load). Each scenario runs in a fresh process; AUTOPATCH_REPORT's
`hub_kernels` says what ran per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import HUB_STANDIN

pytestmark = pytest.mark.gpu


SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import fused_kernels
    from transformers import AutoModelForCausalLM, KernelConfig

    checkpoint, route, repo = sys.argv[1], sys.argv[2], sys.argv[3]
    kwargs = {}
    if route == "theirs":
        kwargs = dict(use_kernels=True, kernel_config=KernelConfig(
            kernel_mapping={"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"}, inherit_mapping=False))
    elif route == "our-repo":
        kwargs = dict(use_kernels=True, kernel_config=KernelConfig(
            kernel_mapping={"RMSNorm": f"{repo}:RMSNorm", "rotary_pos_emb": f"{repo}:rotary_pos_emb"},
            use_local_kernel=True))
    # device_map as users load for Hub kernels: kernelize then maps for the device the model runs on
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda", **kwargs)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1)).to(model.device)
    fused_kernels.reset_launch_counts()
    with torch.no_grad():
        model(input_ids=ids)
    inference = fused_kernels.launch_counts()
    model.train()
    fused_kernels.reset_launch_counts()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    training = fused_kernels.launch_counts()
    standin = [m for n, m in sys.modules.items() if n.startswith("standin_")]
    print(json.dumps({"loss": loss.item(), "inference": inference, "training": training,
                      "standin": standin[0].CALLS if standin else {}}))
''')


def _write_standin(root: Path) -> Path:
    folder = root / "build" / "torch-cuda"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(HUB_STANDIN)
    (folder / "metadata.json").write_text(json.dumps({
        "id": "standin_" + format(abs(hash(str(root))), "x"), "name": "standin", "version": 1,
        "license": "Apache-2.0", "backend": {"type": "cuda"}, "python-depends": []}))
    return root


@pytest.fixture
def setup(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    checkpoint = tmp_path / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)).save_pretrained(checkpoint)
    standin = _write_standin(tmp_path / "standin")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    repo = tmp_path / "autopatch-repo"
    return checkpoint, standin, script, repo, tmp_path


def _run(setup, route: str, **env_extra) -> tuple[dict, dict, str]:
    checkpoint, standin, script, repo, tmp_path = setup
    report = tmp_path / f"report-{route}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSED_KERNELS", "USE_HUB_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", TRITON_INTERPRET="0", AUTOPATCH_REPORT=str(report), AUTOPATCH_KERNEL_REPO=str(repo),
               LOCAL_KERNELS=f"kernels-community/liger-kernels={standin}:kernels-community/rotary={standin}"
                             f":kernels-community/activation={standin}")
    env.update(env_extra)
    subprocess.run([sys.executable, "-m", "autopatch", "kernel-repo"], env=env, check=True, capture_output=True)
    out = subprocess.run([sys.executable, str(script), str(checkpoint), route, str(repo)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    written = json.loads(report.read_text()) if report.exists() else {}
    return got, written, out.stderr


def test_default_mapping_serves_the_standins_without_autopatch(setup):
    got, _, _ = _run(setup, "default")
    assert got["standin"]["LigerRMSNorm"] > 0 and got["standin"]["apply_rotary_transformers"] > 0
    assert not got["training"].get("rms_norm_fwd")


def test_fused_kernels_beat_the_default_mapping(setup):
    plain, _, _ = _run(setup, "default", USE_HUB_KERNELS="0")
    got, report, err = _run(setup, "default", FUSED_KERNELS="rms_norm,rope")
    assert not any(got["standin"].values()), got["standin"]  # never called (or never even loaded)
    assert got["training"]["rms_norm_fwd"] == 5 and got["training"]["rope_fwd"] == 2
    assert got["inference"]["rms_norm_fwd"] == 5
    assert abs(got["loss"] - plain["loss"]) <= 2e-2 * abs(plain["loss"])  # bf16
    assert report["replaced"] == []
    assert report["hub_kernels"]["RMSNorm LlamaRMSNorm"].startswith("autopatch rms_norm")
    assert report["hub_kernels"]["rotary_pos_emb apply_rotary_pos_emb"].startswith("autopatch rope")
    assert "your Hub kernel" not in err


def test_an_explicit_kernel_config_wins_and_is_said(setup):
    got, report, err = _run(setup, "theirs", FUSED_KERNELS="rms_norm,rope")
    assert got["standin"]["LigerRMSNorm"] == 5  # inference: the mode from_pretrained mapped it for
    assert got["inference"].get("rms_norm_fwd", 0) == 0 and got["inference"]["rope_fwd"] == 1 * 2
    assert "rms_norm on LlamaRMSNorm: your Hub kernel kernels-community/liger-kernels:LigerRMSNorm runs there" in err
    assert "your kernel_config names RMSNorm but not for training mode" in err
    assert got["training"]["rms_norm_fwd"] == 5  # training: no mapping of theirs, the module's forward is ours
    assert report["hub_kernels"]["RMSNorm LlamaRMSNorm"].startswith("autopatch rms_norm")  # the last kernelize
    assert [(r["kernel"], r["target"]) for r in report["replaced"]] == [("rms_norm", "LlamaRMSNorm")]


def test_kernel_config_with_our_repository_runs_our_kernels(setup):
    plain, _, _ = _run(setup, "default", USE_HUB_KERNELS="0")
    got, report, _ = _run(setup, "our-repo")
    assert report["hub_kernels"]["RMSNorm LlamaRMSNorm"] == "autopatch rms_norm (kernel repository)"
    assert got["inference"]["rms_norm_fwd"] == 5 and got["inference"]["rope_fwd"] == 2
    assert got["training"]["rms_norm_fwd"] == 5 and got["training"]["rope_fwd"] == 2
    assert abs(got["loss"] - plain["loss"]) <= 2e-2 * abs(plain["loss"])
    assert not any(got["standin"].values()), got["standin"]


def test_local_kernels_pointing_the_default_at_our_repository(setup):
    checkpoint, standin, script, repo, tmp_path = setup
    got, _, _ = _run(setup, "default",
                     LOCAL_KERNELS=f"kernels-community/liger-kernels={repo}:kernels-community/rotary={standin}"
                                   f":kernels-community/activation={standin}")
    assert got["inference"]["rms_norm_fwd"] == 5 and got["training"]["rms_norm_fwd"] == 5
    assert got["standin"]["LigerRMSNorm"] == 0
