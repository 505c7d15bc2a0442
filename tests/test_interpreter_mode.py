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
