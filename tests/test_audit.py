"""What replaced our forwards after we patched them, said in one line and in the JSON report:
Liger-Kernel's module path (apply_liger_kernel_to_llama() rebinds modeling_llama's globals) and its
instance path (what Trainer's use_liger_kernel does), a user's monkeypatch of a patched class, a
forward set on an instance (what Hub kernels' kernelize does); strict mode makes each an error (exit
code 2, one line, no traceback). Each scenario runs in a fresh interpreter with the variables set."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_e2e_env import clean_env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = """
import json, sys, types
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
ids = torch.randint(0, 64, (1, 8))
"""


def run_script(tmp_path, body: str, **env):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(TINY) + textwrap.dedent(body), encoding="utf-8")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=clean_env(TRITON_INTERPRET="1", AUTOPATCH_REPORT=str(report), **env))
    data = json.loads(report.read_text()) if report.exists() else None
    return proc, data


def autopatch_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("autopatch:", "AUTOPATCH_STRICT"))]


def test_liger_module_path_is_named_in_one_line(tmp_path):
    """apply_liger_kernel_to_llama() after our hooks patched modeling_llama: the model built holds
    Liger's classes; one line says which layers run Liger's code and how to choose."""
    proc, data = run_script(tmp_path, """
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
        model = LlamaForCausalLM(config)
        print("BUILT", flush=True)
    """, FUSED_KERNELS="all")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in autopatch_lines(proc.stderr) if "Liger" in ln]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    for layer in ("rms_norm (LlamaRMSNorm)", "swiglu (LlamaMLP)", "rope (apply_rotary_pos_emb)",
                  "fused_linear_cross_entropy (LlamaForCausalLM)"):
        assert layer in line, line
    assert "unset use_liger_kernel" in line and "AUTOPATCH_RMS_NORM=false" in line, line
    assert "Traceback" not in proc.stderr
    replaced = {(r["kernel"], r["target"]): r["by"] for r in data["replaced"]}
    assert replaced[("rms_norm", "LlamaRMSNorm")] == "liger_kernel.transformers.rms_norm.LigerRMSNorm", replaced
    assert replaced[("swiglu", "LlamaMLP")].startswith("liger_kernel."), replaced


def test_liger_instance_path_is_named_before_the_first_training_forward(tmp_path):
    """Trainer's use_liger_kernel patches the instances of a built model (Liger's instance path): the
    audit before the first training forward says so, once."""
    proc, data = run_script(tmp_path, """
        model = LlamaForCausalLM(config)
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        _apply_liger_kernel_to_instance(model=model)
        print("BEFORE FORWARD", file=sys.stderr, flush=True)
        model.train()
        try:
            model(input_ids=ids, labels=ids)
        except Exception as exc:  # Liger's own kernels on the CPU are not what this test is about
            print("liger forward:", type(exc).__name__, file=sys.stderr)
        print("AFTER FORWARD", file=sys.stderr, flush=True)
    """, FUSED_KERNELS="all")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    liger = [ln for ln in autopatch_lines(err) if "Liger" in ln]
    assert len(liger) == 1, err
    assert err.index("BEFORE FORWARD") < err.index(liger[0]) < err.index("AFTER FORWARD"), err
    assert "rms_norm (LlamaRMSNorm)" in liger[0] and "fused_linear_cross_entropy (LlamaForCausalLM)" in liger[0]
    assert {r["kernel"] for r in data["replaced"]} >= {"rms_norm", "swiglu", "fused_linear_cross_entropy"}


def test_liger_under_strict_mode_stops_with_one_line(tmp_path):
    proc, data = run_script(tmp_path, """
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=False, swiglu=False, fused_linear_cross_entropy=False)
        model = LlamaForCausalLM(config)
        print("CONTINUED")
    """, FUSED_KERNELS="rms_norm", AUTOPATCH_STRICT="true")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "CONTINUED" not in proc.stdout and "Traceback" not in proc.stderr
    lines = autopatch_lines(proc.stderr)
    assert lines[-1].startswith("AUTOPATCH_STRICT: Liger-Kernel and autopatch both patch this model: Liger's code "
                                "runs for rms_norm (LlamaRMSNorm)"), proc.stderr
    assert "unset AUTOPATCH_STRICT" in lines[-1]
    assert data["replaced"] == [{"kernel": "rms_norm", "target": "LlamaRMSNorm",
                                 "by": "liger_kernel.transformers.rms_norm.LigerRMSNorm"}]


def test_a_users_monkeypatch_is_named(tmp_path):
    proc, data = run_script(tmp_path, """
        from transformers.models.llama import modeling_llama
        def my_norm_forward(self, hidden_states):
            return hidden_states
        modeling_llama.LlamaRMSNorm.forward = my_norm_forward   # after our hook patched it
        model = LlamaForCausalLM(config)
    """, FUSED_KERNELS="rms_norm")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in autopatch_lines(proc.stderr) if "replaced" in ln]
    assert lines == ["autopatch: rms_norm on LlamaRMSNorm was replaced after autopatch patched it: "
                     "__main__.my_norm_forward runs instead, so autopatch's rms_norm does not run there "
                     "(to keep it and say so, AUTOPATCH_MODELS__llama__RMS_NORM=false)"], proc.stderr
    assert data["replaced"] == [{"kernel": "rms_norm", "target": "LlamaRMSNorm", "by": "__main__.my_norm_forward"}]


def test_an_instance_forward_set_after_the_build_is_named_at_train(tmp_path):
    """What Hub kernels' kernelize does: `forward` set on the instances of a patched class; the audit
    at model.train()/eval() (where transformers re-kernelizes) finds it."""
    proc, data = run_script(tmp_path, """
        model = LlamaForCausalLM(config)
        model.eval()
        def hub_forward(self, hidden_states):
            return hidden_states
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = types.MethodType(hub_forward, module)
        print("SET", file=sys.stderr, flush=True)
        model.train()
        print("TRAIN", file=sys.stderr, flush=True)
    """, FUSED_KERNELS="rms_norm")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    lines = [ln for ln in autopatch_lines(err) if "replaced" in ln]
    assert len(lines) == 1 and "__main__.hub_forward runs instead" in lines[0], err
    assert err.index("SET") < err.index(lines[0]) < err.index("TRAIN"), err


def test_audit_model_for_the_hub_side(tmp_path):
    """audit.audit_model(model, session) returns what is new (kernel, class, by) and records it."""
    proc, _ = run_script(tmp_path, """
        from autopatch import audit, session
        model = LlamaForCausalLM(config)
        assert audit.audit_model(model, session.current()) == []
        norm = model.model.norm
        norm.forward = types.MethodType(lambda self, x: x, norm)
        found = audit.audit_model(model, session.current(), say=False)
        print(json.dumps([list(f) for f in found]))
        print(json.dumps(audit.audit_model(model, session.current())))
    """, FUSED_KERNELS="rms_norm")
    assert proc.returncode == 0, proc.stderr
    first, again = proc.stdout.splitlines()
    assert json.loads(first) == [["rms_norm", "LlamaRMSNorm", "__main__.<lambda>"]]
    assert json.loads(again) == []  # recorded once
