"""Host offload of saved activations (autopatch.offload, AUTOPATCH_OFFLOAD) on the CPU through the copy
target (the pack/unpack path with a separate CPU tensor as the host): loss and every gradient equal to
the plain model, exactly, on a tiny Llama without checkpointing and under both kinds of HF gradient
checkpointing (there: each layer's input is what goes), with LoRA, with the tiled MLP; layers brought
back a layer ahead where the target has room, at their own backward where not; a device copy let go
once the nodes that saved it have it; parameters and small tensors kept; the "auto" budget; the host
check's one line.
GPU tests (marked `gpu`): the pinned-memory, side-stream path, equal gradients, a lower peak."""

from __future__ import annotations

import types
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("transformers")

from autopatch import offload  # noqa: E402
from helpers import rel_err  # noqa: E402
from autopatch.config import load_settings  # noqa: E402

ON = types.SimpleNamespace(offload="true")
AUTO = types.SimpleNamespace(offload="auto")


def _tiny_llama(device="cpu", dtype=torch.float32, hidden=64, layers=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=1 << 16,
                         use_cache=False)
    config._attn_implementation = "eager"  # deterministic on a GPU too (sdpa's backward may use atomics)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).train()


def _checkpointing(model, reentrant):
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _step(model, ids, set_to_none=True, before_backward=lambda: None):
    model.zero_grad(set_to_none=set_to_none)
    loss = model(input_ids=ids, labels=ids).loss
    before_backward()
    loss.backward()
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a, b, tol=0.0):
    """Equal loss and gradients: exactly (tol 0), or within a relative `tol` (GPU kernels)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, x, y in [("loss", loss_a, loss_b)] + [(n, grads_a[n], grads_b[n]) for n in grads_a]:
        if tol == 0.0:
            assert torch.equal(x, y), name
        else:
            assert rel_err(x, y) <= tol, (name, rel_err(x, y))


def _ids(batch=2, seq=16, seed=1):
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _install(model, settings=ON, budget=0):
    off = offload.install(model, None, settings, target=offload.CopyTarget(budget))
    off.min_bytes = 1  # the tiny model's activations are far under 1 MiB
    off.trace = []
    return off


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "grad-ckpt", "grad-ckpt-reentrant"])
def test_loss_and_every_gradient_equal(reentrant):
    model = _checkpointing(_tiny_llama(), reentrant)
    ids = _ids()
    plain = _step(model, ids)
    off = _install(model)
    got = _step(model, ids)
    _assert_same(got, plain)
    assert off.stats["forwards"] == 1
    assert off.stats["offloaded"] > 0 and off.stats["fetched"] == off.stats["offloaded"]
    assert off.host_used == 0  # every host copy released once the backward used it
    by_layer = {}
    for event in off.trace:
        if event[0] == "offload":
            by_layer.setdefault(event[1], []).append(event[2])
    assert {0, 1} <= by_layer.keys()
    if reentrant is not None:
        # outside the recompute, a checkpointed layer saves only its input
        assert by_layer[0] == [(2, 16, 64)] and by_layer[1][0] == (2, 16, 64)
    else:
        assert len(by_layer[0]) > 10  # every activation of the layer
    _assert_same(_step(model, ids), plain)  # and again: nothing left over from the first step


def test_the_previous_layer_comes_back_while_this_one_runs_backward():
    model = _tiny_llama(layers=4)
    off = _install(model)
    _step(model, _ids())
    first_get = {}
    first_fetch = {}
    for i, (kind, layer, *_) in enumerate(off.trace):
        if kind == "get":
            first_get.setdefault(layer, i)
        elif kind == "fetch":
            first_fetch.setdefault(layer, i)
    for layer in (0, 1, 2):
        # fetched after the backward reached the layer above, before its own first use
        assert first_get[layer + 1] < first_fetch[layer] < first_get[layer], (layer, off.trace)


class _Block(nn.Module):
    """A checkpointed block whose recompute keeps no reference to its input: y = exp(x / 2) · w (a
    multiply by a number saves nothing, exp keeps its output). `seen` runs when the gradient of the
    forward's y is ready: the block's recompute is done and its backward still under way."""

    def __init__(self, n, seed, seen):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
        self.seen = seen

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)

    def body(self, x):
        y = (x * 0.5).exp()
        if torch.is_grad_enabled() and not getattr(self, "recomputing", False):
            y.register_hook(lambda g: self.seen(self))
        self.recomputing = True  # the next call of body is the backward's recompute
        return y * self.w


class _Blocks(nn.Module):
    def __init__(self, n=4096, depth=3, seen=lambda block: None):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.75))  # the first block's input requires grad too
        self.layers = nn.ModuleList(_Block(n, i, seen) for i in range(depth))

    def forward(self, x):
        x = x * self.scale
        for layer in self.layers:
            layer.recomputing = False
            x = layer(x)
        return (x * x).sum()


class _Watched(offload.CopyTarget):
    """The copy target remembering each device copy it made (weakly), in order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.copies = []

    def to_device(self, host, after):
        dev, done = super().to_device(host, after)
        self.copies.append(weakref.ref(dev))
        return dev, done


def _blocks_step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_a_device_copy_goes_once_its_users_have_it():
    """A checkpointed block's input comes back for its recompute; the store then lets go of it, so that in
    the block's backward, after the recompute, no device copy made so far is alive (the store held each
    one until its block's backward ended: one layer input more in every layer's backward)."""
    alive = []
    target = _Watched(room_bytes=0)  # no prefetch: only the block's own input is on the device

    def seen(block):
        alive.append(sum(ref() is not None for ref in target.copies))

    model = _Blocks(seen=seen)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9))
    plain = _blocks_step(model, x)
    alive.clear()
    off = offload.install(model, None, ON, target=target)
    off.min_bytes = 1
    _assert_same(_blocks_step(model, x), plain)
    # each block's input, the model's input and its output (saved twice by x·x: one copy)
    assert off.stats["offloaded"] == off.stats["fetched"] == len(target.copies) == 5
    assert alive == [0, 0, 0], alive  # [1, 1, 1] while the store kept them


def test_the_previous_layer_waits_where_the_gpu_has_no_room_for_it():
    """The previous layer comes back early only where the target's room, less one layer's backward
    working set, holds it; otherwise when its own backward asks. Equal loss and gradients either way."""
    ids = _ids()
    plain = _step(_checkpointing(_tiny_llama(layers=4), False), ids)
    working = offload.working_bytes(_tiny_llama(layers=4), (), {"input_ids": ids})
    layer_input = 2 * 16 * 64 * 4  # each checkpointed layer saves its input, tokens × hidden × fp32
    for room, early in ((working + layer_input, True), (working + layer_input - 1, False), (0, False)):
        model = _checkpointing(_tiny_llama(layers=4), False)  # the same weights (seeded)
        off = offload.install(model, None, ON, target=offload.CopyTarget(room_bytes=room))
        off.min_bytes, off.trace = 1, []
        _assert_same(_step(model, ids), plain)
        fetch = {layer: i for i, (kind, layer, *_) in reversed(list(enumerate(off.trace))) if kind == "fetch"}
        get = {layer: i for i, (kind, layer, *_) in reversed(list(enumerate(off.trace))) if kind == "get"}
        for layer in (0, 1, 2):
            # early: fetched while the layer above ran its backward; else right at its own first use
            assert (fetch[layer] < get[layer]) == early, (room, layer, off.trace)
        assert early or {0, 1, 2} <= {layer for kind, layer, *_ in off.trace if kind == "later"}, off.trace


class _TraceToFirstLayer(list):
    """An offloader trace that marks when the backward first uses the first layer's tensors (`reached`),
    calling `measure` then (its value in `measured`): before it ran the backward of the layers above,
    each with a previous layer to bring back early."""

    def __init__(self, measure=lambda: None):
        super().__init__()
        self.measure, self.measured, self.reached = measure, None, False

    def append(self, event):
        if not self.reached and event[:2] == ("get", 0):
            self.reached, self.measured = True, self.measure()
        super().append(event)


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors made under it that are still alive, and their peak while `counting()`."""

    def __init__(self, counting):
        super().__init__()
        self.counting, self.live, self.peak, self.sizes = counting, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self.sizes:
                self.sizes[key] = nbytes
                self.live += nbytes
                weakref.finalize(storage, self._freed, key)
                if self.counting():
                    self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key):
        self.live -= self.sizes.pop(key, 0)


def test_no_room_for_the_previous_layer_holds_one_layer_input_less():
    """What waiting is for: through the backward of the layers above the first, the peak of what the
    backward makes is one layer input lower when the previous layer comes back at its own backward (no
    room) than when it comes back early. The first layer's backward has no previous layer to bring back
    (the whole backward's peak may lie there, the same either way): left out."""
    tokens, hidden = 512, 128
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(0))
    peaks, steps = {}, {}
    for room in (None, 0):
        model = _checkpointing(_tiny_llama(hidden=hidden, layers=4), False)
        _step(model, ids)  # the gradients allocated before the measured backward: both alike
        off = offload.install(model, None, ON, target=offload.CopyTarget(room_bytes=room))
        off.min_bytes = 1
        model.zero_grad(set_to_none=False)
        loss = model(input_ids=ids, labels=ids).loss
        off.trace = trace = _TraceToFirstLayer()
        with _LiveBytes(counting=lambda: not trace.reached) as live:
            loss.backward()
        peaks[room] = live.peak
        steps[room] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        assert trace.reached and bool([e for e in trace if e[0] == "later"]) == (room == 0), trace
    _assert_same(steps[0], steps[None])
    assert peaks[None] - peaks[0] == tokens * hidden * 4, peaks  # one layer input, fp32


def test_parameters_views_of_them_and_small_tensors_stay():
    off = offload.install(nn.Linear(4, 4), None, ON, target="copy")
    weight = nn.Parameter(torch.randn(1024, 512))
    big = torch.randn(1024, 512)  # 2 MiB
    assert off.candidate(big) and off.candidate(big.t()) and off.candidate(big * 2)
    assert not off.candidate(weight) and not off.candidate(weight.t()) and not off.candidate(weight[:, :300])
    leaf = torch.randn(1024, 512, requires_grad=True)
    assert not off.candidate(leaf)
    assert not off.candidate(torch.randn(100, 100))  # 40 KB: under MIN_BYTES
    model = _tiny_llama()
    off = offload.install(model, None, ON, target="copy")  # the default 1 MiB floor
    ids = _ids()
    _step(model, ids)
    assert off.stats["forwards"] == 1 and off.stats["offloaded"] == 0  # a tiny model's are all small


def test_not_in_eval_or_without_autograd():
    model = _tiny_llama()
    off = _install(model)
    ids = _ids()
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    assert off.stats["forwards"] == 0 and off.stats["offloaded"] == 0


def test_auto_keeps_what_fits_the_budget():
    model = _tiny_llama()
    ids = _ids()
    plain = _step(model, ids)
    off = _install(model, AUTO, budget=40_000)
    got = _step(model, ids)
    _assert_same(got, plain)
    assert off.stats["kept"] > 0 and off.stats["offloaded"] > 0
    off.target.budget_bytes = 1 << 40  # everything fits: nothing goes
    before = off.stats["offloaded"]
    _assert_same(_step(model, ids), plain)
    assert off.stats["offloaded"] == before


def test_lora_and_tiled_mlp_with_offload(monkeypatch):
    """LoRA on every linear layer, the tiled MLP on (the glu_mlp rule), gradient checkpointing: the
    combination the longest contexts run, equal to the same model without offload."""
    from peft import LoraConfig, get_peft_model

    from autopatch.rules import glu_mlp
    from autopatch.session import current
    from helpers import everything, modeling

    glu_mlp.RULE.patch_module(modeling("llama"), current(), everything)
    monkeypatch.setattr(current(), "settings", types.SimpleNamespace(tiled_mlp_tokens=8))
    try:
        base = _checkpointing(_tiny_llama(), False)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
        ids = _ids()
        plain = _step(model, ids)
        off = _install(base)
        _assert_same(_step(model, ids), plain)
        assert off.stats["offloaded"] > 0
    finally:
        from autopatch import patching

        patching.restore_all()


def test_lora_layer_zero_input_is_the_embedding_leaf_and_stays():
    """peft with checkpointing makes the frozen embedding's output a leaf that requires grad
    (enable_input_require_grads); autograd's AccumulateGrad holds that leaf, so it stays on the device
    and layer 0 has nothing to bring back: from the third layer on the backward holds one prefetched
    checkpoint that a 2-layer model does not (what a depth cut at 2 and 3 layers must not count per
    layer). Trained embedding (full fine-tune): layer 0's input goes to the host like the others."""
    from peft import LoraConfig, get_peft_model

    layers = 4
    hidden_shape = (2, 16, 64)
    went = {}
    for lora in (False, True):
        base = _checkpointing(_tiny_llama(layers=layers), False)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules="all-linear")) if lora else base
        off = _install(base)
        _step(model, _ids())
        went[lora] = {layer for kind, layer, *shape in off.trace if kind == "offload" and tuple(shape) == (hidden_shape,)}
        fetched = {layer for kind, layer, *_ in off.trace if kind == "fetch"}
        assert went[lora] <= fetched, off.trace
    assert went[False] >= set(range(layers)), went
    assert 0 not in went[True] and went[True] >= set(range(1, layers)), went


def test_host_too_small_one_line_and_no_offload(monkeypatch, capsys):
    monkeypatch.setattr(offload, "host_available", lambda: 3 << 30)  # under the 4 GiB margin: nothing to give
    model = _tiny_llama()
    ids = _ids()
    plain = _step(model, ids)
    off = _install(model)
    _assert_same(_step(model, ids), plain)
    _assert_same(_step(model, ids), plain)
    lines = [line for line in capsys.readouterr().err.splitlines() if "offload" in line]
    assert len(lines) == 1, lines
    assert "host offload off" in lines[0] and "AUTOPATCH_OFFLOAD=false" in lines[0] and "GiB" in lines[0]
    assert off.stats["offloaded"] == 0 and off.stats["forwards"] == 0 and off.off_reason


def test_cpu_model_one_line_and_no_offload(capsys):
    """AUTOPATCH_OFFLOAD on a model that trains on the CPU: said once, the step unchanged."""
    model = _tiny_llama()
    ids = _ids()
    plain = _step(model, ids)
    off = offload.install(model, None, ON)  # no target given: the model's own device decides
    _assert_same(_step(model, ids), plain)
    _assert_same(_step(model, ids), plain)
    lines = [line for line in capsys.readouterr().err.splitlines() if "offload" in line]
    assert len(lines) == 1, lines
    assert "host offload off" in lines[0] and "the cpu device" in lines[0] and "AUTOPATCH_OFFLOAD=false" in lines[0]
    assert off.stats["forwards"] == 0 and "cpu" in off.off_reason


def test_host_cap_during_the_step_keeps_tensors_on_the_device(monkeypatch):
    """Past the host's room (a step offloading more than estimated), tensors stay where they are."""
    monkeypatch.setattr(offload, "estimate_bytes", lambda *a: 0)
    monkeypatch.setattr(offload, "HOST_MARGIN", (0, 0.0))
    monkeypatch.setattr(offload, "host_available", lambda: 50_000)
    model = _tiny_llama()
    ids = _ids()
    plain = _step(model, ids)
    off = _install(model)
    _assert_same(_step(model, ids), plain)
    assert off.stats["offloaded"] > 0 and off.stats["host_full"] > 0
    assert off.stats["offloaded_bytes"] <= 50_000


def test_pinned_bytes_as_the_caching_host_allocator_reserves_them():
    assert offload.pinned_bytes(0) == 0
    assert offload.pinned_bytes(3072, "") == 4096 and offload.pinned_bytes(4096, "") == 4096
    assert offload.pinned_bytes(4097, "") == 8192
    gib = 1 << 30
    assert offload.pinned_bytes(500000 * 4096 * 2, "") == 4 * gib  # a 500000-token, 4096-wide bf16 checkpoint
    assert offload.pinned_bytes(270000 * 4096 * 2, "") == 4 * gib  # 2.06 GiB
    # the allocator's thresholds: above them it reserves what is asked
    assert offload.pinned_bytes(3 * gib, "pinned_max_round_threshold_mb:1024") == 3 * gib
    assert offload.pinned_bytes(3 * gib, "expandable_segments:True,pinned_max_cached_size_mb:2048") == 3 * gib
    assert offload.pinned_bytes(3 * 2**20, "pinned_max_round_threshold_mb:1024") == 4 * 2**20


def _capped_step(monkeypatch, cap, target):
    """One checkpointed step of the tiny Llama (12 tokens: no saved tensor a power of two in size) with
    the host's room fixed at `cap` bytes; (offloader, its step, the plain step)."""
    monkeypatch.setattr(offload, "estimate_bytes", lambda *a, **k: 0)
    monkeypatch.setattr(offload, "HOST_MARGIN", (0, 0.0))
    monkeypatch.setattr(offload, "host_available", lambda: cap)
    model = _checkpointing(_tiny_llama(), False)
    ids = _ids(batch=1, seq=12)
    plain = _step(model, ids)
    off = offload.install(model, None, ON, target=target)
    off.min_bytes = 1
    return off, _step(model, ids), plain


def test_host_cap_counts_what_the_pinned_allocator_reserves(monkeypatch):
    """A host copy takes its power-of-two bucket of pinned memory: the cap counts that, not the tensor's
    bytes (a 2.06 GiB checkpoint reserves 4 GiB); a step that fits the cap by tensor bytes no longer
    passes it in pinned memory."""
    off, got, plain = _capped_step(monkeypatch, 1 << 40, offload.CopyTarget())
    _assert_same(got, plain)
    exact = off.stats["offloaded_bytes"]
    assert off.stats["offloaded"] > 0 and off.stats["pinned_bytes"] == exact
    assert offload.pinned_bytes(exact, "") != exact

    off, got, plain = _capped_step(monkeypatch, exact, offload.CopyTarget())  # room for every tensor's bytes
    _assert_same(got, plain)
    assert off.stats["host_full"] == 0 and off.stats["offloaded_bytes"] == exact

    off, got, plain = _capped_step(monkeypatch, exact, offload.CopyTarget(round_pinned=True))
    _assert_same(got, plain)
    assert off.stats["host_full"] > 0, off.stats  # the same room holds fewer rounded copies
    assert 0 < off.stats["pinned_bytes"] <= exact
    assert off.stats["pinned_bytes"] > off.stats["offloaded_bytes"]


def test_cached_pinned_blocks_count_as_room(monkeypatch):
    """The allocator's free cached blocks (a previous step's host copies, which MemAvailable counts as
    used) are room: with them a second step offloads what the first did, without them nothing."""
    off, got, plain = _capped_step(monkeypatch, 0, offload.CopyTarget(round_pinned=True))
    _assert_same(got, plain)
    assert off.stats["offloaded"] == 0 and off.stats["host_full"] > 0
    off, got, plain = _capped_step(monkeypatch, 0, offload.CopyTarget(round_pinned=True, cached_bytes=1 << 30))
    _assert_same(got, plain)
    assert off.stats["offloaded"] > 0 and off.stats["host_full"] == 0


def test_host_buffers_exact_size_reused_and_swept():
    """Exact-size buffers (to a page), taken again at the same size, freed once a forward leaves them
    untaken; bookkeeping only (not page-locked on the CPU)."""
    from autopatch.host_buffers import PAGE, HostBuffers, exact_bytes

    pool = HostBuffers(register=False)
    a = pool.take(3 * PAGE + 1)
    assert a.numel() == exact_bytes(3 * PAGE + 1) == 4 * PAGE and a.data_ptr() % PAGE == 0
    b = pool.take(PAGE)
    assert pool.held_bytes == 5 * PAGE and pool.free_bytes == 0 and pool.registered == 2
    pool.give(a.data_ptr())
    assert pool.free_bytes == 4 * PAGE
    again = pool.take(4 * PAGE)  # the same size: the same buffer, nothing new
    assert again.data_ptr() == a.data_ptr() and pool.registered == 2 and pool.free_bytes == 0
    pool.give(again.data_ptr())
    pool.give(b.data_ptr())
    assert pool.sweep() == 0  # given back during this forward: kept for the next
    assert pool.free_bytes == 5 * PAGE
    assert pool.take(PAGE).data_ptr() == b.data_ptr()
    assert pool.sweep() == 4 * PAGE  # the other one stayed untaken through a whole forward: freed
    assert pool.held_bytes == PAGE and pool.free_bytes == 0
    pool.give(b.data_ptr())
    big = pool.take(5 * PAGE)  # nothing free fits: the free ones go first
    assert pool.held_bytes == 5 * PAGE and pool.free_bytes == 0
    pool.give(big.data_ptr())
    assert pool.take(4 * PAGE).data_ptr() == big.data_ptr()  # up to FIT larger is taken
    pool.give(big.data_ptr())
    pool.clear()
    assert pool.held_bytes == 0 and pool.free_bytes == 0

    # two of a size, one taken again and one not: the sweep frees that one only
    c, d = pool.take(2 * PAGE), pool.take(2 * PAGE)
    with pool._lock:  # a handle's __del__ run by the garbage collector inside a locked section
        pool.give(c.data_ptr())
    pool.give(d.data_ptr())
    pool.sweep()
    kept = pool.take(2 * PAGE)
    assert pool.sweep() == 2 * PAGE and pool.held_bytes == 2 * PAGE
    assert kept.data_ptr() in (c.data_ptr(), d.data_ptr())


def test_offload_through_exact_buffers_reuses_them_each_step(monkeypatch):
    """Host copies through exact-size buffers: loss and every gradient equal; the host counts each
    copy's own bytes (to a page), a second step at the same length takes the first step's buffers
    (nothing new), a step at another length frees the old ones at the end of its forward."""
    model = _checkpointing(_tiny_llama(), False)
    ids = _ids(batch=1, seq=12)
    plain = _step(model, ids)
    target = offload.CopyTarget(exact_min_bytes=1)
    off = offload.install(model, None, ON, target=target)
    off.min_bytes = 1
    _assert_same(_step(model, ids), plain)
    first, pinned = target.buffers.registered, off.stats["pinned_bytes"]
    assert off.stats["offloaded"] > 0 and first == off.stats["offloaded"]  # one buffer per copy
    assert pinned == target.buffers.held_bytes and pinned % 4096 == 0
    assert off.stats["offloaded_bytes"] <= pinned < off.stats["offloaded_bytes"] + first * 4096
    _assert_same(_step(model, ids), plain)
    assert target.buffers.registered == first and off.host_used == 0
    assert target.buffers.free_bytes == target.buffers.held_bytes == pinned
    longer = _ids(batch=1, seq=1200)
    plain_longer = _step(model, longer)  # offload on: this step's copies take new buffers
    _assert_same(_step(model, longer), plain_longer)
    assert target.buffers.registered > first
    longer_pinned = off.stats["pinned_bytes"] - 2 * pinned
    assert target.buffers.held_bytes == longer_pinned // 2  # the 12-token step's buffers are gone


def test_estimate_and_setting():
    model = _checkpointing(_tiny_llama(), False)
    ids = _ids(batch=2, seq=16)
    assert offload.estimate_bytes(model, (), {"input_ids": ids}) == 2 * 16 * 64 * 4 * 2  # tokens × hidden × fp32 × layers
    assert offload.estimate_bytes(model, (), {"input_ids": ids[:, :12]}, lambda n: offload.pinned_bytes(n, "")) == \
        8192 * 2  # 2 × 12 × 64 × 4 = 6144 bytes per layer input, an 8192-byte pinned block, 2 layers
    plain = _tiny_llama()
    assert offload.estimate_bytes(plain, (), {"input_ids": ids}) == 2 * 16 * (10 * 64 + 3 * 128) * 4 * 2
    assert load_settings({}).offload == "false"
    assert load_settings({"AUTOPATCH_OFFLOAD": "auto"}).offload == "auto"
    assert load_settings({"AUTOPATCH_OFFLOAD": "1"}).offload == "true"
    with pytest.raises(ValueError, match="AUTOPATCH_OFFLOAD"):
        load_settings({"AUTOPATCH_OFFLOAD": "host"})
    assert offload.install(_tiny_llama(), None, load_settings({})) is None
    m = _tiny_llama()
    first = offload.install(m, None, AUTO)
    assert first is not None and offload.install(m, None, AUTO) is first  # once per model
    m(input_ids=ids, labels=ids).loss.backward()  # on the CPU with no target given: stays off
    assert first.off_reason and first.stats["forwards"] == 0


# --- the real path: pinned host memory, a side stream --------------------------------------------------


def _cuda_step(model, ids):
    """One step's loss, gradients and peak, the gradients zeroed in place (allocated before the peak is
    taken: else they grow through the backward and the peak is at its end, where every layer's input
    is gone with or without offload)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = _step(model, ids, set_to_none=False)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [None, False], ids=["plain", "grad-ckpt"])
def test_gpu_equal_gradients_and_lower_peak(reentrant):
    model = _checkpointing(_tiny_llama("cuda", torch.float32, hidden=1024, layers=4), reentrant)
    ids = torch.randint(0, 96, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain, peak_plain = _cuda_step(model, ids)
    plain, peak_plain = _cuda_step(model, ids)  # grads allocated once before: both measured alike
    off = offload.install(model, None, ON)
    got, peak_off = _cuda_step(model, ids)
    assert isinstance(off.target, offload.CudaTarget)
    assert off.stats["offloaded"] > 0 and off.stats["fetched"] == off.stats["offloaded"]
    _assert_same(got, plain, tol=1e-6)
    assert peak_off < peak_plain, (peak_off / 2**20, peak_plain / 2**20)
    torch.cuda.synchronize()
    assert off.host_used == 0


@pytest.mark.gpu
def test_gpu_exact_host_buffers_page_locked_and_reused():
    """Layer inputs of 32 MiB go to exact-size page-locked buffers: copies asynchronous and equal,
    each buffer holds its copy's own 48 MiB (a pinned block would take 64), and a second step
    registers nothing new."""
    model = _checkpointing(_tiny_llama("cuda", torch.float32, hidden=1536, layers=4), False)
    ids = torch.randint(0, 96, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain, _ = _cuda_step(model, ids)
    off = offload.install(model, None, ON)
    got, _ = _cuda_step(model, ids)
    _assert_same(got, plain, tol=1e-6)
    buffers = off.target.buffers
    layer_input = 8192 * 1536 * 4  # 48 MiB: its pinned block would be 64 MiB
    assert buffers.registered >= 4 and buffers.held_bytes == buffers.registered * layer_input  # not 64 MiB each
    registered = buffers.registered
    got, _ = _cuda_step(model, ids)
    _assert_same(got, plain, tol=1e-6)
    assert buffers.registered == registered
    torch.cuda.synchronize()
    assert off.host_used == 0


def _cuda_backward_peak(model, ids, off):
    """One step's loss, gradients and the GPU's peak through the backward of the layers above the first
    (reset once the forward and its copies to the host are done, read at the first use of the first
    layer's tensors: test_no_room_for_the_previous_layer_holds_one_layer_input_less says why)."""
    def forward_done():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    off.trace = _TraceToFirstLayer(measure=torch.cuda.max_memory_allocated)
    out = _step(model, ids, set_to_none=False, before_backward=forward_done)
    torch.cuda.synchronize()
    assert off.trace.reached, off.trace
    return out, off.trace.measured


@pytest.mark.gpu
def test_gpu_no_room_for_the_previous_layer_lowers_the_peak(monkeypatch):
    """Where the GPU has no room for the previous layer's checkpoint beside this layer's backward
    (CudaTarget.room), it comes back when its own backward asks: the same gradients, and the peak through
    the backward of the layers above the first lower by one layer input (T·H·4 = 32 MiB here), which the
    early copy kept on the GPU. Each mode measured on its second step (the first offloaded step also
    makes the host buffers)."""
    model = _checkpointing(_tiny_llama("cuda", torch.float32, hidden=1024, layers=4), False)
    ids = torch.randint(0, 96, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain, _ = _cuda_step(model, ids)
    plain, _ = _cuda_step(model, ids)
    off = offload.install(model, None, ON)
    for _ in range(2):
        early, peak_early = _cuda_backward_peak(model, ids, off)
    assert not [e for e in off.trace if e[0] == "later"], "an 80 GB GPU has room for a 32 MiB prefetch"
    monkeypatch.setattr(offload.CudaTarget, "room", lambda self: 0)
    for _ in range(2):
        late, peak_late = _cuda_backward_peak(model, ids, off)
    assert {layer for kind, layer, *_ in off.trace if kind == "later"} >= {0, 1, 2}, off.trace
    _assert_same(early, plain, tol=1e-6)
    _assert_same(late, plain, tol=1e-6)
    layer_input = 8192 * 1024 * 4
    assert peak_late <= peak_early - 0.9 * layer_input, (peak_early / 2**20, peak_late / 2**20)


@pytest.mark.gpu
def test_gpu_bf16_lora_under_checkpointing():
    """bf16 LoRA under gradient checkpointing at 8K tokens: offload on, the same loss and gradients."""
    from peft import LoraConfig, get_peft_model

    base = _checkpointing(_tiny_llama("cuda", torch.bfloat16, hidden=512, layers=4), False)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    ids = torch.randint(0, 96, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain, _ = _cuda_step(model, ids)
    off = offload.install(base, None, ON)
    got, _ = _cuda_step(model, ids)
    assert off.stats["offloaded"] >= 4  # at least each layer's input
    _assert_same(got, plain, tol=1e-6)


def test_start_up_installs_offload_on_each_model_built(tmp_path):
    """AUTOPATCH_OFFLOAD alone (no kernel) starts the hooks, and every model built gets the offloader."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,"
        " num_key_value_heads=2, vocab_size=128)\n"
        "model = LlamaForCausalLM(cfg)\n"
        "from autopatch.offload import offloader_of\n"
        "off = offloader_of(model)\n"
        "print('offloader', type(off).__name__, off.mode if off is not None else None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
    env.update(AUTOPATCH_OFFLOAD="true", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", "import autopatch; autopatch.enable()\n" + script],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "offloader Offloader true" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_the_report_says_what_offload_did_for_each_model():
    """The JSON report's "offload": per model built under the setting, its mode, why it stayed off (a
    CPU model here) or what its training forwards sent to the host (the copy target)."""
    from autopatch import report
    from autopatch.session import Session

    session = Session(ON)
    on_cpu, copied = _tiny_llama(), _tiny_llama(seed=1)
    for model in (on_cpu, copied):
        session.note_model(model, True)
    offload.install(on_cpu, session)
    off = offload.install(copied, session, target=offload.CopyTarget())
    off.min_bytes = 1
    ids = _ids()
    _step(on_cpu, ids)
    _step(copied, ids)
    assert report.as_json(session)["offload"] == report.offload_state(session)
    cpu, copy = report.offload_state(session)  # in the order the models were built
    assert cpu["model"] == "LlamaForCausalLM" and cpu["mode"] == "true" and "cpu device" in cpu["off"]
    assert cpu["forwards"] == 0 and cpu["offloaded"] == 0
    assert copy["off"] == "" and copy["forwards"] == 1 and copy["offloaded"] > 0 and copy["offloaded_bytes"] > 0
    assert copy["fetched"] == copy["offloaded"]
