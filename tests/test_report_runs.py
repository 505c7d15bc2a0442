"""What ran, not only what was patched: autopatch.report's run counts (the kernels' launch counts and
rule-counted calls), the training watch (optimizer steps), the exit check for a patched loss that
never ran in a process that trained, and strict mode's exit code for it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autopatch import report
from autopatch.report import Record
from test_e2e_env import clean_env

REPO = Path(__file__).resolve().parents[1]
MODULE = "transformers.models.fake.modeling_fake"


@pytest.fixture
def fresh_report():
    import fused_kernels

    saved = report.records()
    report.clear()
    report.reset_runs()
    fused_kernels.reset_launch_counts()  # other tests count their launches as differences: safe to zero
    try:
        yield
    finally:
        report.clear()
        report.add(saved)
        report.reset_runs()


def test_runs_count_forward_launches_of_patched_kernels_only(fresh_report):
    import fused_kernels

    report.add([Record("rms_norm", MODULE, "FakeRMSNorm", True, "offset=0"),
                Record("causal_mask", MODULE, "FakeModel", True),
                Record("rope", MODULE, "apply_rotary_pos_emb", False, reason="not the formula")])
    before = 0
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    fused_kernels.rms_norm(x, w, eps=1e-6).sum().backward()
    runs = report.runs()
    assert set(runs) == {"rms_norm", "causal_mask"}, "only patched kernels are reported"
    assert runs["rms_norm"]["calls"] == before + 1
    assert runs["rms_norm"]["launches"]["rms_norm_bwd"] >= 1
    assert runs["causal_mask"]["calls"] is None, "causal_mask launches nothing: not counted"
    report.count_call("causal_mask", 3)
    assert report.runs()["causal_mask"]["calls"] == 3
    by_kernel = {r.kernel: r for r in report.records_with_runs()}
    assert by_kernel["rms_norm"].runs == before + 1 and by_kernel["rope"].runs is None
    assert by_kernel["rms_norm"] == Record("rms_norm", MODULE, "FakeRMSNorm", True, "offset=0"), \
        "runs takes no part in equality"
    data = report.as_json()
    assert data["runs"]["rms_norm"]["calls"] == before + 1
    assert "runs" not in data["records"][0], "the JSON's records keep their shape; counts are under 'runs'"


def _one_optimizer_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    (p * p).sum().backward()
    opt.step()


def test_exit_verdict_says_a_patched_loss_never_ran_in_a_process_that_trained(fresh_report):
    import fused_kernels

    report.add([Record("fused_linear_cross_entropy", MODULE, "FakeForCausalLM.forward", True)])
    assert report.exit_verdict() is None, "nothing trained yet"
    report.watch_training()
    _one_optimizer_step()
    assert report.trained()["optimizer_steps"] == 1
    line = report.exit_verdict()
    assert line is not None and line.startswith("autopatch: patched loss kernel fused_linear_cross_entropy "
                                                "(FakeForCausalLM) never ran in this process, which trained "
                                                "(1 optimizer step)"), line
    assert "no patched model was called in training mode with labels" in line, line
    # a known bypass names the caller
    report.note_bypass("fused_linear_cross_entropy", "FakeForCausalLM", "somelib.train_step read lm_head itself")
    assert report.exit_verdict().endswith(": somelib.train_step read lm_head itself"), report.exit_verdict()
    # once the kernel ran, nothing to say
    h = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    fused_kernels.fused_linear_cross_entropy(h, w, torch.tensor([1, 2, -100, 5])).backward()
    assert report.exit_verdict() is None


def test_strict_mode_stops_at_a_certain_bypass_with_the_override(fresh_report):
    report.set_strict(True)
    try:
        with pytest.raises(report.StrictModeError) as err:
            report.note_bypass("fused_linear_cross_entropy", "FakeForCausalLM", "a trainer's own head",
                               "fake", certain=True)
    finally:
        report.set_strict(False)
    assert "AUTOPATCH_MODELS__fake__FUSED_LINEAR_CROSS_ENTROPY=false" in str(err.value), err.value
    # an uncertain one (a read of lm_head, maybe harmless) is only remembered
    report.set_strict(True)
    try:
        report.note_bypass("cross_entropy", "FakeForCausalLM", "somebody read lm_head")
    finally:
        report.set_strict(False)
    assert report.bypassed()["cross_entropy"] == "somebody read lm_head"


def test_strict_exit_check_ends_the_process_with_code_2_after_writing_the_report(tmp_path):
    out = tmp_path / "report.json"
    script = textwrap.dedent(f"""
        import torch
        from autopatch import report
        from autopatch.report import Record
        report.add([Record("cross_entropy", "{MODULE}", "FakeForCausalLM.loss_function", True)])
        report.write_at_exit({str(out)!r})
        report.watch_training()
        report.check_at_exit()
        p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=1.0)
        p.sum().backward(); opt.step(); opt.step()
        print("trained")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(PYTHONPATH=str(REPO), AUTOPATCH_STRICT="1"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "trained" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "never ran" in ln]
    assert len(lines) == 1 and lines[0].startswith("AUTOPATCH_STRICT: patched loss kernel cross_entropy"), proc.stderr
    assert "(2 optimizer steps)" in lines[0] and "AUTOPATCH_CROSS_ENTROPY=false" in lines[0], lines[0]
    data = json.loads(out.read_text())
    assert data["trained"]["optimizer_steps"] == 2 and data["runs"]["cross_entropy"]["calls"] == 0, data
