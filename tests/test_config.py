"""autopatch.config: every form of FUSED_KERNELS, the toggles, the per-model overrides, precedence of
flags > environment > env file > defaults, and every bad input with its message."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopatch.config import ConfigError, Settings, load_settings, parse_env_file, parse_kernel_list
from autopatch.names import KERNEL_NAMES

ALL = frozenset(KERNEL_NAMES)


def load(env=None, tmp_path=None, **flags):
    """Settings from exactly `env` (never the test process's environment), cwd = tmp_path."""
    return load_settings(dict(env or {}), cwd=tmp_path, **flags)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- FUSED_KERNELS forms
@pytest.mark.parametrize(
    "value, expected",
    [
        ("rope,rms_norm", {"rope", "rms_norm"}),
        ("all", ALL),
        ("none", set()),
        ("all,-rope", ALL - {"rope"}),
        ("all,-rope,-cross_entropy", ALL - {"rope", "cross_entropy"}),
        (" Rope , RMS_NORM ", {"rope", "rms_norm"}),  # spaces and case do not matter
        ("rope,", {"rope"}),  # a trailing comma is harmless
        ("rope,,swiglu", {"rope", "swiglu"}),
        ("", set()),  # set but empty: nothing
        ("-rope", set()),
        ("none,rope", {"rope"}),  # read left to right
        ("rope,none", set()),
        ("all,-all,geglu", {"geglu"}),
        ("+rope", {"rope"}),
        ("fused_linear_cross_entropy", {"fused_linear_cross_entropy"}),
    ],
)
def test_fused_kernels_forms(tmp_path, value, expected):
    s = load({"FUSED_KERNELS": value}, tmp_path)
    assert s.kernels() == frozenset(expected)
    for kernel in KERNEL_NAMES:
        assert s.enabled_for(kernel, "llama") == (kernel in expected)
    assert parse_kernel_list(value) == frozenset(expected)


def test_defaults_nothing_on(tmp_path):
    s = load({}, tmp_path)
    assert s.kernels() == frozenset()
    assert not s.active()
    assert s.strict is False and s.report is None and s.env_file is None


# --------------------------------------------------------------------------- toggles
@pytest.mark.parametrize("word, on", [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
                                      ("false", False), ("False", False), ("0", False), ("no", False), ("off", False)])
def test_toggle_words(tmp_path, word, on):
    s = load({"AUTOPATCH_SWIGLU": word}, tmp_path)
    assert s.enabled_for("swiglu", "llama") is on
    assert s.kernels() == (frozenset({"swiglu"}) if on else frozenset())


def test_toggle_beats_fused_kernels(tmp_path):
    s = load({"FUSED_KERNELS": "all", "AUTOPATCH_ROPE": "false", "AUTOPATCH_CROSS_ENTROPY": "0"}, tmp_path)
    assert s.kernels() == ALL - {"rope", "cross_entropy"}
    s = load({"FUSED_KERNELS": "rope", "AUTOPATCH_RMS_NORM": "true"}, tmp_path)
    assert s.kernels() == {"rope", "rms_norm"}


def test_toggle_name_case_of_kernel_part(tmp_path):
    s = load({"AUTOPATCH_rms_norm": "on", "AUTOPATCH_Fused_Linear_Cross_Entropy": "on"}, tmp_path)
    assert s.kernels() == {"rms_norm", "fused_linear_cross_entropy"}


def test_strict_and_report(tmp_path):
    s = load({"AUTOPATCH_STRICT": "yes", "AUTOPATCH_REPORT": str(tmp_path / "r-{pid}.json")}, tmp_path)
    assert s.strict is True
    assert s.report == str(tmp_path / "r-{pid}.json")
    assert load({"AUTOPATCH_STRICT": "off"}, tmp_path).strict is False


# --------------------------------------------------------------------------- per-model overrides
def test_per_model_override(tmp_path):
    s = load({"FUSED_KERNELS": "all", "AUTOPATCH_MODELS__gemma2__ROPE": "false",
              "AUTOPATCH_MODELS__qwen3__RMS_NORM": "no"}, tmp_path)
    assert s.enabled_for("rope", "gemma2") is False
    assert s.enabled_for("rms_norm", "gemma2") is True
    assert s.enabled_for("rope", "llama") is True
    assert s.enabled_for("rms_norm", "qwen3") is False
    assert s.enabled_for("rope", "qwen3") is True
    assert s.models == {"gemma2": {"rope": False}, "qwen3": {"rms_norm": False}}


def test_override_can_turn_on_for_one_model(tmp_path):
    s = load({"AUTOPATCH_MODELS__llama__SWIGLU": "true"}, tmp_path)
    assert s.enabled_for("swiglu", "llama") is True
    assert s.enabled_for("swiglu", "mistral") is False
    assert s.active()


def test_override_beats_run_kernels_and_toggles(tmp_path):
    s = load({"AUTOPATCH_ROPE": "true", "AUTOPATCH_MODELS__mistral__ROPE": "false"}, tmp_path, kernels="rope")
    assert s.enabled_for("rope", "mistral") is False
    assert s.enabled_for("rope", "llama") is True


def test_override_module_with_several_model_types(tmp_path):
    # modeling_gemma3 defines gemma3 and gemma3_text; an override on either applies, off wins
    s = load({"FUSED_KERNELS": "all", "AUTOPATCH_MODELS__gemma3_text__ROPE": "false",
              "AUTOPATCH_MODELS__gemma3__ROPE": "true"}, tmp_path)
    assert s.enabled_for("rope", ["gemma3", "gemma3_text"]) is False
    assert s.enabled_for("rope", ["gemma3"]) is True
    assert s.enabled_for("swiglu", ["gemma3", "gemma3_text"]) is True


def test_override_model_type_with_dash(tmp_path):
    # environment names cannot hold '-': xlm_roberta means transformers' "xlm-roberta"
    s = load({"FUSED_KERNELS": "all", "AUTOPATCH_MODELS__xlm_roberta__ROPE": "false"}, tmp_path)
    assert s.models == {"xlm-roberta": {"rope": False}}
    assert s.enabled_for("rope", "xlm-roberta") is False


def test_enabled_for_unknown_kernel_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown kernel 'ropes'.*rms_norm"):
        load({}, tmp_path).enabled_for("ropes", "llama")


# --------------------------------------------------------------------------- env file and precedence
def test_default_env_file_in_cwd(tmp_path):
    write(tmp_path / "autopatch.env", "FUSED_KERNELS=rope,swiglu\n")
    s = load({}, tmp_path)
    assert s.kernels() == {"rope", "swiglu"}
    assert s.env_file == str(tmp_path / "autopatch.env")


def test_env_file_syntax(tmp_path):
    f = write(tmp_path / "x.env", "\n".join([
        "# a comment",
        "",
        "export FUSED_KERNELS = all  # everything",
        "AUTOPATCH_ROPE='false'",
        'AUTOPATCH_MODELS__gemma2__SWIGLU="no"   # quoted, then a comment',
        "AUTOPATCH_STRICT=0",
        "AUTOPATCH_STRICT=1",  # a later line wins, as in a shell
    ]) + "\n")
    assert parse_env_file(f)[0] == ("FUSED_KERNELS", "all", 3)
    s = load({"AUTOPATCH_ENV_FILE": str(f)}, tmp_path)
    assert s.kernels() == ALL - {"rope"}
    assert s.enabled_for("swiglu", "gemma2") is False
    assert s.strict is True


def test_precedence_env_beats_env_file(tmp_path):
    write(tmp_path / "autopatch.env", "FUSED_KERNELS=rope\nAUTOPATCH_SWIGLU=true\nAUTOPATCH_STRICT=true\n")
    s = load({"FUSED_KERNELS": "rms_norm", "AUTOPATCH_SWIGLU": "false"}, tmp_path)
    assert s.kernels() == {"rms_norm"}  # env FUSED_KERNELS wins; env toggle off wins over file's on
    assert s.strict is True  # only the file sets it


def test_env_file_toggle_applies_to_env_fused_kernels(tmp_path):
    # FUSED_KERNELS=all in the environment, one kernel off in the file: the toggle still applies
    write(tmp_path / "autopatch.env", "AUTOPATCH_ROPE=false\n")
    assert load({"FUSED_KERNELS": "all"}, tmp_path).kernels() == ALL - {"rope"}


def test_precedence_flags_beat_env_and_file(tmp_path):
    write(tmp_path / "autopatch.env", "FUSED_KERNELS=all\nAUTOPATCH_REPORT=" + str(tmp_path / "file.json") + "\n")
    env = {"FUSED_KERNELS": "swiglu", "AUTOPATCH_ROPE": "true", "AUTOPATCH_REPORT": str(tmp_path / "env.json")}
    s = load(env, tmp_path, kernels="rms_norm,geglu", report=tmp_path / "flag.json", strict=True)
    assert s.kernels() == {"rms_norm", "geglu"}  # --kernels beats FUSED_KERNELS and AUTOPATCH_ROPE
    assert s.report == str(tmp_path / "flag.json")
    assert s.strict is True
    assert load(env, tmp_path).report == str(tmp_path / "env.json")


def test_precedence_env_file_flag_beats_variable_beats_default(tmp_path):
    write(tmp_path / "autopatch.env", "FUSED_KERNELS=rope\n")
    named = write(tmp_path / "named.env", "FUSED_KERNELS=swiglu\n")
    flag = write(tmp_path / "flag.env", "FUSED_KERNELS=geglu\n")
    assert load({}, tmp_path).kernels() == {"rope"}
    assert load({"AUTOPATCH_ENV_FILE": "named.env"}, tmp_path).kernels() == {"swiglu"}  # relative to cwd
    assert load({"AUTOPATCH_ENV_FILE": str(named)}, tmp_path, env_file=flag).kernels() == {"geglu"}


def test_run_kernels_variable_is_the_flag(tmp_path):
    s = load({"AUTOPATCH_RUN_KERNELS": "all,-geglu", "FUSED_KERNELS": "rope", "AUTOPATCH_GEGLU": "true"}, tmp_path)
    assert s.kernels() == ALL - {"geglu"}


def test_settings_reads_os_environ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FUSED_KERNELS", "rope")
    monkeypatch.setenv("AUTOPATCH_RMS_NORM", "true")
    assert Settings().kernels() == {"rope", "rms_norm"}


# --------------------------------------------------------------------------- bad input
def expect_error(env, tmp_path, *fragments, **flags):
    with pytest.raises(ConfigError) as info:
        load(env, tmp_path, **flags)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_bad_unknown_kernel_name(tmp_path):
    msg = expect_error({"FUSED_KERNELS": "rope,rms_nrom"}, tmp_path, "FUSED_KERNELS", "'rms_nrom'",
                       "did you mean rms_norm", "valid: all, none, " + ", ".join(KERNEL_NAMES))
    assert "\n" not in msg


def test_bad_kernel_flag(tmp_path):
    expect_error({}, tmp_path, "--kernels", "'swiglue'", "valid:", kernels="rope,swiglue")


def test_bad_non_boolean_toggle(tmp_path):
    expect_error({"AUTOPATCH_ROPE": "maybe"}, tmp_path, "AUTOPATCH_ROPE (environment)", "'maybe'",
                 "is not a boolean", "true/false")
    expect_error({"AUTOPATCH_STRICT": "sure"}, tmp_path, "AUTOPATCH_STRICT", "'sure'", "true/false")
    expect_error({"AUTOPATCH_MODELS__llama__ROPE": "nope"}, tmp_path, "AUTOPATCH_MODELS__llama__ROPE",
                 "'nope'", "true/false")


def test_bad_toggle_in_env_file_names_file_and_line(tmp_path):
    f = write(tmp_path / "autopatch.env", "FUSED_KERNELS=all\nAUTOPATCH_SWIGLU=perhaps\n")
    expect_error({}, tmp_path, "AUTOPATCH_SWIGLU", f"{f}, line 2", "'perhaps'", "true/false")


def test_bad_unknown_variable(tmp_path):
    expect_error({"AUTOPATCH_ROPEE": "1"}, tmp_path, "AUTOPATCH_ROPEE", "did you mean AUTOPATCH_ROPE",
                 "valid: FUSED_KERNELS", "AUTOPATCH_RMS_NORM")
    expect_error({"AUTOPATCH_MODELS__llama": "false"}, tmp_path, "AUTOPATCH_MODELS__llama",
                 "AUTOPATCH_MODELS__<model_type>__<KERNEL>")
    expect_error({"AUTOPATCH_MODELS__llama__ROTARY": "false"}, tmp_path, "AUTOPATCH_MODELS__llama__ROTARY",
                 "'ROTARY'", "valid: ROPE, RMS_NORM")


def test_bad_unknown_model_type_in_override(tmp_path):
    expect_error({"FUSED_KERNELS": "all", "AUTOPATCH_MODELS__lama__ROPE": "false"}, tmp_path,
                 "AUTOPATCH_MODELS__lama__ROPE (environment)", "unknown model type 'lama'", "did you mean",
                 "llama", "CONFIG_MAPPING_NAMES")


def test_bad_env_file_named_but_missing(tmp_path):
    expect_error({"AUTOPATCH_ENV_FILE": str(tmp_path / "nope.env")}, tmp_path, "AUTOPATCH_ENV_FILE",
                 "nope.env", "not found")
    expect_error({}, tmp_path, "--env-file", "gone.env", "not found", env_file=tmp_path / "gone.env")


def test_bad_env_file_unreadable(tmp_path, monkeypatch):
    (tmp_path / "dir.env").mkdir()
    expect_error({"AUTOPATCH_ENV_FILE": str(tmp_path / "dir.env")}, tmp_path, "dir.env", "is a directory")
    binary = tmp_path / "bin.env"
    binary.write_bytes(b"FUSED_KERNELS=\xff\xfe\n")
    expect_error({"AUTOPATCH_ENV_FILE": str(binary)}, tmp_path, "bin.env", "not UTF-8")
    locked = write(tmp_path / "locked.env", "FUSED_KERNELS=all\n")
    real_read_text = Path.read_text

    def deny(self, *a, **k):  # tests run as root here: chmod 000 would not stop the read
        if self == locked:
            raise PermissionError(13, "Permission denied")
        return real_read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", deny)
    expect_error({"AUTOPATCH_ENV_FILE": str(locked)}, tmp_path, "locked.env", "not readable")


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("FUSED_KERNELS", "expected KEY=VALUE"),
        ("= all", "expected KEY=VALUE"),
        ("FUSED-KERNELS=all", "expected KEY=VALUE"),
        ("AUTOPATCH_ROPE='false", "unterminated"),
        ('AUTOPATCH_ROPE="false" x', "misplaced"),
    ],
)
def test_bad_env_file_malformed_line(tmp_path, line, fragment):
    f = write(tmp_path / "autopatch.env", f"# ok\nFUSED_KERNELS=all\n{line}\n")
    expect_error({}, tmp_path, str(f), "line 3", fragment)


def test_bad_env_file_unknown_or_forbidden_variable(tmp_path):
    f = write(tmp_path / "autopatch.env", "FUSED_KERNEL=all\n")
    expect_error({}, tmp_path, f"{f}, line 1", "'FUSED_KERNEL'", "did you mean FUSED_KERNELS")
    write(f, "AUTOPATCH_ENV_FILE=other.env\n")
    expect_error({}, tmp_path, "line 1", "cannot be set in an env file")


def test_flce_chunk_mb(tmp_path):
    assert load({}, tmp_path).flce_chunk_mb is None  # the kernel's default (252 MiB)
    assert load({"FUSED_KERNELS_FLCE_CHUNK_MB": "128"}, tmp_path).flce_chunk_mb == 128
    assert load({"FUSED_KERNELS_FLCE_CHUNK_MB": ""}, tmp_path).flce_chunk_mb is None
    f = write(tmp_path / "autopatch.env", "FUSED_KERNELS_FLCE_CHUNK_MB=64\n")
    assert load({}, tmp_path).flce_chunk_mb == 64 and load({}, tmp_path).summary()["flce_chunk_mb"] == 64
    assert load({"FUSED_KERNELS_FLCE_CHUNK_MB": "32"}, tmp_path).flce_chunk_mb == 32  # the environment wins
    f.unlink()


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "64.5", "nan", "inf", "1e3"])
def test_bad_flce_chunk_mb(tmp_path, raw):
    msg = expect_error({"FUSED_KERNELS_FLCE_CHUNK_MB": raw}, tmp_path, "FUSED_KERNELS_FLCE_CHUNK_MB (environment)",
                       repr(raw), "positive whole number of MiB", "e.g. 128")
    assert "\n" not in msg
    write(tmp_path / "autopatch.env", f"FUSED_KERNELS=all\nFUSED_KERNELS_FLCE_CHUNK_MB={raw}\n")
    expect_error({}, tmp_path, "FUSED_KERNELS_FLCE_CHUNK_MB", "line 2", "positive whole number")


def test_bad_report_directory(tmp_path):
    expect_error({"AUTOPATCH_REPORT": str(tmp_path / "missing" / "r.json")}, tmp_path, "AUTOPATCH_REPORT",
                 "does not exist")


def test_error_type_is_value_error(tmp_path):
    # one error type, and a ValueError, so `except ValueError` in user code also catches it
    assert issubclass(ConfigError, ValueError)


def test_every_variable_the_package_names_is_a_valid_setting():
    """A variable autopatch reads (hub's AUTOPATCH_KERNEL_REPO, say) must not stop the program as unknown
    once transformers is imported: every AUTOPATCH_* name in the package's source is one config accepts."""
    import pathlib
    import re

    from autopatch.config import load_settings, valid_variables

    root = pathlib.Path(__file__).resolve().parents[1] / "autopatch"
    named = {m for path in root.rglob("*.py") for m in re.findall(r'"(AUTOPATCH_[A-Z_]+)"', path.read_text())}
    named.discard("AUTOPATCH_MODELS__")  # a prefix: per-model overrides
    assert "AUTOPATCH_KERNEL_REPO" in named
    valid = set(valid_variables())
    assert sorted(named - valid) == []
    assert load_settings({"AUTOPATCH_KERNEL_REPO": "/tmp/repo", "FUSED_KERNELS": "rope"}).kernel_repo == "/tmp/repo"
