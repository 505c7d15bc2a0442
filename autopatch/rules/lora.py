"""peft's LoRA Linear keeps its input in its own dtype for the backward (toggle "lora_input").

Why. peft keeps adapter weights in float32 (`autocast_adapter_dtype=True`, its default) and its
`lora.Linear.forward` computes, per active adapter,

    y = (base(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling).to(base(x).dtype)

so autograd saves the float32 cast of x for lora_A's weight gradient: T·H·4 bytes per LoRA linear,
a separate copy for each of q, k and v although they read the same x, and one for o_proj. At 256K
tokens and H = 4096 that is 4 GiB each, 16 GiB per layer inside a checkpointed layer's recompute,
while x itself (bf16, T·H·2 bytes) is alive anyway. Its backward also makes float32 transients of the
whole input gradient (T·H·4) and of the output gradient (T·O·4).

Under autocast (HF Trainer's bf16=True, TRL) autocast casts both linears' inputs and weights to its
dtype c: lora_A runs on x.to(A.dtype).to(c), so autograd saves that c copy of x (T·H·2 bytes per LoRA
linear: 4 copies a layer for q, k, v, o, 8 GiB at 256K tokens and H = 4096), and c casts of A and B.

What. `LoraDelta` computes the same y with the same operations and keeps x itself (no copy), A, B and
h = x·Aᵀ (T·r, r = 16: 64 bytes a token in float32). The backward recomputes the cast chunk by chunk
over tokens, CHUNK_BYTES of float32 at a time, for every float32 transient:

    c = A.dtype, or autocast's dtype under autocast;  x̃_c = x_c.to(A.dtype).to(c)
    forward   h_c = x̃_c @ A.to(c)ᵀ ;  y_c = (base_c + (h_c @ B.to(c)ᵀ) * s).to(base.dtype)
    backward  g_c = dy_c.to(c) * s ;  dB += g_cᵀ h_c ;  dh_c = g_c B.to(c)
              dA += dh_cᵀ x̃_c ;  dx_c = (dh_c A.to(c)).to(A.dtype).to(x.dtype) ;  d base = dy

the same operations in the same dtypes as peft's (under autocast: as autocast runs them), base(x)
computed by the caller's base layer as peft does. A cast through float32 of a bf16 or fp16 value is
exact, so x̃ is one cast, and x itself when x is already in c. dA and dB accumulate in float32 and
are rounded to c (the dtype peft's matmul gives them) then to A.dtype. Saved: x (shared), h (in c),
the weights; nothing of T·H. Transient: one chunk (CHUNK_BYTES) instead of T·H·4 and T·O·4. The body
runs with autocast off, every cast written out.

When. Per call, only what was proved: `peft.tuners.lora.layer.Linear` itself (not a subclass: the
quantised bases are other classes), adapters not merged or disabled, no `adapter_names` or other
arguments, exactly one active adapter with weights, no variant (DoRA, aLoRA, ...), lora_A / lora_B
plain bias-free nn.Linear of one dtype, no fan_in_fan_out, dropout an nn.Identity (peft's p = 0) or
an nn.Dropout in eval, no autocast or autocast to a proved dtype (bfloat16 and float16 where this
torch's CPU autocast takes them), not under torch.compile (Dynamo traces peft's forward). Anything
else runs peft's own forward (the reason is noted once per process: Session.note_bypass, in
AUTOPATCH_REPORT). Dropout p > 0 in training draws a Bernoulli mask over the float32 x: recomputing
it would need the same RNG draws, so such modules keep peft's path.

Proof. The class is built tiny (in 8, out 6, r 2, random A and B) with a float32 base and with a
bfloat16 base under float32 adapters; its own forward and the patched one must give the same output
and gradients of x, A and B (fp32 1e-5, bf16 1e-2 relative), with a chunk of 2 tokens over 5; then
both again under torch.autocast("cpu", dtype=c) for c in AUTOCAST_DTYPES (1e-2, and the same dtypes
of output and gradients), the patched one through the per-call check and the dtype it reads from
autocast. The proved dtypes are the variant's `autocast`; under any other autocast peft's forward runs.
Autocast on the GPU casts the same op (linear) to its dtype the same way; the proof runs on the CPU,
as the one without autocast does.

Reach. peft is not a transformers modeling module: autopatch.hooks registers a post-import hook for
`peft.tuners.lora.layer` (autopatch.names.LIBRARY_MODULES), which runs this rule alone there. Its line
is said when a model holding its LoRA layers is audited (autopatch.audit), not at peft's import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
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
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)  # proved on the CPU each, at the proof


def chunk_rows(width: int, itemsize: int = 4, budget: int | None = None) -> int:
    """Rows of `width` elements of `itemsize` bytes that fit the budget (at least 1)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // max(1, width * itemsize))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer LoraDelta fills chunk by chunk (tests poison it: an unwritten row shows up)."""
    return torch.empty(shape, dtype=dtype, device=device)


class LoraDelta(torch.autograd.Function):
    """y = (base + (x.to(A.dtype)→c · A_cᵀ) B_cᵀ · s).to(base.dtype), keeping x rather than its cast
    (module docstring). c (`compute`) is the dtype the adapters' matmuls run in: A.dtype, or autocast's
    dtype under autocast (which casts both linears' inputs and weights to it). Inputs: x [..., H],
    base [..., O], A [r, H], B [O, r], s (float), rows per chunk, c. The body runs with autocast off:
    every cast is written out, so forward and backward (which autocast does not reach) agree."""

    @staticmethod
    def forward(ctx, x, base, weight_a, weight_b, scaling, rows, compute):
        with _autocast_off(x.device.type):
            a, b = weight_a.to(compute), weight_b.to(compute)  # r·H, O·r: autocast's weight casts
            x2 = x.reshape(-1, x.shape[-1])
            base2 = base.reshape(-1, base.shape[-1])
            n = x2.shape[0]
            h = _empty((n, weight_a.shape[0]), compute, x.device)
            out = _empty(base2.shape, base.dtype, base.device)
            for i in range(0, n, rows):
                j = min(n, i + rows)
                h[i:j] = F.linear(_via(x2[i:j], weight_a.dtype, compute), a)
                out[i:j] = base2[i:j] + F.linear(h[i:j], b) * scaling  # promoted, then rounded like .to()
        ctx.save_for_backward(x, weight_a, weight_b, h)
        ctx.scaling, ctx.rows, ctx.compute = scaling, rows, compute
        return out.view(base.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight_a, weight_b, h = ctx.saved_tensors
        scaling, rows, compute = ctx.scaling, ctx.rows, ctx.compute
        need_x, need_base, need_a, need_b = ctx.needs_input_grad[:4]
        acc = torch.float32 if compute in _HALF else compute
        with _autocast_off(x.device.type):
            a, b = weight_a.to(compute), weight_b.to(compute)
            x2 = x.reshape(-1, x.shape[-1])
            grad2 = grad.reshape(-1, grad.shape[-1])
            n = x2.shape[0]
            grad_a = torch.zeros(weight_a.shape, dtype=acc, device=weight_a.device) if need_a else None
            grad_b = torch.zeros(weight_b.shape, dtype=acc, device=weight_b.device) if need_b else None
            grad_x = _empty(x2.shape, x.dtype, x.device) if need_x else None
            if need_x or need_a or need_b:
                for i in range(0, n, rows):
                    j = min(n, i + rows)
                    g = grad2[i:j].to(compute) * scaling
                    if need_b:
                        grad_b += (g.t() @ h[i:j]).to(acc)
                    if need_x or need_a:
                        dh = g @ b
                        if need_a:
                            grad_a += (dh.t() @ _via(x2[i:j], weight_a.dtype, compute)).to(acc)
                        if need_x:
                            grad_x[i:j] = _via(dh @ a, weight_a.dtype, x.dtype)
        # the weights' gradients leave the matmuls in c and autocast's cast node takes them to A.dtype
        return (None if grad_x is None else grad_x.view(x.shape),
                grad if need_base else None,
                None if grad_a is None else grad_a.to(compute).to(weight_a.dtype),
                None if grad_b is None else grad_b.to(compute).to(weight_b.dtype),
                None, None, None)


_HALF = (torch.bfloat16, torch.float16)


def _autocast_off(device: str):
    """Autocast off for the body where it is on for the device."""
    on = autocast_dtype(device) is not None
    return torch.autocast(device, enabled=False) if on else contextlib.nullcontext()


def _via(t, mid, to):
    """t.to(mid).to(to) as one cast where the first is exact (float32 holds every bf16 and fp16
    value): forward, peft's x.to(A.dtype) then autocast's cast to c, so x already in c is x itself;
    backward, dx from c through A.dtype to x's dtype."""
    if t.dtype == mid or (t.dtype in _HALF and mid in (torch.float32, torch.float64)):
        return t.to(to)
    return t.to(mid).to(to)


def lora_delta(x, base, weight_a, weight_b, scaling: float, rows: int | None = None, compute=None):
    """LoraDelta.apply with the chunk from CHUNK_BYTES (the widest float32 row of x, base); `compute`
    None: A's dtype (no autocast)."""
    if rows is None:
        rows = chunk_rows(max(x.shape[-1], base.shape[-1]))
    return LoraDelta.apply(x, base, weight_a, weight_b, float(scaling), int(rows), compute or weight_a.dtype)


# --------------------------------------------------------------------------- per call
def _dropout_is_identity(dropout) -> bool:
    if type(dropout) is nn.Identity:
        return True
    return type(dropout) is nn.Dropout and not dropout.training


def autocast_dtype(where) -> torch.dtype | None:
    """The dtype autocast runs linears in on this tensor's device (or device type), None where it is
    off or the device has no autocast (torch.is_autocast_enabled raises for "meta")."""
    device = where.device.type if isinstance(where, torch.Tensor) else where
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:
        return None


def why_not(layer, cls: type, x, args, kwargs, autocast: tuple = ()) -> str:
    """Why this call keeps peft's forward ("" when ours computes it); `autocast`: the autocast dtypes
    proved."""
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
    under = autocast_dtype(x)
    if under is not None and under not in autocast:
        return f"under autocast to {under} (not proved)"
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


def make_forward(original_forward, cls: type, session, autocast: tuple = ()):
    noted: set = set()
    lock = threading.Lock()

    def forward(self, x, *args, **kwargs):
        why = why_not(self, cls, x, args, kwargs, autocast)
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
        out = lora_delta(x, base, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                         compute=autocast_dtype(x))
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


def cpu_autocast_runs(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU autocast takes `dtype` (it warns and stays off for one it does not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=dtype):
            return autocast_dtype(torch.empty(0)) == dtype


def prove(cls: type, original_forward, autocast: torch.dtype | None = None) -> str:
    """"" when the patched forward matches peft's on the probes, else why not. `autocast`: both run
    under torch.autocast("cpu", dtype=autocast) (the backward outside it, as a training step runs it),
    the patched one through the per-call check and the dtype it reads from autocast."""
    for base_dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        if autocast is not None:
            tol = BF16_TOL  # the adapters' matmuls run in a 16-bit dtype
        gen = _probe.generator(7)
        layer = _probe_layer(cls, base_dtype, gen)
        x0 = _probe.randn((5, 8), gen, base_dtype)
        dy = _probe.randn((5, 6), gen, base_dtype)
        params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        results = []
        for run in ("peft", "ours"):
            x = x0.clone().requires_grad_()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                if run == "peft":
                    y = original_forward(layer, x)
                else:
                    proved = () if autocast is None else (autocast,)
                    why = why_not(layer, cls, x, (), {}, proved)
                    if why:
                        return f"the probe layer itself is out of scope: {why}"
                    y = lora_delta(x, layer.base_layer(x), params[0], params[1], layer.scaling["default"], rows=2,
                                   compute=autocast_dtype(x))
            results.append((y, *torch.autograd.grad(y, [x, *params], dy)))
        where = f"{base_dtype} base" + ("" if autocast is None else f", autocast to {autocast}")
        for what, ours, ref in zip(("output", "dx", "dA", "dB"), results[1], results[0]):
            if ours.dtype != ref.dtype:
                return f"{what}: {ours.dtype} against peft's {ref.dtype} ({where})"
            err = _probe.rel_err(ours, ref)
            if not err <= tol:
                return f"{what} differs from peft's forward by {err:.1e} ({where})"
    return ""


@dataclasses.dataclass(frozen=True)
class Variant:
    autocast: tuple = ()  # the autocast dtypes proved: under any other autocast peft's forward runs

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
        proved = []
        try:
            why = prove(cls, forward)
            for dtype in AUTOCAST_DTYPES:
                if why or not cpu_autocast_runs(dtype):
                    continue  # a dtype this torch's CPU autocast does not take stays unproved: peft's path
                why = prove(cls, forward, autocast=dtype)
                proved.append(dtype)
        except Exception as exc:  # noqa: BLE001 - a peft we cannot build the probe with
            why = f"probe failed: {_probe.describe_exc(exc)}"
        if why:
            return Verdict(candidate.target, None, why)
        return Verdict(candidate.target, Variant(tuple(proved)))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        autocast = verdict.variant.autocast
        return [Swap(cls, "forward", lambda: make_forward(vars(cls)["forward"], cls, session, autocast))]


RULE = _Rule()
