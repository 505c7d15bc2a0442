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

    c = A.dtype, or autocast's dtype under autocast;  x̃_c = (x_c.to(A.dtype) · k_c).to(c)
    forward   h_c = x̃_c @ A.to(c)ᵀ ;  y_c = (base_c + (h_c @ B.to(c)ᵀ) * s).to(base.dtype)
    backward  g_c = dy_c.to(c) * s ;  dB += g_cᵀ h_c ;  dh_c = g_c B.to(c)
              dA += dh_cᵀ x̃_c ;  dx_c = ((dh_c A.to(c)).to(A.dtype) · k_c).to(x.dtype) ;  d base = dy

the same operations in the same dtypes as peft's (under autocast: as autocast runs them), base(x)
computed by the caller's base layer as peft does. k is LoRA dropout's scale, 0 or 1/(1 − p) per element
(no k at all without dropout: x̃ is one cast, since a cast through float32 of a bf16 or fp16 value is
exact, and x itself when x is already in c). dA and dB accumulate in float32 and are rounded to c (the
dtype peft's matmul gives them) then to A.dtype. Saved: x (shared), h (in c), the weights, and with
dropout the random state before its draw (torch.get_rng_state: 5056 bytes; on CUDA also the device
generator's, 16 bytes); nothing of T·H. Transient: one chunk (CHUNK_BYTES) instead of T·H·4 and T·O·4.
The body runs with autocast off, every cast written out.

Dropout in training. peft's lora_A reads dropout(x.to(A.dtype)) (nn.Dropout, F.dropout out of place), a
mask drawn over the whole [.., H] input, and autograd keeps that mask and the dropped input (CPU: the
float32 scale T·H·4 and the product T·H·4; CUDA: a bool mask T·H and the product T·H·4). Dropout's bits
depend on the tensor's shape, dtype and layout and on the generator's state, not on its values, so k is
drawn by the same F.dropout over a contiguous tensor of ones of x's shape in A.dtype (1·mask·scale, exact)
right where peft draws (after base(x)), from the same generator: the same mask as peft's under the same
seed, and the same draws taken from the stream. The state before the draw is kept; the backward restores
it inside torch.random.fork_rng (the global stream is left as the forward left it) and draws k again.
Checkpointing replays the layer with the random state it recorded (HF's preserve_rng_state), so the
recompute's forward draws the forward's mask, records the same state, and the backward's k equals both.
k is the one full-size transient: T·H·4 bytes in A.dtype (float32) while this op's forward or backward
runs, and while it is drawn the ones (T·H·4) and dropout's own buffer beside it (CUDA: its T·H bool
mask; CPU: its float noise T·H·4 and bernoulli's own scratch); none of it is saved across layers.

When. Per call, only what was proved: `peft.tuners.lora.layer.Linear` itself (not a subclass: the
quantised bases are other classes), adapters not merged or disabled, no `adapter_names` or other
arguments, exactly one active adapter with weights, no variant (DoRA, aLoRA, ...), lora_A / lora_B
plain bias-free nn.Linear of one dtype, no fan_in_fan_out, dropout an nn.Identity (peft's p = 0), an
nn.Dropout in eval, or an nn.Dropout (not in place) in training where dropout was proved (per autocast
mode) over float32 adapters, on the CPU or CUDA, with x contiguous and (where x is already float32,
dropout then reading x itself) 16-byte aligned, as dropout's CUDA kernel picks its element-to-random
mapping by layout and alignment, not under CUDA graph capture; no autocast or autocast to a proved
dtype (bfloat16 and float16 where this torch's CPU autocast takes them), not under torch.compile
(Dynamo traces peft's forward). Anything else runs peft's own forward (each reason is noted once per
process: Session.note_bypass, in AUTOPATCH_REPORT; every such call is counted, Session.count_original,
and the exit check says so when most calls ran peft's forward).

Proof. The class is built tiny (in 8, out 6, r 2, random A and B) with a float32 base and with a
bfloat16 base under float32 adapters; its own forward and the patched one must give the same output
and gradients of x, A and B (fp32 1e-5, bf16 1e-2 relative), with a chunk of 2 tokens over 5; then
both again under torch.autocast("cpu", dtype=c) for c in AUTOCAST_DTYPES (1e-2, and the same dtypes
of output and gradients), the patched one through the per-call check and the dtype it reads from
autocast. Each mode again with dropout p = PROBE_DROPOUT in training, both runs from the same seed:
the same numbers, a mask that drops some elements and keeps others, and the same next draw from the
global generator after forward and backward. A failing mode is left to peft's forward alone, with
its reason (Variant.unproved); only a failure without autocast and dropout refuses the class. Autocast
on the GPU casts the same op (linear) to its dtype the same way; dropout's CUDA kernel is another one,
whose bits also follow only the shape, layout, alignment and generator state (the GPU tests in
tests/test_rules_lora.py compare its masks and a tiny Llama's step); the proof runs on the CPU.

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
PROBE_DROPOUT = 0.25  # the proof's dropout probability: over its 5 × 8 inputs it drops some and keeps most
DROPOUT_ADAPTER_DTYPE = torch.float32  # dropout's scale k in this dtype is exactly what its kernels multiply by


def chunk_rows(width: int, itemsize: int = 4, budget: int | None = None) -> int:
    """Rows of `width` elements of `itemsize` bytes that fit the budget (at least 1)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // max(1, width * itemsize))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer LoraDelta fills chunk by chunk (tests poison it: an unwritten row shows up)."""
    return torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------- LoRA dropout's mask
def rng_state(device: torch.device) -> tuple:
    """The generators a dropout on `device` may draw from, as torch.utils.checkpoint records them: the
    CPU's (5056 bytes) and, on CUDA, that device's (16 bytes)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def dropout_scale(shape, dtype: torch.dtype, device, p: float) -> torch.Tensor:
    """k: what peft's nn.Dropout(p) multiplies an input of this shape and dtype by, 0 or 1/(1 − p) per
    element, drawn now from the global generators. The same op peft's dropout calls (F.dropout, out of
    place) over a fresh contiguous tensor of ones: dropout's random bits follow the shape, dtype and
    layout (on CUDA its kernel's vector width follows the alignment) and the generator's state, never the
    values, and 1·mask·scale is the scale itself. Bytes: the result, numel·itemsize, kept by the caller;
    while drawn, the ones (numel·itemsize) and dropout's own buffer (CUDA: a numel-byte mask; CPU: its
    noise, numel·itemsize)."""
    ones = torch.ones(shape, dtype=dtype, device=device)
    return F.dropout(ones, p, training=True)


def redrawn_scale(state: tuple, shape, dtype: torch.dtype, device, p: float) -> torch.Tensor:
    """dropout_scale drawn again from `state` (rng_state's) inside torch.random.fork_rng: the mask the
    forward drew, and the global generators left as they were."""
    cpu, own = state
    devices = [device] if own is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
        torch.set_rng_state(cpu)
        if own is not None:
            torch.cuda.set_rng_state(own, device)
        return dropout_scale(shape, dtype, device, p)


class LoraDelta(torch.autograd.Function):
    """y = (base + ((x.to(A.dtype)·k)→c · A_cᵀ) B_cᵀ · s).to(base.dtype), keeping x rather than its cast
    (module docstring). c (`compute`) is the dtype the adapters' matmuls run in: A.dtype, or autocast's
    dtype under autocast (which casts both linears' inputs and weights to it). k: LoRA dropout's scale,
    drawn here when p > 0 (peft's mask under the same random state) and again in the backward from the
    state kept. Inputs: x [..., H] (contiguous where p > 0), base [..., O], A [r, H], B [O, r], s (float),
    rows per chunk, c, p. The body runs with autocast off: every cast is written out, so forward and
    backward (which autocast does not reach) agree."""

    @staticmethod
    def forward(ctx, x, base, weight_a, weight_b, scaling, rows, compute, p):
        with _autocast_off(x.device.type):
            a, b = weight_a.to(compute), weight_b.to(compute)  # r·H, O·r: autocast's weight casts
            x2 = x.reshape(-1, x.shape[-1])
            base2 = base.reshape(-1, base.shape[-1])
            keep = None
            if p:
                ctx.rng = rng_state(x.device)
                keep = dropout_scale(x.shape, weight_a.dtype, x.device, p).view(x2.shape)
            n = x2.shape[0]
            h = _empty((n, weight_a.shape[0]), compute, x.device)
            out = _empty(base2.shape, base.dtype, base.device)
            for i in range(0, n, rows):
                j = min(n, i + rows)
                h[i:j] = F.linear(_adapter_input(x2[i:j], weight_a.dtype, compute, keep, i, j), a)
                out[i:j] = base2[i:j] + F.linear(h[i:j], b) * scaling  # promoted, then rounded like .to()
            del keep
        ctx.save_for_backward(x, weight_a, weight_b, h)
        ctx.scaling, ctx.rows, ctx.compute, ctx.p = scaling, rows, compute, p
        return out.view(base.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight_a, weight_b, h = ctx.saved_tensors
        scaling, rows, compute, p = ctx.scaling, ctx.rows, ctx.compute, ctx.p
        need_x, need_base, need_a, need_b = ctx.needs_input_grad[:4]
        acc = torch.float32 if compute in _HALF else compute
        with _autocast_off(x.device.type):
            a, b = weight_a.to(compute), weight_b.to(compute)
            x2 = x.reshape(-1, x.shape[-1])
            grad2 = grad.reshape(-1, grad.shape[-1])
            n = x2.shape[0]
            keep = None
            if p and (need_x or need_a):
                keep = redrawn_scale(ctx.rng, x.shape, weight_a.dtype, x.device, p).view(x2.shape)
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
                            grad_a += (dh.t() @ _adapter_input(x2[i:j], weight_a.dtype, compute, keep, i, j)).to(acc)
                        if need_x:
                            grad_x[i:j] = _input_grad(dh @ a, weight_a.dtype, x.dtype, keep, i, j)
            del keep
        # the weights' gradients leave the matmuls in c and autocast's cast node takes them to A.dtype
        return (None if grad_x is None else grad_x.view(x.shape),
                grad if need_base else None,
                None if grad_a is None else grad_a.to(compute).to(weight_a.dtype),
                None if grad_b is None else grad_b.to(compute).to(weight_b.dtype),
                None, None, None, None)


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


def _adapter_input(rows, a_dtype, compute, keep, i, j):
    """What lora_A reads for these rows: peft's x.to(A.dtype), dropped (times k, in A.dtype, as
    dropout's kernels multiply), then autocast's cast to c."""
    if keep is None:
        return _via(rows, a_dtype, compute)
    return (rows.to(a_dtype) * keep[i:j]).to(compute)


def _input_grad(d, a_dtype, x_dtype, keep, i, j):
    """dx for these rows from d = dh·A_c: autocast's cast node back to A.dtype, dropout's backward
    (times k), then the input cast's backward to x's dtype."""
    if keep is None:
        return _via(d, a_dtype, x_dtype)
    return (d.to(a_dtype) * keep[i:j]).to(x_dtype)


def lora_delta(x, base, weight_a, weight_b, scaling: float, rows: int | None = None, compute=None, p: float = 0.0):
    """LoraDelta.apply with the chunk from CHUNK_BYTES (the widest float32 row of x, base); `compute`
    None: A's dtype (no autocast); `p`: LoRA dropout's probability in training (0: none)."""
    if rows is None:
        rows = chunk_rows(max(x.shape[-1], base.shape[-1]))
    return LoraDelta.apply(x, base, weight_a, weight_b, float(scaling), int(rows), compute or weight_a.dtype,
                           float(p))


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


def _not_proved(why: str) -> str:
    return f"(not proved: {why})" if why else "(not proved)"


def _why_not_dropout(dropout, x, weight, mode, scope) -> str:
    """Why LoRA dropout in training keeps peft's forward here ("" when ours draws its mask); `mode`:
    autocast's dtype or None."""
    if type(dropout) is not nn.Dropout:
        return f"a LoRA dropout that is not nn.Dropout ({type(dropout).__name__})"
    if dropout.inplace:
        return "an in-place LoRA dropout"
    if mode not in scope.dropout:
        under = "" if mode is None else f" under autocast to {mode}"
        return f"LoRA dropout in training{under} {_not_proved(scope.why(dropout_case(mode)))}"
    if weight.dtype != DROPOUT_ADAPTER_DTYPE:
        return (f"LoRA dropout in training over {weight.dtype} adapters (its scale is rounded to them, "
                "which CUDA's kernel does not do; float32 adapters, peft's default, were proved)")
    if x.device.type not in ("cpu", "cuda"):
        return f"LoRA dropout in training on {x.device.type} (its random state is kept for the CPU and CUDA)"
    if not x.is_contiguous() or (x.dtype == weight.dtype and x.data_ptr() % 16):
        return ("LoRA dropout in training over an input that is not contiguous and 16-byte aligned "
                "(dropout's mask follows its input's layout)")
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return "LoRA dropout in training under CUDA graph capture"
    return ""


def why_not(layer, cls: type, x, args, kwargs, scope: "Variant | None" = None) -> str:
    """Why this call keeps peft's forward ("" when ours computes it); `scope`: what the proof took (the
    autocast dtypes, the modes of dropout in training; default: neither)."""
    scope = Variant() if scope is None else scope
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
    if under is not None and under not in scope.autocast:
        return f"under autocast to {under} {_not_proved(scope.why(autocast_case(under)))}"
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
    dropout = layer.lora_dropout[name]
    if not _dropout_is_identity(dropout):
        why = _why_not_dropout(dropout, x, lora_a.weight, under, scope)
        if why:
            return why
    if not isinstance(layer.scaling.get(name), (int, float)):
        return "a scaling that is not a number"
    return ""


def dropout_p(layer, name: str) -> float:
    """The probability peft's dropout of adapter `name` draws with now (0 where it is the identity)."""
    dropout = layer.lora_dropout[name]
    return float(dropout.p) if type(dropout) is nn.Dropout and dropout.training else 0.0


def make_forward(original_forward, cls: type, session, scope: "Variant | None" = None):
    noted: set = set()
    lock = threading.Lock()

    def forward(self, x, *args, **kwargs):
        why = why_not(self, cls, x, args, kwargs, scope)
        if why:
            if session is not None and not torch.compiler.is_compiling():
                session.count_original(KERNEL)  # the exit check says when most calls came here
                if why not in noted:
                    with lock:
                        first = why not in noted
                        noted.add(why)
                    if first:
                        session.note_bypass(KERNEL, cls.__name__, f"peft's forward ran: {why}", fallback=True)
            return original_forward(self, x, *args, **kwargs)
        name = next(a for a in self.active_adapters if a in self.lora_A.keys())
        base = self.base_layer(x)
        out = lora_delta(x, base, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                         compute=autocast_dtype(x), p=dropout_p(self, name))
        if session is not None:
            session.count_call(KERNEL)
        return out

    return _probe.dressed_forward(forward, original_forward, VARIANT if scope is None else scope.describe())


# --------------------------------------------------------------------------- the proof
def _probe_layer(cls: type, base_dtype: torch.dtype, gen, dropout: float = 0.0):
    """A tiny peft Linear over nn.Linear(8, 6) of `base_dtype`, r 2, float32 adapters, random A and B,
    LoRA dropout `dropout` (peft's nn.Dropout, in training, when above 0)."""
    from peft.tuners.lora.config import LoraConfig  # not `from peft`: this runs while peft's __init__ does

    base = nn.Linear(8, 6, bias=True)
    with torch.no_grad():
        base.weight.copy_(_probe.randn((6, 8), gen))
        base.bias.copy_(_probe.randn((6,), gen))
    base = base.to(base_dtype).requires_grad_(False)
    config = LoraConfig(r=2, lora_alpha=3, lora_dropout=dropout, target_modules=["probe"])
    layer = cls(base, "default", config=config, r=2, lora_alpha=3)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(_probe.randn((2, 8), gen))
        layer.lora_B["default"].weight.copy_(_probe.randn((6, 2), gen))
    layer.lora_A["default"].float(), layer.lora_B["default"].float()
    return layer.train()


def cpu_autocast_runs(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU autocast takes `dtype` (it warns and stays off for one it does not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=dtype):
            return autocast_dtype(torch.empty(0)) == dtype


PROBE_SEED = 11  # the global generator's seed for both runs of a dropout proof (inside probing(): restored after)


def prove(cls: type, original_forward, autocast: torch.dtype | None = None, dropout: float = 0.0) -> str:
    """"" when the patched forward matches peft's on the probes, else why not. `autocast`: both run
    under torch.autocast("cpu", dtype=autocast) (the backward outside it, as a training step runs it),
    the patched one through the per-call check and the dtype it reads from autocast. `dropout`: the
    layer's LoRA dropout in training; both runs (forward and backward) from PROBE_SEED, and the next
    draw of the global generator after each must be the same too."""
    mode = (autocast,) if autocast is not None else ()
    scope = Variant(autocast=mode, dropout=(autocast,) if dropout else ())
    for base_dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        if autocast is not None:
            tol = BF16_TOL  # the adapters' matmuls run in a 16-bit dtype
        gen = _probe.generator(7)
        layer = _probe_layer(cls, base_dtype, gen, dropout)
        x0 = _probe.randn((5, 8), gen, base_dtype)
        dy = _probe.randn((5, 6), gen, base_dtype)
        params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        results, after = [], []
        for run in ("peft", "ours"):
            x = x0.clone().requires_grad_()
            torch.manual_seed(PROBE_SEED)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                if run == "peft":
                    y = original_forward(layer, x)
                else:
                    why = why_not(layer, cls, x, (), {}, scope)
                    if why:
                        return f"the probe layer itself is out of scope: {why}"
                    y = lora_delta(x, layer.base_layer(x), params[0], params[1], layer.scaling["default"], rows=2,
                                   compute=autocast_dtype(x), p=dropout_p(layer, "default"))
            results.append((y, *torch.autograd.grad(y, [x, *params], dy)))
            after.append(torch.rand(4))
        where = (f"{base_dtype} base" + ("" if autocast is None else f", autocast to {autocast}")
                 + (f", dropout {dropout}" if dropout else ""))
        if dropout:
            torch.manual_seed(PROBE_SEED)
            kept = dropout_scale(x0.shape, params[0].dtype, x0.device, dropout) != 0
            if kept.all() or not kept.any():
                return f"the probe's dropout mask drops {'nothing' if kept.all() else 'everything'} ({where})"
            if not torch.equal(after[0], after[1]):
                return f"the global generator's next draw differs from peft's after a step ({where})"
        for what, ours, ref in zip(("output", "dx", "dA", "dB"), results[1], results[0]):
            if ours.dtype != ref.dtype:
                return f"{what}: {ours.dtype} against peft's {ref.dtype} ({where})"
            err = _probe.rel_err(ours, ref)
            if not err <= tol:
                return f"{what} differs from peft's forward by {err:.1e} ({where})"
    return ""


def autocast_case(dtype: torch.dtype) -> str:
    return f"autocast to {dtype}"


def dropout_case(mode: torch.dtype | None) -> str:
    return "dropout in training" + ("" if mode is None else f" under autocast to {mode}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """What the proof took: under anything else peft's forward runs, with the reason."""

    autocast: tuple = ()  # the autocast dtypes proved
    dropout: tuple = ()  # the modes LoRA dropout in training was proved in: None (no autocast), autocast dtypes
    unproved: tuple = ()  # (case, why): each autocast dtype or dropout mode the proof did not take

    def why(self, case: str) -> str:
        return dict(self.unproved).get(case, "")

    def describe(self) -> str:
        if not self.unproved:
            return VARIANT
        return f"{VARIANT}; peft's forward under: {', '.join(case for case, _ in self.unproved)}"


def _attempt(cls, forward, **mode) -> str:
    """prove(...) for one mode, an exception its reason."""
    try:
        return prove(cls, forward, **mode)
    except Exception as exc:  # noqa: BLE001 - a peft we cannot build the probe with
        return f"probe failed: {_probe.describe_exc(exc)}"


class _Rule(Rule):
    """One candidate: peft.tuners.lora.layer.Linear, in that module only."""

    name = "lora"
    kernels = (KERNEL,)

    def candidates(self, module: ModuleType) -> list[Candidate]:
        cls = vars(module).get("Linear") if module.__name__ == MODULE else None
        return [Candidate("Linear", cls)] if isinstance(cls, type) else []

    def prove(self, candidate: Candidate, module: ModuleType) -> Verdict:
        """The class, without autocast and dropout, or nothing; then each autocast dtype and each mode of
        dropout in training on its own: one that fails keeps peft's forward there alone."""
        cls = candidate.key
        forward = vars(cls).get("forward")
        if forward is None or _probe.positional_params(forward) is None:
            return Verdict(candidate.target, None, "peft's Linear has no forward of its own")
        for attr in ("active_adapters", "disable_adapters", "merged"):  # properties of peft's tuner layer
            if not hasattr(cls, attr):
                return Verdict(candidate.target, None, f"peft's Linear has no {attr}")
        why = _attempt(cls, forward)
        if why:
            return Verdict(candidate.target, None, why)
        autocast, dropout, unproved = [], [], []
        for mode in (None, *AUTOCAST_DTYPES):
            if mode is not None:
                why = ("this torch's CPU autocast does not take it" if not cpu_autocast_runs(mode)
                       else _attempt(cls, forward, autocast=mode))
                if why:
                    unproved.append((autocast_case(mode), why))
                    continue
                autocast.append(mode)
            why = _attempt(cls, forward, autocast=mode, dropout=PROBE_DROPOUT)
            if why:
                unproved.append((dropout_case(mode), why))
            else:
                dropout.append(mode)
        return Verdict(candidate.target, Variant(tuple(autocast), tuple(dropout), tuple(unproved)))

    def swaps(self, candidate: Candidate, verdict: Verdict, session, enabled) -> list[Swap]:
        cls = candidate.key
        scope = verdict.variant
        return [Swap(cls, "forward", lambda: make_forward(vars(cls)["forward"], cls, session, scope))]


RULE = _Rule()
