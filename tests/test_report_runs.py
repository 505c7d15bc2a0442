"""What ran, not only what was patched: the run counts autopatch.report renders from a Session (the
kernels' launch counts, by the kernel -> launch-op table of autopatch.names, and rule-counted calls),
the training watch (optimizer steps), the exit check for a patched loss of a built model that never
ran in a process that trained (with its real cause), and strict mode's exit code for it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autopatch import names, report, runtime
from autopatch.config import load_settings
from autopatch.session import Record, Session, StrictModeError
from test_e2e_env import clean_env

REPO = Path(__file__).resolve().parents[1]
MODULE = "transformers.models.fake.modeling_fake"


@pytest.fixture
def session():
    import fused_kernels

    fused_kernels.reset_launch_counts()  # other tests count their launches as differences: safe to zero
    fresh = Session(load_settings({}))
    fresh.installed.add("exit")  # no exit check registered from a unit test
    return fresh


def test_runs_count_forward_launches_of_patched_kernels_only(session):
    import fused_kernels

    session.add([Record("rms_norm", MODULE, "FakeRMSNorm", True, "offset=0"),
                Record("causal_mask", MODULE, "FakeModel", True),
                Record("rope", MODULE, "apply_rotary_pos_emb", False, reason="not the formula")])
    before = 0
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    fused_kernels.rms_norm(x, w, eps=1e-6).sum().backward()
    runs = report.runs(session)
    assert set(runs) == {"rms_norm", "causal_mask"}, "only patched kernels are reported"
    assert runs["rms_norm"]["calls"] == before + 1
    assert runs["rms_norm"]["launches"]["rms_norm_bwd"] >= 1
    assert runs["causal_mask"]["calls"] is None, "causal_mask launches nothing: not counted"
    session.count_call("causal_mask", 3)
    assert report.runs(session)["causal_mask"]["calls"] == 3
    by_kernel = {r.kernel: r for r in report.records_with_runs(session)}
    assert by_kernel["rms_norm"].runs == before + 1 and by_kernel["rope"].runs is None
    assert by_kernel["rms_norm"] == Record("rms_norm", MODULE, "FakeRMSNorm", True, "offset=0"), \
        "runs takes no part in equality"
    data = report.as_json(session)
    assert data["runs"]["rms_norm"]["calls"] == before + 1
    assert "runs" not in data["records"][0], "the JSON's records keep their shape; counts are under 'runs'"


def test_every_kernel_name_has_its_launch_ops():
    """Each kernel a user can type maps to the ops fused_kernels counts (or to none: the non-kernels)."""
    assert set(names.FORWARD_OPS) == set(names.KERNEL_NAMES) == set(names.LAUNCH_OPS)
    assert names.FORWARD_OPS["gelu_mlp"] == ("gelu_fwd",)
    assert "moe_experts_fwd" in names.FORWARD_OPS["swiglu"] and "moe_experts_fwd" in names.FORWARD_OPS["geglu"]
    assert names.SHARED_OPS == {"moe_experts_fwd", "moe_experts_bwd", "moe_experts_recompute"}


def test_gelu_mlp_runs_count_the_gelu_launches(session):
    """A patched GELU MLP runs fused_kernels.gelu_linear, whose kernels count as gelu_fwd/gelu_bwd."""
    import fused_kernels

    session.add([Record("gelu_mlp", MODULE, "FakeMLP", True, "gelu tanh")])
    h = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    fused_kernels.gelu_linear(h, w, None, approximate="tanh").sum().backward()
    fused_kernels.gelu_linear(h.detach(), w.detach(), None, approximate="tanh")
    runs = report.runs(session)
    assert runs["gelu_mlp"]["calls"] == 2, runs
    assert runs["gelu_mlp"]["launches"]["gelu_bwd"] == 1 and runs["gelu_mlp"]["launches"]["gelu_recompute"] == 1, runs


def test_glu_linear_and_moe_launches_count_for_their_kernel(session):
    import fused_kernels

    session.add([Record("swiglu", MODULE, "FakeMLP", True, "silu")])
    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    fused_kernels.glu_linear(gate, up, torch.randn(16, 32), None, activation="silu")
    fused_kernels.swiglu(gate, up)
    assert report.runs(session)["swiglu"]["calls"] == 2
    fused_kernels._utils.count_launch("moe_experts_fwd")  # what one call of the fused MoE experts counts
    assert report.runs(session)["swiglu"]["calls"] == 3
    assert "geglu" not in report.runs(session), "a kernel that patched nothing is not reported"


def _one_optimizer_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    (p * p).sum().backward()
    opt.step()


def test_exit_verdict_says_a_patched_loss_never_ran_in_a_process_that_trained(session):
    import fused_kernels

    session.add([Record("fused_linear_cross_entropy", MODULE, "FakeForCausalLM.forward", True),
                 Record("fused_linear_cross_entropy", "transformers.models.bloom.modeling_bloom",
                        "BloomForCausalLM.forward", True)])
    session.note_built("FakeForCausalLM", [MODULE])  # Bloom's module was imported, never built
    assert report.exit_verdict(session) is None, "nothing trained yet"
    session.count_optimizer_step()
    line = report.exit_verdict(session)
    assert line is not None and line.startswith("autopatch: patched loss kernel fused_linear_cross_entropy "
                                                "(FakeForCausalLM) never ran in this process, which trained "
                                                "(1 optimizer step)"), line
    assert "Bloom" not in line, "only models that were built are named"
    assert "no patched model was called in training mode with labels" in line, line
    # a known bypass names the caller
    session.note_bypass("fused_linear_cross_entropy", "FakeForCausalLM", "somelib.train_step read lm_head itself")
    assert report.exit_verdict(session).endswith(": somelib.train_step read lm_head itself")
    # once the kernel ran, nothing to say
    h = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    fused_kernels.fused_linear_cross_entropy(h, w, torch.tensor([1, 2, -100, 5])).backward()
    assert report.exit_verdict(session) is None


def test_exit_verdict_gives_the_fallback_as_the_cause(session, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    session.add([Record("fused_linear_cross_entropy", MODULE, "FakeForCausalLM.forward", True)])
    session.note_built("FakeForCausalLM", [MODULE])
    session.count_training_call()
    assert session.note_fallback("fused_linear_cross_entropy", "lm_head weight on cpu")
    line = report.exit_verdict(session)
    assert line.endswith("(1 training call): the original code ran: CPU tensors without TRITON_INTERPRET "
                         "(lm_head weight on cpu)"), line
    assert "no patched model was called" not in line


def test_exit_verdict_names_what_replaced_the_loss(session):
    session.add([Record("fused_linear_cross_entropy", MODULE, "FakeForCausalLM.forward", True)])
    session.note_built("FakeForCausalLM", [MODULE])
    session.count_optimizer_step()
    session.note_replaced("fused_linear_cross_entropy", "FakeForCausalLM", "liger_kernel.lce_forward")
    assert report.exit_verdict(session).endswith(": liger_kernel.lce_forward replaced it on FakeForCausalLM")


def test_strict_mode_stops_at_a_certain_bypass_with_the_override():
    strict = Session(load_settings({"AUTOPATCH_STRICT": "true"}))
    with pytest.raises(StrictModeError) as err:
        strict.note_bypass("fused_linear_cross_entropy", "FakeForCausalLM", "a trainer's own head",
                           "fake", certain=True)
    assert "AUTOPATCH_MODELS__fake__FUSED_LINEAR_CROSS_ENTROPY=false" in str(err.value), err.value
    # an uncertain one (a read of lm_head, maybe harmless) is only remembered
    strict.note_bypass("cross_entropy", "FakeForCausalLM", "somebody read lm_head")
    assert report.bypassed(strict)["cross_entropy"] == "somebody read lm_head"


def test_strict_exit_check_ends_the_process_with_code_2_after_writing_the_report(tmp_path):
    out = tmp_path / "report.json"
    script = textwrap.dedent(f"""
        import torch
        from autopatch import runtime
        from autopatch.config import load_settings
        from autopatch.session import Record
        session = runtime.begin(load_settings())
        session.add([Record("cross_entropy", "{MODULE}", "FakeForCausalLM.loss_function", True)])
        session.note_built("FakeForCausalLM", ["{MODULE}"])
        p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=1.0)
        p.sum().backward(); opt.step(); opt.step()
        print("trained")
    """)
    proc = subprocess.run([sys.executable, "-c", script],
                          env=clean_env(PYTHONPATH=str(REPO), AUTOPATCH_STRICT="1", AUTOPATCH_REPORT=str(out)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "trained" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "never ran" in ln]
    assert len(lines) == 1 and lines[0].startswith("AUTOPATCH_STRICT: patched loss kernel cross_entropy"), proc.stderr
    assert "(2 optimizer steps)" in lines[0] and "AUTOPATCH_CROSS_ENTROPY=false" in lines[0], lines[0]
    data = json.loads(out.read_text())
    assert data["trained"]["optimizer_steps"] == 2 and data["runs"]["cross_entropy"]["calls"] == 0, data


def test_gelu_mlp_runs_in_a_gpt_neox_are_counted(tmp_path):
    """FUSED_KERNELS=gelu_mlp on a GPT-NeoX: its MLPs run fused_kernels.gelu_linear (launched as
    gelu_fwd/gelu_bwd), and the report's runs.gelu_mlp counts each layer's call."""
    out = tmp_path / "report.json"
    script = textwrap.dedent("""
        import torch
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        config = GPTNeoXConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4)
        model = GPTNeoXForCausalLM(config)
        ids = torch.randint(0, 64, (1, 8))
        model(input_ids=ids, labels=ids).loss.backward()
    """)
    proc = subprocess.run([sys.executable, "-c", script],
                          env=clean_env(PYTHONPATH=str(REPO), FUSED_KERNELS="gelu_mlp", AUTOPATCH_REPORT=str(out)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert any(r["kernel"] == "gelu_mlp" and r["patched"] for r in data["records"]), data["records"]
    runs = data["runs"]["gelu_mlp"]
    assert runs["calls"] == 2, runs  # one per layer
    assert runs["launches"]["gelu_fwd"] == 2 and runs["launches"]["gelu_bwd"] == 2, runs
