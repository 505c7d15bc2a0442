"""What the rules share for numerical detection: finding the classes a modeling module defines,
building a tiny instance of a component (from plain sizes or from a tiny config of the module's own
config class), random CPU inputs from a local generator, and comparing outputs; and the run-time
checks the patched forwards share (same_state, plain_linear).

Everything here runs while a user's program imports a modeling module, so it must be cheap
(milliseconds), must not leave any trace in global state — the global RNG above all: building a
module runs its weight init on the global generator, so every build happens inside `probing()`,
which restores the state afterwards — and must build on the CPU in float32 whatever default device or
dtype the user has set: `probing()` is that state, and the rule template (autopatch.rules._template)
runs every proof inside it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from types import ModuleType
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks  # the global module hooks

from autopatch.session import Record

# Sizes of the probe components. Distinct numbers, so that a wrong axis or a swapped pair of
# projections shows up as a shape error or a numerical mismatch rather than passing by accident.
HIDDEN = 32
INTERMEDIATE = 48
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 16
EPS = 0.0625  # large enough to matter against the probe inputs' variance, exact in every dtype

_TINY_CONFIG_VALUES = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "moe_intermediate_size": INTERMEDIATE,
    "shared_expert_intermediate_size": INTERMEDIATE,
    "ffn_hidden_size": INTERMEDIATE,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
}


def defined_classes(module: ModuleType) -> list[type]:
    """nn.Module subclasses defined in `module` itself (not imported into it), in source order."""
    found = []
    for value in list(vars(module).values()):
        if (
            isinstance(value, type)
            and issubclass(value, nn.Module)
            and getattr(value, "__module__", None) == module.__name__
        ):
            found.append(value)
    return found


def candidate_classes(module: ModuleType, kernel: str, text: str, keep: Callable[[type], bool]):
    """(classes, records): the classes defined in `module` for which keep(cls) holds, after one look at
    the module's source for `text` (a module without it has none: most modules are ruled out before any
    class's source is read); or ([], [a record of the error]) when reading the sources fails."""
    if text not in source_text(module):
        return [], []
    try:
        return [c for c in defined_classes(module) if keep(c)], []
    except Exception as exc:  # noqa: BLE001 - never raise into an import
        return [], [Record(kernel, module.__name__, "*", False, reason=describe_exc(exc))]


def module_function(module: ModuleType, name: str):
    """The function `module.name` if the module defines it itself (behind a Hub-kernel function layer
    or not, `hub_function`), else None."""
    value = hub_function(vars(module).get(name))
    if inspect.isfunction(value) and value.__module__ == module.__name__:
        return value
    return None


def hub_function(value):
    """The plain function behind a Hugging Face `kernels` function layer, else `value` itself. With the
    `kernels` package installed (transformers 5.25 requires it), `@use_kernel_forward_from_hub` turns a
    module-level function such as `apply_rotary_pos_emb` into an instance of an nn.Module class `Func`
    whose forward calls the function, which it holds in its closure as `func`; the module's callers call
    the instance. Rebinding the module global to a plain function leaves `kernels.kernelize` nothing to
    swap there, as without the package."""
    if not isinstance(value, nn.Module) or type(value).__name__ != "Func":
        return value
    forward = vars(type(value)).get("forward")
    cells = dict(zip(getattr(getattr(forward, "__code__", None), "co_freevars", ()),
                     getattr(forward, "__closure__", None) or ()))
    try:
        func = cells["func"].cell_contents if "func" in cells else None
    except ValueError:  # an empty cell
        func = None
    return func if inspect.isfunction(func) else value


def positional_params(fn) -> list[inspect.Parameter] | None:
    """The parameters of a function or method (without self); None if it has no readable signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name == "self":
        params = params[1:]
    return params


def forward_extra_args(cls: type) -> str:
    """'' when cls.forward takes exactly one input tensor; otherwise a description of the rest."""
    params = positional_params(cls.forward)
    if params is None:
        return "forward has no readable signature"
    if not params:
        return "forward takes no input"
    rest = params[1:]
    if params[0].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return "forward takes *args/**kwargs"
    if rest:
        names = ", ".join(("*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else "") + p.name for p in rest)
        return f"forward takes extra arguments ({names})"
    return ""


def config_class_for(cls: type, module: ModuleType):
    """The config class of `cls`'s own architecture, chosen among the config classes the modeling
    module can see by the longest class-name prefix (Llama4TextMLP -> Llama4TextConfig, not
    Llama4Config). None when no config class name is a prefix of `cls.__name__`."""
    try:
        from transformers import PretrainedConfig
    except Exception:  # noqa: BLE001 - no transformers: nothing to build from
        return None
    best, best_len = None, 0
    for value in list(vars(module).values()):
        if not (isinstance(value, type) and issubclass(value, PretrainedConfig)):
            continue
        name = value.__name__
        if not name.endswith("Config"):
            continue
        prefix = name[: -len("Config")]
        if prefix and cls.__name__.startswith(prefix) and len(prefix) > best_len:
            best, best_len = value, len(prefix)
    return best


_config_cache: dict[type, object] = {}


def tiny_config(config_cls):
    """A default instance of `config_cls` shrunk to probe sizes (cached per class), sub-configs
    (text_config, vision_config, ...) shrunk too. The config is built with defaults and then shrunk
    attribute by attribute: configs validate their keyword arguments differently, setting attributes
    that already exist works for all of them."""
    if config_cls in _config_cache:
        return _config_cache[config_cls]
    config = None
    with quiet():
        try:
            config = config_cls()
        except Exception:  # noqa: BLE001 - some configs need arguments; then we cannot probe from one
            config = None
        if config is not None:
            for part in [config, *sub_configs(config)]:
                for name, value in _TINY_CONFIG_VALUES.items():
                    _set_existing(part, name, value)
                for name in ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop", "dropout", "activation_dropout"):
                    _set_existing(part, name, 0.0, only_type=float)
    _config_cache[config_cls] = config
    return config


def sub_configs(config) -> list:
    """The configs nested in a composite config, text_config first."""
    try:
        from transformers import PretrainedConfig
    except Exception:  # noqa: BLE001
        return []
    found = []
    try:
        items = list(vars(config).items())
    except TypeError:
        return []
    for name, value in sorted(items, key=lambda kv: kv[0] != "text_config"):
        if isinstance(value, PretrainedConfig) and value is not config:
            found.append(value)
    return found


def probe_configs(cls: type, module: ModuleType) -> list:
    """Tiny configs to build `cls` from, best first: the config class its __init__ annotates, the one
    its name prefix points to, then their sub-configs."""
    try:
        from transformers import PretrainedConfig
    except Exception:  # noqa: BLE001
        return []
    classes = []
    params = positional_params(cls.__init__) or []
    if params and isinstance(params[0].annotation, type) and issubclass(params[0].annotation, PretrainedConfig):
        classes.append(params[0].annotation)
    by_prefix = config_class_for(cls, module)
    if by_prefix is not None and by_prefix not in classes:
        classes.append(by_prefix)
    if not classes:  # e.g. Qwen2MLP inside qwen2_vl: no name to go by, try the module's configs
        classes = [v for v in list(vars(module).values())
                   if isinstance(v, type) and issubclass(v, PretrainedConfig) and v is not PretrainedConfig]
    configs = [c for c in (tiny_config(k) for k in classes) if c is not None]
    for config in list(configs):
        configs.extend(sub for sub in sub_configs(config) if all(sub is not c for c in configs))
    return configs


def _set_existing(config, name: str, value, only_type=None) -> None:
    """config.name = value if the config has that attribute (of that type); configs that refuse
    (validated or per-layer attributes) keep theirs."""
    try:
        current = getattr(config, name)
        if only_type is not None and not isinstance(current, only_type):
            return
        if isinstance(current, (list, tuple)):  # a per-layer value (Gemma3n's intermediate_size)
            if not all(isinstance(v, type(value)) for v in current):
                return
            value = type(current)([value] * len(current))
        setattr(config, name, value)
    except Exception:  # noqa: BLE001 - missing, refused or ambiguous attribute
        pass


@contextlib.contextmanager
def quiet():
    """No warnings or transformers log lines while probing: they are about our tiny configs, not
    about the user's model."""
    tf_logger = logging.getLogger("transformers")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logger.setLevel(level)


@contextlib.contextmanager
def probing():
    """The probes' own state, whatever the user's code is in when a modeling module is imported: the
    CPU as default device (over `with torch.device("cuda")`, `"meta"` or torch.set_default_device),
    float32 as default dtype (over torch.set_default_dtype(torch.bfloat16)), grad enabled and no
    inference mode (over no_grad / inference_mode: the probes' tensors are plain ones), no autocast,
    deterministic algorithms off, torch.compile not tracing (a probe is plain Python), quiet, on one
    thread (the probes' matrices are tiny, and a thread pool waiting on busy cores costs 10-20 ms per
    op instead of microseconds). The global CPU RNG is restored afterwards (module construction draws
    from it), so a model's initial weights are the same with and without autopatch; every setting
    changed here is restored on the way out."""
    threads = torch.get_num_threads()
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if threads != 1:
            torch.set_num_threads(1)
        if dtype != torch.float32:
            torch.set_default_dtype(torch.float32)
        if deterministic:
            torch.use_deterministic_algorithms(False)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            stack.enter_context(torch.device("cpu"))
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(quiet())
            yield
    finally:
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
        if torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def sealed(fn, *args):
    """fn(*args) inside probing(), kept out of a torch.compile trace (a rule can run while a compiled
    function's first call imports a modeling module: its probe is plain Python, not part of a graph)."""
    if torch.compiler.is_compiling():
        fn = torch.compiler.disable(fn, recursive=True)
    with probing():
        return fn(*args)


def build_norm(cls: type, module: ModuleType, attempts: list):
    """try_build for a norm class: from a probe config first when its __init__ takes a config (the
    sizes come from it), else by the (hidden size, eps) argument sets in `attempts`."""
    params = positional_params(cls.__init__) or []
    if params and "config" in params[0].name:
        attempts = [lambda c=config: ((c,), {}) for config in probe_configs(cls, module)] + attempts
    return try_build(cls, attempts)


def run_forward(fn, *args):
    """(fn(*args), None) when it returns a tensor, else (None, why): a probe's call of the original."""
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the probe reports it
        return None, describe_exc(exc)
    if not isinstance(out, torch.Tensor):
        return None, f"returned {type(out).__name__}, not a tensor"
    return out, None


def try_build(cls: type, attempts: Iterable[Callable[[], tuple[tuple, dict]]]):
    """Instantiate `cls` with the first argument set that works. Returns (instance, None) or
    (None, reason). Call inside probing()."""
    errors = []
    for make_args in attempts:
        try:
            args, kwargs = make_args()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        try:
            instance = cls(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - next attempt
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        tensors = list(instance.parameters()) + list(instance.buffers())
        if any(t.device.type != "cpu" for t in tensors):
            # built under a meta-device context (accelerate's init_empty_weights patches parameter
            # registration): give it CPU storage; the probes overwrite every value they read
            instance = instance.to_empty(device="cpu")
        return instance.float().eval().requires_grad_(False), None
    reason = errors[0] if errors else "no way to build it"
    return None, f"could not build a probe instance ({reason[:160]})"


def instance_state(instance) -> tuple:
    """What an instance's constructor arguments may have switched, as (name, value) pairs: its
    None/bool/str attributes (group_size=None, with_scale=True, ...) and the names of its parameters,
    buffers and submodules. Numbers are left out: sizes and eps differ between instances and the
    patched code reads them. A patched forward runs the original code for an instance whose state
    differs from the probed one."""
    simple = tuple(sorted(
        (k, v) for k, v in vars(instance).items()
        if not k.startswith("_") and k != "training" and (v is None or isinstance(v, (bool, str)))
    ))
    return simple + (("<tensors>", tensor_names(instance)),)


def tensor_names(instance) -> tuple:
    params = tuple(k for k, v in instance._parameters.items() if v is not None)
    buffers = tuple(k for k, v in instance._buffers.items() if v is not None)
    children = tuple(k for k, v in instance._modules.items() if v is not None)
    return params, buffers, children


def same_state(instance, state: tuple) -> bool:
    """Whether `instance` matches a state recorded by instance_state()."""
    for name, value in state:
        if name == "<tensors>":
            if tensor_names(instance) != value:
                return False
        else:
            current = getattr(instance, name, _MISSING)
            if value is None or isinstance(value, bool):
                if current is not value:
                    return False
            elif not (isinstance(current, str) and current == value):
                return False
    return True


_MISSING = object()


def generator(seed: int = 0) -> torch.Generator:
    """A local CPU generator: probes never draw from (or disturb) the global RNG."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape, gen: torch.Generator, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf on a shape mismatch or a non-finite output."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return float("inf")
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom else num


def describe_exc(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 160 else text[:157] + "..."


def plain_linear(module) -> bool:
    """An nn.Linear whose call is exactly F.linear(x, weight, bias), so that a patched forward may use
    its weight directly (plain_call)."""
    return plain_call(module, nn.Linear)


def plain_call(module, cls: type) -> bool:
    """Whether calling `module` runs exactly `cls.forward`: an instance of cls with no subclass forward
    (quantised, LoRA), no instance-level forward (accelerate hooks), no module hooks (FSDP units, user
    hooks) and no global module hooks (nn.modules.module.register_module_forward_hook: they would see
    every call but this one)."""
    return (
        isinstance(module, cls)
        and type(module).forward is cls.forward
        and "forward" not in module.__dict__
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not _module_hooks._global_forward_hooks
        and not _module_hooks._global_forward_pre_hooks
    )


def dressed_forward(forward, original_forward, variant_text: str):
    """Give a replacement forward the original's name, qualname and docstring (tracebacks and
    introspection read like transformers'), a link to it (__wrapped__) and the detected variant."""
    forward.__name__ = "forward"
    forward.__qualname__ = getattr(original_forward, "__qualname__", "forward")
    forward.__doc__ = getattr(original_forward, "__doc__", None)
    forward.__wrapped__ = original_forward
    forward._autopatch_variant = variant_text
    return forward


def build_mlp(cls, module):
    """An instance of an MLP class (gated or not) from the signatures MLPs take: a tiny config of its
    architecture (with or without an intermediate size), sizes and an activation name, or nothing.
    (instance, None) or (None, reason); call inside probing()."""
    attempts = []
    for config in probe_configs(cls, module):
        attempts += [
            lambda c=config: ((c,), {}),
            lambda c=config: ((c,), {"intermediate_size": INTERMEDIATE}),
            lambda c=config: ((INTERMEDIATE, c), {}),
            lambda c=config: ((c, 0), {}),  # (config, layer_idx)
        ]
    attempts += [
        lambda: ((HIDDEN, INTERMEDIATE), {}),
        lambda: ((HIDDEN, INTERMEDIATE, "silu"), {}),
        lambda: ((HIDDEN, INTERMEDIATE, HIDDEN, "silu"), {}),  # (in, hidden, out, act)
        lambda: ((), {}),  # everything defaulted
    ]
    return try_build(cls, attempts)


def tracing_for_export() -> bool:
    """torch.export / torch.jit tracing: a choice made from this call's values would be baked in for
    every later shape, so the rules that choose at run time leave those calls to the original code."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False)) or torch.jit.is_tracing()


def forward_with_flag(original: Callable, flag: list, value: Callable, variant: str) -> Callable:
    """A forward that runs original(self, ...) with flag[0] = value(self, args, kwargs) (the innermost
    call decides) and restores it afterwards, for rules whose module-level replacements answer differently
    while such a call runs. `flag` is a one-element list: torch.compile traces its reads and writes. The
    wrapper keeps the original's name, doc and signature."""

    def forward(self, *args, **kwargs):
        outer = flag[0]
        flag[0] = value(self, args, kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            flag[0] = outer

    forward.__name__ = forward.__qualname__ = "forward"
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__wrapped__ = original
    forward.__signature__ = inspect.signature(original)
    forward._autopatch_variant = variant
    return forward


def source_text(*functions) -> str:
    """The sources of `functions`, joined; None and functions without a readable source (built-ins,
    code made at run time) are skipped. What the rules' structural detection reads."""
    sources = []
    for fn in functions:
        if fn is None:
            continue
        try:
            sources.append(inspect.getsource(fn))
        except (OSError, TypeError):
            continue
    return "\n".join(sources)


def init_source(cls: type) -> str:
    """The source of cls's __init__ and of the ones it inherits and extends (up to nn.Module), joined;
    what a rule's structural detection reads for attribute names."""
    own = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        own.append(vars(klass).get("__init__"))
    return source_text(*own)
