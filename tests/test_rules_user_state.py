"""The rules' verdicts do not depend on the state the user's program is in when a modeling module is
first imported: a fresh process per state imports the modeling modules of a representative set of the
coverage table's architectures (decoders, Gemma's offset norm, GPT-NeoX's plain GELU MLP, MoE experts,
a vision-language model) for the first time inside that state, runs every rule over them there, and
must get the records a plain import gets. The states: `with torch.device("meta")` (FSDP2's meta
init), a bfloat16 default dtype, and a CUDA default device on this CPU-only machine (any probe tensor
made on the ambient device fails there) together with inference mode, deterministic algorithms and
CPU autocast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

MODELS = ("llama", "gemma", "gemma2", "gpt_neox", "qwen3", "qwen3_moe", "mixtral", "phi", "cohere", "qwen2_vl")

_SCRIPT = r'''
import contextlib, importlib, json, sys
import torch
import transformers  # the user's program imports transformers first; its modeling modules come later
from autopatch import rules
from autopatch.session import Session

state = sys.argv[1]
models = sys.argv[2].split(",")


@contextlib.contextmanager
def user_state():
    if state == "plain":
        yield
    elif state == "meta":
        with torch.device("meta"):
            yield
    elif state == "bf16":
        torch.set_default_dtype(torch.bfloat16)
        yield
    elif state == "cuda+inference+deterministic+autocast":
        torch.set_default_device("cuda")
        torch.use_deterministic_algorithms(True)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        raise SystemExit(f"unknown state {state}")


rows = []
rng = torch.get_rng_state()
with user_state():
    for name in models:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for r in rules.patch_module(module, Session(), lambda kernel: True):
            rows.append(r.as_dict())
    default_dtype = str(torch.get_default_dtype())
    deterministic = torch.are_deterministic_algorithms_enabled()
print(json.dumps({"rows": rows, "rng_kept": torch.equal(rng, torch.get_rng_state()),
                  "default_dtype": default_dtype, "deterministic": deterministic}))
'''


def _run(state: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for key in [k for k in env if k.startswith(("AUTOPATCH", "FUSED_KERNELS"))]:
        del env[key]  # the rules alone, called by the script: no start-up hooks
    done = subprocess.run([sys.executable, "-c", _SCRIPT, state, ",".join(MODELS)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, f"{state}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain():
    return _run("plain")


def test_plain_import_patches_the_representative_set(plain):
    patched = {(r["kernel"], r["target"]) for r in plain["rows"] if r["patched"]}
    for expected in [("rms_norm", "LlamaRMSNorm"), ("rms_norm", "GemmaRMSNorm"), ("rope", "apply_rotary_pos_emb"),
                     ("swiglu", "LlamaMLP"), ("geglu", "GemmaMLP"), ("gelu_mlp", "GPTNeoXMLP"),
                     ("swiglu", "Qwen3MoeExperts.forward"), ("swiglu", "MixtralExperts.forward"),
                     ("fused_linear_cross_entropy", "LlamaForCausalLM.forward"),
                     ("vision_attention", "VisionAttention.forward")]:
        assert expected in patched, (expected, sorted(patched))
    assert plain["rng_kept"]


@pytest.mark.slow
@pytest.mark.parametrize("state", ["meta", "bf16", "cuda+inference+deterministic+autocast"])
def test_same_records_whatever_state_the_modules_are_first_imported_in(plain, state):
    got = _run(state)
    want = {json.dumps(r, sort_keys=True) for r in plain["rows"]}
    have = {json.dumps(r, sort_keys=True) for r in got["rows"]}
    assert have == want, f"{state}: missing {sorted(want - have)[:6]}; extra {sorted(have - want)[:6]}"
    assert got["rng_kept"], f"{state}: the CPU random stream moved"
    expected_dtype = "torch.bfloat16" if state == "bf16" else "torch.float32"
    assert got["default_dtype"] == expected_dtype, "the user's default dtype was not restored"
    assert got["deterministic"] == (state == "cuda+inference+deterministic+autocast")
