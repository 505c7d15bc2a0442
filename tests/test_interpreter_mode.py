"""TRITON_INTERPRET changed after the kernels were built: triton.jit reads it when a kernel's module
is imported, so a script that sets it later must get a clear error, not Triton's "0 active drivers".
Each case in a fresh interpreter (subprocess), the variable as the shell would leave it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

SET_TOO_LATE = """
import json, os, warnings
import torch
import fused_kernels
os.environ["TRITON_INTERPRET"] = "1"          # too late: the kernels are built for a GPU already
x = torch.randn(4, 8)
out = {}
for name, call in (("can_run", lambda: fused_kernels.triton_can_run(x)),
                   ("swiglu", lambda: fused_kernels.swiglu(x, x))):
    try:
        call()
        out[name] = "ran"
    except RuntimeError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""

UNSET_TOO_LATE = """
import json, os, warnings
import torch
import fused_kernels
x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    before = fused_kernels.triton_can_run(x)
    os.environ["TRITON_INTERPRET"] = "0"      # the kernels stay built for the interpreter
    after = fused_kernels.triton_can_run(x)
print(json.dumps({"before": before, "after": after,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in seen]}))
"""


def run(body: str, interpret: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_set_after_import_says_how_to_set_it():
    out = run(SET_TOO_LATE, interpret=None)
    for name in ("can_run", "swiglu"):
        message = out[name]
        assert "TRITON_INTERPRET=1 must be set before triton is imported: export it in the shell, " \
               "or set it at the top of the script" in message, (name, message)
        assert "active drivers" not in message


def test_unset_after_import_warns_and_falls_back():
    out = run(UNSET_TOO_LATE, interpret="1")
    assert out["before"] is True and out["after"] is False
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["warnings"][0].startswith("RuntimeWarning: TRITON_INTERPRET was on when triton and the fused "
                                         "kernels were imported and is off now")


TRAINS_ON_CPU = """
import torch
import transformers.models.bloom.modeling_bloom      # what peft's import does: no Bloom model is built
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
print("TRAINED")
"""


def run_training(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FUSED_KERNELS") and not k.startswith("AUTOPATCH_")}
    env.update(PYTHONPATH=str(REPO), TRITON_INTERPRET="0", **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(TRAINS_ON_CPU)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU without the interpreter")
def test_cpu_without_interpreter_exit_line_gives_the_real_cause():
    """CPU tensors, TRITON_INTERPRET off: every patched component runs the original code. The exit
    check names only the model built (Llama, not the imported Bloom) and the real cause."""
    proc = run_training({"FUSED_KERNELS": "all"})
    assert proc.returncode == 0 and "TRAINED" in proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "never ran" in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("autopatch: patched loss kernel") and "(LlamaForCausalLM)" in lines[0], lines[0]
    assert "Bloom" not in lines[0], lines[0]
    assert ": the original code ran: CPU tensors without TRITON_INTERPRET" in lines[0], lines[0]
    assert "no patched model was called" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU without the interpreter")
def test_cpu_without_interpreter_strict_mode_is_one_line():
    proc = run_training({"FUSED_KERNELS": "all", "AUTOPATCH_STRICT": "true"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "TRAINED" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    strict = [ln for ln in proc.stderr.splitlines() if "AUTOPATCH_STRICT" in ln]
    assert len(strict) == 1 and "the original code would run instead" in strict[0], proc.stderr
    assert "unset AUTOPATCH_STRICT" in strict[0]
