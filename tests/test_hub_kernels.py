"""Hugging Face Hub kernels and autopatch, offline on the CPU (Triton's interpreter): our kernels as a
`kernels` layer repository (torch-cpu variant, LocalLayerRepository), and the precedence between the
user's explicit kernel mapping, FUSED_KERNELS / apply() and transformers' implicit default mapping,
with a tiny Llama saved with save_pretrained and loaded with from_pretrained.

transformers' default mapping serves CUDA (and ROCm, XPU) only, so on the CPU nothing is kernelized by
default; the precedence tests register the same default repositories for "cpu" in transformers'
default mapping and point them, through kernels' own LOCAL_KERNELS, at stand-in repositories whose
layers count their calls, as a CUDA machine with the Hub would serve Liger's RMSNorm and the rotary
kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
kernels_pkg = pytest.importorskip("kernels")

import fused_kernels  # noqa: E402
from kernels import LayerRepository, LocalLayerRepository, Mode, use_kernel_mapping  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations import hub_kernels  # noqa: E402

import autopatch  # noqa: E402
from autopatch import hub, hub_layers, patching  # noqa: E402
from autopatch import session as sessions  # noqa: E402
from helpers import HUB_STANDIN  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LIGER = LayerRepository("kernels-community/liger-kernels", layer_name="LigerRMSNorm", version=4)
ROTARY = LayerRepository("kernels-community/rotary", layer_name="apply_rotary_transformers", version=2)
TOL = 1e-5



def write_standin(root: Path) -> Path:
    """A stand-in Hub repository (torch-cpu variant) with Liger's and the rotary kernel's layer names."""
    folder = root / "build" / "torch-cpu"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(HUB_STANDIN)
    ident = "standin_" + format(abs(hash(str(root))), "x")
    (folder / "metadata.json").write_text(json.dumps({
        "id": ident, "name": "standin", "version": 1, "license": "Apache-2.0",
        "backend": {"type": "cpu"}, "python-depends": []}))
    return root


def standin_calls(root: Path) -> dict:
    ident = json.loads((root / "build" / "torch-cpu" / "metadata.json").read_text())["id"]
    module = sys.modules.get(ident)
    return dict(module.CALLS) if module is not None else {"LigerRMSNorm": 0, "apply_rotary_transformers": 0}


@pytest.fixture(autouse=True)
def clean():
    """kernels' process-wide mapping and layer cache, autopatch's patches, session and hub layers."""
    glob = sys.modules["kernels._internals.layer.globals"]
    layer = sys.modules["kernels._internals.layer.layer"]
    token = glob._KERNEL_MAPPING.set({})
    layer._CACHED_LAYER.clear()
    session = sessions.current()
    session.reset_runs()
    session.meta.pop("hub_kernels", None)
    hub_layers.reset()
    hub.install()
    yield session
    glob._KERNEL_MAPPING.reset(token)
    layer._CACHED_LAYER.clear()
    patching.restore_all()
    hub_layers.reset()
    session.reset_runs()
    session.meta.pop("hub_kernels", None)


@pytest.fixture
def repo(tmp_path):
    return hub.ensure_repo(tmp_path / "autopatch-repo")


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    path = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def cpu_defaults(monkeypatch, tmp_path):
    """transformers' default mapping with the CUDA entries for RMSNorm and rotary_pos_emb registered
    for "cpu" too, served by stand-ins through LOCAL_KERNELS."""
    standin = write_standin(tmp_path / "standin")
    defaults = {k: dict(v) for k, v in hub_kernels.get_kernel_mapping_transformers().items()}
    both = {Mode.TRAINING | Mode.TORCH_COMPILE: None, Mode.INFERENCE | Mode.TORCH_COMPILE: None}
    defaults["RMSNorm"]["cpu"] = dict.fromkeys(both, LIGER)
    defaults["rotary_pos_emb"]["cpu"] = dict.fromkeys(both, ROTARY)
    monkeypatch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", defaults)
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/liger-kernels={standin}:kernels-community/rotary={standin}")
    return standin


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert torch.allclose(loss, ref_loss, rtol=TOL, atol=TOL), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.allclose(grads[name], ref_grads[name], rtol=TOL, atol=TOL), name


def reference(checkpoint):
    """Loss and gradients of the unpatched model (no Hub kernels, nothing of ours)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=False)
    model.train()
    return loss_and_grads(model)


def patch_classes():
    """What FUSED_KERNELS=rms_norm,rope does at import: the Llama classes patched (apply() on a first model)."""
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    from autopatch.names import KERNEL_NAMES

    toggles = {k: k in ("rms_norm", "rope") for k in KERNEL_NAMES}
    records = autopatch.apply(LlamaForCausalLM(config), **toggles)
    assert {r.kernel for r in records if r.patched} >= {"rms_norm", "rope"}


def launches():
    counts = fused_kernels.launch_counts()
    return ({k: v for k, v in counts.items() if k.startswith("rms_norm")},
            {k: v for k, v in counts.items() if k.startswith("rope")})


# --------------------------------------------------------------------------- the repository
def test_repository_layout_loads_in_kernels(repo):
    for variant, backend in (("torch-cpu", "cpu"), ("torch-cuda", "cuda")):
        meta = json.loads((repo / "build" / variant / "metadata.json").read_text())
        assert meta["name"] == "autopatch" and meta["backend"] == {"type": backend}
        assert set(meta["digest"]["files"]) == {"__init__.py"}
        from kernels._rust import Digest, DigestAlgorithm, Metadata

        parsed = Metadata.read_from_file(repo / "build" / variant / "metadata.json")
        parsed.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, repo / "build" / variant))
    for name in ("RMSNorm", "RMSNormZeroCentered", "rotary_pos_emb"):
        layer = LocalLayerRepository(repo_path=repo, layer_name=name).load()
        assert layer is hub_layers.LAYERS[name]
        assert layer.has_backward is True and layer.can_torch_compile is True
    stamp = (repo / "build" / "torch-cpu" / "metadata.json").stat().st_mtime_ns
    assert hub.ensure_repo(repo) == repo
    assert (repo / "build" / "torch-cpu" / "metadata.json").stat().st_mtime_ns == stamp  # nothing rewritten


def test_cli_prints_the_directory_and_names_the_variable_when_unwritable(tmp_path):
    env = dict(os.environ, AUTOPATCH_KERNEL_REPO=str(tmp_path / "here"))
    out = subprocess.run([sys.executable, "-m", "autopatch", "kernel-repo"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "here")
    assert (tmp_path / "here" / "build" / "torch-cuda" / "__init__.py").is_file()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env["AUTOPATCH_KERNEL_REPO"] = str(blocker / "repo")
    out = subprocess.run([sys.executable, "-m", "autopatch", "kernel-repo"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1
    assert str(blocker / "repo") in lines[0] and "AUTOPATCH_KERNEL_REPO" in lines[0]


def test_a_layer_we_lack_gets_kernels_error_and_our_line(repo, capsys):
    with pytest.raises(ValueError, match="Layer `LayerNorm` not found in kernel repo"):
        LocalLayerRepository(repo_path=repo, layer_name="LayerNorm").load()
    err = [line for line in capsys.readouterr().err.splitlines() if "autopatch" in line]
    assert len(err) == 1 and "'LayerNorm'" in err[0]
    assert "RMSNorm, RMSNormZeroCentered, rotary_pos_emb" in err[0] and "LigerRMSNorm" in err[0]


# --------------------------------------------------------------------------- route: our repository
def test_our_repository_through_a_kernel_mapping(repo, checkpoint):
    """The mapping KernelConfig(use_local_kernel=True) builds, given to kernels.kernelize: our layers
    run our kernels, with the loss and gradients of the unpatched model."""
    want = reference(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")},
               "rotary_pos_emb": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="rotary_pos_emb")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernels_pkg.kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert vars(model.model.norm)["forward"].__func__ is hub_layers.RMSNorm.forward
    fused_kernels.reset_launch_counts()
    assert_same(loss_and_grads(model), want)
    norms, ropes = launches()
    assert norms.get("rms_norm_fwd", 0) == 5 and norms.get("rms_norm_bwd", 0) == 5  # 2 layers x 2 + final
    assert ropes.get("rope_fwd", 0) == 2 and ropes.get("rope_bwd", 0) == 2
    ran = hub_layers.ran()
    assert ran[("RMSNorm", "LlamaRMSNorm")] == "autopatch rms_norm (kernel repository)"
    assert ran[("rotary_pos_emb", "apply_rotary_pos_emb")] == "autopatch rope (kernel repository)"
    reported = sessions.current().meta["hub_kernels"]  # AUTOPATCH_REPORT's hub_kernels
    assert reported["RMSNorm LlamaRMSNorm"] == reported["rotary_pos_emb apply_rotary_pos_emb"].replace(
        "rope", "rms_norm") == "autopatch rms_norm (kernel repository)"


def test_kernel_config_with_our_repository_trains_with_our_kernels(repo, checkpoint, monkeypatch):
    """from_pretrained(kernel_config=KernelConfig(..., use_local_kernel=True)). transformers admits no
    "cpu" in a KernelConfig (CUDA and other accelerators only); admitted here, the CUDA path runs as
    is. KernelConfig keys the mapping by the mode at load time (inference); our layers have a backward,
    so train() keeps them (transformers alone would fall back to the module's own forward)."""
    from transformers import KernelConfig
    from transformers.utils import kernel_config as kc

    monkeypatch.setattr(kc, "KERNELS_SUPPORTED_DEVICE_TYPES", [*kc.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"])
    want = reference(checkpoint)
    config = KernelConfig(kernel_mapping={"RMSNorm": f"{repo}:RMSNorm", "rotary_pos_emb": f"{repo}:rotary_pos_emb"},
                          use_local_kernel=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True, kernel_config=config)
    model.train()
    assert vars(model.model.norm)["forward"].__func__ is hub_layers.RMSNorm.forward
    fused_kernels.reset_launch_counts()
    assert_same(loss_and_grads(model), want)
    norms, ropes = launches()
    assert norms.get("rms_norm_fwd", 0) == 5 and ropes.get("rope_fwd", 0) == 2


def test_an_unproven_class_runs_its_own_forward_under_our_layer():
    """A Gemma-style (1 + w) norm decorated "RMSNorm" is proven offset=1: the kernel runs with that
    offset; a class the rule cannot prove (a bias) runs its own forward."""
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("RMSNorm")
    class BiasedNorm(torch.nn.Module):
        def __init__(self, hidden=32):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(hidden))
            self.bias = torch.nn.Parameter(torch.zeros(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            x = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return x * (1 + self.weight) + self.bias

    BiasedNorm.__module__ = __name__
    norm = BiasedNorm()
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(3, 32)
    want = norm(x)
    fused_kernels.reset_launch_counts()
    got = hub_layers.RMSNorm.forward(norm, x)
    assert torch.equal(got, want)
    assert not launches()[0]
    assert "left alone" in hub_layers.ran()[("RMSNorm", "BiasedNorm")]


def test_a_later_session_gets_its_own_record_of_our_layer(monkeypatch):
    """Our layer resolved what runs for a class under one session; a fresh session (a second
    Trainer in one process, apply() again) resolves again, so its report says what runs there."""

    class ProbeNorm(torch.nn.Module):
        def __init__(self, hidden=32):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):  # Llama's
            x = hidden_states.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * x.to(hidden_states.dtype)

    ProbeNorm.__module__ = __name__
    norm, x = ProbeNorm(), torch.randn(3, 32)
    hub_layers.RMSNorm.forward(norm, x)
    first = sessions.current()
    assert first.meta["hub_kernels"]["RMSNorm ProbeNorm"].startswith("autopatch rms_norm")
    later = sessions.Session()
    later.installed.update({"exit", "optimizer"})
    monkeypatch.setattr(sessions, "_current", later)
    fused_kernels.reset_launch_counts()
    got = hub_layers.RMSNorm.forward(norm, x)
    assert torch.allclose(got, norm(x), rtol=1e-5, atol=1e-6)
    assert launches()[0].get("rms_norm_fwd") == 1
    assert later.meta["hub_kernels"]["RMSNorm ProbeNorm"].startswith("autopatch rms_norm")
    assert any(r.target == "ProbeNorm" and r.patched for r in later.all_records())


def test_gemma_norm_under_the_generic_name_keeps_its_offset():
    from transformers import GemmaConfig
    from transformers.models.gemma import modeling_gemma

    norm = modeling_gemma.GemmaRMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 32)
    want = norm(x)
    fused_kernels.reset_launch_counts()
    got = hub_layers.RMSNorm.forward(norm, x)
    assert torch.allclose(got, want, rtol=TOL, atol=TOL)
    assert launches()[0].get("rms_norm_fwd") == 1
    assert GemmaConfig is not None


def test_local_kernels_make_the_default_mapping_serve_ours(repo, checkpoint, monkeypatch):
    """LOCAL_KERNELS=kernels-community/liger-kernels=<our repo>:kernels-community/rotary=<our repo>:
    transformers' default mapping (here registered for "cpu") loads our layers, nothing else set."""
    defaults = {k: dict(v) for k, v in hub_kernels.get_kernel_mapping_transformers().items()}
    both = (Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)
    defaults["RMSNorm"]["cpu"] = dict.fromkeys(both, LIGER)
    defaults["rotary_pos_emb"]["cpu"] = dict.fromkeys(both, ROTARY)
    monkeypatch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", defaults)
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/liger-kernels={repo}:kernels-community/rotary={repo}")
    want = reference(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    assert vars(model.model.norm)["forward"].__func__ is hub_layers.RMSNorm.forward
    fused_kernels.reset_launch_counts()
    assert_same(loss_and_grads(model), want)
    norms, ropes = launches()
    assert norms.get("rms_norm_fwd", 0) == 5 and ropes.get("rope_fwd", 0) == 2


# --------------------------------------------------------------------------- precedence
def test_fused_kernels_beat_the_implicit_default_mapping(checkpoint, cpu_defaults, capsys):
    """Classes patched (FUSED_KERNELS / apply()), transformers' default mapping kernelizing at
    from_pretrained and again at train(): ours runs, the default repositories are never called."""
    want = reference(checkpoint)
    patch_classes()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # use_kernels: the default (on)
    assert model.use_kernels
    model.train()  # kernelizes again, for training
    assert "forward" not in vars(model.model.norm)
    fused_kernels.reset_launch_counts()
    assert_same(loss_and_grads(model), want)
    norms, ropes = launches()
    assert norms.get("rms_norm_fwd", 0) == 5 and ropes.get("rope_fwd", 0) == 2
    assert standin_calls(cpu_defaults) == {"LigerRMSNorm": 0, "apply_rotary_transformers": 0}
    session = sessions.current()
    assert session.replaced == {}
    assert session.meta["hub_kernels"]["RMSNorm LlamaRMSNorm"].startswith("autopatch rms_norm")
    assert session.meta["hub_kernels"]["rotary_pos_emb apply_rotary_pos_emb"].startswith("autopatch rope")
    err = capsys.readouterr().err
    assert "replaced" not in err and "your Hub kernel" not in err and "kernel_config" not in err


def test_kernelize_reports_to_the_session_current_then(checkpoint, cpu_defaults, monkeypatch):
    """apply() under a session that is gone by the next kernelize (a fresh one put in and taken out
    again): what runs per layer goes to the session current at that kernelize, not the gone one."""
    kept = sessions.current()
    gone = sessions.Session()
    gone.installed.update({"exit", "optimizer"})  # no exit check nor optimizer hook from a unit test
    monkeypatch.setattr(sessions, "_current", gone)
    patch_classes()  # apply() begins `gone` and installs the kernelize wrapper with it
    monkeypatch.setattr(sessions, "_current", kept)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    assert "forward" not in vars(model.model.norm)
    assert kept.meta["hub_kernels"]["RMSNorm LlamaRMSNorm"].startswith("autopatch rms_norm")
    assert kept.meta["hub_kernels"]["rotary_pos_emb apply_rotary_pos_emb"].startswith("autopatch rope")
    assert "hub_kernels" not in gone.meta


def test_without_our_patch_the_default_mapping_stays(checkpoint, cpu_defaults):
    """The control: nothing patched, transformers' default kernelizes and its layers run."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    loss_and_grads(model)
    calls = standin_calls(cpu_defaults)
    assert calls["LigerRMSNorm"] == 5 and calls["apply_rotary_transformers"] == 2


def test_an_earlier_default_forward_is_dropped_at_the_next_kernelize(checkpoint, cpu_defaults):
    """Loaded (and kernelized by default) before the classes were patched, then train(): ours runs."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert "forward" in vars(model.model.norm)
    patch_classes()
    model.train()
    assert "forward" not in vars(model.model.norm)
    fused_kernels.reset_launch_counts()
    loss_and_grads(model)
    assert launches()[0].get("rms_norm_fwd") == 5
    assert standin_calls(cpu_defaults)["LigerRMSNorm"] == 0


def test_the_users_explicit_mapping_wins_and_is_said(checkpoint, cpu_defaults, capsys):
    """The user's own kernelize with their own mapping naming RMSNorm and rotary_pos_emb: theirs runs
    for those layers, one line each says so, the session records it; without it ours runs again."""
    patch_classes()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    capsys.readouterr()
    theirs = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=cpu_defaults, layer_name="LigerRMSNorm")},
              "rotary_pos_emb": {"cpu": LocalLayerRepository(repo_path=cpu_defaults,
                                                             layer_name="apply_rotary_transformers")}}
    with use_kernel_mapping(theirs):
        kernels_pkg.kernelize(model, mode=Mode.TRAINING, device="cpu")
    fused_kernels.reset_launch_counts()
    loss_and_grads(model)
    calls = standin_calls(cpu_defaults)
    assert calls == {"LigerRMSNorm": 5, "apply_rotary_transformers": 2}
    norms, ropes = launches()
    assert not norms.get("rms_norm_fwd") and not ropes.get("rope_fwd")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autopatch")]
    assert len(err) == 2, err
    assert any("rms_norm on LlamaRMSNorm: your Hub kernel" in line and "LigerRMSNorm runs there" in line for line in err)
    assert any("rope on apply_rotary_pos_emb: your Hub kernel" in line for line in err)
    session = sessions.current()
    assert set(session.replaced) == {("rms_norm", "LlamaRMSNorm"), ("rope", "apply_rotary_pos_emb")}
    # another model of the same classes, not kernelized with their mapping: ours
    other = AutoModelForCausalLM.from_pretrained(checkpoint)
    other.train()
    fused_kernels.reset_launch_counts()
    loss_and_grads(other)
    assert launches()[0].get("rms_norm_fwd") == 5 and launches()[1].get("rope_fwd") == 2
    assert standin_calls(cpu_defaults) == calls


def test_an_explicit_kernel_config_wins_in_the_modes_it_maps(checkpoint, cpu_defaults, monkeypatch, capsys):
    """from_pretrained(kernel_config=...) naming RMSNorm: theirs runs in inference (the mode it was
    mapped for) and is said; at train() transformers' kernelize finds no training mapping and keeps
    the module's forward, ours, and that is said too."""
    from transformers import KernelConfig
    from transformers.utils import kernel_config as kc

    monkeypatch.setattr(kc, "KERNELS_SUPPORTED_DEVICE_TYPES", [*kc.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"])
    patch_classes()
    capsys.readouterr()
    config = KernelConfig(kernel_mapping={"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"})
    model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True, kernel_config=config)
    with torch.no_grad():
        model(**inputs())
    assert standin_calls(cpu_defaults)["LigerRMSNorm"] == 5
    err = capsys.readouterr().err
    assert "rms_norm on LlamaRMSNorm: your Hub kernel kernels-community/liger-kernels:LigerRMSNorm runs there" in err
    model.train()
    err = capsys.readouterr().err
    assert "your kernel_config names RMSNorm but not for training mode" in err
    fused_kernels.reset_launch_counts()
    loss_and_grads(model)
    assert launches()[0].get("rms_norm_fwd") == 5
    assert standin_calls(cpu_defaults)["LigerRMSNorm"] == 5  # not called in training


def test_precedence_holds_under_torch_compile(checkpoint, cpu_defaults):
    want = reference(checkpoint)
    patch_classes()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    fused_kernels.reset_launch_counts()
    model.zero_grad(set_to_none=True)
    loss = compiled(**inputs()).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same((loss.detach(), grads), want)
    # (under torch.compile fused_kernels counts rope's launches, not rms_norm's)
    assert launches()[1].get("rope_fwd") == 2 and "forward" not in vars(model.model.norm)
    assert standin_calls(cpu_defaults) == {"LigerRMSNorm": 0, "apply_rotary_transformers": 0}


def test_our_layers_compile_fullgraph(repo, checkpoint):
    want = reference(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")},
               "rotary_pos_emb": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="rotary_pos_emb")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernels_pkg.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu")
    assert vars(model.model.norm)["forward"].__func__ is hub_layers.RMSNorm.forward
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    fused_kernels.reset_launch_counts()
    model.zero_grad(set_to_none=True)
    loss = compiled(**inputs()).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same((loss.detach(), grads), want)
    assert launches()[1].get("rope_fwd") == 2  # (under torch.compile fused_kernels counts rope's launches only)
    assert hub_layers.ran()[("RMSNorm", "LlamaRMSNorm")] == "autopatch rms_norm (kernel repository)"


# --------------------------------------------------------------------------- the environment route
SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from kernels import LayerRepository, Mode
    from transformers import AutoModelForCausalLM
    from transformers.integrations import hub_kernels
    import fused_kernels

    mapping = hub_kernels.get_kernel_mapping_transformers()
    modes = (Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)
    mapping["RMSNorm"]["cpu"] = dict.fromkeys(modes, LayerRepository(
        "kernels-community/liger-kernels", layer_name="LigerRMSNorm", version=4))
    mapping["rotary_pos_emb"]["cpu"] = dict.fromkeys(modes, LayerRepository(
        "kernels-community/rotary", layer_name="apply_rotary_transformers", version=2))
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    model.train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    fused_kernels.reset_launch_counts()
    model(input_ids=ids, labels=ids).loss.backward()
    counts = fused_kernels.launch_counts()
    standin = [m for n, m in sys.modules.items() if n.startswith("standin_")]
    print(json.dumps({"rms_norm_fwd": counts.get("rms_norm_fwd", 0), "rope_fwd": counts.get("rope_fwd", 0),
                      "standin": standin[0].CALLS if standin else {}}))
''')


def test_fused_kernels_from_the_environment_beat_the_default_mapping(checkpoint, tmp_path):
    standin = write_standin(tmp_path / "standin-env")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    env = dict(os.environ, FUSED_KERNELS="rms_norm,rope", HF_HUB_OFFLINE="1", TRITON_INTERPRET="1",
               AUTOPATCH_REPORT=str(report),
               LOCAL_KERNELS=f"kernels-community/liger-kernels={standin}:kernels-community/rotary={standin}")
    out = subprocess.run([sys.executable, str(script), str(checkpoint)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rms_norm_fwd"] == 5 and got["rope_fwd"] == 2
    assert got["standin"] in ({}, {"LigerRMSNorm": 0, "apply_rotary_transformers": 0})
    written = json.loads(report.read_text())
    assert written["replaced"] == []
    assert written["hub_kernels"]["RMSNorm LlamaRMSNorm"].startswith("autopatch rms_norm")
    assert written["hub_kernels"]["rotary_pos_emb apply_rotary_pos_emb"].startswith("autopatch rope")


def test_apply_without_start_up_watches_later_kernelize_passes(tmp_path):
    """apply() in a process the import hooks never started still puts FUSED_KERNELS' precedence over
    later kernelize passes (train() / eval()): the kernelize wrapper is installed by apply() itself."""
    script = textwrap.dedent("""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import autopatch
        from autopatch import hub
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
        assert not hub.installed()
        autopatch.apply(model, rms_norm=True)
        print("installed", hub.installed())
    """)
    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "installed True" in proc.stdout
