"""peft's LoRA Linear keeps its input in its own dtype for the backward (toggle "lora_input").

Why. peft keeps adapter weights in float32 (`autocast_adapter_dtype=True`, its default) and its
`lora.Linear.forward` computes, per active adapter,

    y = (base(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling).to(base(x).dtype)

so autograd saves the float32 cast of x for lora_A's weight gradient: T·H·4 bytes per LoRA linear,
a separate copy for each of q, k and v although they read the same x, and one for o_proj. At 256K
tokens and H = 4096 that is 4 GiB each, 16 GiB per layer inside a checkpointed layer's recompute,
while x itself (bf16, T·H·2 bytes) is alive anyway. Its backward also makes float32 transients of the
whole input gradient (T·H·4) and of the output gradient (T·O·4).

What. `LoraDelta` computes the same y with the same operations and keeps x itself (no copy), A, B and
h = x·Aᵀ (T·r, r = 16: 64 bytes a token in float32). The backward recomputes the cast chunk by chunk
over tokens, CHUNK_BYTES of float32 at a time, for every float32 transient:

    forward   h_c = x_c.to(A.dtype) @ Aᵀ ;  y_c = (base_c + (h_c @ Bᵀ) * s).to(base.dtype)
    backward  g_c = dy_c.to(A.dtype) * s ;  dB += g_cᵀ h_c ;  dh_c = g_c B
              dA += dh_cᵀ x_c.to(A.dtype) ;  dx_c = (dh_c A).to(x.dtype) ;  d base = dy

dA and dB accumulate in float32 (bf16 adapters: cast at the end). Saved: x (shared), h, the weights;
nothing of T·H in float32. Transient: one chunk (CHUNK_BYTES) instead of T·H·4 and T·O·4.

When. Per call, only what was proved: `peft.tuners.lora.layer.Linear` itself (not a subclass: the
quantised bases are other classes), adapters not merged or disabled, no `adapter_names` or other
arguments, exactly one active adapter with weights, no variant (DoRA, aLoRA, ...), lora_A / lora_B
plain bias-free nn.Linear of one dtype, no fan_in_fan_out, dropout an nn.Identity (peft's p = 0) or
an nn.Dropout in eval, no autocast, not under torch.compile (Dynamo traces peft's forward). Anything
else runs peft's own forward (the reason is noted once per process: Session.note_bypass, in
AUTOPATCH_REPORT). Dropout p > 0 in training draws a Bernoulli mask over the float32 x: recomputing
it would need the same RNG draws, so such modules keep peft's path.

Proof. The class is built tiny (in 8, out 6, r 2, random A and B) with a float32 base and with a
bfloat16 base under float32 adapters; its own forward and the patched one must give the same output
and gradients of x, A and B (fp32 1e-5, bf16 1e-2 relative), with a chunk of 2 tokens over 5.

Reach. peft is not a transformers modeling module: autopatch.hooks registers a post-import hook for
`peft.tuners.lora.layer` (autopatch.names.LIBRARY_MODULES), which runs this rule alone there. Its line
is said when a model holding its LoRA layers is audited (autopatch.audit), not at peft's import.
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from autopatch.rules import _probe
from autopatch.rules._template import Candidate, Rule, Swap, Verdict

KERNEL = "lora_input"
MODULE = "peft.tuners.lora.layer"
VARIANT = "LoRA input kept in its own dtype, its cast to the adapters' dtype recomputed in the backward"
CHUNK_BYTES = 64 << 20  # float32 bytes of a backward (and forward) transient: rows per chunk = this / (4·width)
FP32_TOL = 1e-5
BF16_TOL = 1e-2


def chunk_rows(width: int, itemsize: int = 4, budget: int | None = None) -> int:
    """Rows of `width` elements of `itemsize` bytes that fit the budget (at least 1)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // max(1, width * itemsize))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer LoraDelta fills chunk by chunk (tests poison it: an unwritten row shows up)."""
    return torch.empty(shape, dtype=dtype, device=device)


class LoraDelta(torch.autograd.Function):
    """y = (base + (x.to(A.dtype) Aᵀ) Bᵀ · s).to(base.dtype), keeping x rather than its cast (module
    docstring). Inputs: x [..., H], base [..., O], A [r, H], B [O, r], s (float), rows per chunk."""

    @staticmethod
    def forward(ctx, x, base, weight_a, weight_b, scaling, rows):
        dtype = weight_a.dtype
        x2 = x.reshape(-1, x.shape[-1])
        base2 = base.reshape(-1, base.shape[-1])
        n = x2.shape[0]
        h = _empty((n, weight_a.shape[0]), dtype, x.device)
        out = _empty(base2.shape, base.dtype, base.device)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            h[i:j] = F.linear(x2[i:j].to(dtype), weight_a)
            out[i:j] = base2[i:j] + F.linear(h[i:j], weight_b) * scaling  # promoted, then rounded like .to()
        ctx.save_for_backward(x, weight_a, weight_b, h)
        ctx.scaling, ctx.rows = scaling, rows
        return out.view(base.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight_a, weight_b, h = ctx.saved_tensors
        scaling, rows = ctx.scaling, ctx.rows
        need_x, need_base, need_a, need_b = ctx.needs_input_grad[:4]
        dtype = weight_a.dtype
        acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        x2 = x.reshape(-1, x.shape[-1])
        grad2 = grad.reshape(-1, grad.shape[-1])
        n = x2.shape[0]
        grad_a = torch.zeros(weight_a.shape, dtype=acc, device=weight_a.device) if need_a else None
        grad_b = torch.zeros(weight_b.shape, dtype=acc, device=weight_b.device) if need_b else None
        grad_x = _empty(x2.shape, x.dtype, x.device) if need_x else None
        if need_x or need_a or need_b:
            for i in range(0, n, rows):
                j = min(n, i + rows)
                g = grad2[i:j].to(dtype) * scaling
                if need_b:
                    grad_b += (g.t() @ h[i:j]).to(acc)
                if need_x or need_a:
                    dh = g @ weight_b
                    if need_a:
                        grad_a += (dh.t() @ x2[i:j].to(dtype)).to(acc)
                    if need_x:
                        grad_x[i:j] = dh @ weight_a
        return (None if grad_x is None else grad_x.view(x.shape),
                grad if need_base else None,
                None if grad_a is None else grad_a.to(dtype),
                None if grad_b is None else grad_b.to(dtype),
                None, None)


def lora_delta(x, base, weight_a, weight_b, scaling: float, rows: int | None = None):
    """LoraDelta.apply with the chunk from CHUNK_BYTES (the widest float32 row of x, base)."""
    if rows is None:
        rows = chunk_rows(max(x.shape[-1], base.shape[-1]))
    return LoraDelta.apply(x, base, weight_a, weight_b, float(scaling), int(rows))


# --------------------------------------------------------------------------- per call
def _dropout_is_identity(dropout) -> bool:
    if type(dropout) is nn.Identity:
        return True
    return type(dropout) is nn.Dropout and not dropout.training


def why_not(layer, cls: type, x, args, kwargs) -> str:
    """Why this call keeps peft's forward ("" when ours computes it)."""
    if type(layer) is not cls:
        return f"{type(layer).__name__} is a subclass of peft's Linear"
    if args or kwargs:
        return "called with arguments beyond the input"
    if torch.compiler.is_compiling() or _probe.tracing_for_export():
        return "under torch.compile"
    if layer.disable_adapters or layer.merged:
        return "adapters disabled or merged"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return "an input that is not a floating tensor"
    if torch.is_autocast_enabled(x.device.type):
        return "under autocast"
    active = [a for a in layer.active_adapters if a in layer.lora_A.keys()]
    if len(active) != 1:
        return f"{len(active)} active adapters"
    name = active[0]
    if name in getattr(layer, "lora_variant", {}):
        return f"a LoRA variant ({type(layer.lora_variant[name]).__name__})"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out"
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if not (_probe.plain_linear(lora_a) and _probe.plain_linear(lora_b)):
        return "lora_A / lora_B are not plain nn.Linear"
    if lora_a.bias is not None or lora_b.bias is not None:
        return "lora_bias"
    if lora_a.weight.dtype != lora_b.weight.dtype or not lora_a.weight.is_floating_point():
        return "lora_A and lora_B of different dtypes"
    if x.dtype != lora_a.weight.dtype and not getattr(layer, "cast_input_dtype_enabled", True):
        return "input dtype casting disabled"
    if not _dropout_is_identity(layer.lora_dropout[name]):
        return "LoRA dropout in training (its mask is drawn over the cast input)"
    if not isinstance(layer.scaling.get(name), (int, float)):
        return "a scaling that is not a number"
    return ""


def make_forward(original_forward, cls: type, session):
    noted: set = set()
    lock = threading.Lock()

    def forward(self, x, *args, **kwargs):
        why = why_not(self, cls, x, args, kwargs)
        if why:
            if why not in noted and not torch.compiler.is_compiling():
                with lock:
                    first = why not in noted
                    noted.add(why)
                if first and session is not None:
                    session.note_bypass(KERNEL, cls.__name__, f"peft's forward ran: {why}", fallback=True)
            return original_forward(self, x, *args, **kwargs)
        name = next(a for a in self.active_adapters if a in self.lora_A.keys())
        base = self.base_layer(x)
        out = lora_delta(x, base, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])
        if session is not None:
            session.count_call(KERNEL)
        return out

    return _probe.dressed_forward(forward, original_forward, VARIANT)


# --------------------------------------------------------------------------- the proof
def _probe_layer(cls: type, base_dtype: torch.dtype, gen):
    """A tiny peft Linear over nn.Linear(8, 6) of `base_dtype`, r 2, float32 adapters, random A and B."""
    from peft.tuners.lora.config import LoraConfig  # not `from peft`: this runs while peft's __init__ does

    base = nn.Linear(8, 6, bias=True)
    with torch.no_grad():
        base.weight.copy_(_probe.randn((6, 8), gen))
        base.bias.copy_(_probe.randn((6,), gen))
    base = base.to(base_dtype).requires_grad_(False)
    config = LoraConfig(r=2, lora_alpha=3, lora_dropout=0.0, target_modules=["probe"])
    layer = cls(base, "default", config=config, r=2, lora_alpha=3)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(_probe.randn((2, 8), gen))
        layer.lora_B["default"].weight.copy_(_probe.randn((6, 2), gen))
    layer.lora_A["default"].float(), layer.lora_B["default"].float()
    return layer


def prove(cls: type, original_forward) -> str:
    """"" when the patched forward matches peft's on the probes, else why not."""
    for base_dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        gen = _probe.generator(7)
        layer = _probe_layer(cls, base_dtype, gen)
        why = why_not(layer, cls, torch.zeros(1, 8, dtype=base_dtype), (), {})
        if why:
            return f"the probe layer itself is out of scope: {why}"
        x0 = _probe.randn((5, 8), gen, base_dtype)
        dy = _probe.randn((5, 6), gen, base_dtype)
        params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        results = []
        for run in ("peft", "ours"):
            x = x0.clone().requires_grad_()
            if run == "peft":
                y = original_forward(layer, x)
            else:
                y = lora_delta(x, layer.base_layer(x), params[0], params[1], layer.scaling["default"], rows=2)
            results.append((y, *torch.autograd.grad(y, [x, *params], dy)))
        for what, ours, ref in zip(("output", "dx", "dA", "dB"), results[1], results[0]):
            if ours.dtype != ref.dtype:
                return f"{what}: {ours.dtype} against peft's {ref.dtype} ({base_dtype} base)"
            err = _probe.rel_err(ours, ref)
            if not err <= tol:
                return f"{what} differs from peft's forward by {err:.1e} ({base_dtype} base)"
    return ""


@dataclasses.dataclass(frozen=True)
class Variant:
    def describe(self) -> str:
        return VARIANT


class _Rule(Rule):
    """One candidate: peft.tuners.lora.layer.Linear, in that module only."""

    name = "lora"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        cls = vars(module).get("Linear") if module.__name__ == MODULE else None
        return [Candidate("Linear", cls)] if isinstance(cls, type) else []

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        cls = candidate.key
        forward = vars(cls).get("forward")
        if forward is None or _probe.positional_params(forward) is None:
            return Verdict(candidate.target, None, "peft's Linear has no forward of its own")
        for attr in ("active_adapters", "disable_adapters", "merged"):  # properties of peft's tuner layer
            if not hasattr(cls, attr):
                return Verdict(candidate.target, None, f"peft's Linear has no {attr}")
        try:
            why = prove(cls, forward)
        except Exception as exc:  # noqa: BLE001 - a peft we cannot build the probe with
            why = f"probe failed: {_probe.describe_exc(exc)}"
        return Verdict(candidate.target, None, why) if why else Verdict(candidate.target, Variant())

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        return [Swap(cls, "forward", lambda: make_forward(vars(cls)["forward"], cls, session))]


RULE = _Rule()
