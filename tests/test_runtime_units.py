"""In-process units of the runtime: the report's rendering of a Session (stderr line, strict
refusals, table, JSON, notices under a progress bar), apply()'s keywords and module discovery, and
the hooks' module names, model-type lookup and waiting summary lines. Rules are replaced by a fake one where the point is the
plumbing, not the detection."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from autopatch import _api, hooks, report, rules, runtime
from autopatch.rules import _kernels
from autopatch import session as sessions
from autopatch.config import load_settings
from autopatch.names import KERNEL_NAMES
from autopatch.session import Record, Session, StrictModeError

LLAMA = "transformers.models.llama.modeling_llama"


@pytest.fixture
def fresh_report(monkeypatch):
    """A fresh process session (plain settings) for the test; the real one is put back after."""
    fresh = Session(load_settings({}))
    fresh.installed.update({"exit", "optimizer"})  # no atexit check nor optimizer hook from a unit test
    monkeypatch.setattr(sessions, "_current", fresh)
    return fresh


# --------------------------------------------------------------------------- report
def test_summary_line():
    recs = [
        Record("rms_norm", LLAMA, "LlamaRMSNorm", True, "offset=0 casting=llama"),
        Record("rope", LLAMA, "apply_rotary_pos_emb", True, "half"),
        Record("swiglu", LLAMA, "LlamaMLP", True),
        Record("fused_linear_cross_entropy", LLAMA, "LlamaForCausalLM.forward", True),
        Record("cross_entropy", LLAMA, "LlamaForCausalLM.forward", False, reason="off"),
    ]
    assert report.summary_line(LLAMA, recs, lambda k: k != "cross_entropy") == (
        "autopatch: modeling_llama: rms_norm (LlamaRMSNorm), rope, swiglu (LlamaMLP), "
        "fused_linear_cross_entropy (LlamaForCausalLM)"
    )
    assert report.summary_line(LLAMA, []) is None
    refused = [Record("rms_norm", LLAMA, "OddNorm", False, reason="matched no variant")]
    line = report.summary_line(LLAMA, refused, lambda k: True)
    assert line.startswith("autopatch: modeling_llama: nothing patched; left alone: rms_norm (OddNorm)")
    assert report.summary_line(LLAMA, refused, lambda k: False) is None  # off: not worth a line


def test_refusals_count_enabled_kernels_and_rule_errors():
    recs = [
        Record("rms_norm", LLAMA, "A", True),
        Record("rms_norm", LLAMA, "B", False, reason="no match"),
        Record("geglu", LLAMA, "C", False, reason="geglu is off"),
        Record("glu_mlp", LLAMA, "*", False, reason="rule raised KeyError: 'x'"),
    ]
    got = report.refusals(recs, lambda k: k != "geglu")
    assert [r.target for r in got] == ["B", "*"]


def test_format_table():
    recs = [Record("rms_norm", LLAMA, "LlamaRMSNorm", True, "offset=0 casting=llama"),
            Record("rope", LLAMA, "apply_rotary_pos_emb", False, reason="interleaved rotation")]
    lines = report.format_table(recs).splitlines()
    assert lines[0] == LLAMA
    assert lines[1].split() == ["kernel", "target", "result"]
    assert lines[2].split()[:3] == ["rms_norm", "LlamaRMSNorm", "patched:"] and lines[2].endswith("casting=llama")
    assert lines[3].endswith("left alone: interleaved rotation")


def test_json_report(tmp_path):
    session = Session(load_settings({"FUSED_KERNELS": "rope"}))
    session.add([Record("rope", LLAMA, "apply_rotary_pos_emb", True, "half")])
    session.note_replaced("rope", "apply_rotary_pos_emb", "somelib.rope")
    written = report.write_json(str(tmp_path / "r-{pid}.json"), session)
    assert written.endswith(f"r-{__import__('os').getpid()}.json")
    data = json.loads(open(written).read())
    assert data["records"] == [{"kernel": "rope", "module": LLAMA, "target": "apply_rotary_pos_emb",
                                "patched": True, "variant": "half", "reason": ""}]
    assert data["settings"]["kernels"] == ["rope"] and data["argv"] == sys.argv
    assert data["replaced"] == [{"kernel": "rope", "target": "apply_rotary_pos_emb", "by": "somelib.rope"}]
    assert "torch" in data["versions"]


def test_fallback_notice_once_and_strict(capsys):
    session = Session(load_settings({}))
    _kernels.fallback(session, "rope", "apply_rotary_pos_emb got cpu tensors")
    _kernels.fallback(session, "rope", "again")
    err = capsys.readouterr().err
    assert err.count("autopatch: rope: apply_rotary_pos_emb got cpu tensors; running the original code") == 1
    assert "again" not in err
    strict = Session(load_settings({"AUTOPATCH_STRICT": "true"}))
    with pytest.raises(StrictModeError, match="AUTOPATCH_STRICT.*rms_norm: got cpu tensors"):
        _kernels.fallback(strict, "rms_norm", "got cpu tensors")


def test_report_keeps_no_state():
    """report.py renders: no module-level mutable state, no hooks, no settings look-up."""
    import inspect

    source = inspect.getsource(report)
    for needle in ("load_settings", "atexit", "register_optimizer_step_post_hook", "os._exit", "global "):
        assert needle not in source, needle
    from autopatch import names

    mutable = [name for name, value in vars(report).items()  # the kernel data of autopatch.names aside
               if not name.startswith("__") and isinstance(value, (list, dict, set)) and value is not getattr(names, name, None)]
    assert mutable == [], mutable


def rendered_lines(raw: str) -> list[str]:
    """What a terminal shows for `raw`: "\r" returns to the line's start and overwrites, "\n" ends it."""
    lines, line, col = [], [], 0
    for ch in raw:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    if line:
        lines.append("".join(line).rstrip())
    return lines


@pytest.mark.parametrize("notice", ["say", "fallback_notice"])
def test_notices_start_on_their_own_line_under_a_progress_bar(monkeypatch, fresh_report, notice):
    import io

    tqdm = pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = tqdm.tqdm(total=10, file=sys.stderr, ascii=True, mininterval=0, miniters=1, ncols=60, desc="train")
    bar.update(3)
    if notice == "say":
        sessions.say("autopatch: modeling_llama: rms_norm (LlamaRMSNorm)")
        expected = "autopatch: modeling_llama: rms_norm (LlamaRMSNorm)"
    else:
        _kernels.fallback(fresh_report, "rope", "apply_rotary_pos_emb got cpu tensors")
        expected = ("autopatch: rope: apply_rotary_pos_emb got cpu tensors; running the original code instead "
                    "(Triton runs on CUDA tensors, or on the CPU with TRITON_INTERPRET=1)")
    bar.update(3)
    bar.close()
    shown = rendered_lines(err.getvalue())
    assert expected in shown, shown  # the whole line, with no bar before it
    assert shown[-1].startswith("train:  60%")  # the bar was drawn again below the notice
    # without a bar, a plain line
    err.truncate(0), err.seek(0)
    sessions.say("autopatch: plain")
    assert err.getvalue() == "autopatch: plain\n"


# --------------------------------------------------------------------------- apply()
def test_apply_keywords():
    assert _api.resolve_toggles({}) == {"rope": True, "rms_norm": True, "layer_norm": True, "swiglu": True,
                                        "geglu": True, "gelu_mlp": True,
                                        "cross_entropy": False, "fused_linear_cross_entropy": True,
                                        "causal_mask": True, "vision_attention": True, "masked_attention": True,
                                        "lora_input": False}  # peft's layers: the import hooks' only
    liger = {"rope": True, "rms_norm": False, "swiglu": True, "cross_entropy": True,
             "fused_linear_cross_entropy": False}
    got = _api.resolve_toggles(liger)
    assert {k: got[k] for k in liger} == liger and got["geglu"] is True
    with pytest.raises(TypeError, match=r"'layer_nrom': did you mean layer_norm\?.*valid kernel keywords: "
                       + ", ".join(KERNEL_NAMES)):
        _api.resolve_toggles({"layer_nrom": True})
    with pytest.raises(TypeError, match="rope must be True or False, got 'yes'"):
        _api.resolve_toggles({"rope": "yes"})


FAKE_MODELING = "transformers_modules.fake_org.modeling_fake"


@pytest.fixture
def fake_world(monkeypatch, fresh_report):
    """A fake modeling module with a tiny model, and a fake rule that records what it was asked."""
    modeling = types.ModuleType(FAKE_MODELING)

    class FakeMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(4, 4)

    class FakeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = FakeMLP()
            self.norm = torch.nn.LayerNorm(4)

    for cls in (FakeMLP, FakeModel):
        cls.__module__ = FAKE_MODELING
        setattr(modeling, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, FAKE_MODELING, modeling)

    class FakeRule:
        name = "fake"
        kernels = KERNEL_NAMES
        seen: list = []
        refuse = False

        def patch_module(self, module, *args):
            enabled = args[-1]  # (module, session, enabled)
            self.seen.append((module.__name__, {k: enabled(k) for k in KERNEL_NAMES}))
            if self.refuse:
                return [Record("rms_norm", module.__name__, "FakeNorm", False, reason="no variant matched")]
            return [Record("swiglu", module.__name__, "FakeMLP", True, "swiglu")]

    rule = FakeRule()
    monkeypatch.setattr(rules, "RULES", (rule,))
    return modeling, rule


def test_apply_runs_rules_over_the_models_modules(fake_world, fresh_report, capsys):
    modeling, rule = fake_world
    model = modeling.FakeModel()
    assert _api.modules_of(model) == [modeling]  # torch.nn's modules are not modeling modules
    records = _api.apply(model, rope=False, cross_entropy=True)
    assert records == [Record("swiglu", FAKE_MODELING, "FakeMLP", True, "swiglu")]
    assert fresh_report.all_records() == records
    assert fresh_report.built == {FAKE_MODELING: ["FakeModel"]}
    name, seen = rule.seen[-1]
    assert name == FAKE_MODELING
    assert seen == {"rope": False, "rms_norm": True, "layer_norm": True, "swiglu": True, "geglu": True,
                    "gelu_mlp": True, "cross_entropy": True, "fused_linear_cross_entropy": True, "causal_mask": True,
                    "vision_attention": True, "masked_attention": True, "lora_input": False}
    assert capsys.readouterr().err == "autopatch: modeling_fake: swiglu (FakeMLP)\n"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        _api.apply(model, rotary=True)
    with pytest.raises(TypeError, match=r"^apply\(\) got unexpected keyword argument\(s\) 'rms_nrom'; "
                                        r"'rms_nrom': did you mean rms_norm\? valid kernel keywords: ") as err:
        _api.apply(model, rms_nrom=True)
    assert "\n" not in str(err.value)  # one line, as the environment path's


def test_apply_strict_raises_on_refusal(fake_world, monkeypatch):
    modeling, rule = fake_world
    rule.refuse = True
    assert _api.apply(modeling.FakeModel())[0].patched is False  # not strict: recorded, no error
    monkeypatch.setenv("AUTOPATCH_STRICT", "true")  # apply() begins the session with the environment's settings
    with pytest.raises(StrictModeError, match="rms_norm left .*FakeNorm alone: no variant matched") as err:
        _api.apply(modeling.FakeModel())
    assert "autopatch.apply(model, rms_norm=False)" in str(err.value)  # the way out


# --------------------------------------------------------------------------- hooks' helpers
def test_modeling_module_names_lists_without_importing():
    before = {m for m in sys.modules if m.startswith("transformers.models.")}
    names = hooks.modeling_module_names()
    assert {m for m in sys.modules if m.startswith("transformers.models.")} == before
    assert LLAMA in names and "transformers.models.gemma2.modeling_gemma2" in names
    assert len(names) > 300 and len(set(names)) == len(names)
    assert not [n for n in names if n.startswith("transformers.models.auto.")]
    assert all(n.rpartition(".")[2].startswith("modeling_") for n in names)


@pytest.mark.parametrize("name, expected", [
    (LLAMA, True),
    ("transformers.models.deprecated.mega.modeling_mega", True),
    ("transformers.models.llama.configuration_llama", False),
    ("transformers.models.auto.modeling_auto", False),
    ("transformers.models.bert.modeling_tf_bert", False),
    ("transformers.models.bert.modeling_flax_bert", False),
    ("transformers.models.llama", False),
    ("transformers.modeling_utils", False),
    ("transformers.models.llama.modeling_llama.sub", False),
    ("transformers_modules.org.modeling_x", False),
])
def test_is_modeling_module_name(name, expected):
    assert hooks.is_modeling_module_name(name) is expected


def test_listing_and_name_test_agree():
    names = hooks.modeling_module_names()
    assert all(hooks.is_modeling_module_name(n) for n in names)


def test_pending_lines_said_for_the_model_built(capsys, fake_world, fresh_report):
    modeling, _ = fake_world
    other = "transformers.models.bloom.modeling_bloom"
    fresh_report.pending.update({FAKE_MODELING: "autopatch: modeling_fake: swiglu (FakeMLP)",
                                 other: "autopatch: modeling_bloom: cross_entropy"})
    assert runtime.say_pending_for(torch.nn.Linear(2, 2)) == []  # torch's classes: no modeling module
    assert runtime.say_pending_for(modeling.FakeModel()) == ["autopatch: modeling_fake: swiglu (FakeMLP)"]
    assert capsys.readouterr().err == "autopatch: modeling_fake: swiglu (FakeMLP)\n"
    assert fresh_report.pending == {other: "autopatch: modeling_bloom: cross_entropy"}
    assert runtime.say_pending_for(modeling.FakeModel()) == []  # said once


def test_model_types_of(monkeypatch):
    config_mod = types.ModuleType("transformers.models.foo3.configuration_foo3")

    class Foo3Config:
        model_type = "foo3"

    class Foo3TextConfig:
        model_type = "foo3_text"

    for cls in (Foo3Config, Foo3TextConfig):
        cls.__module__ = config_mod.__name__
        setattr(config_mod, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, config_mod.__name__, config_mod)
    assert runtime.model_types_of(types.ModuleType("transformers.models.foo3.modeling_foo3")) == ["foo3", "foo3_text"]
    assert runtime.model_types_of(types.ModuleType("transformers.models.bar.modeling_bar")) == ["bar"]
