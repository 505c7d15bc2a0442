"""benchmarks/bench_long_context.py on the CPU: the search (doubling, then bisection) and the trial worker
on a tiny Llama, plain and patched through FUSED_KERNELS, each trial in its own process. Liger's kernels
do not run in Triton's interpreter, so the CPU run leaves that peer out."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_long_context  # noqa: E402

pytestmark = pytest.mark.slow


def test_search_doubles_then_bisects(monkeypatch):
    """Lengths up to 40960 fit: doubling from 8192 fails at 65536, bisection ends at 40960."""
    asked = []

    def fake_trial(model_key, peer, seq, args):
        asked.append(seq)
        return {"status": "ok" if seq <= 40960 else "oom", "seq": seq}

    monkeypatch.setattr(bench_long_context, "run_trial", fake_trial)
    args = SimpleNamespace(start=8192, max_seq=1 << 20, granularity=4096)
    trials = []
    assert bench_long_context.longest("m", "p", args, trials) == 40960
    assert asked[:4] == [8192, 16384, 32768, 65536]
    assert asked[4:] == [49152, 40960, 45056]
    assert len(trials) == len(asked)


def test_tiny_run_on_the_cpu(tmp_path):
    out = tmp_path / "lc.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/bench_long_context.py", "--models", "tiny_llama",
                           "--peers", "hf,ours", "--device", "cpu", "--start", "16", "--max-seq", "32",
                           "--granularity", "16", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(r["peer"], r["longest"]) for r in data["longest"]] == [("hf", 32), ("ours", 32)]
    losses = {}
    for t in data["trials"]:
        assert t["status"] == "ok", t
        assert math.isfinite(t["loss"]) and t["loss"] > 0
        losses.setdefault(t["seq"], {})[t["peer"]] = t["loss"]
    for seq, by_peer in losses.items():  # same seed, same weights, same tokens: the same loss
        assert by_peer["ours"] == pytest.approx(by_peer["hf"], rel=1e-5), seq
    assert "| tiny_llama | ours | ≥32 |" in proc.stdout  # no longer length tried: an open bound


def test_tiny_run_with_offload_and_tiled_mlp_on_the_cpu(tmp_path):
    """The ours_offload_tiled peer: its trial runs under AUTOPATCH_OFFLOAD and AUTOPATCH_TILED_MLP_TOKENS
    (set for the trial's interpreter), the MLPs tiled at 8 tokens; offload has no GPU here and says
    why; the loss is plain HF's."""
    out = tmp_path / "lc.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/bench_long_context.py", "--models", "tiny_llama",
                           "--peers", "hf,ours_offload_tiled", "--device", "cpu", "--start", "32", "--max-seq", "32",
                           "--granularity", "16", "--tiled-mlp-tokens", "8", "--steps-at-length", "2",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(r["peer"], r["longest"]) for r in data["longest"]] == [("hf", 32), ("ours_offload_tiled", 32)]
    by_peer = {t["peer"]: t for t in data["trials"]}
    assert all(t["status"] == "ok" for t in by_peer.values()), by_peer
    assert by_peer["ours_offload_tiled"]["loss"] == pytest.approx(by_peer["hf"]["loss"], rel=1e-5)
    assert by_peer["ours_offload_tiled"]["settings"] == {"offload": "auto", "tiled_mlp_tokens": 8,
                                                        "attention_query_block_tokens": None}
    assert by_peer["ours_offload_tiled"]["offload"]["off_reason"] == "the model trains on the cpu device, not a CUDA device"
    for t in by_peer.values():  # two steps at the length, after a warm-up that made AdamW's moments
        assert len(t["steps_s"]) == 2 and t["step_s"] == t["steps_s"][-1] and t["adamw_moments_resident"], t


def _merged(tmp_path, *runs):
    """bench_long_context.merge over the runs, each written to its own JSON file first."""
    paths = []
    for i, data in enumerate(runs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(data))
    return bench_long_context.merge([str(p) for p in paths])


def test_merge_takes_every_run_and_bounds_each_peer(tmp_path):
    """Two runs merged: the longest fit per peer from all trials, a later trial of the same length
    replacing an earlier one; an open bound (nothing failed above) is shown as such."""
    env = {"gpu": "test"}
    ok = lambda peer, seq: {"model": "m", "peer": peer, "seq": seq, "status": "ok", "peak_gib": 1.0}  # noqa: E731
    oom = lambda peer, seq: {"model": "m", "peer": peer, "seq": seq, "status": "oom"}  # noqa: E731
    first = {"environment": env, "trials": [ok("hf", 8192), oom("hf", 16384), oom("ours", 65536)]}
    second = {"environment": env, "trials": [ok("ours", 32768), ok("ours", 65536)]}
    merged = _merged(tmp_path, first, second)
    rows = {r["peer"]: r for r in merged["longest"]}
    assert rows["hf"]["longest"] == 8192 and rows["hf"]["first_failed"] == 16384
    assert rows["ours"]["longest"] == 65536 and rows["ours"]["first_failed"] is None  # the oom was replaced
    text = bench_long_context.table(merged)
    assert "| m | hf | 8192 |" in text and "| m | ours | ≥65536 |" in text


def test_merge_voids_trials_without_the_moments_where_newer_ones_have_them(tmp_path):
    """A peer measured again with AdamW's moments resident: its older first-step trials (fresh optimizer)
    no longer bound it, even the ones that fit longer; a peer with only older trials keeps them."""
    env = {"gpu": "test"}
    old_ok = lambda peer, seq: {"model": "m", "peer": peer, "seq": seq, "status": "ok"}  # noqa: E731
    first = {"environment": env, "trials": [old_ok("liger", 262144), old_ok("liger", 196608), old_ok("hf", 32768)]}
    second = {"environment": env, "trials": [
        {"model": "m", "peer": "liger", "seq": 229376, "status": "ok", "adamw_moments_resident": True},
        {"model": "m", "peer": "liger", "seq": 245760, "status": "oom", "adamw_moments_resident": True}]}
    merged = _merged(tmp_path, first, second)
    rows = {r["peer"]: r for r in merged["longest"]}
    assert (rows["liger"]["longest"], rows["liger"]["first_failed"]) == (229376, 245760)
    assert rows["hf"]["longest"] == 32768
    voided = {t["seq"]: t for t in merged["trials"] if t["status"] == "void"}
    assert set(voided) == {262144, 196608} and voided[262144]["measured_status"] == "ok"
    assert "moments" in voided[262144]["void_reason"]


def test_cross_check_runs_full_depth_and_the_cut(monkeypatch):
    asked = []

    def fake_trial(model_key, peer, seq, args):
        asked.append(args.layers)
        return {"status": "ok", "seq": seq, "peak_gib": 10.0 if args.layers is None else 10.5}

    monkeypatch.setattr(bench_long_context, "run_trial", fake_trial)
    args = SimpleNamespace(layers=3, device="cpu")
    out = bench_long_context.cross_check("tiny_llama", "ours", 4096, args)
    assert asked == [None, 3] and out["estimate_over_measured"] == pytest.approx(1.05)


def test_a_cut_shallower_than_three_layers_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_long_context.main(["--layers", "2", "--models", "tiny_llama", "--device", "cpu"])
    assert "use --layers 3" in capsys.readouterr().err


def test_the_warm_up_step_leaves_adamw_moments_for_the_measured_step():
    """The trial's optimizer is made once per model: after the warm-up step every trained parameter has
    its two moments, so they are resident through the measured step (a run's second and later steps)."""
    import torch

    cpu = torch.device("cpu")
    model = bench_long_context.build("tiny_llama", "hf", None, cpu, torch)
    opt = bench_long_context.make_optimizer(model, cpu, torch)
    bench_long_context.one_step(model, 16, cpu, torch, opt)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all({"exp_avg", "exp_avg_sq"} <= set(opt.state[p]) for p in trained)
    assert all(p.grad is None for p in trained)  # zeroed to None after the step, as a training loop does
