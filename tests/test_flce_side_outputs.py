"""Side outputs of the fused linear cross entropy, so training metrics need no [tokens, vocab] tensor:
the kernel's `stats` (per-token loss, top-1) against float64 references, and a patched model's
training output: `token_loss` / `is_top1` attributes and the LazyLogits in the logits slot
(AUTOPATCH_RETURN_LOGITS=auto), computed only when read, then equal to the plain model's logits and
differentiable like them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_kernels as fk
import stack_worker
from helpers import assert_close

from autopatch import patching
from autopatch.config import load_settings
from autopatch.rules._lazy_logits import LazyLogits
from autopatch.session import current

F32 = torch.float32


def _reference(h, w, b, t, scale, softcap):
    z = h.double() @ w.double().T + (0 if b is None else b.double())
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


@pytest.mark.parametrize("scale,softcap,bias", [(1.0, None, False), (0.5, 3.0, True), (-2.0, None, False)])
def test_kernel_stats_token_loss_and_top1(scale, softcap, bias):
    g = torch.Generator().manual_seed(0)
    n, hdim, v = 40, 16, 24
    h = torch.randn(n, hdim, generator=g).requires_grad_()
    w = torch.randn(v, hdim, generator=g).requires_grad_()
    b = torch.randn(v, generator=g) if bias else None
    z = _reference(h, w, b, None, scale, softcap)
    # half the targets are the arg-max, the rest random, a few ignored: top-1 is neither all nor none
    t = torch.where(torch.arange(n) % 2 == 0, z.argmax(-1), torch.randint(0, v, (n,), generator=g))
    t[::7] = -100
    stats = {"token_loss": None, "is_top1": None}
    loss = fk.fused_linear_cross_entropy(h, w, t, bias=b, logit_scale=scale, softcap=softcap, stats=stats)
    ref_rows = F.cross_entropy(z, t, reduction="none")  # 0 at ignored targets
    assert_close(stats["token_loss"], ref_rows, F32, "token_loss")
    assert stats["token_loss"].dtype == torch.float32 and not stats["token_loss"].requires_grad
    top = (z.argmax(-1) == t) & (t != -100)
    assert torch.equal(stats["is_top1"], top), (stats["is_top1"], top)
    assert 0 < int(top.sum()) < int((t != -100).sum())
    assert_close(loss, ref_rows.sum() / (t != -100).sum(), F32, "loss")
    loss.backward()  # the stats take nothing from the gradients
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_kernel_stats_reduction_none_keeps_its_own_copy():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 5, 8, generator=g), torch.randn(12, 8, generator=g)
    t = torch.randint(0, 12, (2, 5), generator=g)
    stats = {"token_loss": None}
    rows = fk.fused_linear_cross_entropy(h, w, t, reduction="none", stats=stats)
    assert stats["token_loss"].shape == (2, 5) and "is_top1" not in stats or stats.get("is_top1") is None
    assert torch.equal(stats["token_loss"], rows) and stats["token_loss"].data_ptr() != rows.data_ptr()
    with pytest.raises(ValueError, match="token_loss.*is_top1"):
        fk.fused_linear_cross_entropy(h, w, t, stats={"accuracy": None})


@pytest.fixture
def mode(monkeypatch):
    def set_mode(value):
        # apply() reads the environment, unless the import hooks began the session (their settings hold)
        monkeypatch.setenv("AUTOPATCH_RETURN_LOGITS", value)
        monkeypatch.setattr(current(), "settings", load_settings({"AUTOPATCH_RETURN_LOGITS": value}))

    current().reset_runs()  # notices are once per session
    set_mode("auto")
    yield set_mode
    patching.restore_all()


def _batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _shifted(labels):
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def test_model_side_outputs_and_lazy_logits(mode, capsys):
    import autopatch

    model = stack_worker.tiny_llama()
    model.train()
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels)
    (ref.loss + 0.3 * ref.logits.logsumexp(-1).mean()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    autopatch.apply(model, fused_linear_cross_entropy=True)
    before = fk.launch_counts().get("fused_linear_cross_entropy_fwd", 0)
    out = model(input_ids=ids, labels=labels)
    assert fk.launch_counts().get("fused_linear_cross_entropy_fwd", 0) == before + 1
    logits = out.logits
    assert isinstance(logits, LazyLogits) and logits._value is None
    assert logits.shape == ref.logits.shape and logits.dtype == ref.logits.dtype and logits.device == ref.logits.device
    assert logits.size(-1) == 256 and logits.dim() == 3 and "computed=False" in repr(logits)
    assert logits.float()._value is None, "a same-dtype cast computes nothing"
    assert logits._value is None, "metadata, repr and casts must not compute the logits"
    assert list(out.keys()) == list(ref.keys()) and len(out.to_tuple()) == len(ref.to_tuple())

    shift = _shifted(labels)
    ref_rows = F.cross_entropy(ref.logits.double().reshape(-1, 256), shift.reshape(-1), reduction="none")
    assert out.token_loss.shape == labels.shape
    assert_close(out.token_loss, ref_rows.reshape(labels.shape), F32, "token_loss")
    assert torch.equal(out.is_top1, (ref.logits.argmax(-1) == shift) & (shift != -100))
    assert "token_loss" not in out.keys(), "side outputs are attributes, not fields"
    assert_close(out.loss, ref.loss, F32, "loss")

    # reading the logits computes them once, differentiably: a loss built on them trains as plain
    assert capsys.readouterr().err.count("logits were read") == 0
    extra = 0.3 * logits.logsumexp(-1).mean()
    assert logits._value is not None and not isinstance(logits._value, LazyLogits)
    assert_close(logits._value, ref.logits, F32, "computed logits")
    (out.loss + extra).backward()
    for name, g in ref_grads.items():
        assert_close(model.get_parameter(name).grad, g, F32, f"grad {name} through loss + f(logits)")
    assert capsys.readouterr().err.count("logits were read, so they were computed") == 1


def test_accelerate_fp32_conversion_does_not_compute_the_logits(mode):
    pytest.importorskip("accelerate")
    from accelerate.utils import convert_to_fp32

    import autopatch

    model = stack_worker.tiny_llama().to(torch.bfloat16)
    model.train()
    ids, labels = _batch()
    autopatch.apply(model, fused_linear_cross_entropy=True)
    out = model(input_ids=ids, labels=labels)
    assert isinstance(out.logits, LazyLogits) and out.logits.dtype == torch.bfloat16
    converted = convert_to_fp32(out)
    assert isinstance(converted.logits, LazyLogits) and converted.logits.dtype == torch.float32
    assert out.logits._value is None and converted.logits._value is None
    ref = model.lm_head(model.model(input_ids=ids).last_hidden_state).float()
    assert_close(converted.logits.detach(), ref, torch.bfloat16, "converted logits")


@pytest.mark.parametrize("value", ["false", "true"])
def test_return_logits_false_and_true(mode, value):
    import autopatch

    mode(value)
    model = stack_worker.tiny_llama()
    model.train()
    ids, labels = _batch()
    autopatch.apply(model, fused_linear_cross_entropy=True)
    out = model(input_ids=ids, labels=labels)
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    if value == "false":
        assert out.logits is None and tup[1] is None
        assert out.is_top1 is None, "false skips the top-1 read"
    else:
        assert type(out.logits) is torch.Tensor and not out.logits.requires_grad
        assert torch.equal(out.is_top1, (out.logits.argmax(-1) == _shifted(labels)) & (_shifted(labels) != -100))
    assert out.token_loss.shape == labels.shape and torch.isfinite(out.token_loss).all()
    assert out.token_loss[_shifted(labels) == -100].eq(0).all()


# ----------------------------------------------------------------------------------------------
# Distribution statistics (entropy, log Σ p², mean logit): what TRL's fused head reports, forward-only

from fused_kernels.ops import fused_linear_cross_entropy as _flce
_DIST = ("entropy", "log_sum_sq_probs", "mean_logits")


def _dist_reference(z):
    logp = z.log_softmax(-1)
    return {"entropy": -(logp.exp() * logp).sum(-1), "log_sum_sq_probs": torch.logsumexp(2 * logp, -1),
            "mean_logits": z.mean(-1)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,softcap,bias", [(1.0, None, False), (3.0, None, True), (0.8, 2.5, False)])
def test_kernel_stats_distribution(dtype, scale, softcap, bias, monkeypatch):
    """V = 4500 spans two blocks of the sweep (the running max moves between them); chunks of 16 rows;
    logits up to ~±40 at scale 3 (the entropy without lse − Σ p·z cancellation); ignored tokens are 0.
    The statistics are defined on the logits chunk, which is in the inputs' dtype: for bf16 the float64
    reference takes hidden @ weight.T + bias rounded to bf16 once, as the GEMM writes it (at |z| ≈ 40
    that rounding alone moves a peaked entropy by ~1 %, for TRL's bf16 tile too)."""
    monkeypatch.setitem(_flce._CONFIG, "chunk_rows", 16)
    g = torch.Generator().manual_seed(3)
    n, hdim, v = 45, 16, 4500
    h = (torch.randn(n, hdim, generator=g) * 0.7).to(dtype)
    w = (torch.randn(v, hdim, generator=g) * 0.7).to(dtype)
    b = (torch.randn(v, generator=g)).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::6] = -100
    stats = {name: None for name in _DIST}
    rows = fk.fused_linear_cross_entropy(h, w, t, bias=b, reduction="none", logit_scale=scale, softcap=softcap,
                                         stats=stats)
    z = _reference(h, w, b, t, scale, softcap)
    z_chunk = (h.double() @ w.double().T + (0 if b is None else b.double())).to(dtype).double() * scale
    if softcap is not None:
        z_chunk = softcap * torch.tanh(z_chunk / softcap)
    keep = t != -100
    for name, ref in _dist_reference(z_chunk).items():
        got = stats[name]
        assert got.dtype == torch.float32 and got.shape == (n,) and not got.requires_grad, name
        assert torch.equal(got[~keep], torch.zeros_like(got[~keep])), name
        assert float(ref[keep].abs().min()) > 0, name  # no zero compared
        assert_close(got[keep], ref[keep], dtype, name)
    assert_close(rows, F.cross_entropy(z, t, reduction="none"), dtype, "token losses")


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_kernel_stats_temperature_via_scale_and_softcap(softcap):
    """A temperature T as TRL applies it, z = (c·tanh(s·x / c)) / T, is logit_scale = s / T and
    softcap = c / T here: the log-probabilities (−loss) and every statistic of softmax(z)."""
    g = torch.Generator().manual_seed(4)
    n, hdim, v, s, temperature = 30, 12, 700, 1.5, 0.6
    h, w = torch.randn(n, hdim, generator=g), torch.randn(v, hdim, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    x = h.double() @ w.double().T * s
    z = (softcap * torch.tanh(x / softcap) if softcap else x) / temperature
    stats = {name: None for name in _DIST}
    rows = fk.fused_linear_cross_entropy(h, w, t, reduction="none", logit_scale=s / temperature,
                                         softcap=softcap / temperature if softcap else None, stats=stats)
    assert_close(-rows, z.log_softmax(-1).gather(-1, t[:, None])[:, 0], F32, "log_probs")
    for name, ref in _dist_reference(z).items():
        assert_close(stats[name], ref, F32, name)


def test_kernel_stats_distribution_leave_the_loss_and_gradients_alone(monkeypatch):
    """The statistics are forward-only and change nothing else: the per-token losses and the gradients
    of Σ g·loss (reduction "none", the backward recomputes) are the same with and without them, and the
    default call never launches the statistics kernel."""
    g = torch.Generator().manual_seed(5)
    n, hdim, v = 24, 8, 300
    h0, w0 = torch.randn(n, hdim, generator=g), torch.randn(v, hdim, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[5] = -100
    up = torch.rand(n, generator=g) + 0.5
    results = []
    calls = []
    real = _flce._side_stats_
    monkeypatch.setattr(_flce, "_side_stats_", lambda *a: (calls.append(1), real(*a)))
    for stats in (None, {name: None for name in _DIST}):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        rows = fk.fused_linear_cross_entropy(h, w, t, reduction="none", stats=stats)
        (rows * up).sum().backward()
        results.append((rows.detach(), h.grad, w.grad))
        assert len(calls) == (0 if stats is None else 1), calls  # one chunk: one launch, forward only
    for a, b in zip(*results):
        assert torch.equal(a, b)
    z = h0.double() @ w0.double().T
    ref = F.cross_entropy(z, t, reduction="none")
    assert float(ref.abs().min()) == 0.0 and float(ref.abs().max()) > 0  # the ignored token only
    assert_close(results[0][0], ref, F32, "token losses")


def test_kernel_stats_distribution_every_name_and_validation():
    """One call fills every side output; an unknown name is refused, naming the known ones."""
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(2, 7, 8, generator=g), torch.randn(50, 8, generator=g)
    t = torch.randint(0, 50, (2, 7), generator=g)
    stats = {name: None for name in ("token_loss", "is_top1") + _DIST}
    loss = fk.fused_linear_cross_entropy(h, w, t, stats=stats)
    z = h.double() @ w.double().T
    for name, ref in _dist_reference(z).items():
        assert stats[name].shape == (2, 7), name
        assert_close(stats[name], ref, F32, name)
    assert_close(loss, F.cross_entropy(z.reshape(-1, 50), t.reshape(-1)), F32, "loss")
    with pytest.raises(ValueError, match="entropy, log_sum_sq_probs, mean_logits"):
        fk.fused_linear_cross_entropy(h, w, t, stats={"perplexity": None})


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_kernel_stats_distribution_real_vocab(temperature):
    """The compiled sweep at Qwen3's head (V = 151936, several chunks): entropy, log Σ p² and the mean
    logit of 256 rows against float64 of the bf16 logits chunk, ignored rows 0, the token losses the
    same as without the statistics, and is_top1 from the sweep the same as from the arg-max path."""
    g = torch.Generator(device="cuda").manual_seed(7)
    n, hdim, v = 4096, 1024, 151936
    h = torch.randn(n, hdim, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    with torch.no_grad():
        t[::2] = (h[::2] @ w.T).argmax(-1)  # half the targets top-1
    t[1::97] = -100
    stats = {name: None for name in _DIST + ("is_top1",)}
    rows = fk.fused_linear_cross_entropy(h, w, t, reduction="none", logit_scale=1 / temperature, stats=stats)
    alone = {"is_top1": None}
    plain = fk.fused_linear_cross_entropy(h, w, t, reduction="none", logit_scale=1 / temperature, stats=alone)
    assert torch.equal(rows, plain)
    assert torch.equal(stats["is_top1"], alone["is_top1"]) and 0 < int(alone["is_top1"].sum()) < n
    k = 256
    z = (h[:k].double() @ w.double().T).to(torch.bfloat16).double() / temperature
    keep = t[:k] != -100
    for name, ref in _dist_reference(z).items():
        got = stats[name][:k]
        assert torch.equal(got[~keep], torch.zeros_like(got[~keep])), name
        assert float(ref[keep].abs().min()) > 0, name
        assert_close(got[keep], ref[keep], torch.bfloat16, name, tol=1e-3)
    assert bool(torch.isfinite(torch.stack([stats[name] for name in _DIST])).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,softcap", [(1.0, None), (-2.0, None), (0.5, 3.0), (0.0, None)])
def test_kernel_stats_top1_from_the_sweep(dtype, scale, softcap, monkeypatch):
    """With a distribution statistic asked for, is_top1 comes from the same sweep (scale 0 excepted):
    the same as the arg-max path gives alone and as float64's first arg-max, over two blocks of
    the sweep, several chunks, ignored targets, and an exact tie (the first of two equal maxima wins)."""
    monkeypatch.setitem(_flce._CONFIG, "chunk_rows", 8)
    g = torch.Generator().manual_seed(8)
    n, hdim, v = 33, 16, 4500
    h = torch.randn(n, hdim, generator=g)
    w = torch.randn(v, hdim, generator=g) * 0.5
    h[1] = h[0]
    w[10] = w[4200] = h[0] * (-2 if scale < 0 else 2)  # rows 0 and 1: classes 10 and 4200 tie at the top
    h, w = h.to(dtype), w.to(dtype)
    z = _reference(h, w, None, None, scale, softcap)
    # the order of the raw logits chunk, in the inputs' dtype (bf16 rounding can tie two close maxima;
    # a rounded tanh could tie distinct logits, so not z's order)
    x = (h.double() @ w.double().T).to(dtype).double()
    key = -x if scale < 0 else x
    t = torch.where(torch.arange(n) % 2 == 0, key.argmax(-1), torch.randint(0, v, (n,), generator=g))
    t[0], t[1] = 4200, 10
    t[5::9] = -100
    seen = []
    monkeypatch.setattr(_flce, "_top1_", lambda *a, real=_flce._top1_: (seen.append(1), real(*a)))
    alone = {"is_top1": None}
    fk.fused_linear_cross_entropy(h, w, t, logit_scale=scale, softcap=softcap, stats=alone)
    assert seen, "is_top1 alone takes the arg-max path"
    seen.clear()
    both = {"is_top1": None, "entropy": None}
    fk.fused_linear_cross_entropy(h, w, t, logit_scale=scale, softcap=softcap, stats=both)
    assert bool(seen) == (scale == 0), "with a statistic, is_top1 comes from the sweep unless the scale is 0"
    if scale == 0:
        want = (t == 0)
    else:
        want = (key.argmax(-1) == t) & (t != -100)
        assert not bool(want[0]) and bool(want[1]), "the tie: the first maximum wins"
    assert 0 < int(want.sum()) < int((t != -100).sum()) or scale == 0
    assert torch.equal(alone["is_top1"], want), (alone["is_top1"], want)
    assert torch.equal(both["is_top1"], want), (both["is_top1"], want)
    assert_close(both["entropy"][t != -100], _dist_reference(z)["entropy"][t != -100],
                 dtype, "entropy", tol=1e-5 if dtype == torch.float32 else 2e-2)
