"""On a CUDA GPU: new sequence lengths build no new Triton binary per length.

Triton compiles a kernel once per combination of its constexpr values, its launch options (num_warps,
num_stages, ...) and the specialisation of its other arguments: an int by whether it is 1 or divisible
by 16 and by its width (i32 / i64), a pointer by 16-byte alignment. A constexpr computed from the length
would compile a binary per length; the int specialisations give a few variants at most.

rms_norm (hidden 4096), rope (32 q / 8 k heads of 128) and fused_linear_cross_entropy (hidden 2048,
V = 128256) run forward+backward in bf16 at 20 lengths of 1000 .. 70000 tokens. The binaries each
kernel compiled meanwhile are read from its JITFunction's cache (an autotuned kernel's: the
JITFunction under its Autotuner) and asserted:
  - at most 4 binaries share constexprs and launch options (the int and alignment specialisations);
  - no constexpr takes more than 8 values over the 20 lengths (one taken from the length takes ~20;
    one bucketed to powers of two, 7 in this range).
The autotuned kernels (rms_norm's, rope's) tune again per power-of-two bucket of the row count (7 here)
among the same few candidates, each compiled once per specialisation; the non-autotuned ones build at
most 4 binaries per launch shape of their plan.

A tiny Llama patched by autopatch, compiled with inductor and trained at five lengths, compiles no
more graphs than the same model unpatched.
"""

from __future__ import annotations

import collections

import pytest
import torch

from helpers import assert_close

pytestmark = pytest.mark.gpu

BF16, F32 = torch.bfloat16, torch.float32
# 20 lengths over 1000 .. 70000, some multiples of 16 and some not, in 8 power-of-two buckets
LENGTHS = (1000, 1337, 2048, 2900, 4096, 5003, 7777, 8192, 11111, 16000,
           16385, 21000, 30001, 32768, 40000, 47999, 50021, 60000, 65536, 70000)
MAX_PER_SHAPE = 4  # binaries sharing constexprs and launch options
MAX_VALUES = 8  # values of one constexpr over LENGTHS


# ---------------------------------------------------------------------------- reading Triton's caches
def _kernels(*modules) -> dict:
    """{"module.kernel": JITFunction} of every Triton and Gluon kernel the modules define (an autotuned
    kernel: the JITFunction under its Autotuner / Heuristics, found through their `.fn`)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for module in modules:
        for value in list(vars(module).values()):
            fn = value
            for _ in range(4):
                if isinstance(fn, JITFunction) or not hasattr(fn, "fn"):
                    break
                fn = fn.fn
            if isinstance(fn, JITFunction):
                name = getattr(fn, "__name__", None) or getattr(fn.fn, "__name__", repr(fn))
                found.setdefault(f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{name}", fn)
    return found


def _binaries(fn) -> dict:
    """{(device, cache key): CompiledKernel} of every binary `fn` holds. Triton >= 3.1 keeps them in
    fn.device_caches[device][0]; older releases in fn.cache[device]. Read without indexing, so that a
    device the kernel never ran on is not added to the defaultdict."""
    caches = getattr(fn, "device_caches", None)
    if isinstance(caches, dict):
        per_device = {device: entry[0] for device, entry in list(caches.items())}
    else:
        per_device = dict(getattr(fn, "cache", {}) or {})
    return {(device, key): kernel for device, cache in per_device.items() for key, kernel in list(cache.items())}


def _shape_of(fn, kernel) -> tuple:
    """(constexprs by name, launch options) of a compiled kernel: what makes one binary a launch shape of
    its own, apart from the int / alignment specialisations. Fails naming what it could not read."""
    constants = getattr(getattr(kernel, "src", None), "constants", None)
    metadata = getattr(kernel, "metadata", None)
    assert constants is not None and metadata is not None, (
        f"cannot read the constexprs of a compiled {type(kernel).__name__} (src.constants, metadata) in "
        f"this Triton; adapt _shape_of")
    names = [p.name for p in fn.params]
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    values = {}
    for key, value in constants.items():
        path = key if isinstance(key, tuple) else (key,)
        index = path[0]
        name = index if isinstance(index, str) else names[index] if index < len(names) else str(index)
        if len(path) == 1 and name in constexpr_names:  # not an int specialised to 1, nor a tuple element
            values[name] = repr(value)
    options = tuple((f, getattr(metadata, f, None)) for f in ("num_warps", "num_stages", "num_ctas", "maxnreg"))
    return tuple(sorted(values.items())), options


class NewBinaries:
    """The binaries the kernels of `modules` compile inside the `with` block, per kernel."""

    def __init__(self, *modules):
        self.kernels = _kernels(*modules)
        self.before = {}
        self.new = {}

    def __enter__(self):
        self.before = {name: set(_binaries(fn)) for name, fn in self.kernels.items()}
        return self

    def __exit__(self, *exc):
        for name, fn in self.kernels.items():
            added = {k: v for k, v in _binaries(fn).items() if k not in self.before[name]}
            if added:
                self.new[name] = (fn, added)
        return False

    def summary(self) -> str:
        lines = []
        for name, (fn, added) in sorted(self.new.items()):
            shapes = collections.Counter(_shape_of(fn, k) for k in added.values())
            lines.append(f"{name}: {len(added)} binaries, {len(shapes)} launch shapes, "
                         f"at most {max(shapes.values())} per shape")
        return "\n".join(lines) or "no new binaries"

    def check(self, what: str) -> None:
        report = f"{what}, {len(LENGTHS)} lengths {LENGTHS[0]}..{LENGTHS[-1]}:\n{self.summary()}"
        print(report)
        for name, (fn, added) in self.new.items():
            shapes = collections.Counter(_shape_of(fn, k) for k in added.values())
            crowded = {s: n for s, n in shapes.items() if n > MAX_PER_SHAPE}
            assert not crowded, (f"{name}: more than {MAX_PER_SHAPE} binaries of one launch shape (an int argument "
                                 f"specialised per length?): {crowded}\n{report}")
            per_name = collections.defaultdict(set)
            for constexprs, _options in shapes:
                for cname, value in constexprs:
                    per_name[cname].add(value)
            spread = {c: sorted(v) for c, v in per_name.items() if len(v) > MAX_VALUES}
            assert not spread, (f"{name}: a constexpr takes more than {MAX_VALUES} values over the lengths (taken "
                                f"from the length?): {spread}\n{report}")


# ------------------------------------------------------------------------------------- the ops
def _finite(*tensors, what: str) -> None:
    for i, t in enumerate(tensors):
        assert t is not None and bool(torch.isfinite(t).all()), f"{what}: tensor {i} has NaN / inf or is missing"


def test_rms_norm_binaries_stay_bounded():
    import fused_kernels as fk
    from fused_kernels.ops import norm_smem, rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(BF16).requires_grad_()
    with NewBinaries(rms_norm, norm_smem) as built:
        for length in LENGTHS:
            x = torch.randn(1, length, 4096, device="cuda", generator=gen).to(BF16).requires_grad_()
            y = fk.rms_norm(x, weight, 1e-6)
            dy = torch.randn(y.shape, device="cuda", generator=gen).to(BF16)
            y.backward(dy)
            _finite(y, x.grad, weight.grad, what=f"rms_norm at {length}")
            if length == LENGTHS[0]:  # the numbers, once: float64 on the first rows
                x64 = x.detach()[0, :256].double()
                ref = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16).double() \
                    * weight.detach().double()
                assert_close(y.detach()[0, :256].double(), ref, BF16, "rms_norm output")
            weight.grad = None
    torch.cuda.synchronize()
    built.check("rms_norm 4096 bf16 forward+backward")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def test_rope_binaries_stay_bounded():
    import fused_kernels as fk
    from fused_kernels.ops import rope

    gen = torch.Generator(device="cuda").manual_seed(1)
    with NewBinaries(rope) as built:
        for length in LENGTHS:
            q = torch.randn(1, length, 32, 128, device="cuda", generator=gen).to(BF16).requires_grad_()
            k = torch.randn(1, length, 8, 128, device="cuda", generator=gen).to(BF16).requires_grad_()
            angles = torch.rand(1, length, 64, device="cuda", generator=gen) * 6.0
            angles = torch.cat((angles, angles), -1)
            cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
            q_out, k_out = fk.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            torch.autograd.backward((q_out, k_out), (torch.ones_like(q_out), torch.ones_like(k_out)))
            _finite(q_out, k_out, q.grad, k.grad, what=f"rope at {length}")
            if length == LENGTHS[0]:
                q64 = q.detach().transpose(1, 2).double()
                c, s = cos.double()[:, None], sin.double()[:, None]
                assert_close(q_out.detach().double(), q64 * c + _rotate_half(q64) * s, BF16, "rope q output")
    torch.cuda.synchronize()
    built.check("rope 32/8 heads x 128 bf16 forward+backward")


def test_fused_linear_cross_entropy_binaries_stay_bounded():
    import fused_kernels as fk
    from fused_kernels.ops import cross_entropy, cross_entropy_smem, fused_linear_cross_entropy

    gen = torch.Generator(device="cuda").manual_seed(2)
    weight = (0.02 * torch.randn(128256, 2048, device="cuda", generator=gen)).to(BF16).requires_grad_()
    with NewBinaries(cross_entropy, cross_entropy_smem, fused_linear_cross_entropy) as built:
        for length in LENGTHS:
            hidden = torch.randn(length, 2048, device="cuda", generator=gen).to(BF16).requires_grad_()
            target = torch.randint(0, 128256, (length,), device="cuda", generator=gen)
            target[:7] = -100
            loss = fk.fused_linear_cross_entropy(hidden, weight, target)
            loss.backward()
            _finite(loss, hidden.grad, weight.grad, what=f"fused_linear_cross_entropy at {length}")
            if length == LENGTHS[0]:
                logits = hidden.detach().double() @ weight.detach().double().T
                ref = torch.nn.functional.cross_entropy(logits, target)
                assert_close(loss.detach().double(), ref, BF16, "fused_linear_cross_entropy loss")
                del logits
            weight.grad = None
    torch.cuda.synchronize()
    built.check("fused_linear_cross_entropy 2048 -> 128256 bf16 forward+backward")


# ---------------------------------------------------------------------------- a whole model, inductor
def _tiny_llama():
    from stack_worker import PAD_ID, TINY_LLAMA
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA, "max_position_embeddings": 256}, pad_token_id=PAD_ID)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().cuda()


def _train_compiled(model) -> tuple[int, list]:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    model.train()
    steps = []
    for i, length in enumerate((17, 33, 64, 100, 129)):
        gen = torch.Generator().manual_seed(300 + i)
        ids = torch.randint(3, 256, (2, length), generator=gen).cuda()
        labels = ids.clone()
        labels[0, : length // 4] = -100
        model.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, labels=labels)
        out.loss.backward()
        steps.append((length, out.loss.detach().clone(),
                      {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch._dynamo.reset()
    return counter.frame_count, steps


def test_patched_tiny_llama_inductor_compiles_no_more_than_plain(restore_patches):
    import autopatch

    plain_compiles, plain_steps = _train_compiled(_tiny_llama())
    model = _tiny_llama()
    patched = {r.kernel for r in autopatch.apply(model) if r.patched}
    assert patched >= {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"}, patched
    compiles, steps = _train_compiled(model)
    print(f"inductor, tiny Llama at 5 lengths: plain {plain_compiles} compiles, patched {compiles}")
    assert compiles <= plain_compiles, (
        f"patched: {compiles} compiles, plain: {plain_compiles} (TORCH_LOGS=recompiles says which guard failed)")
    for (length, loss, grads), (_, plain_loss, plain_grads) in zip(steps, plain_steps):
        assert_close(loss, plain_loss, F32, f"loss at length {length}")
        for name, grad in plain_grads.items():
            assert_close(grads[name], grad, F32, f"grad {name} at length {length}")
