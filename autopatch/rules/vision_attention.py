"""Vision towers' windowed attention under SDPA (toggle "vision_attention"): the windows of one length in
one SDPA call, instead of one call per window.

Why. Qwen2-VL-style vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, their Omni and MoE variants, GLM-4V,
and the others transformers generates from them) attend within windows or within images, given as
`cu_seqlens`. Under a flash-attention implementation the attention module hands cu_seqlens to a varlen
kernel; under "sdpa", transformers' default, it splits q, k and v at `lengths.tolist()` and calls SDPA
once per window. Qwen2.5-VL-3B's tower (32 blocks, 28 of them windowed) on four 448 × 448 images makes
about 1800 calls of 64 tokens a forward, as many again in the backward: each too small to fill the GPU,
each paying the host's dispatch cost.

What. For an attention class whose forward has both branches —
    if is_flash_attention_requested(self.config):
        OUT, _ = attention_interface(self, q, k, v, <args>, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                     max_length_q=m, max_length_k=m, <args>, **kwargs)
    else:
        lengths = cu[1:] - cu[:-1]
        splits = [torch.split(tensor, lengths.tolist(), dim=2) for tensor in (q, k, v)]
        attn_outputs = [attention_interface(self, q, k, v, <args>, **kwargs)[0] for q, k, v in zip(*splits)]
        OUT = torch.cat(attn_outputs, dim=1)
with the same q, k, v, cu, OUT and the same other arguments in both (checked on the syntax tree; or
the loop as a `for` that also collects each window's attention weights into the list W the flash branch
binds in `OUT, W = ...`, which then gets a list of the same length, None each under SDPA) — the
flash branch runs while that forward runs under "sdpa", with `window_attention` as the interface: each
run of consecutive windows of one length becomes one batch [windows, heads, length, head_dim] for
transformers' own sdpa_attention_forward, whose output [windows, length, heads, head_dim] is the loop's
concatenation in the same order. Each window still attends to itself alone: the loop's numbers. With
dropout in training the windows go one at a time, in order, as in the loop (the same random draws).

Scope. The module's `is_flash_attention_requested` and `ALL_ATTENTION_FUNCTIONS` are replaced by
versions that answer differently only for the config of a patched attention forward while it runs; every
other attention (the text decoder's), every other implementation (eager, flash, flex) and torch.export /
jit tracing get transformers' answers.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from types import ModuleType
from typing import Callable

import torch

import dataclasses

from autopatch import patching
from autopatch.rules import _probe
from autopatch.rules._template import Candidate, Rule, Swap, Verdict
from autopatch.session import current

KERNEL = "vision_attention"
VARIANT = "windows of one length batched into one SDPA call (the cu_seqlens branch under sdpa)"
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# (config, weights per window) of the patched attention forward running now (the innermost), else None.
# A one-element list: torch.compile traces reads and writes of it.
_ACTIVE = [None]


# --------------------------------------------------------------------------- the attention
def window_runs(cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first token, windows, length) of each run of consecutive windows of one length; one host sync,
    as the loop's `lengths.tolist()`."""
    runs: list[list[int]] = []
    start = 0
    for length in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist():
        if runs and runs[-1][2] == length:
            runs[-1][1] += 1
        else:
            runs.append([start, 1, length])
        start += length
    return [tuple(r) for r in runs]


def _as_windows(t: torch.Tensor, start: int, windows: int, length: int) -> torch.Tensor:
    """[1, heads, tokens, head_dim] -> the run's windows as a batch, [windows, heads, length, head_dim]."""
    return t[0, :, start:start + windows * length].unflatten(1, (windows, length)).transpose(0, 1)


def window_attention(sdpa: Callable, count: bool = True, weights_per_window: bool = False, session=None) -> Callable:
    """An attention interface over cu_seqlens windows, built on `sdpa` (transformers' sdpa_attention_forward):
    query, key, value [1, heads, tokens, head_dim] -> ([1, tokens, heads, head_dim], None), or with
    `weights_per_window` a list of each window's attention weights second (what a loop that collects them
    holds: None each under SDPA). Each call is counted as a run of the toggle in `session` (default: the
    process's) unless `count` is False (the rule's own probe)."""

    def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                  cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
        if cu_seq_lens_q is None and cu_seq_lens_k is None:  # not a cu_seqlens call: plain SDPA, as registered
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
        if (attention_mask is not None or query.shape[0] != 1 or cu_seq_lens_q is None
                or (cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k, cu_seq_lens_q))):
            raise ValueError("vision_attention: expected one sequence of windows (batch 1, no mask, the same "
                             f"cu_seqlens for queries and keys); got query {tuple(query.shape)}, mask "
                             f"{attention_mask is not None}; turn it off with AUTOPATCH_VISION_ATTENTION=false")
        runs = window_runs(cu_seq_lens_q)
        if dropout:  # one window at a time, in order: the loop's random draws
            runs = [(start + i * length, 1, length) for start, n, length in runs for i in range(n)]
        outs, weights = [], []
        for start, windows, length in runs:
            q, k, v = (_as_windows(t, start, windows, length) for t in (query, key, value))
            out, w = sdpa(module, q, k, v, attention_mask=None, dropout=dropout, scaling=scaling,
                          is_causal=is_causal, **kwargs)
            outs.append(out.reshape(1, windows * length, *out.shape[2:]))
            weights += [None] * windows if w is None else list(w.split(1))
        if count:
            (session or current()).count_call(KERNEL)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), (weights if weights_per_window else None)

    attention.__wrapped__ = sdpa
    return attention


# --------------------------------------------------------------------------- the module's look-ups
class _Interfaces:
    """The modeling module's ALL_ATTENTION_FUNCTIONS as transformers has it, except that "sdpa" is the
    window attention while a patched attention forward runs."""

    def __init__(self, registry, session=None):
        self._registry = registry
        self._session = session

    def _window_attention(self):
        return window_attention(self._registry["sdpa"], weights_per_window=_ACTIVE[0][1], session=self._session)

    def get_interface(self, name, default=None, *args, **kwargs):
        if name == "sdpa" and _ACTIVE[0] is not None:
            return self._window_attention()
        return self._registry.get_interface(name, default, *args, **kwargs)

    def __getitem__(self, name):
        if name == "sdpa" and _ACTIVE[0] is not None:
            return self._window_attention()
        return self._registry[name]

    def __contains__(self, name):
        return name in self._registry

    def __iter__(self):
        return iter(self._registry)

    def __len__(self):
        return len(self._registry)

    def __getattr__(self, name):
        return getattr(self._registry, name)


def _make_is_flash(original: Callable) -> Callable:
    def is_flash_attention_requested(config=None, *args, **kwargs):
        active = _ACTIVE[0]
        if config is not None and active is not None and config is active[0] and not args and not kwargs:
            return True  # the patched forward's cu_seqlens branch, run by window_attention
        return original(config, *args, **kwargs)

    is_flash_attention_requested.__wrapped__ = original
    return is_flash_attention_requested


def _make_forward(original: Callable, weights_per_window: bool) -> Callable:
    def active(self, args: tuple, kwargs: dict):
        """What a patched attention forward answers for: its config under "sdpa", else None (eager,
        flash, flex; torch.export / jit tracing; a DataParallel replica, which runs in a thread while
        others read the flag): transformers' answers."""
        config = getattr(self, "config", None)
        if (getattr(config, "_attn_implementation", None) != "sdpa" or getattr(self, "_is_replica", False)
                or _probe.tracing_for_export()):
            return None
        return config, weights_per_window

    return _probe.forward_with_flag(original, _ACTIVE, active, VARIANT)


# --------------------------------------------------------------------------- the structural proof
def _canon(source: str) -> str:
    return ast.unparse(ast.parse(source))


def _call_args(call: ast.Call) -> tuple[list[str], list[tuple[str | None, str]]]:
    return [ast.unparse(a) for a in call.args], [(kw.arg, ast.unparse(kw.value)) for kw in call.keywords]


def branch_form(fn: Callable) -> tuple[str | None, str]:
    """(form, "") when `fn` (an attention forward) has the two branches of the module docstring over the
    same tensors and arguments; the form is "comprehension" (the loop keeps the outputs) or "weights" (a
    for loop that also collects each window's attention weights into the list the flash branch binds).
    Else (None, why not)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None, "no readable source"
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If)
                and ast.unparse(node.test) == "is_flash_attention_requested(self.config)"]
    if len(branches) != 1:
        return None, f"{len(branches)} `if is_flash_attention_requested(self.config):` branches, not one"
    branch = branches[0]
    flash = [s for s in branch.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
             and ast.unparse(s.value.func) == "attention_interface"]
    if len(flash) != 1 or not isinstance(flash[0].targets[0], ast.Tuple) or len(flash[0].targets[0].elts) != 2:
        return None, "the flash branch is not one `OUT, _ = attention_interface(...)` call"
    out, weights = (ast.unparse(e) for e in flash[0].targets[0].elts)
    args, keywords = _call_args(flash[0].value)
    varlen = dict(kw for kw in keywords if kw[0] in _VARLEN_KWARGS)
    if (len(args) != 4 or args[0] != "self" or set(varlen) != set(_VARLEN_KWARGS)
            or varlen["cu_seq_lens_q"] != varlen["cu_seq_lens_k"]):
        return None, "the flash call does not take (self, q, k, v) with one cu_seqlens for queries and keys"
    cu = varlen["cu_seq_lens_q"]
    rest = ", ".join(f"{name}={value}" if name else f"**{value}" for name, value in keywords
                     if name not in _VARLEN_KWARGS)
    split = [f"lengths = {cu}[1:] - {cu}[:-1]",
             f"splits = [torch.split(tensor, lengths.tolist(), dim=2) for tensor in ({', '.join(args[1:])})]"]
    forms = {
        "comprehension": [
            f"attn_outputs = [attention_interface(self, q, k, v, {rest})[0] for q, k, v in zip(*splits)]"],
        "weights": [
            f"attn_outputs, {weights} = ([], [])",
            f"for q, k, v in zip(*splits):\n    attn_output, attn_weight = attention_interface(self, q, k, v, {rest})\n"
            f"    attn_outputs.append(attn_output)\n    {weights}.append(attn_weight)"],
    }
    got = [ast.unparse(s) for s in branch.orelse]
    for form, loop in forms.items():
        if got == [_canon(e) for e in (*split, *loop, f"{out} = torch.cat(attn_outputs, dim=1)")]:
            return form, ""
    return None, "the other branch is not the split loop over the flash call's tensors and arguments"


@functools.lru_cache(maxsize=1)
def _numbers_agree() -> str | None:
    """window_attention against the loop on one tiny fp32 case (windows of lengths 3, 3, 5, 2, 2, 1 and
    two heads, transformers' sdpa_attention_forward under both); None when equal within 1e-6."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except Exception as exc:  # noqa: BLE001
        return f"transformers' sdpa_attention_forward is not importable: {_probe.describe_exc(exc)}"
    with _probe.probing():  # lru-cached: the first call may come from a test, outside the template
        gen = _probe.generator(7)
        q, k, v = (_probe.randn((1, 2, 16, 8), gen) for _ in range(3))
        cu = torch.tensor([0, 3, 6, 11, 13, 15, 16], dtype=torch.int32)
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = 1, False
        windows = zip(*(t.split((cu[1:] - cu[:-1]).tolist(), dim=2) for t in (q, k, v)))
        loop = torch.cat([sdpa_attention_forward(module, a, b, c, None, dropout=0.0, scaling=0.3, is_causal=False)[0]
                          for a, b, c in windows], dim=1)
        got, _ = window_attention(sdpa_attention_forward, count=False)(
            module, q, k, v, None, dropout=0.0, scaling=0.3, is_causal=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        err = _probe.rel_err(got, loop)
    return None if err <= 1e-6 else f"window attention differs from the loop by {err:.1e} on the probe"


def _has_split_loop(forward) -> bool:
    """Whether a forward's source names both branches of the module docstring (the candidates)."""
    text = _probe.source_text(forward)
    return "is_flash_attention_requested(self.config)" in text and "lengths.tolist()" in text


@dataclasses.dataclass(frozen=True)
class WindowVariant:
    form: str  # "comprehension" or "weights" (branch_form)
    forward: Callable  # the attention forward proved (the class's own)

    def describe(self) -> str:
        return VARIANT + ("; each window's attention weights listed" if self.form == "weights" else "")


class _Rule(Rule):
    name = "vision_attention"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        # Every modeling module passes through here as it is imported: one look at the module's source
        # rules out the ones with no split loop before any class's source is read.
        if "lengths.tolist()" not in _probe.source_text(module):
            return []
        return [Candidate(f"{c.__name__}.forward", c, module) for c in _probe.defined_classes(module)
                if _has_split_loop(vars(c).get("forward"))]

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        cls = candidate.key
        forward = patching.original(cls, "forward") if patching.is_patched(cls, "forward") else vars(cls)["forward"]
        missing = [n for n in ("is_flash_attention_requested", "ALL_ATTENTION_FUNCTIONS") if not hasattr(module, n)]
        if missing:
            return Verdict(candidate.target, None,
                           f"the module has no {', '.join(missing)} of its own to answer for the forward")
        form, why = branch_form(forward)
        why = why or _numbers_agree()
        return Verdict(candidate.target, None, why) if why else Verdict(candidate.target, WindowVariant(form, forward))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        variant, module = verdict.variant, candidate.subject
        return [
            Swap(module, "is_flash_attention_requested", lambda: _make_is_flash(module.is_flash_attention_requested)),
            Swap(module, "ALL_ATTENTION_FUNCTIONS", lambda: _Interfaces(module.ALL_ATTENTION_FUNCTIONS, session)),
            Swap(candidate.key, "forward", lambda: _make_forward(variant.forward, variant.form == "weights")),
        ]


RULE = _Rule()
