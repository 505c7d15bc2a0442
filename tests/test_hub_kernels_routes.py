"""The Hub-kernel routes as a user runs them, each scenario in a fresh process with transformers 5.25 +
kernels 0.19.1, offline (HF_HUB_OFFLINE=1): a tiny Llama saved with save_pretrained and loaded with
from_pretrained(device_map=<device>) (default use_kernels: transformers' default mapping kernelizes
RMSNorm and rotary_pos_emb, and SiLU in inference). LOCAL_KERNELS points kernels-community/liger-kernels,
kernels-community/rotary and kernels-community/activation at a stand-in repository each test writes, so
nothing is fetched (offline, a default repository without a stand-in fails the load). AUTOPATCH_REPORT's
`hub_kernels` says what ran per layer.

On a CUDA GPU (`gpu` marker) the default mapping is transformers' own, in bf16. On the CPU (Triton's
interpreter, float32) the script first registers every CUDA entry of transformers' default mapping for
"cpu" too and admits "cpu" in KernelConfig, so the same layers load the same repositories as on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import HUB_STANDIN

pytest.importorskip("kernels")

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
LOSS_TOL = {"cpu": 1e-5, "cuda": 2e-2}  # relative: float32 on the CPU, bf16 on the GPU

CPU_AS_CUDA = textwrap.dedent('''
    from transformers.integrations import hub_kernels
    from transformers.utils import kernel_config
    mapping = {name: dict(per_device) for name, per_device in hub_kernels.get_kernel_mapping_transformers().items()}
    for per_device in mapping.values():
        if "cuda" in per_device:
            per_device["cpu"] = per_device["cuda"]
    hub_kernels._KERNEL_MAPPING_CACHE = mapping
    kernel_config.KERNELS_SUPPORTED_DEVICE_TYPES = [*kernel_config.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"]
''')

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import fused_kernels
    from transformers import AutoModelForCausalLM, KernelConfig

    checkpoint, route, repo, device = sys.argv[1:5]
    if device == "cpu":
        exec(open(sys.argv[5]).read())
    kwargs = {}
    if route == "theirs":
        kwargs = dict(use_kernels=True, kernel_config=KernelConfig(
            kernel_mapping={"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"}, inherit_mapping=False))
    elif route == "our-repo":
        kwargs = dict(use_kernels=True, kernel_config=KernelConfig(
            kernel_mapping={"RMSNorm": f"{repo}:RMSNorm", "rotary_pos_emb": f"{repo}:rotary_pos_emb"},
            use_local_kernel=True))
    # device_map as users load for Hub kernels: kernelize then maps for the device the model runs on
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map=device, **kwargs)
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


def _write_standin(root: Path, device: str) -> Path:
    folder = root / "build" / f"torch-{device}"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(HUB_STANDIN)
    (folder / "metadata.json").write_text(json.dumps({
        "id": "standin_" + format(abs(hash(str(root))), "x"), "name": "standin", "version": 1,
        "license": "Apache-2.0", "backend": {"type": device}, "python-depends": []}))
    return root


@pytest.fixture(params=DEVICES)
def setup(request, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = request.param
    torch.manual_seed(0)
    checkpoint = tmp_path / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)).save_pretrained(checkpoint)
    standin = _write_standin(tmp_path / "standin", device)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "cpu_as_cuda.py").write_text(CPU_AS_CUDA)
    repo = tmp_path / "autopatch-repo"
    return checkpoint, standin, script, repo, tmp_path, device


def _run(setup, route: str, **env_extra) -> tuple[dict, dict, str]:
    checkpoint, standin, script, repo, tmp_path, device = setup
    report = tmp_path / f"report-{route}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSED_KERNELS", "USE_HUB_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", TRITON_INTERPRET="1" if device == "cpu" else "0", AUTOPATCH_REPORT=str(report),
               AUTOPATCH_KERNEL_REPO=str(repo),
               LOCAL_KERNELS=f"kernels-community/liger-kernels={standin}:kernels-community/rotary={standin}"
                             f":kernels-community/activation={standin}")
    env.update(env_extra)
    subprocess.run([sys.executable, "-m", "autopatch", "kernel-repo"], env=env, check=True, capture_output=True)
    out = subprocess.run([sys.executable, str(script), str(checkpoint), route, str(repo), device,
                          str(tmp_path / "cpu_as_cuda.py")], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    written = json.loads(report.read_text()) if report.exists() else {}
    return got, written, out.stderr


def _same_loss(got, plain, setup) -> bool:
    return abs(got["loss"] - plain["loss"]) <= LOSS_TOL[setup[-1]] * abs(plain["loss"])


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
    assert _same_loss(got, plain, setup)
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
    assert _same_loss(got, plain, setup)
    assert not any(got["standin"].values()), got["standin"]


def test_local_kernels_pointing_the_default_at_our_repository(setup):
    checkpoint, standin, script, repo, tmp_path, device = setup
    got, _, _ = _run(setup, "default",
                     LOCAL_KERNELS=f"kernels-community/liger-kernels={repo}:kernels-community/rotary={standin}"
                                   f":kernels-community/activation={standin}")
    assert got["inference"]["rms_norm_fwd"] == 5 and got["training"]["rms_norm_fwd"] == 5
    assert got["standin"]["LigerRMSNorm"] == 0
