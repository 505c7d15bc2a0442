"""Every variable autopatch reads, its default and its validation: one pydantic-settings model.

Variables (process environment, or lines of an env file):

    FUSED_KERNELS=rope,rms_norm           kernels to turn on; also `all`, `none`, `all,-rope`
                                          (read left to right: a name adds, -name removes, all adds
                                          every kernel, none clears)
    AUTOPATCH_<KERNEL>=true|false         one kernel on/off (AUTOPATCH_ROPE=false); beats FUSED_KERNELS
    AUTOPATCH_MODELS__<model_type>__<KERNEL>=true|false
                                          per-model override (AUTOPATCH_MODELS__gemma2__ROPE=false),
                                          model_type as in the model's config; beats everything above
    AUTOPATCH_ENV_FILE=path               env file to read (else ./autopatch.env when it exists)
    AUTOPATCH_REPORT=path.json            write every patch/refusal as JSON at exit ({pid} expands)
    AUTOPATCH_STRICT=true|false           a refused candidate of an enabled kernel, or a patched
                                          component falling back to the original code, is an error
    AUTOPATCH_RUN_KERNELS=list            what `autopatch run --kernels LIST` sets for itself and its
                                          children: the kernel set, beating FUSED_KERNELS and toggles
    AUTOPATCH_RETURN_LOGITS=auto|true|false
                                          the logits slot of a fused training call: true = the real
                                          logits (no grad), false = None, auto = a LazyLogits computed
                                          only if read (autopatch.rules._causal_lm_loss)
    FUSED_KERNELS_FLCE_CHUNK_MB=252       MiB of logits the fused linear cross entropy computes at a
                                          time (a positive whole number; default 252)
    AUTOPATCH_OFFLOAD=false|auto|true     the tensors autograd saves for the backward of a training
                                          forward (the checkpointed layer inputs under gradient
                                          checkpointing) kept in pinned host memory: auto = only what
                                          does not fit the GPU's free memory, true = every one of
                                          1 MiB or more (autopatch.offload; default false)
    AUTOPATCH_TILED_MLP_TOKENS=8192       the most tokens a patched MLP (swiglu, geglu, gelu_mlp)
                                          runs at once in training: longer inputs go in chunks,
                                          recomputed in the backward (autopatch.rules._tiled; a
                                          positive whole number; default off)
    AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS=8192
                                          with masked_attention on: causal attention (no mask)
                                          over more than twice this many queries runs as one SDPA
                                          call per block of this many queries, so flash's backward
                                          workspace is a block's (autopatch.rules.masked_attention;
                                          a positive whole number; 0 or unset: off)
    AUTOPATCH_KERNEL_REPO=dir             where `python -m autopatch kernel-repo` writes our kernels as a
                                          Hub `kernels` layer repository (autopatch.hub; default
                                          <cache>/autopatch/kernel-repo)

Sources, strongest first: `autopatch run` flags (init keywords here), the process environment, the
env file, the defaults (nothing on). Sources merge per variable, then the kernel set is computed:
run kernels if given, else FUSED_KERNELS with the AUTOPATCH_<KERNEL> toggles applied, so an env file's
AUTOPATCH_ROPE=false still turns rope off under FUSED_KERNELS=all from the environment. Per-model
overrides apply on top of whichever set is in force.

Every bad value raises ConfigError, whose message names the variable and where it came from (the
environment, a flag, or file:line), the bad item and the valid items.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from autopatch.names import KERNEL_NAMES, NOT_PROVIDED

DEFAULT_ENV_FILE = "autopatch.env"
PREFIX = "AUTOPATCH_"
MODELS_PREFIX = "AUTOPATCH_MODELS__"

# variable name -> settings field (the kernel toggles and model overrides are matched by pattern)
SCALAR_VARIABLES: dict[str, str] = {
    "FUSED_KERNELS": "fused_kernels",
    "AUTOPATCH_RUN_KERNELS": "run_kernels",
    "AUTOPATCH_ENV_FILE": "env_file",
    "AUTOPATCH_REPORT": "report",
    "AUTOPATCH_STRICT": "strict",
    "AUTOPATCH_RETURN_LOGITS": "return_logits",
    "FUSED_KERNELS_FLCE_CHUNK_MB": "flce_chunk_mb",
    "AUTOPATCH_OFFLOAD": "offload",
    "AUTOPATCH_TILED_MLP_TOKENS": "tiled_mlp_tokens",
    "AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS": "attention_query_block_tokens",
    "AUTOPATCH_KERNEL_REPO": "kernel_repo",
}
RETURN_LOGITS_CHOICES = ("auto", "true", "false")
OFFLOAD_CHOICES = ("false", "auto", "true")
# Variables an env file may not set: they choose the file, or belong to `autopatch run`.
NOT_IN_ENV_FILE = ("AUTOPATCH_ENV_FILE", "AUTOPATCH_RUN_KERNELS")
FLAG_NAMES = {"run_kernels": "--kernels", "env_file": "--env-file", "report": "--report", "strict": "--strict"}

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


class ConfigError(ValueError):
    """A bad autopatch setting. The message names the variable (or file and line), the bad item and
    the valid items; it is meant to be shown to the user as is."""


def valid_variables() -> list[str]:
    names = list(SCALAR_VARIABLES)
    names += [PREFIX + k.upper() for k in KERNEL_NAMES]
    names.append(MODELS_PREFIX + "<model_type>__<KERNEL>")
    return names


# --------------------------------------------------------------------------- value parsers
class _BadValue(ValueError):
    """Raised by the validators; `key` locates the variable in the origin map."""

    def __init__(self, key: tuple, message: str):
        super().__init__(message)
        self.key = key
        self.message = message


def _suggest(bad: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(bad, list(valid), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(close)}? " if close else ""


def parse_kernel_list(text: str) -> frozenset[str]:
    """FUSED_KERNELS syntax -> set of kernel names. Raises ValueError naming the bad item."""
    chosen: set[str] = set()
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            continue  # tolerate "rope," and "rope,,rms_norm"
        remove = item.startswith("-")
        name = item.lstrip("+-").strip()
        if name == "all":
            chosen = set() if remove else set(KERNEL_NAMES)
        elif name == "none" and not remove:
            chosen = set()
        elif name in KERNEL_NAMES:
            (chosen.discard if remove else chosen.add)(name)
        elif name in NOT_PROVIDED:  # a Liger key without a kernel here: accepted (Settings.not_provided), not in the set
            pass
        else:
            valid = ("all", "none", *KERNEL_NAMES)
            raise ValueError(
                f"unknown kernel {raw.strip()!r} in {text!r}; {_suggest(name, valid)}"
                f"valid: {', '.join(valid)} (a leading - removes one, e.g. all,-rope)"
            )
    return frozenset(chosen)


def not_provided_in(text: str) -> frozenset[str]:
    """The NOT_PROVIDED keys a FUSED_KERNELS-style list asks for (Liger's relu_squared)."""
    items = {raw.strip().lower().lstrip("+") for raw in str(text).split(",")}
    return frozenset(k for k in NOT_PROVIDED if k in items)


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    valid = ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS, FALSE_WORDS))
    raise ValueError(f"{text!r} is not a boolean; valid: {valid}")


def _auto_or_bool(field: str, value, expected: str) -> str:
    """"auto", "true" or "false" from a variable's text; _BadValue naming `field` otherwise."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    try:
        return "true" if parse_bool(text) else "false"
    except ValueError:
        raise _BadValue((field,), f"{expected}, got {value!r}") from None


def _positive_or_none(field: str, value, expected: str) -> int | None:
    """A positive whole number from a variable's text (empty: None); _BadValue naming `field` otherwise."""
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip()
    if not text:
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise _BadValue((field,), f"{expected}, got {value!r}")


def _canonical(model_type: str) -> str:
    # Environment names cannot carry '-' or '.', so "xlm_roberta" must find "xlm-roberta".
    return model_type.lower().replace("-", "_").replace(".", "_")


def known_model_types() -> dict[str, str] | None:
    """canonical name -> transformers model_type, from CONFIG_MAPPING_NAMES (None if unavailable)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except Exception:
        return None
    return {_canonical(name): name for name in CONFIG_MAPPING_NAMES}


# --------------------------------------------------------------------------- variable names
def key_for_variable(name: str) -> tuple:
    """Where a variable goes in the settings: ("fused_kernels",), ("toggles", kernel),
    ("models", model_type, kernel) ... Raises ValueError for a name autopatch does not know."""
    if name in SCALAR_VARIABLES:
        return (SCALAR_VARIABLES[name],)
    if name.startswith(MODELS_PREFIX):
        parts = name[len(MODELS_PREFIX):].split("__")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(
                f"unknown variable {name!r}; per-model overrides are written "
                f"{MODELS_PREFIX}<model_type>__<KERNEL>, e.g. {MODELS_PREFIX}gemma2__ROPE=false"
            )
        model_type, kernel = parts[0].lower(), parts[1].lower()
        if kernel not in KERNEL_NAMES:
            raise ValueError(
                f"unknown kernel {parts[1]!r} in {name!r}; {_suggest(kernel, KERNEL_NAMES)}"
                f"valid: {', '.join(k.upper() for k in KERNEL_NAMES)}"
            )
        return ("models", model_type, kernel)
    if name.startswith(PREFIX):
        kernel = name[len(PREFIX):].lower()
        if kernel in KERNEL_NAMES:
            return ("toggles", kernel)
    valid = valid_variables()
    raise ValueError(f"unknown variable {name!r}; {_suggest(name, valid)}valid: {', '.join(valid)}")


def is_autopatch_variable(name: str) -> bool:
    return name in SCALAR_VARIABLES or name.startswith(PREFIX)


def _put(tree: dict, key: tuple, value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(part, {})
    tree[key[-1]] = value


# --------------------------------------------------------------------------- env file
def parse_env_file(path: Path) -> list[tuple[str, str, int]]:
    """KEY=VALUE lines -> [(key, value, line number)]. Blank lines and # comments are skipped;
    `export ` prefixes, single/double quotes and trailing ` # comments` after unquoted values are
    understood. Raises ConfigError naming the file and line for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"env file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"env file {str(path)!r} is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"env file {str(path)!r} is not readable (permission denied)") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"env file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"env file {str(path)!r} cannot be read: {exc.strerror or exc}") from None

    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        key, sep, value = stripped.partition("=")
        key = key.strip()
        if not sep or not key or not all(c.isalnum() or c == "_" for c in key) or key[0].isdigit():
            raise ConfigError(
                f"{path}, line {number}: expected KEY=VALUE (e.g. FUSED_KERNELS=all), got {line.strip()!r}"
            )
        value = value.strip()
        if value[:1] in ("'", '"'):
            quote = value[0]
            end = value.find(quote, 1)
            rest = value[end + 1:].strip() if end > 0 else ""
            if end < 0 or (rest and not rest.startswith("#")):
                raise ConfigError(
                    f"{path}, line {number}: unterminated or misplaced {quote} quote in {line.strip()!r}"
                )
            value = value[1:end]
        else:
            hash_at = value.find(" #")
            if hash_at >= 0:
                value = value[:hash_at].rstrip()
        entries.append((key, value, number))
    return entries


# --------------------------------------------------------------------------- sources
@dataclasses.dataclass
class _Request:
    """What one load reads: the environment, the flags, and where each value came from."""

    environ: Mapping[str, str]
    flags: dict[str, Any]
    cwd: Path
    origins: dict[tuple, str] = dataclasses.field(default_factory=dict)

    def env_file_choice(self) -> tuple[Path | None, str]:
        """(path, how it was chosen). A named file must exist; the default one is read if it does."""
        if self.flags.get("env_file"):
            return Path(self.flags["env_file"]), "--env-file"
        named = self.environ.get("AUTOPATCH_ENV_FILE", "").strip()
        if named:
            return Path(named), "AUTOPATCH_ENV_FILE (environment)"
        default = self.cwd / DEFAULT_ENV_FILE
        if default.is_file():
            return default, f"./{DEFAULT_ENV_FILE}"
        return None, ""


_request: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("autopatch_config_request", default=None)


def _current_request() -> _Request:
    return _request.get() or _Request(environ=os.environ, flags={}, cwd=Path.cwd())


class _EnvironSource(PydanticBaseSettingsSource):
    """FUSED_KERNELS and AUTOPATCH_* variables of the process environment."""

    def __init__(self, settings_cls, request: _Request):
        super().__init__(settings_cls)
        self.request = request

    def get_field_value(self, field, field_name):  # required by the base class; __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for name, value in sorted(self.request.environ.items()):
            if not is_autopatch_variable(name):
                continue
            try:
                key = key_for_variable(name)
            except ValueError as exc:
                raise ConfigError(f"{name} (environment): {exc}") from None
            _put(tree, key, value)
            self.request.origins.setdefault(key, f"{name} (environment)")
        return tree


class _EnvFileSource(PydanticBaseSettingsSource):
    """The env file: --env-file, else AUTOPATCH_ENV_FILE, else ./autopatch.env if it exists."""

    def __init__(self, settings_cls, request: _Request):
        super().__init__(settings_cls)
        self.request = request

    def get_field_value(self, field, field_name):
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path, chosen_by = self.request.env_file_choice()
        if path is None:
            return {}
        if not path.is_absolute():
            path = self.request.cwd / path
        try:
            entries = parse_env_file(path)
        except ConfigError as exc:
            raise ConfigError(f"{chosen_by}: {exc}") from None
        tree: dict[str, Any] = {"env_file": str(path)}
        origins: dict[tuple, str] = {("env_file",): chosen_by}
        for name, value, number in entries:
            where = f"{name} ({path}, line {number})"
            if name in NOT_IN_ENV_FILE:
                raise ConfigError(f"{where}: {name} cannot be set in an env file; set it in the environment")
            if not is_autopatch_variable(name):
                valid = valid_variables()
                raise ConfigError(
                    f"{where}: unknown variable {name!r}; {_suggest(name, valid)}valid: {', '.join(valid)}"
                )
            try:
                key = key_for_variable(name)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            _put(tree, key, value)  # a later line wins over an earlier one, as in a shell
            origins[key] = where
        for key, where in origins.items():  # weaker than the flags and the environment
            self.request.origins.setdefault(key, where)
        return tree


# --------------------------------------------------------------------------- the model
class Settings(BaseSettings):
    """The validated configuration. Build with load_settings() (it turns validation errors into
    ConfigError); `Settings()` alone reads os.environ and ./autopatch.env the same way."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    fused_kernels: frozenset[str] | None = None  # FUSED_KERNELS
    run_kernels: frozenset[str] | None = None  # AUTOPATCH_RUN_KERNELS / autopatch run --kernels
    toggles: dict[str, bool] = {}  # AUTOPATCH_<KERNEL>
    models: dict[str, dict[str, bool]] = {}  # AUTOPATCH_MODELS__<model_type>__<KERNEL>
    env_file: str | None = None  # the env file that was read
    report: str | None = None  # AUTOPATCH_REPORT
    strict: bool = False  # AUTOPATCH_STRICT
    return_logits: str = "auto"  # AUTOPATCH_RETURN_LOGITS
    flce_chunk_mb: int | None = None  # FUSED_KERNELS_FLCE_CHUNK_MB; None: the kernel's default
    offload: str = "false"  # AUTOPATCH_OFFLOAD
    tiled_mlp_tokens: int | None = None  # AUTOPATCH_TILED_MLP_TOKENS; None: the MLPs run whole
    attention_query_block_tokens: int | None = None  # AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS; None: one call
    kernel_repo: str | None = None  # AUTOPATCH_KERNEL_REPO (read by autopatch.hub, which runs without Settings)
    not_provided: frozenset[str] = frozenset()  # Liger keys asked for in the kernel lists, no kernel here

    @model_validator(mode="before")
    @classmethod
    def _asked_not_provided(cls, data):
        if isinstance(data, dict):
            asked = set()
            for field in ("fused_kernels", "run_kernels"):
                value = data.get(field)
                if isinstance(value, str):
                    asked |= not_provided_in(value)
            if asked:
                data = {**data, "not_provided": frozenset(asked)}
        return data

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        request = _current_request()
        for field in request.flags:
            request.origins.setdefault((field,), FLAG_NAMES[field])
        return (init_settings, _EnvironSource(settings_cls, request), _EnvFileSource(settings_cls, request))

    @field_validator("fused_kernels", "run_kernels", mode="before")
    @classmethod
    def _kernel_list(cls, value, info):
        if value is None or isinstance(value, (set, frozenset)):
            return value
        try:
            return parse_kernel_list(str(value))
        except ValueError as exc:
            raise _BadValue((info.field_name,), str(exc)) from None

    @field_validator("toggles", mode="before")
    @classmethod
    def _toggles(cls, value):
        out = {}
        for kernel, raw in dict(value).items():
            if kernel not in KERNEL_NAMES:
                raise _BadValue(("toggles", kernel), f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
            try:
                out[kernel] = parse_bool(raw)
            except ValueError as exc:
                raise _BadValue(("toggles", kernel), str(exc)) from None
        return out

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, value):
        out: dict[str, dict[str, bool]] = {}
        for model_type, kernels in dict(value).items():
            for kernel, raw in dict(kernels).items():
                key = ("models", model_type, kernel)
                if kernel not in KERNEL_NAMES:
                    raise _BadValue(key, f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
                try:
                    out.setdefault(model_type, {})[kernel] = parse_bool(raw)
                except ValueError as exc:
                    raise _BadValue(key, str(exc)) from None
        if not out:
            return out
        # Model types are checked against transformers' own list, and only here: importing it costs
        # a second, so a configuration without overrides never pays for it.
        known = known_model_types()
        if known is None:
            return out
        checked: dict[str, dict[str, bool]] = {}
        for model_type, kernels in out.items():
            real = known.get(_canonical(model_type))
            if real is None:
                key = ("models", model_type, next(iter(kernels)))
                raise _BadValue(
                    key,
                    f"unknown model type {model_type!r}; {_suggest(_canonical(model_type), known)}"
                    f"valid: the model_type of a transformers config, e.g. llama, gemma2, qwen3 "
                    f"({len(known)} known; see transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)",
                )
            checked.setdefault(real, {}).update(kernels)
        return checked

    @field_validator("strict", mode="before")
    @classmethod
    def _strict(cls, value):
        try:
            return parse_bool(value)
        except ValueError as exc:
            raise _BadValue(("strict",), str(exc)) from None

    @field_validator("return_logits", mode="before")
    @classmethod
    def _return_logits(cls, value):
        return _auto_or_bool("return_logits", value, "expected auto, true or false")

    @field_validator("flce_chunk_mb", mode="before")
    @classmethod
    def _flce_chunk_mb(cls, value):
        return _positive_or_none("flce_chunk_mb", value, "expected a positive whole number of MiB for the fused "
                                 "linear cross entropy's logits chunk, e.g. 128 (default 252)")

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, value):
        return _auto_or_bool("offload", value, "expected false, auto or true")

    @field_validator("tiled_mlp_tokens", mode="before")
    @classmethod
    def _tiled_mlp_tokens(cls, value):
        return _positive_or_none("tiled_mlp_tokens", value, "expected a positive whole number of tokens above "
                                 "which the MLPs run in chunks, e.g. 8192")

    @field_validator("attention_query_block_tokens", mode="before")
    @classmethod
    def _attention_query_block_tokens(cls, value):
        if isinstance(value, (int, str)) and not isinstance(value, bool) and str(value).strip() == "0":
            return None  # 0: off, as unset
        return _positive_or_none("attention_query_block_tokens", value, "expected a positive whole number of "
                                 "queries per causal attention call, e.g. 8192, or 0 (off)")

    @field_validator("report", mode="before")
    @classmethod
    def _report(cls, value):
        if value is None:
            return None
        text = str(value).strip()
        if not text:
            return None
        parent = Path(text).expanduser().parent
        if not parent.is_dir():
            raise _BadValue(("report",), f"directory {str(parent)!r} of report file {text!r} does not exist")
        return str(Path(text).expanduser())

    # ---------------------------------------------------------------- queries
    def kernels(self) -> frozenset[str]:
        """The kernels on for every model without an override."""
        if self.run_kernels is not None:
            return self.run_kernels
        chosen = set(self.fused_kernels or ())
        for kernel, on in self.toggles.items():
            (chosen.add if on else chosen.discard)(kernel)
        return frozenset(chosen)

    def enabled_for(self, kernel: str, model_type: str | Iterable[str] | None = None) -> bool:
        """Whether `kernel` is on for a model type (or a module defining several, e.g. gemma3 and
        gemma3_text). An override for any of the types applies; if overrides disagree, off wins."""
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(KERNEL_NAMES)}")
        if model_type is None:
            types: list[str] = []
        elif isinstance(model_type, str):
            types = [model_type]
        else:
            types = list(model_type)
        overrides = []
        by_canonical = {_canonical(t): v for t, v in self.models.items()}
        for t in types:
            values = by_canonical.get(_canonical(t))
            if values is not None and kernel in values:
                overrides.append(values[kernel])
        if overrides:
            return all(overrides)
        return kernel in self.kernels()

    def active(self) -> bool:
        """Whether any kernel is on for any model, or host offload is asked for (else the import hooks
        need not look at models)."""
        return (bool(self.kernels()) or any(v for kernels in self.models.values() for v in kernels.values())
                or self.offload != "false")

    def summary(self) -> dict:
        return {
            "kernels": sorted(self.kernels(), key=KERNEL_NAMES.index),
            "models": {t: dict(v) for t, v in self.models.items()},
            "env_file": self.env_file,
            "report": self.report,
            "strict": self.strict,
            "return_logits": self.return_logits,
            "flce_chunk_mb": self.flce_chunk_mb,
            "offload": self.offload,
            "tiled_mlp_tokens": self.tiled_mlp_tokens,
            "attention_query_block_tokens": self.attention_query_block_tokens,
        }


def load_settings(environ: Mapping[str, str] | None = None, *, kernels: str | None = None,
                  env_file: str | os.PathLike | None = None, report: str | os.PathLike | None = None,
                  strict: bool | None = None, cwd: str | os.PathLike | None = None) -> Settings:
    """Build the Settings from (strongest first) these flags, `environ` (default os.environ), the env
    file, the defaults. Raises ConfigError with a message fit for the user."""
    flags: dict[str, Any] = {}
    if kernels is not None:
        flags["run_kernels"] = kernels
    if env_file is not None:
        flags["env_file"] = str(env_file)
    if report is not None:
        flags["report"] = str(report)
    if strict is not None:
        flags["strict"] = strict
    request = _Request(environ=os.environ if environ is None else environ, flags=flags,
                       cwd=Path(cwd) if cwd is not None else Path.cwd())
    token = _request.set(request)
    try:
        return Settings(**flags)
    except ValidationError as exc:
        raise _config_error(exc, request) from None
    finally:
        _request.reset(token)


def _config_error(exc: ValidationError, request: _Request) -> ConfigError:
    messages = []
    for error in exc.errors():
        bad = (error.get("ctx") or {}).get("error")
        if isinstance(bad, _BadValue):
            where = request.origins.get(bad.key) or _variable_name(bad.key)
            messages.append(f"{where}: {bad.message}")
        else:
            field = ".".join(str(p) for p in error.get("loc", ()))
            where = request.origins.get(tuple(error.get("loc", ()))[:1]) or field
            messages.append(f"{where}: {error.get('msg')} (got {error.get('input')!r})")
    return ConfigError("; ".join(messages))


def _variable_name(key: tuple) -> str:
    if key[0] == "toggles":
        return PREFIX + key[1].upper()
    if key[0] == "models":
        return f"{MODELS_PREFIX}{key[1]}__{key[2].upper()}"
    for name, field in SCALAR_VARIABLES.items():
        if field == key[0]:
            return name
    return key[0]

