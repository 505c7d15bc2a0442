"""Checks every kernel test uses: relative error against a float64 reference, poisoned outputs."""

from __future__ import annotations

import contextlib
import importlib

import torch

# Relative-error bounds by the dtype of the kernel's inputs, against float64 references (docs/architecture.md).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere in `out` gives inf."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}"
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "", tol=None) -> None:
    """Assert ‖out − ref‖/‖ref‖ within the bound for `dtype` (the inputs' dtype)."""
    bound = REL_TOL[dtype] if tol is None else tol
    err = rel_err(out, ref)
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.0e} ({dtype})"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so that any element a kernel fails to write shows up."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-(2**31) + 7)
    return t


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, requires_grad=False, generator=None):
    """Random normal tensor, never all zeros, made in float32 then cast."""
    t = torch.randn(*shape, dtype=torch.float32, generator=generator) * scale
    t = t.to(dtype=dtype, device=device)
    if requires_grad:
        t.requires_grad_(True)
    return t


# --- rule tests -------------------------------------------------------------------------------


def everything(kernel: str) -> bool:
    """An `enabled` callback that turns every kernel on."""
    return True


def modeling(name: str):
    """transformers.models.<name>.modeling_<name>, imported."""
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def verdict_of(records, target):
    """The one record a rule returned for `target`."""
    found = [r for r in records if r.target == target]
    assert len(found) == 1, f"expected one record for {target}, got {records}"
    return found[0]


def tensors_with_history() -> int:
    """Live tensors that carry autograd history (a grad_fn), found through the garbage collector:
    after a finished training step there should be none of the step's own."""
    import gc
    import warnings

    with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated module aliases
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@contextlib.contextmanager
def poisoned_outputs(module, allocator: str = "_new_output"):
    """Every buffer `module` (an op of fused_kernels) allocates through `allocator` for its kernels to
    write starts as NaN, so an element the kernels never write shows up."""
    original = getattr(module, allocator)

    def nan_filled(*args, **kwargs):  # whatever the op's allocator takes (rope's: a tensor and a dim order)
        return original(*args, **kwargs).fill_(float("nan"))

    setattr(module, allocator, nan_filled)
    try:
        yield
    finally:
        setattr(module, allocator, original)


def launch_shapes(monkeypatch, module, launcher: str) -> list:
    """The `shape` keyword every call of module.launcher passes from now on (the call still runs)."""
    calls = []
    real = getattr(module, launcher)

    def counted(*args, **kwargs):
        calls.append(kwargs["shape"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, launcher, counted)
    return calls


def twice_deterministic(step):
    """step() run twice under torch.use_deterministic_algorithms(True) (warn only), both results."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return step(), step()
    finally:
        torch.use_deterministic_algorithms(False)


def loss_logger():
    """A transformers TrainerCallback that keeps every logged training loss in `.losses`."""
    from transformers import TrainerCallback

    class LossLog(TrainerCallback):
        def __init__(self):
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return LossLog()


def check_class_verdict(rule, model: str, cls_name: str, variant, reason, kernel: str | None = None):
    """A class rule on one class of a modeling module: patched as `variant` (the forward replaced, the
    original kept, a second run idempotent), or with variant None left alone with `reason` in its
    record (the forward untouched). Returns the record."""
    from autopatch import patching
    from autopatch.session import current

    module = modeling(model)
    cls = getattr(module, cls_name)
    before = cls.forward
    record = verdict_of(rule.patch_module(module, current(), everything), cls_name)
    assert record.module == module.__name__ and (kernel is None or record.kernel == kernel), record
    if variant is None:
        assert not record.patched and reason in record.reason, record
        assert cls.forward is before
    else:
        assert record.patched and record.variant == variant, record
        assert cls.forward is not before and patching.original(cls, "forward") is before
        patched = vars(cls)["forward"]  # (cls.forward of a wrapt swap is a fresh bound wrapper each time)
        assert verdict_of(rule.patch_module(module, current(), everything), cls_name) == record  # idempotent
        assert vars(cls)["forward"] is patched
    return record


def launches(prefix: str) -> int:
    """How many times the kernels whose names start with `prefix` ran in this process."""
    import fused_kernels

    return sum(n for name, n in fused_kernels.launch_counts().items() if name.startswith(prefix))


def train_and_eval(model, inputs):
    """(loss, eval logits, {name: grad}): one training forward+backward with `inputs` (labels included),
    then an eval forward of the same ids without labels."""
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(**inputs)
    out.loss.backward()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"]).logits
    return out.loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}



def plan(config, *call, device, **fields):
    """Any op's plan: `config` is the op's fused_kernels.ops.<op>_config module, the call its `Call`'s fields
    (positionally, then by name), `device` the DeviceFacts planned for."""
    return config.plan(config.Call(*call, **fields), device)


# A stand-in Hub kernel repository's __init__.py (tests/test_hub_kernels*.py): layers under the names of
# kernels-community/liger-kernels and kernels-community/rotary that compute the plain formulas and count
# their calls, so a test tells whose layer ran without the Hub.
HUB_STANDIN = '''
import torch
import torch.nn as nn

CALLS = {"LigerRMSNorm": 0, "apply_rotary_transformers": 0}  # (Silu: the default mapping's, in inference; not counted)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LigerRMSNorm(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        CALLS["LigerRMSNorm"] += 1
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class Silu(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, x):
        return torch.nn.functional.silu(x)


class apply_rotary_transformers(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        CALLS["apply_rotary_transformers"] += 1
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class layers:
    LigerRMSNorm = LigerRMSNorm
    Silu = Silu
    apply_rotary_transformers = apply_rotary_transformers
'''
