"""Per-kernel benchmark cases: RMSNorm, LayerNorm, RoPE, SwiGLU, cross entropy, fused linear cross entropy.

Every case is one op at one shape, in bf16, timed forward, backward and forward+backward against its
peers in this process:
  hf_eager       the formula Hugging Face transformers runs (written out below, from modeling_llama.py
                 and loss_utils.py: LlamaRMSNorm.forward, apply_rotary_pos_emb, silu(gate) * up,
                 F.cross_entropy on .float() logits, lm_head matmul then that cross entropy)
  torch_compile  torch.compile(dynamic=False) of the same formula (dynamo reset before each case)
  liger          Liger-Kernel's functional ops, when its wheel is importable
  cutce          cut_cross_entropy.linear_cross_entropy (FLCE only; default filter_eps="high", which
                 skips small gradient entries: approximate gradients), and cutce_exact (filter_eps=None)
  ours           fused_kernels.* (the functional API, docs/architecture.md)
  host_floor     not a peer: one autograd node launching one empty Triton kernel each way (_HostFloor);
                 its wall time is what this host's Python costs any eager fused op, its GPU time ~0

Per peer and mode: median ms (bench_common.bench_ms), peak MiB beyond the inputs and the gradients the
call leaves behind, for fwd+bwd also `gpu_ms` (the kernels' own durations summed, torch.profiler: the
time with the host's launch overhead taken out), achieved GB/s (or TFLOP/s for FLCE) from the case's
byte/FLOP floor, the fraction of the ceiling measured in this run, and the relative error of outputs
and input gradients against hf_eager (a peer computing something else shows up there, not only in its
speed).

Floors: RMSNorm fwd 2 passes over x-sized tensors (read x, write y), bwd 3 (read x, dy;
write dx), fwd+bwd 5; LayerNorm the same (plus weight and bias); RoPE 2 passes over q and k each way; SwiGLU fwd 3 (gate, up, y), bwd 5
(dy, gate, up -> dgate, dup), fwd+bwd 8; cross entropy fwd 1 (read logits), bwd and fwd+bwd 2 (read
logits, write their gradient); FLCE 2*N*H*V FLOPs forward, 4*N*H*V backward, 6*N*H*V together.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_common import (
    Deadline,
    MiB,
    bench_after_setup_ms,
    bench_ms,
    free_memory,
    peak_extra_bytes,
    rel_err,
    storages,
    sync,
)

MODES = ("fwd", "bwd", "fwdbwd")
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------
# The HF formulas, written out (transformers 5.x, modeling_llama.py / loss/loss_utils.py)
# ----------------------------------------------------------------------------------------------------


def hf_rms_norm(x, weight, eps: float = 1e-6):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def hf_layer_norm(x, weight, bias, eps: float = 1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def hf_swiglu(gate, up):
    return F.silu(gate) * up


def hf_cross_entropy(logits, target):
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="mean")


def hf_linear_cross_entropy(hidden, weight, target):
    logits = hidden @ weight.t()  # lm_head (no bias)
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="mean")


# RoPE cases take q and k in HF's memory layout: projections come out as (batch, seq, heads, dim) and
# the attention code transposes them to (batch, heads, seq, dim) views. The peers see those views.
def _rope_views(impl):
    def call(q_bshd, k_bshd, cos, sin):
        return impl(q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), cos, sin)

    return call


# ----------------------------------------------------------------------------------------------------
# Peers: name -> factory(op) -> callable. A factory raises when the peer is unavailable; the error
# string is recorded and the case goes on without it.
# ----------------------------------------------------------------------------------------------------

HF = {
    "rms_norm": hf_rms_norm,
    "layer_norm": hf_layer_norm,
    "rope": _rope_views(hf_apply_rotary_pos_emb),
    "swiglu": hf_swiglu,
    "cross_entropy": hf_cross_entropy,
    "flce": hf_linear_cross_entropy,
}


def _peer_hf_eager(op):
    return HF[op]


def _peer_torch_compile(op):
    return torch.compile(HF[op], dynamic=False)


def _peer_liger(op):
    if op == "rms_norm":
        from liger_kernel.transformers.functional import liger_rms_norm

        return lambda x, w: liger_rms_norm(x, w, 1e-6)
    if op == "layer_norm":
        from liger_kernel.transformers.functional import liger_layer_norm

        return lambda x, w, b: liger_layer_norm(x, w, b, 1e-5)
    if op == "rope":
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        return _rope_views(liger_rotary_pos_emb)
    if op == "swiglu":
        from liger_kernel.ops import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply
    if op == "cross_entropy":
        from liger_kernel.transformers.functional import liger_cross_entropy

        return lambda logits, target: liger_cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
    if op == "flce":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    raise KeyError(op)


def _peer_cutce(op, exact: bool = False):
    if op != "flce":
        raise KeyError(op)
    from cut_cross_entropy import linear_cross_entropy

    kwargs = {"filter_eps": None} if exact else {}
    return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, **kwargs)


def _peer_ours(op):
    import fused_kernels as fk

    if op == "rms_norm":
        return lambda x, w: fk.rms_norm(x, w, eps=1e-6)
    if op == "layer_norm":
        return lambda x, w, b: fk.layer_norm(x, w, b, eps=1e-5)
    if op == "rope":
        return _rope_views(lambda q, k, cos, sin: fk.rope(q, k, cos, sin, unsqueeze_dim=1))
    if op == "swiglu":
        return fk.swiglu
    if op == "cross_entropy":
        return lambda logits, target: fk.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
    if op == "flce":
        return lambda h, w, t: fk.fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    raise KeyError(op)


@triton.jit
def _touch_kernel(ptr):
    """Writes nothing (the mask is off): a launch through Triton's Python path, and no more."""
    tl.store(ptr, 0.0, mask=tl.program_id(0) < 0)


class _HostFloor(torch.autograd.Function):
    """The least any eager fused op does: one autograd node, one Triton launch each way, empty outputs
    of the right shapes. Its fwd+bwd time is this host's floor for every peer built that way (all of
    ours and Liger's); a wall-time target below it cannot be met here, whatever the kernels do."""

    @staticmethod
    def forward(ctx, shapes_like, *inputs):
        ctx.like = [(t.shape, t.dtype) if t.requires_grad else None for t in inputs]
        outs = [torch.empty_like(t) for t in shapes_like] if shapes_like else [inputs[0].new_empty((), dtype=torch.float32)]
        _touch_kernel[(1,)](outs[0])
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        out = [None if like is None else torch.empty(like[0], dtype=like[1], device=grads[0].device) for like in ctx.like]
        _touch_kernel[(1,)](grads[0])
        return (None, *out)


def _peer_host_floor(op):
    if op == "rms_norm":
        return lambda x, w: _HostFloor.apply((x,), x, w)
    if op == "layer_norm":
        return lambda x, w, b: _HostFloor.apply((x,), x, w, b)
    if op == "rope":
        return _rope_views(lambda q, k, cos, sin: _HostFloor.apply((q, k), q, k, cos, sin))
    if op == "swiglu":
        return lambda gate, up: _HostFloor.apply((gate,), gate, up)
    if op == "cross_entropy":
        return lambda logits, target: _HostFloor.apply((), logits, target)
    raise KeyError(op)


PEERS: dict[str, Callable[[str], Callable]] = {
    "hf_eager": _peer_hf_eager,
    "torch_compile": _peer_torch_compile,
    "liger": _peer_liger,
    "cutce": lambda op: _peer_cutce(op, exact=False),
    "cutce_exact": lambda op: _peer_cutce(op, exact=True),
    "ours": _peer_ours,
    "host_floor": _peer_host_floor,
}
# host_floor is a yardstick, not a peer: it computes nothing and is left out of the ratios.
ELEMENTWISE_PEERS = ("hf_eager", "torch_compile", "liger", "ours", "host_floor")
NOT_A_PEER = ("host_floor",)
FLCE_PEERS = ("hf_eager", "torch_compile", "liger", "cutce", "cutce_exact", "ours")


# ----------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    args: tuple  # what the peer is called with
    leaves: list  # tensors whose gradients the backward produces
    grad_out: list | None  # upstream gradients for tensor outputs; None for a scalar loss


@dataclasses.dataclass
class Case:
    name: str
    op: str
    tags: tuple
    params: dict
    make: Callable[[torch.device, int], Inputs]
    floors: dict  # mode -> {"bytes": n} or {"flops": n}
    peers: tuple = ELEMENTWISE_PEERS
    modes: tuple = MODES
    min_reps: int = 10
    max_ms: float = 1000.0


def _randn(shape, device, gen, dtype=torch.bfloat16, scale=1.0, requires_grad=False):
    t = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    if scale != 1.0:
        t.mul_(scale)
    t = t.to(dtype)
    return t.requires_grad_(requires_grad)


def _targets(n, vocab, device, gen):
    t = torch.randint(0, vocab, (n,), device=device, generator=gen)
    t[:: max(1, min(2048, n // 4))] = IGNORE_INDEX  # the shifted-label position of each sequence
    return t


def rms_norm_case(rows, hidden, tags, modes=MODES):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        x = _randn((rows, hidden), device, g, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
        w.requires_grad_(True)
        dy = _randn((rows, hidden), device, g)
        return Inputs((x, w), [x, w], [dy])

    xb, wb = rows * hidden * 2, hidden * 2
    floors = {"fwd": {"bytes": 2 * xb + wb}, "bwd": {"bytes": 3 * xb + 2 * wb}, "fwdbwd": {"bytes": 5 * xb + 3 * wb}}
    return Case(f"rms_norm {rows}x{hidden}", "rms_norm", tags, {"rows": rows, "hidden": hidden}, make, floors,
                modes=modes)


def layer_norm_case(rows, hidden, tags, modes=MODES):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        x = _randn((rows, hidden), device, g, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16).requires_grad_(True)
        b = (0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16).requires_grad_(True)
        dy = _randn((rows, hidden), device, g)
        return Inputs((x, w, b), [x, w, b], [dy])

    # forward reads x, w, b and writes y; backward reads x, dy, w and writes dx, dw, db
    xb, wb = rows * hidden * 2, hidden * 2
    floors = {"fwd": {"bytes": 2 * xb + 2 * wb}, "bwd": {"bytes": 3 * xb + 3 * wb},
              "fwdbwd": {"bytes": 5 * xb + 5 * wb}}
    return Case(f"layer_norm {rows}x{hidden}", "layer_norm", tags, {"rows": rows, "hidden": hidden}, make, floors,
                modes=modes)


def _rope_cos_sin(seq, dim, device, theta=500000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, seq, dim), as LlamaRotaryEmbedding returns
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def rope_case(batch, q_heads, kv_heads, seq, dim, tags):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        q = _randn((batch, seq, q_heads, dim), device, g, requires_grad=True)
        k = _randn((batch, seq, kv_heads, dim), device, g, requires_grad=True)
        cos, sin = _rope_cos_sin(seq, dim, device)
        dq = _randn((batch, q_heads, seq, dim), device, g)
        dk = _randn((batch, kv_heads, seq, dim), device, g)
        return Inputs((q, k, cos, sin), [q, k], [dq, dk])

    qk = (batch * q_heads + batch * kv_heads) * seq * dim * 2
    cs = 2 * seq * dim * 2
    floors = {"fwd": {"bytes": 2 * qk + cs}, "bwd": {"bytes": 2 * qk + cs}, "fwdbwd": {"bytes": 4 * qk + 2 * cs}}
    params = {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "seq": seq, "head_dim": dim,
              "layout": "q,k stored (batch, seq, heads, dim), passed as transpose(1, 2) views like HF attention"}
    return Case(f"rope {batch}x{q_heads}/{kv_heads}x{seq}x{dim}", "rope", tags, params,
                make, floors)


def swiglu_case(rows, cols, tags):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        gate = _randn((rows, cols), device, g, requires_grad=True)
        up = _randn((rows, cols), device, g, requires_grad=True)
        dy = _randn((rows, cols), device, g)
        return Inputs((gate, up), [gate, up], [dy])

    tb = rows * cols * 2
    floors = {"fwd": {"bytes": 3 * tb}, "bwd": {"bytes": 5 * tb}, "fwdbwd": {"bytes": 8 * tb}}
    return Case(f"swiglu {rows}x{cols}", "swiglu", tags, {"rows": rows, "cols": cols}, make, floors)


def cross_entropy_case(tokens, vocab, tags, modes=MODES):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        logits = _randn((tokens, vocab), device, g, scale=2.0, requires_grad=True)
        target = _targets(tokens, vocab, device, g)
        return Inputs((logits, target), [logits], None)

    lb = tokens * vocab * 2
    floors = {"fwd": {"bytes": lb}, "bwd": {"bytes": 2 * lb}, "fwdbwd": {"bytes": 2 * lb}}
    return Case(f"cross_entropy {tokens}x{vocab}", "cross_entropy", tags, {"tokens": tokens, "vocab": vocab}, make,
                floors, modes=modes)


def flce_case(tokens, hidden, vocab, tags, modes=MODES, min_reps=5, max_ms=600.0):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        h = _randn((tokens, hidden), device, g, requires_grad=True)
        w = _randn((vocab, hidden), device, g, scale=1.0 / math.sqrt(hidden), requires_grad=True)
        target = _targets(tokens, vocab, device, g)
        return Inputs((h, w, target), [h, w], None)

    nhv = tokens * hidden * vocab
    floors = {"fwd": {"flops": 2 * nhv}, "bwd": {"flops": 4 * nhv}, "fwdbwd": {"flops": 6 * nhv}}
    return Case(f"flce {tokens}x{hidden}->{vocab}", "flce", tags,
                {"tokens": tokens, "hidden": hidden, "vocab": vocab}, make, floors,
                peers=FLCE_PEERS, modes=modes, min_reps=min_reps, max_ms=max_ms)


def real_cases() -> list[Case]:
    """The README table's cases first (so a budget cut loses sweep points, not table rows), then sweeps."""
    sweep_only = ("fwdbwd",)
    cases = [
        rms_norm_case(16384, 4096, ("main", "sweep_rms_norm")),
        rope_case(4, 32, 8, 4096, 128, ("main",)),
        swiglu_case(16384, 14336, ("main",)),
        cross_entropy_case(8192, 128256, ("main", "sweep_cross_entropy")),
        flce_case(8192, 4096, 128256, ("main", "sweep_flce_tokens", "sweep_flce_vocab")),
        rms_norm_case(65536, 1024, ("scale", "sweep_rms_norm")),
        rms_norm_case(4096, 16384, ("scale", "sweep_rms_norm")),
        rms_norm_case(1024, 65536, ("scale", "sweep_rms_norm")),
        cross_entropy_case(8192, 32000, ("scale", "sweep_cross_entropy")),
        cross_entropy_case(8192, 262144, ("scale", "sweep_cross_entropy")),
        flce_case(16384, 2304, 262144, ("scale",), min_reps=3, max_ms=500.0),
        layer_norm_case(16384, 4096, ("main", "layer_norm")),
        layer_norm_case(65536, 1024, ("scale", "layer_norm")),
        layer_norm_case(4096, 16384, ("scale", "layer_norm")),
        rms_norm_case(32768, 2048, ("sweep_rms_norm",), modes=sweep_only),
        rms_norm_case(8192, 8192, ("sweep_rms_norm",), modes=sweep_only),
        rms_norm_case(2048, 32768, ("sweep_rms_norm",), modes=sweep_only),
        cross_entropy_case(8192, 65536, ("sweep_cross_entropy",), modes=sweep_only),
        cross_entropy_case(8192, 151936, ("sweep_cross_entropy",), modes=sweep_only),
    ]
    for tokens in (2048, 4096, 16384):
        cases.append(flce_case(tokens, 4096, 128256, ("sweep_flce_tokens",), modes=sweep_only, min_reps=3,
                               max_ms=300.0))
    for vocab in (32000, 65536, 262144):
        cases.append(flce_case(8192, 4096, vocab, ("sweep_flce_vocab",), modes=sweep_only, min_reps=3,
                               max_ms=300.0))
    return cases


def tiny_cases() -> list[Case]:
    """CPU dry run: every op at a shape the Triton interpreter gets through in seconds."""
    return [
        rms_norm_case(8, 64, ("main", "sweep_rms_norm")),
        rms_norm_case(4, 200, ("scale", "sweep_rms_norm")),
        layer_norm_case(8, 100, ("main", "layer_norm")),
        rope_case(1, 2, 1, 8, 16, ("main",)),
        swiglu_case(8, 96, ("main",)),
        cross_entropy_case(8, 100, ("main", "sweep_cross_entropy")),
        flce_case(8, 32, 100, ("main", "sweep_flce_tokens", "sweep_flce_vocab")),
    ]


# ----------------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------------


def _as_tuple(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def _backward(out, grad_out, retain_graph=False):
    outs = _as_tuple(out)
    torch.autograd.backward(outs, grad_tensors=grad_out, retain_graph=retain_graph)


def _short(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "OOM: " + str(exc).splitlines()[0][:200]
    text = f"{type(exc).__name__}: {exc}"
    return text[:400]


def _clear_grads(leaves):
    for t in leaves:
        t.grad = None


def _metrics(ms, floor, ceilings):
    m = {"ms": ms}
    if "bytes" in floor:
        m["gbps"] = floor["bytes"] / (ms * 1e-3) / 1e9
        if ceilings.get("copy_gbps"):
            m["frac_ceiling"] = m["gbps"] / ceilings["copy_gbps"]
    else:
        m["tflops"] = floor["flops"] / (ms * 1e-3) / 1e12
        if ceilings.get("matmul_tflops"):
            m["frac_ceiling"] = m["tflops"] / ceilings["matmul_tflops"]
    return m


def _floor_ms(floor, ceilings):
    if "bytes" in floor and ceilings.get("copy_gbps"):
        return floor["bytes"] / (ceilings["copy_gbps"] * 1e9) * 1e3
    if "flops" in floor and ceilings.get("matmul_tflops"):
        return floor["flops"] / (ceilings["matmul_tflops"] * 1e12) * 1e3
    return None


def kernel_times(fn, device, leaves, calls: int = 3) -> dict:
    """The CUDA kernels of one fn() call: name -> [µs, launches], averaged over `calls` calls under
    torch.profiler (leaves' .grad cleared before each). Idle gaps between kernels are not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _clear_grads(leaves)
            fn()
        sync(device)
    kernels: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(ev.name, [0.0, 0.0])
            entry[0] += (getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)) / calls
            entry[1] += 1 / calls
    return kernels


def kernel_ms(fn, device, leaves, calls: int = 3):
    """Sum of the CUDA kernels' durations in one fn() call (see kernel_times), or None when the
    profiler is unavailable or saw nothing."""
    try:
        total_us = sum(us for us, _ in kernel_times(fn, device, leaves, calls).values())
    except Exception:  # noqa: BLE001 - a diagnostic; the wall time stands on its own
        return None
    return total_us / 1e3 if total_us > 0 else None


def run_peer(case: Case, peer: str, device: torch.device, ceilings: dict, deadline: Deadline, ref: dict | None,
             seed: int, keep_ref: bool) -> tuple[dict, dict | None]:
    """Measure one peer on one case. Returns (result, reference outputs if keep_ref)."""
    res: dict = {"status": "ok", "modes": {}}
    try:
        fn = PEERS[peer](case.op)
    except Exception as exc:  # not installed, no such op
        return {"status": "unavailable", "error": _short(exc)}, None
    inp = None
    new_ref = None
    try:
        inp = case.make(device, seed)
        existing = storages(list(inp.args) + (inp.grad_out or []))
        # Warm-up (compiles, autotunes) and the correctness check against hf_eager, in one fwd+bwd.
        out = fn(*inp.args)
        _backward(out, inp.grad_out)
        sync(device)
        outs = [o.detach() for o in _as_tuple(out)]
        grads = [t.grad.detach() if t.grad is not None else None for t in inp.leaves]
        if ref is not None:
            errs = {}
            for i, (o, r) in enumerate(zip(outs, ref["outs"])):
                errs[f"out{i}"] = rel_err(o, r)
            for i, (gr, r) in enumerate(zip(grads, ref["grads"])):
                if gr is not None and r is not None:
                    errs[f"grad{i}"] = rel_err(gr, r)
            res["rel_err_vs_hf_eager"] = errs
        if keep_ref:
            new_ref = {"outs": [o.clone() for o in outs], "grads": [None if gr is None else gr.clone() for gr in grads]}
        del out, outs, grads
        _clear_grads(inp.leaves)
        free_memory(device)
    except Exception as exc:
        res = {"status": "error", "error": _short(exc)}
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            res["traceback"] = traceback.format_exc(limit=6)[-1500:]
        del inp
        free_memory(device, full=True)
        return res, None

    leaves, go, args = inp.leaves, inp.grad_out, inp.args

    def fwd():
        return fn(*args)

    def fwdbwd():
        _backward(fn(*args), go)

    for mode in case.modes:
        if deadline.over():
            res["modes"][mode] = {"error": "skipped: kernel time budget spent"}
            continue
        m: dict = {}
        out = None
        try:
            # Peak memory, one call.
            _clear_grads(leaves)
            free_memory(device)
            if mode == "fwd":
                extra, kept = peak_extra_bytes(fwd, device, leaves, existing)
                del kept
            elif mode == "fwdbwd":
                extra, _ = peak_extra_bytes(fwdbwd, device, leaves, existing)
            else:
                out = fwd()
                extra, _ = peak_extra_bytes(lambda: _backward(out, go), device, leaves, existing)
                del out
            if extra >= 0:
                m["peak_mib"] = extra / MiB
            _clear_grads(leaves)
            free_memory(device)
            # Time.
            if mode == "fwd":
                ms = bench_ms(fwd, device, min_reps=case.min_reps, max_ms=case.max_ms)
            elif mode == "fwdbwd":
                ms = bench_ms(fwdbwd, device, grad_to_none=leaves, min_reps=case.min_reps, max_ms=case.max_ms)
            else:
                ms = bench_after_setup_ms(fwd, lambda out: _backward(out, go), device, grad_to_none=leaves,
                                          min_reps=case.min_reps, max_ms=case.max_ms)
            m.update(_metrics(ms, case.floors[mode], ceilings))
            if mode == "fwdbwd" and device.type == "cuda":
                # The GPU's own time: what the kernels take once launched. do_bench's wall time also
                # holds whatever the GPU spent waiting for Python to launch them (host-bound below
                # ~0.5 ms on a slow host, for every peer alike).
                _clear_grads(leaves)
                gpu = kernel_ms(fwdbwd, device, leaves)
                if gpu is not None:
                    m["gpu_ms"] = gpu
                    m["gpu_frac_ceiling"] = _metrics(gpu, case.floors[mode], ceilings).get("frac_ceiling")
        except Exception as exc:
            m["error"] = _short(exc)
        finally:
            out = None  # an exception between fwd() and its backward must not keep the graph alive
            _clear_grads(leaves)
            free_memory(device)
        res["modes"][mode] = m
    del inp, leaves, go, args
    free_memory(device, full=True)
    return res, new_ref


def run_case(case: Case, device: torch.device, ceilings: dict, deadline: Deadline, peers_filter=None,
             seed: int = 0, cpu_compile: bool = False) -> dict:
    entry = {
        "case": case.name,
        "op": case.op,
        "tags": list(case.tags),
        "params": case.params,
        "modes": list(case.modes),
        "floor": {m: dict(case.floors[m], ms=_floor_ms(case.floors[m], ceilings)) for m in case.modes},
        "peers": {},
    }
    try:
        torch._dynamo.reset()  # each case compiles fresh; no recompile limit across shapes
    except Exception:
        pass
    ref = None
    for peer in case.peers:
        if peers_filter and peer not in peers_filter and peer != "hf_eager":
            continue
        if peer == "torch_compile" and device.type != "cuda" and not cpu_compile:
            entry["peers"][peer] = {"status": "skipped", "error": "torch.compile not run on the CPU dry run"}
            continue
        if deadline.over():
            entry["peers"][peer] = {"status": "skipped", "error": "kernel time budget spent"}
            continue
        res, new_ref = run_peer(case, peer, device, ceilings, deadline, ref, seed, keep_ref=(peer == "hf_eager"))
        if new_ref is not None:
            ref = new_ref
        entry["peers"][peer] = res
    del ref
    free_memory(device)
    _ratios(entry)
    return entry


def _ratios(entry: dict) -> None:
    """Each peer's time over the best other peer's, per mode; and ours over the best peer."""
    entry["best"] = {}
    for mode in entry["modes"]:
        times = {p: r["modes"][mode]["ms"] for p, r in entry["peers"].items()
                 if r.get("status") == "ok" and "ms" in r.get("modes", {}).get(mode, {}) and p not in NOT_A_PEER}
        for p, t in times.items():
            others = [v for q, v in times.items() if q != p]
            if others:
                entry["peers"][p]["modes"][mode]["ratio_to_best_other"] = t / min(others)
        peer_times = {p: t for p, t in times.items() if p != "ours"}
        if peer_times:
            best = min(peer_times, key=peer_times.get)
            entry["best"][mode] = {"peer": best, "ms": peer_times[best]}
            if "ours" in times:
                entry["best"][mode]["ours_ratio"] = times["ours"] / peer_times[best]


def run_kernels(device: torch.device, ceilings: dict, deadline: Deadline, tiny: bool, only=None, peers=None,
                on_case_done=None, cpu_compile: bool = False, modes=None) -> list[dict]:
    """modes: measure only these of a case's modes (fwd, bwd, fwdbwd); a case left with none is dropped.
    fwdbwd alone is what the README table compares, in about a third of the time."""
    cases = tiny_cases() if tiny else real_cases()
    if only:
        cases = [c for c in cases if any(s in c.name for s in only)]
    if modes:
        cases = [dataclasses.replace(c, modes=tuple(m for m in c.modes if m in modes)) for c in cases]
        cases = [c for c in cases if c.modes]
    results = []
    for i, case in enumerate(cases):
        if deadline.over():
            results.append({"case": case.name, "op": case.op, "tags": list(case.tags), "params": case.params,
                            "skipped": "kernel time budget spent"})
            continue
        print(f"[kernels] {i + 1}/{len(cases)} {case.name}  ({deadline.left():.0f} s left)", flush=True)
        t0 = time.monotonic()
        entry = run_case(case, device, ceilings, deadline, peers_filter=peers, cpu_compile=cpu_compile)
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        results.append(entry)
        print(f"          [{entry['wall_s']:.0f} s] " + _one_line(entry), flush=True)
        if on_case_done:
            on_case_done(results)
    return results


def _one_line(entry: dict) -> str:
    parts = []
    for p, r in entry["peers"].items():
        m = r.get("modes", {}).get("fwdbwd", {})
        if "ms" in m:
            parts.append(f"{p} {m['ms']:.3f}ms/{m.get('peak_mib', float('nan')):.0f}MiB")
        else:
            parts.append(f"{p} {r.get('error') or m.get('error') or r.get('status')}"[:80])
    return " | ".join(parts)
