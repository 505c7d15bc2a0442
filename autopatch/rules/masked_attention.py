"""SDPA under a boolean mask, only over the keys each query block can see (toggle "masked_attention").

Why. When transformers hands SDPA a mask tensor — sliding windows longer than the window (Gemma 2/3,
Mistral, Qwen2 with sliding layers), bidirectional image blocks (Gemma 3, PaliGemma), padding (DPO's
padded pairs, any collator that pads), packed documents (restarting position_ids, no cache: the
block-diagonal mask) — `sdpa_attention_forward` calls SDPA with `is_causal=False` and
the [batch, 1, queries, keys] mask. cuDNN / memory-efficient attention then compute every query-key
tile, masked or not: a 1024-token window over 4096 tokens costs the whole 4096 × 4096 square, a causal
mask with padding costs twice the causal half. Measured on the H200 (Gemma-3-4B shape, 4 × 4096 tokens,
torch 2.11): the text attention is 316 of the step's 1176 ms of kernels.

What. For each block of QUERY_BLOCK queries, the keys that any of its rows may see (any batch, any
head) lie in [first, last]; every other key of the block is masked in every row, so its softmax weight
is exactly 0 and leaving it out changes nothing but the rounding of sums over zeros. The attention of
that block is SDPA over the keys [first, last] (widened to KEY_ALIGN multiples) with the same slice of
the mask: one SDPA call per query block, through transformers' own sdpa_attention_forward, outputs
concatenated along the queries. GQA keys and values are repeated to the query heads once, as
sdpa_attention_forward does with a mask, and sliced (views: nothing more is kept for the backward).

When. `plan()` decides, from the mask alone (one host sync per mask tensor, cached on it: the layers of
a forward and a checkpointed recompute share it): a 4-D boolean mask of [queries, keys] with at least
2 × QUERY_BLOCK queries, every row seeing some key (a row that sees none keeps the backend's own answer),
and the blocks covering at most MAX_COVERED of the square. Everything else — no mask (is_causal), float
masks, dropout, position_bias, softcap, torch.compile / export / jit tracing, a CUDA graph capture, devices
other than CUDA and CPU — goes to transformers' function unchanged.

Scope. The wrapper sits in transformers' attention registry ("sdpa") and acts for the attention classes
of the modeling modules this rule patched (a marker on the module: per-model toggles and apply(...,
masked_attention=False) take it back); every other caller gets transformers' function.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from types import ModuleType
from typing import Callable

import torch

import dataclasses

from autopatch.rules import _probe
from autopatch.rules._template import Candidate, Rule, Swap, Verdict
from autopatch.session import current

KERNEL = "masked_attention"
VARIANT = "SDPA under a boolean mask: one call per query block over the keys its mask allows"
QUERY_BLOCK = 1024  # queries per SDPA call (dev/tune_masked_attention.py: 256 and 512 are slower on the H200)
KEY_ALIGN = 64  # key ranges widened to multiples of this, or of the block when smaller (the kernels' tile)
MAX_COVERED = 0.75  # the blocks' share of the [queries, keys] square above which one full call is kept
_MARK = "_autopatch_masked_attention"  # set (through patching) on each patched modeling module
_CACHE = "_autopatch_key_blocks"  # attribute of a mask tensor: (query block, its version, plan)


# --------------------------------------------------------------------------- the plan
def plan(mask: torch.Tensor, q_len: int, k_len: int,
         block: int | None = None) -> list[tuple[int, int, int, int]] | None:
    """[(q0, q1, k0, k1)]: query rows q0:q1 attend over keys k0:k1 only (every key outside is masked in
    every row of the block), or None when one full call stays (see the module docstring). One host sync."""
    block = block or QUERY_BLOCK
    align = min(KEY_ALIGN, block)
    if (mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, k_len)
            or q_len < 2 * block):
        return None
    allowed = mask.any(0).any(0)  # [queries, keys]: some batch row or head sees it (no copy of a broadcast mask)
    n_blocks = math.ceil(q_len / block)
    if n_blocks * block != q_len:
        allowed = torch.cat([allowed, allowed.new_zeros(n_blocks * block - q_len, k_len)])
    seen = allowed.view(n_blocks, block, k_len).any(1).to(torch.int8)  # [blocks, keys]
    first = seen.argmax(1)
    last = k_len - 1 - seen.flip(1).argmax(1)
    every_row = mask.any(-1).all().view(1)
    stats = torch.cat([first, last, every_row.long()]).tolist()
    if not stats[-1]:
        return None
    chunks, covered = [], 0
    for i in range(n_blocks):
        q0, q1 = i * block, min(q_len, (i + 1) * block)
        k0 = stats[i] // align * align
        k1 = min(k_len, -(-(stats[n_blocks + i] + 1) // align) * align)
        chunks.append((q0, q1, k0, k1))
        covered += (q1 - q0) * (k1 - k0)
    return chunks if covered <= MAX_COVERED * q_len * k_len else None


def _cached_plan(mask: torch.Tensor, q_len: int, k_len: int, block: int) -> list | None:
    key = (block, q_len, k_len, mask._version)
    cached = getattr(mask, _CACHE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    chunks = plan(mask, q_len, k_len, block)
    try:
        setattr(mask, _CACHE, (key, chunks))
    except (AttributeError, RuntimeError):  # a tensor type without Python attributes: plan each call
        pass
    return chunks


# --------------------------------------------------------------------------- the attention
class _Ungrouped:
    """The attention module as sdpa_attention_forward sees it after the keys are repeated to every
    query head: no key/value groups; everything else read from the module."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module
        self.is_causal = getattr(module, "is_causal", True)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _patched_for(module) -> bool:
    owner = sys.modules.get(type(module).__module__)
    return owner is not None and vars(owner).get(_MARK, False) is True


def _chunks_for(module, query, key, attention_mask, dropout, kwargs, check_owner: bool, block: int) -> list | None:
    if attention_mask is None or attention_mask.dtype != torch.bool or dropout:
        return None
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return None
    if query.device.type not in ("cuda", "cpu") or query.dim() != 4 or key.dim() != 4:
        return None
    if torch.compiler.is_compiling() or _probe.tracing_for_export():
        return None
    if query.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph capture: no host sync
        return None
    if check_owner and not _patched_for(module):
        return None
    return _cached_plan(attention_mask, query.shape[2], key.shape[2], block)


def masked_attention(sdpa: Callable, check_owner: bool = True, count: bool = True,
                     block: int | None = None, session=None) -> Callable:
    """An attention interface with sdpa_attention_forward's signature and results, built on `sdpa`
    (transformers' own): the query blocks of plan() one SDPA call each, else `sdpa` unchanged. With
    `check_owner` (the registry's wrapper) only for attention modules of patched modeling modules; each
    blocked call counted as a run of the toggle in `session` (default: the process's) unless `count` is
    False (the rule's probe). `block`:
    queries per call (QUERY_BLOCK, read at each call, when None)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        chunks = _chunks_for(module, query, key, attention_mask, dropout, kwargs, check_owner, block or QUERY_BLOCK)
        if chunks is None:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:  # as sdpa_attention_forward does under a mask; the blocks then slice views of these
            from transformers.integrations.sdpa_attention import repeat_kv

            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        ungrouped = _Ungrouped(module)
        outs = [sdpa(ungrouped, query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1],
                     attention_mask[:, :, q0:q1, k0:k1], dropout=0.0, scaling=scaling, is_causal=is_causal,
                     **kwargs)[0]
                for q0, q1, k0, k1 in chunks]
        if count:
            (session or current()).count_call(KERNEL)
        return torch.cat(outs, dim=1), None

    attention.__wrapped__ = sdpa
    attention._autopatch_variant = VARIANT
    return attention


# --------------------------------------------------------------------------- the registry and the proof
def _registry():
    """(transformers' shared attention-function mapping, its sdpa_attention_forward), or (None, why)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import AttentionInterface
    except Exception as exc:  # noqa: BLE001
        return None, f"transformers' attention registry is not importable: {_probe.describe_exc(exc)}"
    mapping = getattr(AttentionInterface, "_global_mapping", None)
    if not isinstance(mapping, dict) or "sdpa" not in mapping:
        return None, "transformers' AttentionInterface has no shared mapping with an 'sdpa' entry"
    current = mapping["sdpa"]
    if current is not sdpa_attention_forward and getattr(current, "__wrapped__", None) is not sdpa_attention_forward:
        return None, f"the registered 'sdpa' is {getattr(current, '__qualname__', current)!r}, not transformers' own"
    return (mapping, sdpa_attention_forward), ""


@functools.lru_cache(maxsize=1)
def _numbers_agree() -> str | None:
    """masked_attention against sdpa_attention_forward on one tiny fp32 case: GQA (4 query heads, 2 key
    heads), 40 tokens in blocks of 8, a causal sliding window of 12 with a bidirectional block in one row
    and right padding in the other; the output and the gradients of q, k and v. None when equal within
    1e-6 and the blocks were used."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with _probe.probing(), torch.enable_grad():
        gen = _probe.generator(11)
        q = _probe.randn((2, 4, 40, 8), gen).requires_grad_()
        k, v = (_probe.randn((2, 2, 40, 8), gen).requires_grad_() for _ in range(2))
        i = torch.arange(40)
        mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 12)).expand(2, 1, 40, 40).clone()
        mask[0, 0, 5:13, 5:13] = True
        mask[1, 0, :, 35:] = False
        mask[1, 0, 35:, 35] = True
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = 2, True
        chunks = plan(mask, 40, 40, block=8)
        if chunks is None or len(chunks) != 5:
            return f"the probe's mask gave no query blocks ({chunks})"
        grad = _probe.randn((2, 40, 4, 8), gen)
        results = []
        for fn in (sdpa_attention_forward, masked_attention(sdpa_attention_forward, False, False, block=8)):
            out, _ = fn(module, q, k, v, mask, dropout=0.0, scaling=0.4, is_causal=None)
            results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        err = max(_probe.rel_err(a, b) for a, b in zip(results[1], results[0]))
    return None if err <= 1e-6 else f"masked attention differs from sdpa_attention_forward by {err:.1e} on the probe"


def _uses_registry(cls: type) -> bool:
    """Whether cls's own forward looks up transformers' attention registry: the name among its code's
    globals (read from the bytecode of the undecorated function, not its source: ~0.03 ms a module
    against 3-7 ms, and a comment naming the registry does not count)."""
    forward = vars(cls).get("forward")
    code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


@dataclasses.dataclass(frozen=True)
class RegistryVariant:
    mapping: dict  # transformers' shared attention-function mapping
    sdpa: Callable  # its sdpa_attention_forward

    def describe(self) -> str:
        return VARIANT


class _Rule(Rule):
    """Candidates: the attention classes of a module that look up the registry; their swaps, the same
    for all: the registry's "sdpa" (once per process) and the module's marker."""

    name = "masked_attention"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        if "ALL_ATTENTION_FUNCTIONS" not in _probe.source_text(module):
            return []
        return [Candidate(f"{c.__name__}.forward", c, module) for c in _probe.defined_classes(module)
                if _uses_registry(c)]

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        local = getattr(getattr(module, "ALL_ATTENTION_FUNCTIONS", None), "_local_mapping", None) or {}
        if "sdpa" in local:
            return Verdict(candidate.target, None, "the module registers an 'sdpa' of its own")
        found, why = _registry()
        why = why or _numbers_agree() or ""
        return Verdict(candidate.target, None, why) if why else Verdict(candidate.target, RegistryVariant(*found))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        variant = verdict.variant
        return [Swap(variant.mapping, "sdpa", lambda: masked_attention(variant.sdpa, session=session), item=True),
                Swap(candidate.subject, _MARK, lambda: True)]


RULE = _Rule()
