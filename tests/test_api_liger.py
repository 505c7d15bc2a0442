"""apply() as a Liger user calls it: every key of Liger's config accepted (relu_squared recorded as not
provided here), `config=` taking None / a dict / TrainingArguments, and a kernel turned off in a second
call restored to the original code, with records and the stderr line saying what is in force."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import autopatch  # noqa: E402
import fused_kernels  # noqa: E402
import tiny_models  # noqa: E402
from autopatch import _api, patching, rules  # noqa: E402
from autopatch import session as sessions  # noqa: E402
from autopatch.config import load_settings, parse_kernel_list  # noqa: E402
from autopatch.names import KERNEL_NAMES, NOT_PROVIDED  # noqa: E402

LIGER_KEYS = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm",
              "relu_squared")  # Liger-Kernel 0.8.5's apply_liger_kernel_to_* keywords


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    fresh = sessions.Session()
    fresh.installed.update({"exit", "optimizer"})  # no exit check from a unit test
    monkeypatch.setattr(sessions, "_current", fresh)
    yield
    patching.restore_all()


def _llama():
    arch = tiny_models.Architecture("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM")
    return tiny_models.build_tiny(arch)


def _launches(model):
    fused_kernels.reset_launch_counts()
    model(**tiny_models.smoke_inputs(model)).loss.backward()
    model.zero_grad(set_to_none=True)
    return fused_kernels.launch_counts()


def test_every_liger_key_is_accepted():
    chosen = _api.resolve_toggles(dict.fromkeys(LIGER_KEYS, True))
    assert set(chosen) == set(KERNEL_NAMES) and "relu_squared" not in chosen
    assert all(chosen[k] for k in LIGER_KEYS if k in KERNEL_NAMES)
    with pytest.raises(TypeError, match=r"'relu_sqared'.*valid kernel keywords: .*layer_norm"):
        _api.resolve_toggles({"relu_sqared": True})
    with pytest.raises(TypeError, match="relu_squared must be True or False"):
        _api.resolve_toggles({"relu_squared": "yes"})


def test_relu_squared_recorded_not_provided(capsys):
    model = _llama()
    records = autopatch.apply(model, relu_squared=True)
    mine = [r for r in records if r.kernel == "relu_squared"]
    assert len(mine) == 1 and not mine[0].patched and "not provided here" in mine[0].reason
    assert mine[0] in autopatch.applied()
    assert "relu_squared" not in capsys.readouterr().err  # not a refusal: the stderr line leaves it out
    assert not [r for r in autopatch.apply(model, relu_squared=False) if r.kernel == "relu_squared"]


def test_relu_squared_in_strict_mode_does_not_raise(monkeypatch):
    monkeypatch.setenv("AUTOPATCH_STRICT", "1")  # apply() begins the session with the environment's settings
    records = autopatch.apply(_llama(), relu_squared=True, rope=False)
    assert any(r.kernel == "relu_squared" for r in records)


def test_fused_kernels_variable_accepts_relu_squared():
    assert parse_kernel_list("all") == frozenset(KERNEL_NAMES)  # every kernel provided, nothing else
    assert parse_kernel_list("all,relu_squared") == frozenset(KERNEL_NAMES)
    assert parse_kernel_list("rope,relu_squared") == frozenset({"rope"})
    assert parse_kernel_list("all,-relu_squared") == frozenset(KERNEL_NAMES)
    with pytest.raises(ValueError, match="unknown kernel 'relu'"):
        parse_kernel_list("relu")
    settings = load_settings({"FUSED_KERNELS": "rms_norm,layer_norm,relu_squared"})
    assert settings.fused_kernels == frozenset({"rms_norm", "layer_norm"})
    assert settings.not_provided == frozenset({"relu_squared"})
    from autopatch import runtime

    session = runtime.begin(settings)  # what start-up does: the key asked for is recorded as not provided
    found = [r for r in session.all_records() if r.kernel == "relu_squared"]
    assert len(found) == 1 and "FUSED_KERNELS" in found[0].reason and "not provided here" in found[0].reason
    assert set(NOT_PROVIDED).isdisjoint(KERNEL_NAMES)


class _TrainingArguments:
    """What apply() reads of transformers.TrainingArguments."""

    def __init__(self, liger_kernel_config):
        self.use_liger_kernel = True
        self.liger_kernel_config = liger_kernel_config


def test_config_none_dict_or_training_arguments():
    assert _api.toggles_from_config(None) == {}
    assert _api.toggles_from_config(_TrainingArguments(None)) == {}
    assert _api.toggles_from_config(_TrainingArguments({"rope": False})) == {"rope": False}
    assert _api.toggles_from_config({"swiglu": False}) == {"swiglu": False}
    with pytest.raises(TypeError, match="config must be None, a dict of kernel toggles or a TrainingArguments"):
        _api.toggles_from_config(["rope"])
    with pytest.raises(TypeError, match="liger_kernel_config must be a dict or None"):
        _api.toggles_from_config(_TrainingArguments("rope"))

    model = _llama()
    records = autopatch.apply(model, _TrainingArguments(None))  # the defaults
    assert {r.kernel for r in records if r.patched} >= {"rms_norm", "swiglu", "rope"}
    patching.restore_all()
    records = autopatch.apply(model, config={"swiglu": False, "rope": False})
    patched = {r.kernel for r in records if r.patched}
    assert "swiglu" not in patched and "rope" not in patched and "rms_norm" in patched
    patching.restore_all()
    records = autopatch.apply(model, {"swiglu": False}, swiglu=True)  # keywords beat the config
    assert "swiglu" in {r.kernel for r in records if r.patched}


def test_training_arguments_object():
    transformers = pytest.importorskip("transformers")
    try:
        args = transformers.TrainingArguments(output_dir="/tmp/autopatch-test-args", report_to=[])
    except Exception as exc:  # noqa: BLE001 - an install without accelerate cannot build one
        pytest.skip(f"TrainingArguments not buildable here: {exc}")
    assert args.liger_kernel_config is None
    records = autopatch.apply(_llama(), args)
    assert any(r.patched and r.kernel == "rms_norm" for r in records)


def test_second_apply_turns_kernels_off(capsys):
    model = _llama()
    autopatch.apply(model)
    on = _launches(model)
    assert on.get("swiglu_fwd", 0) > 0 and on.get("rms_norm_fwd", 0) > 0
    capsys.readouterr()

    records = autopatch.apply(model, swiglu=False, rms_norm=False)
    off = _launches(model)
    assert off.get("swiglu_fwd", 0) == 0 and off.get("rms_norm_fwd", 0) == 0
    assert off.get("rope_fwd", 0) > 0  # still on
    assert not any(r.patched and r.kernel in ("swiglu", "rms_norm") for r in records), records
    turned = {r.kernel for r in records if "turned off by apply()" in r.reason}
    assert turned == {"swiglu", "rms_norm"}
    line = capsys.readouterr().err
    assert "rope" in line and "swiglu" not in line and "rms_norm" not in line, line
    module = _api.modules_of(model)[0]
    assert not patching.is_patched(module.LlamaMLP, "forward")

    records = autopatch.apply(model, swiglu=True, rms_norm=True)  # and back on
    assert {"swiglu", "rms_norm"} <= {r.kernel for r in records if r.patched}
    back = _launches(model)
    assert back.get("swiglu_fwd", 0) > 0 and back.get("rms_norm_fwd", 0) > 0


def test_layer_norm_off_restores_the_instances():
    arch = tiny_models.Architecture("gpt2", "transformers.models.gpt2.modeling_gpt2", "GPT2LMHeadModel")
    model = tiny_models.build_tiny(arch)
    autopatch.apply(model)
    assert _launches(model).get("layer_norm_fwd", 0) > 0
    autopatch.apply(model, layer_norm=False)
    assert all(type(m) is torch.nn.LayerNorm for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    assert _launches(model).get("layer_norm_fwd", 0) == 0
    module = _api.modules_of(model)[0]
    assert not patching.is_patched(module.GPT2PreTrainedModel, "post_init")


def test_partial_turn_off_of_a_shared_rule_is_refused(monkeypatch):
    import types

    module = types.ModuleType("transformers_modules.fake.modeling_fake")
    holder = types.SimpleNamespace(f=lambda: 1)
    key = (id(holder), "f")
    monkeypatch.setitem(rules._made, (module.__name__, "glu_mlp"), (frozenset({"swiglu", "geglu"}), {key}))
    patching.replace(holder, "f", lambda: 2)
    with pytest.raises(ValueError, match="swiglu cannot be turned off alone.*turn geglu off too"):
        rules.unpatch(module, lambda k: k == "swiglu")
    assert holder.f() == 2
    assert rules.unpatch(module, lambda k: True) == ["geglu", "swiglu"]
    assert holder.f() == 1
