"""Where fused_kernels cannot be imported, every rule leaves its targets alone and says why, with one
reason (autopatch.rules._kernels.import_problem), and the modeling code stays as it was."""

from __future__ import annotations

import sys

import pytest

from helpers import everything, modeling, verdict_of

pytest.importorskip("transformers")

from autopatch import patching  # noqa: E402
from autopatch.rules import _kernels, glu_mlp, loss, moe_gate, rms_norm, rope  # noqa: E402
from autopatch.session import current  # noqa: E402

REASON = "fused_kernels could not be imported"


@pytest.fixture
def unimportable(monkeypatch):
    # None in sys.modules makes `import fused_kernels` raise (ModuleNotFoundError), as a broken install would
    monkeypatch.setitem(sys.modules, "fused_kernels", None)
    yield
    patching.restore_all()


def test_import_problem_says_why(unimportable):
    problem = _kernels.import_problem()
    assert problem.startswith(REASON) and "ModuleNotFoundError" in problem


def test_import_problem_is_empty_when_the_kernels_import():
    assert _kernels.import_problem() == ""
    assert _kernels.kernels() is sys.modules["fused_kernels"]


@pytest.mark.parametrize("rule,model,target,owner,attr", [
    (rms_norm.RULE, "llama", "LlamaRMSNorm", "LlamaRMSNorm", "forward"),
    (rope.RULE, "llama", "apply_rotary_pos_emb", None, "apply_rotary_pos_emb"),
    (glu_mlp.RULE, "llama", "LlamaMLP", "LlamaMLP", "forward"),
    (loss.RULE, "llama", "LlamaForCausalLM.loss_function", "LlamaForCausalLM", "forward"),
    (moe_gate.RULE, "qwen3_moe", "Qwen3MoeExperts._apply_gate", "Qwen3MoeExperts", "_apply_gate"),
])
def test_every_rule_leaves_its_target_alone(unimportable, rule, model, target, owner, attr):
    module = modeling(model)
    holder = module if owner is None else getattr(module, owner)
    before = getattr(holder, attr)
    record = verdict_of(rule.patch_module(module, current(), everything), target)
    assert not record.patched and record.reason.startswith(REASON), record
    assert getattr(holder, attr) is before
