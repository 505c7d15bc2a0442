"""Variable sequence lengths without a compile per length (CPU, kernels in Triton's interpreter; float32
against float64 references, 1e-5 relative).

torch.compile (dynamo's default: the first length is compiled static, the second marks the length
dynamic, so two graphs serve every length):
  - each functional op compiled with fullgraph=True (aot_eager) and run forward+backward at five lengths
    compiles at most twice, and exactly once when the length dims are marked dynamic from the first call
    (mark_dynamic raises if anything our code traces specialises them); outputs and gradients equal the
    float64 reference at every length;
  - the losses with num_items_in_batch a Python int that changes with the batch (a symbolic int in the
    trace after the second batch): no graph break, the same values as sum / num_items_in_batch;
  - the patched tiny Llama compiled whole, trained at five lengths: no more compiles than the plain
    model, and its losses and gradients equal the plain model's at every length;
  - the tiled MLP's token limit (AUTOPATCH_TILED_MLP_TOKENS) is not read under a trace: it once put a
    guard on the length into the graph, and the lengths past the limit compiled a third graph.
Triton (no compile under the interpreter: tests/test_dynamic_lengths_gpu.py counts binaries on a GPU):
  - every op's plan() gives launch configs (the kernels' constexprs) and autotuning keys from a bounded
    set across 300 lengths: what depends on the length is bucketed to powers of two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close

F32, BF16 = torch.float32, torch.bfloat16
LENGTHS = (17, 33, 64, 100, 129)
HIDDEN = 32


def _compile_counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("aot_eager")


def _randn(gen, *shape, grad=True):
    return torch.randn(*shape, generator=gen, dtype=F32).requires_grad_(grad)


# ------------------------------------------------------------------------------------------ the ops
@dataclasses.dataclass(frozen=True)
class OpCase:
    """One functional op: `make(length, gen)` gives its leaf tensors and, per argument, the dims that grow
    with the sequence (batch and length); `arguments` makes the op's arguments of the leaves (views);
    `run` is the op, `reference` the same maths (run in float64)."""
    name: str
    make: Callable
    run: Callable
    reference: Callable
    arguments: Callable = lambda *leaves: leaves


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rms_inputs(length, gen):
    return (_randn(gen, 2, length, HIDDEN), _randn(gen, HIDDEN)), {0: (0, 1)}


def _layer_norm_inputs(length, gen):
    return (_randn(gen, 2, length, HIDDEN), _randn(gen, HIDDEN), _randn(gen, HIDDEN)), {0: (0, 1)}


def _rope_inputs(length, gen):
    angles = torch.rand(1, length, 8, generator=gen) * 6.0
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    leaves = (_randn(gen, 2, length, 4, 16), _randn(gen, 2, length, 2, 16), cos, sin)
    return leaves, {0: (0, 2), 1: (0, 2), 2: (1,), 3: (1,)}  # dims of _rope_arguments' q, k, cos, sin


def _rope_arguments(q, k, cos, sin):
    # HF's layout: q, k are (batch, seq, heads, dim) projections viewed as (batch, heads, seq, dim)
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _glu_inputs(length, gen):
    return (_randn(gen, 2, length, 48), _randn(gen, 2, length, 48)), {0: (0, 1), 1: (0, 1)}


def _targets(length, gen, classes=64):
    t = torch.randint(0, classes, (length,), generator=gen)
    t[:3] = -100
    return t


# The losses take the tokens flattened, as a causal LM's loss does (and the interpreter runs a program per row).
def _flce_inputs(length, gen):
    return (_randn(gen, length, HIDDEN), _randn(gen, 64, HIDDEN), _targets(length, gen)), {0: (0,), 2: (0,)}


def _ce_inputs(length, gen):
    return (_randn(gen, length, 64), _targets(length, gen)), {0: (0,), 1: (0,)}


def _ops():
    import fused_kernels as fk

    return (
        OpCase("rms_norm", _rms_inputs, lambda x, w: fk.rms_norm(x, w, 1e-6),
               lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
        OpCase("layer_norm", _layer_norm_inputs, lambda x, w, b: fk.layer_norm(x, w, b),
               lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
        OpCase("rope", _rope_inputs, lambda q, k, c, s: fk.rope(q, k, c, s),
               lambda q, k, c, s: (q * c[:, None] + _rotate_half(q) * s[:, None],
                                   k * c[:, None] + _rotate_half(k) * s[:, None]), _rope_arguments),
        OpCase("swiglu", _glu_inputs, lambda g, u: fk.swiglu(g, u), lambda g, u: F.silu(g) * u),
        OpCase("geglu", _glu_inputs, lambda g, u: fk.geglu(g, u), lambda g, u: F.gelu(g, approximate="tanh") * u),
        OpCase("cross_entropy", _ce_inputs, lambda x, t: fk.cross_entropy(x, t),
               lambda x, t: F.cross_entropy(x, t)),
        OpCase("fused_linear_cross_entropy", _flce_inputs, lambda h, w, t: fk.fused_linear_cross_entropy(h, w, t),
               lambda h, w, t: F.cross_entropy(h @ w.T, t)),
    )


OP_NAMES = ["rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy"]


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _check_at_every_length(case: OpCase, call, mark_dynamic: bool) -> None:
    """call (the compiled op) forward+backward at every length against the float64 reference: outputs
    and the gradient of every input that takes one, for a random upstream gradient."""
    for i, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(100 + i)
        leaves, dynamic = case.make(length, gen)
        arguments = case.arguments(*leaves)
        if mark_dynamic:
            for index, dims in dynamic.items():
                for dim in dims:
                    torch._dynamo.mark_dynamic(arguments[index], dim)
        outs = _outputs(call(*arguments))
        upstream = [torch.randn(o.shape, generator=gen, dtype=F32) for o in outs]
        torch.autograd.backward(outs, upstream)

        ref_leaves = [t.detach().double() if t.is_floating_point() else t for t in leaves]
        for ref, leaf in zip(ref_leaves, leaves):
            ref.requires_grad_(leaf.requires_grad)
        ref_outs = _outputs(case.reference(*case.arguments(*ref_leaves)))
        torch.autograd.backward(ref_outs, [u.double() for u in upstream])
        what = f"{case.name} at length {length}"
        for j, (got, want) in enumerate(zip(outs, ref_outs)):
            assert_close(got.detach(), want.detach(), F32, f"{what}: output {j}")
        for j, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
            if leaf.requires_grad:
                assert leaf.grad is not None, f"{what}: input {j} got no gradient"
                assert_close(leaf.grad, ref.grad, F32, f"{what}: gradient of input {j}")


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_compiles_at_most_twice_over_five_lengths(name):
    case = next(c for c in _ops() if c.name == name)
    counter = _compile_counter()
    compiled = torch.compile(case.run, backend=counter, fullgraph=True)
    _check_at_every_length(case, compiled, mark_dynamic=False)
    assert counter.frame_count <= 2, (
        f"{name}: {counter.frame_count} compiles over lengths {LENGTHS}; dynamo's default needs 2 (the first "
        f"length static, then dynamic). Run with TORCH_LOGS=recompiles to see the guard that failed")
    torch._dynamo.reset()


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_compiles_once_with_the_lengths_marked_dynamic(name):
    """mark_dynamic on the batch and length dims from the first call: one graph for every length. Any
    specialisation of those dims in what dynamo traces (a Python branch on a size, int() of one, a guard
    in a fake implementation) raises a ConstraintViolationError here."""
    case = next(c for c in _ops() if c.name == name)
    counter = _compile_counter()
    compiled = torch.compile(case.run, backend=counter, fullgraph=True)
    _check_at_every_length(case, compiled, mark_dynamic=True)
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} compiles with the lengths marked dynamic"
    torch._dynamo.reset()


@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_loss_with_a_python_int_num_items_in_batch_that_changes(op):
    """num_items_in_batch as the int count of each batch: from the second batch on dynamo makes it a
    symbolic int; math.isfinite on it stopped the trace ("torch.* op returned non-Tensor"). Now it
    reaches the kernels as a 0-d tensor: no break, no compile per value, the loss sum / num_items."""
    import fused_kernels as fk

    def loss(h, w, t, n):
        if op == "cross_entropy":
            return fk.cross_entropy(h @ w.T, t, num_items_in_batch=n)
        return fk.fused_linear_cross_entropy(h, w, t, num_items_in_batch=n)

    counter = _compile_counter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for i, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(200 + i)
        h, w = _randn(gen, length, HIDDEN), _randn(gen, 64, HIDDEN)
        t = torch.randint(0, 64, (length,), generator=gen)
        t[:2] = -100
        n_items = 3 * length + 5  # not the count of t: the divisor is whatever the caller says
        got = compiled(h, w, t, n_items)
        got.backward()
        h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        want = F.cross_entropy(h64 @ w64.T, t, reduction="sum") / n_items
        want.backward()
        assert_close(got.detach(), want.detach(), F32, f"{op} loss at length {length}")
        assert_close(h.grad, h64.grad, F32, f"{op} grad of hidden at length {length}")
        assert_close(w.grad, w64.grad, F32, f"{op} grad of weight at length {length}")
    assert counter.frame_count <= 2, f"{op}: {counter.frame_count} compiles over {len(LENGTHS)} values of num_items"
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ a whole model
def _tiny_llama(seed: int = 0):
    """A tiny Llama with transformers' default attention (SDPA), so the causal_mask and masked_attention
    rules take part as they do in training."""
    from stack_worker import PAD_ID, TINY_LLAMA
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA, "max_position_embeddings": 256}, pad_token_id=PAD_ID)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def _train_at_every_length(model) -> tuple[int, list]:
    """(compiles, [(length, loss, {name: grad})]) of torch.compile(model, fullgraph=True, aot_eager),
    one training forward+backward with labels per length."""
    counter = _compile_counter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    model.train()
    steps = []
    for i, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(300 + i)
        ids = torch.randint(3, 256, (2, length), generator=gen)
        labels = ids.clone()
        labels[0, : length // 4] = -100
        model.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append((length, out.loss.detach().clone(), grads))
    torch._dynamo.reset()
    return counter.frame_count, steps


@pytest.mark.slow
def test_patched_tiny_llama_compiles_no_more_than_plain(restore_patches):
    import autopatch
    import fused_kernels

    plain_compiles, plain_steps = _train_at_every_length(_tiny_llama())
    model = _tiny_llama()
    records = autopatch.apply(model)
    patched = {r.kernel for r in records if r.patched}
    assert patched >= {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"}, patched
    before = dict(fused_kernels.launch_counts())
    compiles, steps = _train_at_every_length(model)
    ran = {k: v - before.get(k, 0) for k, v in fused_kernels.launch_counts().items()}
    assert compiles <= plain_compiles <= 2, (
        f"patched: {compiles} compiles, plain: {plain_compiles}, over lengths {LENGTHS} (TORCH_LOGS=recompiles)")
    for kernel in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
        assert ran.get(f"{kernel}_fwd", 0) >= len(LENGTHS) and ran.get(f"{kernel}_bwd", 0) >= len(LENGTHS), ran
    for (length, loss, grads), (_, plain_loss, plain_grads) in zip(steps, plain_steps):
        assert_close(loss, plain_loss, F32, f"loss at length {length}")
        assert set(grads) == set(plain_grads), f"length {length}: not the same parameters got gradients"
        for name, grad in plain_grads.items():
            assert_close(grads[name], grad, F32, f"grad {name} at length {length}")


@pytest.mark.slow
def test_tiled_mlp_limit_puts_no_guard_on_the_length(restore_patches, monkeypatch):
    """With AUTOPATCH_TILED_MLP_TOKENS at 100 the patched MLP's tokens (2 × length: 34 ... 258) cross the
    limit. Under a trace the MLP is not tiled, so the limit must not be compared with the token count
    there: that comparison was a guard `2 <= length <= 50`, and the lengths past it compiled again."""
    import autopatch
    from autopatch.config import load_settings
    from autopatch.session import current

    model = _tiny_llama()
    assert any(r.kernel == "swiglu" and r.patched for r in autopatch.apply(model))
    monkeypatch.setattr(current(), "settings", load_settings({"AUTOPATCH_TILED_MLP_TOKENS": "100"}))
    mlp = model.model.layers[0].mlp
    counter = _compile_counter()
    compiled = torch.compile(mlp, backend=counter, fullgraph=True)
    for i, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(400 + i)
        x = _randn(gen, 2, length, mlp.gate_proj.in_features)
        mlp.zero_grad(set_to_none=True)
        out = compiled(x)
        upstream = torch.randn(out.shape, generator=gen)
        out.backward(upstream)
        grads = (x.grad, mlp.gate_proj.weight.grad, mlp.down_proj.weight.grad)
        x64 = x.detach().double().requires_grad_()
        weights = [p.detach().double().requires_grad_() for p in
                   (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)]
        gate_w, up_w, down_w = weights
        ref = (F.silu(x64 @ gate_w.T) * (x64 @ up_w.T)) @ down_w.T
        ref.backward(upstream.double())
        assert_close(out.detach(), ref.detach(), F32, f"MLP output at length {length}")
        for got, want, what in zip(grads, (x64.grad, gate_w.grad, down_w.grad), ("x", "gate_proj", "down_proj")):
            assert_close(got, want, F32, f"MLP grad of {what} at length {length}")
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles of the MLP over lengths {LENGTHS}"
    torch._dynamo.reset()


# ------------------------------------------------------------------- Triton: what plan() chooses
# A GPU as the plans see one (tests/test_plans.py's H100) and the CPU interpreter.
def _devices():
    from fused_kernels._gpu import OFF_GPU, DeviceFacts

    return {"cpu": OFF_GPU, "h100": DeviceFacts(True, 132, (9, 0), 233472, True)}


# 314 lengths from 1 to 140000, about evenly spaced in log; 143 of them between 1000 and 70000
ALL_LENGTHS = sorted({round(10 ** (i * math.log10(140000) / 399)) for i in range(400)})
LONG = [n for n in ALL_LENGTHS if 1000 <= n <= 70000]
# What a power-of-two bucketing allows: one value per power of two the lengths span, and one more.
BOUND_ALL = math.ceil(math.log2(ALL_LENGTHS[-1])) + 2
BOUND_LONG = math.ceil(math.log2(70000 / 1000)) + 2


def _compiled_part(config):
    """The part of a plan's config that reaches a kernel as constexprs (a new binary per value): the
    grid sizes (programs, clusters, row groups) are runtime values and are left out."""
    from fused_kernels._gpu import ClusterLaunch
    from fused_kernels.ops import glu_config, layer_norm_config

    if isinstance(config, ClusterLaunch):
        return config.shape
    if isinstance(config, glu_config.GluConfig):
        return config._replace(programs=None)
    if isinstance(config, layer_norm_config.LayerNormConfig):
        return dataclasses.replace(config, fwd_programs=None, bwd_programs=None,
                                   param_grid=config.param_grid and config.param_grid[:3],
                                   bwd_cluster=config.bwd_cluster and config.bwd_cluster.shape)
    return config


def _rms_norm_key(n_cols, direction):
    from fused_kernels.ops import rms_norm_config as rc

    def key(n, device):
        p = rc.plan(rc.Call(n, n_cols, BF16, BF16, direction, dy_dtype=BF16), device)
        # config None: triton.autotune picks, keyed by the row count's bucket
        return p.path, _compiled_part(p.config), rc._row_bucket(n) if p.config is None else None
    return key


def _rope_key(n, device):
    from fused_kernels.ops import rope_config as rc

    p = rc.plan(rc.Call(n, 32, 8, 128), device)
    return p.path, p.config, rc._token_bucket(n) if p.config is None else None


def _glu_key(rows_path):
    from fused_kernels.ops import glu_config as gc

    def key(n, device):
        call = (gc.Call(n, 14336, 2, "fwd", row_strides=(28672, 28672, 14336)) if rows_path
                else gc.Call(1, n * 14336, 2, "fwd"))  # contiguous operands: one flat row
        return _compiled_part(gc.plan(call, device).config)
    return key


def _layer_norm_key(direction):
    from fused_kernels.ops import layer_norm_config as lc

    def key(n, device):
        p = lc.plan(lc.Call(n, 4096, BF16, direction, weight_dtype=BF16, dy_dtype=BF16), device)
        return p.path, _compiled_part(p.config)
    return key


def _cross_entropy_key(v):
    from fused_kernels.ops import cross_entropy_config as cc

    def key(n, device):
        p = cc.plan(cc.Call(n, v, BF16, BF16), device)
        return p.path, p.config
    return key


def _flce_key(v):
    """The cross-entropy launches of fused_linear_cross_entropy's chunks: chunk rows are runtime values,
    but the cross-entropy plan reads them."""
    from fused_kernels.ops import cross_entropy_config as cc
    from fused_kernels.ops import fused_linear_cross_entropy_config as fc

    def key(n, device):
        rows = fc.plan(fc.Call(n, v, 2), device).config
        chunk_sizes = {min(rows, n - start) for start in range(0, n, rows)}
        return frozenset((p.path, p.config) for p in (cc.plan(cc.Call(r, v, BF16, BF16), device)
                                                      for r in chunk_sizes))
    return key


PLAN_KEYS = {
    **{f"rms_norm {n_cols} {d}": _rms_norm_key(n_cols, d) for n_cols in (4096, 16384, 65536)
       for d in ("forward", "backward")},
    "rope 32/8 heads x 128": _rope_key,
    "swiglu flat": _glu_key(False),
    "swiglu gate_up halves": _glu_key(True),
    "layer_norm forward": _layer_norm_key("forward"),
    "layer_norm backward": _layer_norm_key("backward"),
    **{f"cross_entropy V={v}": _cross_entropy_key(v) for v in (32000, 128256)},
    **{f"fused_linear_cross_entropy V={v}": _flce_key(v) for v in (32000, 128256)},
}


@pytest.mark.parametrize("name", sorted(PLAN_KEYS))
def test_plans_choose_from_a_bounded_set_across_lengths(name):
    """A constexpr or autotuning key taken from the length itself compiles (or tunes) once per length;
    plan() must bucket it. Across 314 lengths (1 .. 140000) at most one choice per power of two."""
    key = PLAN_KEYS[name]
    for device_name, device in _devices().items():
        chosen = {key(n, device) for n in ALL_LENGTHS}
        long = {key(n, device) for n in LONG}
        assert len(chosen) <= BOUND_ALL and len(long) <= BOUND_LONG, (
            f"{name} on {device_name}: {len(chosen)} launch configs / autotuning keys over {len(ALL_LENGTHS)} "
            f"lengths (at most {BOUND_ALL}), {len(long)} over {len(LONG)} lengths in 1000..70000 (at most "
            f"{BOUND_LONG}); e.g. {sorted(map(str, long))[:4]}")
