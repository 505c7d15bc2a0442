"""The rule template (autopatch.rules._template): its checks on a rule made for the test (the record's
kernel from the variant that matched, a disabled kernel, a swap another rule made, fused_kernels not
importable, the cached verdict, a rule's own error) and the state its proofs run in, whatever the
caller's state is; and the real gated-MLP rules refusing a forward another rule swapped."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

from helpers import everything, modeling, verdict_of

from autopatch import patching
from autopatch.rules import _template, gelu_mlp, glu_mlp
from autopatch.rules._template import Candidate, Rule, Swap, Verdict
from autopatch.session import Session

pytestmark = pytest.mark.usefixtures("restore_patches")


@dataclasses.dataclass(frozen=True)
class _Variant:
    kernel: str

    def describe(self) -> str:
        return f"fake {self.kernel}"


class _SiluMLP(nn.Module):
    ACT = "silu"

    def forward(self, x):
        return x


class _GeluMLP(nn.Module):
    ACT = "gelu"

    def forward(self, x):
        return x


class _OddMLP(nn.Module):
    ACT = "gelu-odd"  # refused, under the kernel its activation would have used

    def forward(self, x):
        return x


def _fake_module(*classes):
    module = types.ModuleType("fake_modeling")
    for cls in classes:
        setattr(module, cls.__name__, cls)
    return module


class _FakeRule(Rule):
    """Proves from the class's ACT; swaps `forward` for a marker function."""

    kernels = ("swiglu", "geglu")

    def __init__(self, name="fake"):
        super().__init__()
        self.name = name
        self.proved: list = []
        self.made: list = []
        self.seen_state: list = []

    def candidates(self, module):
        return [Candidate(c.__name__, c) for c in vars(module).values() if isinstance(c, type)]

    def prove(self, candidate, module):
        cls = candidate.key
        self.proved.append(cls)
        self.seen_state.append({
            "device": torch.empty(1).device.type, "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
        })
        if cls.ACT == "boom":
            raise RuntimeError("the proof broke")
        if cls.ACT == "gelu-odd":
            return Verdict(cls.__name__, None, "an activation the kernels do not have", kernel="geglu")
        return Verdict(cls.__name__, _Variant("swiglu" if cls.ACT == "silu" else "geglu"))

    def swaps(self, candidate, verdict, session, enabled):
        cls = candidate.key

        def make():
            def forward(self, x):
                return x + 1

            forward.rule = self_name
            self.made.append(cls)
            return forward

        self_name = self.name
        return [Swap(cls, "forward", make)]


def test_kernel_of_each_record_is_the_variants():
    rule = _FakeRule()
    records = rule.patch_module(_fake_module(_SiluMLP, _GeluMLP, _OddMLP), Session(), everything)
    by_target = {r.target: r for r in records}
    assert by_target["_SiluMLP"].kernel == "swiglu" and by_target["_SiluMLP"].patched
    assert by_target["_GeluMLP"].kernel == "geglu" and by_target["_GeluMLP"].patched
    assert by_target["_GeluMLP"].variant == "fake geglu"
    odd = by_target["_OddMLP"]
    assert odd.kernel == "geglu" and not odd.patched and odd.reason == "an activation the kernels do not have"


def test_disabled_kernel_is_recorded_and_nothing_swapped():
    rule = _FakeRule()
    before = _GeluMLP.forward
    records = rule.patch_module(_fake_module(_SiluMLP, _GeluMLP), Session(), lambda k: k == "swiglu")
    gelu = verdict_of(records, "_GeluMLP")
    assert not gelu.patched and gelu.reason == "kernel geglu disabled" and gelu.variant == "fake geglu"
    assert _GeluMLP.forward is before and not patching.is_patched(_GeluMLP, "forward")
    assert verdict_of(records, "_SiluMLP").patched


def test_a_swap_another_rule_made_is_refused():
    other, ours = _FakeRule("other"), _FakeRule("ours")
    module = _fake_module(_SiluMLP)
    assert verdict_of(other.patch_module(module, Session(), everything), "_SiluMLP").patched
    swapped = vars(_SiluMLP)["forward"]
    record = verdict_of(ours.patch_module(module, Session(), everything), "_SiluMLP")
    assert not record.patched and record.reason == "forward patched by another rule (other)"
    assert vars(_SiluMLP)["forward"] is swapped and ours.made == []


def test_a_restored_swap_made_again_elsewhere_is_not_the_old_rules():
    """A rule's swap restored, then the same attribute patched by something that is not a rule: the
    rule that made the first swap is not named, and no rule takes the attribute."""
    other, ours = _FakeRule("other"), _FakeRule("ours")
    module = _fake_module(_SiluMLP)
    assert verdict_of(other.patch_module(module, Session(), everything), "_SiluMLP").patched
    patching.restore_all()

    def foreign(self, x):
        return x - 1

    patching.replace(_SiluMLP, "forward", foreign)
    record = verdict_of(ours.patch_module(module, Session(), everything), "_SiluMLP")
    assert not record.patched and record.reason == "forward patched by another rule"
    assert vars(_SiluMLP)["forward"] is foreign and ours.made == []


def test_already_ours_is_patched_without_a_second_swap():
    rule = _FakeRule()
    module = _fake_module(_SiluMLP)
    first = rule.patch_module(module, Session(), everything)
    swapped = vars(_SiluMLP)["forward"]
    second = rule.patch_module(module, Session(), lambda k: False)  # in force: still patched, as recorded
    assert first == second and second[0].patched
    assert vars(_SiluMLP)["forward"] is swapped and rule.made == [_SiluMLP]


def test_unimportable_kernels_leave_it_alone(monkeypatch):
    rule = _FakeRule()
    monkeypatch.setattr(_template, "import_problem", lambda: "fused_kernels could not be imported (ImportError: x)")
    record = verdict_of(rule.patch_module(_fake_module(_SiluMLP), Session(), everything), "_SiluMLP")
    assert not record.patched and record.reason.startswith("fused_kernels could not be imported")
    assert not patching.is_patched(_SiluMLP, "forward")


def test_the_verdict_is_cached_until_cleared():
    rule = _FakeRule()
    module = _fake_module(_SiluMLP)
    rule.patch_module(module, Session(), everything)
    patching.restore_all()
    rule.patch_module(module, Session(), everything)
    assert rule.proved == [_SiluMLP]
    rule.verdicts.clear()
    rule.patch_module(module, Session(), everything)
    assert rule.proved == [_SiluMLP, _SiluMLP]


def test_a_rule_error_is_a_refusal_not_an_exception():
    class _Boom(nn.Module):
        ACT = "boom"

    record = verdict_of(_FakeRule().patch_module(_fake_module(_Boom), Session(), everything), "_Boom")
    assert not record.patched and record.reason == "rule error: RuntimeError: the proof broke"


def test_the_proof_runs_in_its_own_state_and_the_callers_is_restored():
    rule = _FakeRule()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.device("meta"), torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            rule.patch_module(_fake_module(_SiluMLP), Session(), everything)
            assert torch.empty(1).device.type == "meta" and torch.is_inference_mode_enabled()
            assert torch.is_autocast_enabled("cpu")
        assert torch.get_default_dtype() == torch.bfloat16
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(dtype)
    assert rule.seen_state == [{"device": "cpu", "dtype": torch.float32, "grad": True, "inference": False,
                                "autocast": False, "deterministic": False}]


def test_the_callers_cpu_random_stream_is_untouched():
    """Rules over real modules (their probes build instances, whose init draws from the global RNG):
    the CPU generator's state afterwards is the one before, so a model built next gets the same
    initial weights as without autopatch."""
    from autopatch import rules

    for rule in rules.RULES:
        rule.verdicts.clear()  # prove again: the probes must run here
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    for name in ("llama", "qwen3_moe", "gpt_neox"):
        rules.patch_module(modeling(name), Session(), everything)
    assert torch.equal(torch.get_rng_state(), state)
    with_rules = nn.Linear(8, 8).weight.detach().clone()
    torch.manual_seed(1234)
    assert torch.equal(nn.Linear(8, 8).weight, with_rules)


@pytest.mark.parametrize("rule,model,cls_name", [(glu_mlp.RULE, "llama", "LlamaMLP"),
                                                 (gelu_mlp.RULE, "gpt_neox", "GPTNeoXMLP")])
def test_gated_and_gelu_mlp_rules_refuse_a_forward_another_rule_swapped(rule, model, cls_name):
    module = modeling(model)
    cls = getattr(module, cls_name)
    other = _FakeRule("other")
    other.prove = lambda candidate, module: Verdict(candidate.target, _Variant(rule.kernels[0]))
    other.candidates = lambda module: [Candidate(cls_name, cls)]
    assert verdict_of(other.patch_module(module, Session(), everything), cls_name).patched
    swapped = vars(cls)["forward"]
    record = verdict_of(rule.patch_module(module, Session(), everything), cls_name)
    assert not record.patched and record.reason == "forward patched by another rule (other)", record
    assert vars(cls)["forward"] is swapped
