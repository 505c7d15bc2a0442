"""MoE experts containers -> fused_kernels.moe_experts (kernels "swiglu" and "geglu", as Liger's keys do).

transformers 5.x stores a MoE layer's experts in one module per layer (3-D `gate_up_proj` / `down_proj`
parameters) whose class is decorated with `@use_experts_implementation`: the decorator's `forward`
dispatches on `config._experts_implementation` ("grouped_mm" by default where torch has it, "eager" =
the class's own per-expert loop, "batched_mm", or a kernel backend), and its `__init__` records the
layout as flags (`has_gate`, `has_bias`, `is_transposed`, `is_concatenated`, `has_post_expert_norm`).

Detection (per class defined in the modeling module): its `forward` is that decorator's dispatcher
(the same code object), its layout flags (read from the decorator's closure) are gated, concatenated
[gate; up], no biases, no post-expert norm, and its `_apply_gate` is transformers' default
`act(gate) * up` (a class with a gate of its own, e.g. gpt-oss's clamped gate, is left alone by name).
Proof: the class's own eager forward runs on a small float64 stand-in instance (4 experts, 3 tokens × 2
of them, one expert unused) and must equal the formula fused_kernels.moe_experts computes, to 1e-12
relative; any other result, or an eager forward that reads what the stand-in lacks, leaves it alone.

Records are labelled, as the moe_gate rule's, with the kernel of the architecture's default activation
(swiglu for SiLU experts, geglu for GELU ones).

Patch. `forward` on the class is replaced by one that calls fused_kernels.moe_experts with the
instance's own weights, layout and activation (SiLU -> the SwiGLU experts, GELU tanh/erf -> GeGLU, by
the glu_mlp classifier). At run time it hands back to the original dispatcher for: expert parallelism,
an experts implementation that names a kernel backend of its own (deepgemm, sonicmoe, ...), an
activation the kernels do not have or whose kernel is off, weights of another dtype than the hidden
states (transformers casts there), DTensor weights, and tensors the Triton kernels cannot take.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from types import ModuleType
from typing import Callable

import torch

from autopatch import patching
from autopatch.rules import _gated, _probe
from autopatch.rules._kernels import fallback, kernels
from autopatch.rules._template import Candidate, Rule, Swap, Verdict

METHOD = "forward"
TAG = "fused experts"  # every record of this rule starts its variant or reason with it (the coverage matrix's column)
VARIANT = f"{TAG}: routing, grouped GEMMs, act(gate)·up and the weighted combine in fused_kernels.moe_experts"
# experts implementations whose results the fused path reproduces; any other names a kernel backend
IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")
LAYOUT = {"has_gate": True, "is_concatenated": True, "has_bias": False, "has_post_expert_norm": False}
WHAT_IS_MISSING = {
    "has_gate": "no gate (up projection and activation only)",
    "is_concatenated": "interleaved gate/up rows",
    "has_bias": "expert biases",
    "has_post_expert_norm": "a norm after each expert",
}


@functools.lru_cache(maxsize=1)
def _dispatcher_code():
    """The code object of the decorator's forward, or None where this transformers has no decorator."""
    try:
        from transformers.integrations import moe
    except Exception:  # noqa: BLE001 - older transformers: no candidates
        return None

    class _Probe(torch.nn.Module):
        def __init__(self, config):
            super().__init__()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    return moe.use_experts_implementation(_Probe).forward.__code__


def _dispatcher(cls: type):
    """cls's decorator forward (the one this rule patched, or the class's own), or None."""
    code = _dispatcher_code()
    fn = patching.original(cls, METHOD) if patching.is_patched(cls, METHOD) else vars(cls).get(METHOD)
    return fn if code is not None and getattr(fn, "__code__", None) is code else None


def layout_flags(cls: type) -> dict:
    """The layout flags the decorator recorded for cls (from its __init__'s closure)."""
    init = vars(cls).get("__init__")
    names = getattr(getattr(init, "__code__", None), "co_freevars", ())
    cells = getattr(init, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(names, cells) if name in (*LAYOUT, "is_transposed")}


def candidates(module: ModuleType) -> list[type]:
    return [c for c in _probe.defined_classes(module) if _dispatcher(c) is not None]


def _stand_in(cls: type, flags: dict, n_experts: int, hidden: int, width: int, g: torch.Generator):
    """An instance of cls made without its __init__ (no config): what the eager forward reads."""
    inst = cls.__new__(cls)
    torch.nn.Module.__init__(inst)
    transposed = bool(flags.get("is_transposed"))
    gate_up = torch.randn(n_experts, 2 * width, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(n_experts, hidden, width, generator=g, dtype=torch.float64)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    # straight into _parameters: accelerate's init_empty_weights patches register_parameter to move
    # every new parameter to the meta device
    inst._parameters["gate_up_proj"] = torch.nn.Parameter(gate_up, requires_grad=False)
    inst._parameters["down_proj"] = torch.nn.Parameter(down, requires_grad=False)
    inst.act_fn = torch.nn.SiLU()
    inst.num_experts = n_experts
    inst.hidden_dim = inst.hidden_size = hidden
    inst.intermediate_dim = inst.intermediate_size = inst.expert_dim = width
    inst.config = types.SimpleNamespace(_experts_implementation="eager")
    inst._is_expert_parallel = False
    for name, value in {**LAYOUT, "is_transposed": transposed}.items():
        setattr(inst, name, value)
    return inst, gate_up, down, transposed


def _formula(x, idx, w, gate_up, down, transposed):
    """Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t)): what fused_kernels.moe_experts computes."""
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gu = torch.einsum("th,tjoh->tjo", x, gate_up[idx])
    gate, up = gu.chunk(2, dim=-1)
    y = torch.einsum("tji,tjhi->tjh", torch.nn.functional.silu(gate) * up, down[idx])
    return (y * w[..., None]).sum(1)


def prove(cls: type) -> str:
    """"" when cls's own eager forward equals the fused formula on a float64 probe, else why not."""
    flags = layout_flags(cls)
    off = [WHAT_IS_MISSING[name] for name, want in LAYOUT.items() if bool(flags.get(name, want)) != want]
    why = []
    if off:
        why.append(f"layout with {', '.join(off)} (the fused experts take gated, concatenated, bias-free experts)")
    if not _gated.handles(cls):
        why.append(f"{cls.__name__} has a gate of its own (_apply_gate), not act(gate) * up")
    if why:
        return f"{TAG}: " + "; ".join(why)
    eager = getattr(_dispatcher(cls), "__wrapped__", None)
    if eager is None:
        return f"{TAG}: the experts forward wraps no eager forward to compare with"
    g = torch.Generator().manual_seed(0)
    inst, gate_up, down, transposed = _stand_in(cls, flags, n_experts=4, hidden=6, width=5, g=g)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 2], [2, 1], [1, 0]])  # expert 3 unused
    w = torch.rand(3, 2, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = eager(inst, x, idx, w)
    except Exception as exc:  # noqa: BLE001 - an eager forward that needs more than the stand-in has
        return f"{TAG}: the eager forward did not run on a stand-in instance ({_probe.describe_exc(exc)})"
    want = _formula(x, idx, w, gate_up, down, transposed)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"{TAG}: the eager forward returns {type(got).__name__}, not the (tokens, hidden) tensor expected"
    err = ((got - want).norm() / want.norm()).item()
    if not err < 1e-12:
        return f"{TAG}: the eager forward differs from Σ w·down(act(gate)·up) (relative error {err:.1e})"
    return ""


def make_forward(original: Callable, kernels_on: frozenset, session) -> Callable:
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        kind = _gated.activation_kind(getattr(self, "act_fn", None))
        gate_up, down = getattr(self, "gate_up_proj", None), getattr(self, "down_proj", None)
        impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if (args or kwargs or kind is None or _gated.KINDS[kind][0] not in kernels_on or impl not in IMPLEMENTATIONS
                or getattr(self, "_is_expert_parallel", False)
                or any(bool(getattr(self, name, want)) != want for name, want in LAYOUT.items())
                or not isinstance(hidden_states, torch.Tensor) or not isinstance(gate_up, torch.Tensor)
                or not isinstance(down, torch.Tensor) or hidden_states.dtype not in _gated.FLOAT_DTYPES
                or gate_up.dtype != hidden_states.dtype or down.dtype != hidden_states.dtype
                or any(hasattr(t, "device_mesh") for t in (hidden_states, gate_up, down))):  # DTensor: torch's ops
            return original(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if not kernels().triton_can_run(hidden_states, gate_up, down):
            fallback(session, _gated.KINDS[kind][0], f"{type(self).__name__} got {hidden_states.device.type} tensors")
            return original(self, hidden_states, top_k_index, top_k_weights)
        return kernels().moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down,
                                     activation=_gated.GLU_LINEAR_ACTIVATION[kind],
                                     transposed=bool(getattr(self, "is_transposed", False)))

    forward.__name__ = forward.__qualname__ = METHOD
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__wrapped__ = original
    forward._autopatch_variant = VARIANT
    return forward


def is_experts_record(record) -> bool:
    """Whether a Record came from this rule (its variant or reason starts with TAG)."""
    return (record.variant or "").startswith(TAG) or (record.reason or "").startswith(TAG)


@dataclasses.dataclass(frozen=True)
class ExpertsVariant:
    kernel: str  # the kernel of the activation the architecture's instances hold (swiglu / geglu)

    def describe(self) -> str:
        return VARIANT


class _Rule(Rule):
    name = "moe_experts"
    kernels = ("swiglu", "geglu")
    tag = TAG

    def candidates(self, module: ModuleType) -> list[Candidate]:
        return [Candidate(f"{c.__name__}.{METHOD}", c) for c in candidates(module)]

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        kernel = _gated.default_activation_kernel(candidate.key, module) or "swiglu"
        why = prove(candidate.key)
        if why:
            return Verdict(candidate.target, None, why, kernel)
        return Verdict(candidate.target, ExpertsVariant(kernel))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        kernels_on = frozenset(k for k in self.kernels if enabled(k))
        return [Swap(cls, METHOD, lambda: make_forward(_dispatcher(cls), kernels_on, session))]


RULE = _Rule()
_verdicts = RULE.verdicts
