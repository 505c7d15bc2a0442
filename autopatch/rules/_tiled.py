"""The tiled MLP: a patched MLP (glu_mlp, gelu_mlp) run over chunks of its tokens, recomputed in the
backward, above AUTOPATCH_TILED_MLP_TOKENS (Settings.tiled_mlp_tokens).

An MLP maps each token on its own, so running it on the tokens in chunks gives the same output. In
training the whole-sequence MLP keeps [tokens, intermediate] activations for its backward (the gate,
the up projection and their product; for a GELU MLP the first projection's output), several times
the [tokens, hidden] input and output. Here one autograd node keeps only the input: the forward runs
the chunks without autograd, writing each chunk's output into one output tensor; the backward runs
each chunk again with autograd and takes the gradients of the input and of the module's parameters
from it, chunk by chunk (half-precision weight gradients summed in float32). At most one chunk's
activations exist at a time, forward or backward, for the price of one more MLP forward (none under
non-reentrant checkpointing, whose recompute then skips the MLP: below).

The chunk's computation is the patched forward's own (the module's own projections, so LoRA and
other adapters on them are used and trained), and the parameters are inputs of the node, so their
gradients reach autograd's graph as any gradient does (hooks, DDP's reducer, accumulation into
.grad). The random state (CPU and the input's device) is kept from the forward and restored for the
recompute, so a dropout inside a projection (LoRA's) draws the same masks in both; the autocast state
is kept the same way.

The input is saved by a node of its own placed before the tiled node (_KeptInput: x itself forward
and backward), which the tiled node reads it from in its backward. Saving comes when a node is made,
after its forward: saved by the tiled node, x was saved after all the chunks had run. In a layer
under torch.utils.checkpoint (non-reentrant), the backward's recompute of the layer stops at the
last tensor the layer saves; in a pre-norm decoder layer that is the MLP's input (the residual add
after it saves nothing), so the recompute ran the whole MLP again, for an output it throws away: one
MLP forward of compute and a [tokens, hidden] output beside the recompute's other tensors. Saved
first, it stops the recompute before the chunks run. Where something after the MLP saves a tensor
too, the recompute goes on through the MLP as before.

Not tiled: without autograd recording (inference, a reentrant checkpoint's first pass: the whole MLP
runs as patched), under torch.compile (the compiled graph chooses its own memory plan), and modules
whose parameters are sharded (DeepSpeed ZeRO-3 or DTensor: gathered by their own hooks only for a
forward the framework sees).
"""

from __future__ import annotations

import math
from typing import Callable

import torch


_HALF = (torch.bfloat16, torch.float16)


def limit_of(session) -> int | None:
    """The most tokens an MLP runs at once, or None (not tiled): AUTOPATCH_TILED_MLP_TOKENS."""
    value = getattr(getattr(session, "settings", None), "tiled_mlp_tokens", None)
    return value if isinstance(value, int) and value > 0 else None


def tokens_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def chunks(tokens: int, limit: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of near-equal length, none longer than `limit`."""
    count = max(1, math.ceil(tokens / limit))
    size = math.ceil(tokens / count)
    return [(s, min(s + size, tokens)) for s in range(0, tokens, size)]


def _sharded(param) -> bool:
    return hasattr(param, "ds_id") or hasattr(param, "device_mesh")


def wanted(module, x: torch.Tensor, limit: int | None) -> bool:
    """Whether this call runs tiled: a limit set, more tokens than it, autograd recording, no compile,
    no sharded parameter."""
    # torch.compile first: the token count compared under a trace is a guard on the sequence length,
    # which recompiled the graph when a length crossed the limit, for an answer that is "no" either way
    if limit is None or torch.compiler.is_compiling() or x.dim() < 2 or not torch.is_grad_enabled():
        return False
    if tokens_of(x) <= limit:
        return False
    return not any(_sharded(p) for p in module.parameters())


def run(module, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor], limit: int) -> torch.Tensor:
    """body(x) (a token-wise MLP of `module`) over chunks of at most `limit` tokens, recomputed in the
    backward (module docstring)."""
    params = [p for p in module.parameters() if p.requires_grad]
    keeper = None
    if x.requires_grad:  # else no node saves anything: the tiled node keeps x itself
        x = _KeptInput.apply(x)
        keeper = x.grad_fn
    return _TiledMLP.apply(body, limit, len(params), keeper, x, *params)


def _autocast_state(device_type: str) -> list[tuple[str, torch.dtype, bool]]:
    states = []
    for kind in dict.fromkeys((device_type, "cpu")):
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            states.append((kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled()))
    return states


class _KeptInput(torch.autograd.Function):
    """x itself, forward and backward; the node saves x for the tiled node after it, which reads it
    from here (`keeper.saved_tensors`) in its backward: saved before the chunks run (module docstring).
    Its own backward passes the gradient through and reads nothing."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, body, limit, n_params, keeper, x, *params):
        flat = x.reshape(-1, x.shape[-1])
        ranges = chunks(flat.shape[0], limit)
        ctx.body, ctx.ranges, ctx.params = body, ranges, params
        ctx.lead = tuple(x.shape[:-1])
        ctx.autocast = _autocast_state(x.device.type)
        ctx.devices = [x.device] if x.device.type == "cuda" else []
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        out = None
        with torch.no_grad():
            for start, end in ranges:
                y = body(flat[start:end])
                if out is None:
                    out = y.new_empty((flat.shape[0], *y.shape[1:]))
                out[start:end] = y
                del y
        ctx.keeper = keeper  # x's node (_KeptInput), or None: x saved here
        if keeper is None:
            ctx.save_for_backward(x)
        return out.view(*ctx.lead, *out.shape[1:])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors if ctx.keeper is None else ctx.keeper.saved_tensors
        ctx.keeper = None
        params = ctx.params
        want_x = ctx.needs_input_grad[4]
        want_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(flat.shape[0], -1)
        grad_x = torch.empty_like(flat) if want_x else None
        grads: list = [None] * len(params)
        targets = [p for p, w in zip(params, want_p) if w]
        with torch.random.fork_rng(devices=ctx.devices, device_type="cuda" if ctx.devices else "cpu"):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.devices, ctx.device_rng):
                torch.cuda.set_rng_state(state, device)
            for start, end in ctx.ranges:
                piece = flat[start:end].detach().requires_grad_(want_x)
                with torch.enable_grad(), _autocast(ctx.autocast):
                    y = ctx.body(piece)
                inputs = ([piece] if want_x else []) + targets
                if not inputs:
                    continue
                got = torch.autograd.grad(y, inputs, grad_flat[start:end].view_as(y), allow_unused=True)
                del y
                if want_x:
                    grad_x[start:end] = got[0] if got[0] is not None else 0
                    got = got[1:]
                for i, g in zip((i for i, w in enumerate(want_p) if w), got):
                    if g is None:
                        continue
                    if grads[i] is None:
                        # half-precision weight gradients summed over the chunks in float32, as one
                        # GEMM over all the tokens would accumulate them
                        grads[i] = g.float() if g.dtype in _HALF and len(ctx.ranges) > 1 else g
                    else:
                        grads[i].add_(g)
        grads = [g if g is None or g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
        gx = grad_x.view(*ctx.lead, flat.shape[-1]) if want_x else None
        ctx.body = ctx.params = None
        return (None, None, None, None, gx, *grads)


class _autocast:
    """The forward's autocast states entered again for the recompute."""

    def __init__(self, states):
        self.contexts = [torch.autocast(kind, dtype=dtype, cache_enabled=cache) for kind, dtype, cache in states]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False
