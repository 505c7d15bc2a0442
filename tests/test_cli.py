"""The command line: list, doctor, --help everywhere, and how `run` splits its own options from the
script's. In-process where nothing is imported for real; doctor on real modeling modules runs in a
subprocess (it imports transformers models and patches their classes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopatch import __main__ as cli
from autopatch import hooks
from autopatch.names import KERNELS, KERNEL_NAMES

REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
    env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def test_list(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name, what in KERNELS.items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert what.split()[0] in line
    assert "autopatch.apply(model) defaults to all but cross_entropy" in out


def test_console_script_list():
    exe = Path(sys.executable).parent / "autopatch"
    out = subprocess.run([str(exe), "list"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines() if line[:1].isalpha()][: len(KERNEL_NAMES)] == list(KERNEL_NAMES)


@pytest.mark.parametrize("argv, code", [
    (["list"], cli.CLOSED_STDOUT),
    (["--help"], 0),  # argparse ignores a failed write of its help text
    (["doctor", "--help"], 0),
])
def test_closed_stdout_exits_quietly(argv, code):
    """`autopatch list | head`: the reader is gone before we write. No traceback, no "Exception
    ignored" at exit; `list` exits with the status a shell reports for a tool ended by SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the child writes a byte: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "autopatch", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=clean_env(), cwd=REPO, timeout=60)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (code, "")
    assert cli.CLOSED_STDOUT == 128 + 13  # SIGPIPE


@pytest.mark.parametrize("argv, expect", [
    (["--help"], ["usage: autopatch", "{run,doctor,list,kernel-repo}", "FUSED_KERNELS"]),
    (["run", "--help"], ["usage: autopatch run", "--kernels LIST", "--env-file F", "--report F", "--strict", "-m module"]),
    (["doctor", "--help"], ["usage: autopatch doctor", "model_type", "--all", "llama"]),
    (["list", "--help"], ["usage: autopatch list"]),
])
def test_help_everywhere(capsys, argv, expect):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    for fragment in expect:
        assert fragment in out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage: autopatch" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["train.py", "--help", "-m", "x"], ([], "script", "train.py", ["--help", "-m", "x"])),
    (["--kernels", "rope", "--strict", "train.py", "a"], (["--kernels", "rope", "--strict"], "script", "train.py", ["a"])),
    (["--kernels=rope", "-m", "pkg.mod", "--kernels", "x"], (["--kernels=rope"], "module", "pkg.mod", ["--kernels", "x"])),
    (["-mpkg", "a"], ([], "module", "pkg", ["a"])),
    (["--env-file", "a.env", "--", "-weird.py", "x"], (["--env-file", "a.env"], "script", "-weird.py", ["x"])),
    (["--report", "r.json"], (["--report", "r.json"], None, None, [])),
])
def test_run_splits_its_options_from_the_scripts(argv, expected):
    assert cli._split_run_argv(argv) == expected


def test_run_without_target(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--kernels", "all"])
    assert info.value.code == 2
    assert "autopatch run: give a script to run" in capsys.readouterr().err


def test_doctor_bad_input(capsys, monkeypatch):
    monkeypatch.setitem(hooks._state, "suspended", False)
    monkeypatch.delenv("FUSED_KERNELS", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "lama"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "autopatch doctor: unknown model type 'lama'; did you mean llama" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--kernels", "rope,rms_nrom", "llama"])
    assert info.value.code == 2
    assert "--kernels: unknown kernel 'rms_nrom'" in capsys.readouterr().err


@pytest.mark.slow
def test_doctor_output():
    """doctor on two real architectures: per component, rule, target, and the verdict."""
    out = subprocess.run([sys.executable, "-m", "autopatch", "doctor", "llama", "gemma2"], capture_output=True,
                         text=True, env=clean_env(FUSED_KERNELS="all,-cross_entropy"), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("autopatch doctor: transformers ")
    assert "kernels: rope, rms_norm, layer_norm, swiglu, geglu, gelu_mlp, fused_linear_cross_entropy" in text.splitlines()[0]
    blocks = {b.splitlines()[0].split()[0]: b for b in text.split("\n\n") if b.startswith("transformers.models.")}
    llama = blocks["transformers.models.llama.modeling_llama"]
    assert "(model_type llama)" in llama
    rows = {tuple(line.split()[:2]): line for line in llama.splitlines()[2:] if line.startswith("  ")}
    assert "patched" in rows[("rms_norm", "LlamaRMSNorm")]
    assert "patched" in rows[("rope", "apply_rotary_pos_emb")]
    assert "patched" in rows[("swiglu", "LlamaMLP")]
    gemma2 = blocks["transformers.models.gemma2.modeling_gemma2"]
    gemma_rows = {tuple(line.split()[:2]): line for line in gemma2.splitlines()[2:] if line.startswith("  ")}
    assert "offset=1" in gemma_rows[("rms_norm", "Gemma2RMSNorm")]  # Gemma's (1 + weight)
    assert "patched" in gemma_rows[("geglu", "Gemma2MLP")]
    assert "off: cross_entropy" in gemma2
    # doctor runs the rules itself: the import hooks stay quiet
    assert "autopatch: modeling_" not in out.stderr
