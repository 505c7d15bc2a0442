"""The loss rule (autopatch.rules.loss): fused CE as transformers' ForCausalLMLoss, fused linear CE in
a *ForCausalLM forward in training with labels. Tiny random models, patched vs unpatched, on the
loss, the logits and every parameter gradient, fp32 at 1e-5 relative; the kernels run under the
Triton interpreter and their launch counts prove it."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from helpers import assert_close, launches, tensors_with_history

transformers = pytest.importorskip("transformers")

from autopatch import patching, report  # noqa: E402
from autopatch.rules._lazy_logits import LazyLogits  # noqa: E402
from autopatch.rules import loss as loss_rule  # noqa: E402
from autopatch.rules._causal_lm_source import analyse_forward  # noqa: E402
from autopatch.session import current  # noqa: E402

FP32 = torch.float32
VOCAB = 96
BATCH, SEQ = 2, 8


pytestmark = pytest.mark.usefixtures("restore_patches")


def _launches(fk, prefix: str) -> int:
    return launches(prefix)


ALL_ON = lambda kernel: True  # noqa: E731


# ---------------------------------------------------------------------------------------------
# tiny models

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

ARCHS = {
    # name: (modeling module, class, config class, config overrides, what it exercises)
    "llama": ("llama", "LlamaForCausalLM", "LlamaConfig", dict(head_dim=16)),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    # gemma2 and cohere tie lm_head to the input embeddings (their configs' default)
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=16, final_logit_softcapping=3.0)),
    "cohere": ("cohere", "CohereForCausalLM", "CohereConfig", dict(logit_scale=0.5)),
    "granite": ("granite", "GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=3.0)),
    "mixtral": ("mixtral", "MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.3)),
    "phi": ("phi", "PhiForCausalLM", "PhiConfig", dict()),  # lm_head with bias
}


def _module(arch):
    import importlib

    name = ARCHS[arch][0]
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _build(arch, seed=0):
    _, cls_name, cfg_name, overrides = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(_module(arch), cls_name)(cfg).float()
    with torch.no_grad():
        # O(1)-sized logits, so that softcap and scale matter; random bias where there is one
        model.lm_head.weight.normal_(0.0, 0.3)
        if model.lm_head.bias is not None:
            model.lm_head.bias.normal_(0.0, 1.0)
    return model


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100
    labels[1, 5] = -100
    return ids, labels


def no_full_logits(x) -> bool:
    """The fused path's logits slot: None (AUTOPATCH_RETURN_LOGITS=false) or, by default, a LazyLogits
    whose values were never computed."""
    return x is None or (isinstance(x, LazyLogits) and x._value is None)


def _train_step(model, **kwargs):
    """Loss, output and every parameter gradient of one training forward/backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _scenarios():
    ids, labels = _inputs()
    g = torch.Generator().manual_seed(2)
    keep = 5
    shift = torch.randint(0, VOCAB, (BATCH, keep), generator=g)
    shift[1, 1] = -100
    return {
        # ignore_index tokens in labels, loss normalised by num_items_in_batch (gradient accumulation)
        "num_items_in_batch": dict(input_ids=ids, labels=labels,
                                   num_items_in_batch=torch.tensor(int((labels != -100).sum()) + 7)),
        # caller-shifted targets for only the last `keep` positions (logits_to_keep), mean reduction
        "shift_labels+logits_to_keep": dict(input_ids=ids, labels=labels, shift_labels=shift, logits_to_keep=keep),
    }


@pytest.mark.parametrize("arch", list(ARCHS))
def test_patched_model_matches_original(arch, kernels):
    model = _build(arch)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (arch in ("gemma2", "cohere")), "tied embeddings are covered by gemma2 and cohere"
    assert (model.lm_head.bias is not None) == (arch == "phi")
    scenarios = _scenarios()
    ids, labels = _inputs()
    refs = {name: _train_step(model, **kw) for name, kw in scenarios.items()}
    model.eval()
    with torch.no_grad():
        ref_eval = model(input_ids=ids, labels=labels)
        ref_eval_nolabels = model(input_ids=ids)

    records = loss_rule.RULE.patch_module(_module(arch), current(), ALL_ON)
    cls_name = ARCHS[arch][1]
    mine = {r.kernel: r for r in records if r.target.startswith(cls_name + ".")}
    assert mine["fused_linear_cross_entropy"].patched, mine
    assert mine["cross_entropy"].patched, mine

    for name, kw in scenarios.items():
        flce_before = _launches(kernels, "fused_linear_cross_entropy")
        out, grads = _train_step(model, **kw)
        ref_out, ref_grads = refs[name]
        assert _launches(kernels, "fused_linear_cross_entropy") > flce_before, f"{name}: fused kernel did not run"
        assert no_full_logits(out.logits), f"{name}: full logits returned in the fused training path"
        assert_close(out.loss, ref_out.loss, FP32, f"{arch} {name} loss")
        if getattr(ref_out, "aux_loss", None) is not None:
            assert_close(out.aux_loss, ref_out.aux_loss, FP32, f"{arch} {name} aux_loss")
        assert grads.keys() == ref_grads.keys()
        for pname, ref_grad in ref_grads.items():
            assert_close(grads[pname], ref_grad, FP32, f"{arch} {name} grad {pname}")

    model.eval()
    ce_before = _launches(kernels, "cross_entropy")
    with torch.no_grad():
        out_eval = model(input_ids=ids, labels=labels)
        out_eval_nolabels = model(input_ids=ids)
    assert _launches(kernels, "cross_entropy") > ce_before, "fused cross entropy did not run in eval"
    assert torch.equal(out_eval.logits, ref_eval.logits)
    assert torch.equal(out_eval_nolabels.logits, ref_eval_nolabels.logits)
    assert out_eval_nolabels.loss is None
    assert_close(out_eval.loss, ref_eval.loss, FP32, f"{arch} eval loss")


def test_llama_edges(kernels):
    """Positional labels, tuple output, no labels in training, no_grad in training, a
    logits_to_keep whose targets do not line up (the original's error), a user-set loss."""
    arch = "llama"
    model = _build(arch)
    ids, labels = _inputs()
    model.train()
    with torch.no_grad():
        ref_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        ref_train_nolabels = model(input_ids=ids)
    with pytest.raises(ValueError):
        model(input_ids=ids, labels=labels, logits_to_keep=3)
    params = list(inspect.signature(type(model).forward).parameters)
    positional = [None] * (params.index("labels") - 2) + [labels]  # after self, input_ids
    ref_positional, ref_grads = _train_step_positional(model, ids, positional)
    # a caller's ignore_index reaches the loss through the forward's **kwargs
    labels_minus1 = torch.where(labels == -100, -1, labels)
    ref_ignore, ref_ignore_grads = _train_step(model, input_ids=ids, labels=labels_minus1, ignore_index=-1)

    loss_rule.RULE.patch_module(_module(arch), current(), ALL_ON)

    with torch.no_grad():
        # with grad disabled, the original path and the fused CE; logits returned
        out_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        out_train_nolabels = model(input_ids=ids)
    assert len(out_tuple) == len(ref_tuple) and torch.equal(out_tuple[1], ref_tuple[1])
    assert torch.equal(out_train_nolabels.logits, ref_train_nolabels.logits)
    with torch.enable_grad():
        fused_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert len(fused_tuple) == len(ref_tuple), "every tuple position stays where the plain model has it"
    assert no_full_logits(fused_tuple[1]), "the logits slot holds no logits in the fused training path"
    assert_close(fused_tuple[0], ref_tuple[0], FP32, "tuple loss")
    with pytest.raises(ValueError):
        model(input_ids=ids, labels=labels, logits_to_keep=3)
    out_positional, grads = _train_step_positional(model, ids, positional)
    assert no_full_logits(out_positional.logits)
    assert_close(out_positional.loss, ref_positional.loss, FP32, "positional labels loss")
    for pname, ref_grad in ref_grads.items():
        assert_close(grads[pname], ref_grad, FP32, f"positional labels grad {pname}")
    out_ignore, grads = _train_step(model, input_ids=ids, labels=labels_minus1, ignore_index=-1)
    assert no_full_logits(out_ignore.logits)
    assert_close(out_ignore.loss, ref_ignore.loss, FP32, "ignore_index=-1 loss")
    for pname, ref_grad in ref_ignore_grads.items():
        assert_close(grads[pname], ref_grad, FP32, f"ignore_index=-1 grad {pname}")

    # another loss type chosen by the config is kept, on full logits
    from transformers.loss.loss_utils import ForMaskedLMLoss

    model.loss_type = "ForMaskedLM"
    assert model.loss_function is ForMaskedLMLoss
    assert model(input_ids=ids, labels=labels).logits is not None
    model.loss_type = "ForCausalLM"

    # a loss the user set on the instance is used as is, and on full logits
    seen = {}

    def custom_loss(logits, labels, vocab_size, **kwargs):
        seen["shape"] = tuple(logits.shape)
        return logits.float().square().mean()

    model.loss_function = custom_loss
    out = model(input_ids=ids, labels=labels)
    assert seen["shape"] == (BATCH, SEQ, VOCAB) and out.logits is not None
    assert model.loss_function is custom_loss


def _train_step_positional(model, ids, positional):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, *positional)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tuple_output_keeps_every_position(arch, kernels):
    """return_dict=False in training with labels: the fused path returns a tuple of the plain model's
    length, None where the logits were, and every other element where the plain model puts it (so
    `loss, logits = out[:2]` never silently gets the cache or the router logits)."""
    model = _build(arch)
    ids, labels = _inputs()
    model.train()
    ref = model(input_ids=ids, labels=labels, return_dict=False)
    loss_rule.RULE.patch_module(_module(arch), current(), ALL_ON)
    flce_before = _launches(kernels, "fused_linear_cross_entropy")
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert _launches(kernels, "fused_linear_cross_entropy") > flce_before, "fused kernel did not run"
    assert isinstance(out, tuple) and len(out) == len(ref), (len(out), len(ref))
    logits_at = [i for i, x in enumerate(ref) if isinstance(x, torch.Tensor) and x.shape == (BATCH, SEQ, VOCAB)]
    assert len(logits_at) == 1, "the plain tuple has one logits element"
    assert no_full_logits(out[logits_at[0]]), "the logits slot holds no logits in the fused training path"
    assert_close(out[0], ref[0], FP32, f"{arch} tuple loss")
    for i, (mine, theirs) in enumerate(zip(out, ref)):
        if i in (0, logits_at[0]):
            continue
        assert type(mine) is type(theirs), f"{arch}: tuple element {i} is {type(mine)}, plain {type(theirs)}"
        if isinstance(theirs, torch.Tensor):
            assert_close(mine, theirs, FP32, f"{arch} tuple element {i}")
    out_dict = model(input_ids=ids, labels=labels)
    assert no_full_logits(out_dict.logits) and list(out_dict.keys())[0] == "loss"


def test_kernels_toggle_separately(kernels):
    module = _module("llama")
    cls = module.LlamaForCausalLM
    original_forward = cls.forward
    model = _build("llama")
    ids, labels = _inputs()
    ref, ref_grads = _train_step(model, input_ids=ids, labels=labels)

    # cross_entropy only: the forward is not wrapped; training computes logits and the fused CE
    records = loss_rule.RULE.patch_module(module, current(), lambda k: k == "cross_entropy")
    assert {r.kernel for r in records} == {"cross_entropy"}
    assert cls.forward is original_forward
    ce, flce = _launches(kernels, "cross_entropy"), _launches(kernels, "fused_linear_cross_entropy")
    out, grads = _train_step(model, input_ids=ids, labels=labels)
    assert out.logits is not None
    assert _launches(kernels, "cross_entropy") > ce and _launches(kernels, "fused_linear_cross_entropy") == flce
    assert_close(out.loss, ref.loss, FP32, "CE-only loss")
    for pname, ref_grad in ref_grads.items():
        assert_close(grads[pname], ref_grad, FP32, f"CE-only grad {pname}")
    # a later call that also turns the fused linear CE on adds it to the same class
    records = loss_rule.RULE.patch_module(module, current(), ALL_ON)
    assert all(r.patched for r in records) and cls.forward is not original_forward
    out, _ = _train_step(model, input_ids=ids, labels=labels)
    assert no_full_logits(out.logits) and _launches(kernels, "fused_linear_cross_entropy") > flce
    patching.restore_all()
    assert cls.forward is original_forward and "lm_head" not in vars(cls)

    # fused_linear_cross_entropy only: eval keeps transformers' own loss
    records = loss_rule.RULE.patch_module(module, current(), lambda k: k == "fused_linear_cross_entropy")
    assert {r.kernel for r in records} == {"fused_linear_cross_entropy"}
    model.eval()
    ce = _launches(kernels, "cross_entropy")
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    assert _launches(kernels, "cross_entropy") == ce
    from transformers.loss.loss_utils import ForCausalLMLoss

    assert model.loss_function is ForCausalLMLoss


def test_finished_step_keeps_no_activations_without_a_full_collection(kernels):
    """Once a fused training step is done, nothing of its autograd graph may live on until Python's
    next full garbage collection: a reference cycle holding the final hidden states kept the last
    norm's output (128 MiB for a Llama-8B batch of 16k tokens) alive across steps, raising every later
    peak. Two steps with the cyclic collector off must leave no tensor with autograd history."""
    import gc

    module = _module("llama")
    model = _build("llama")
    ids, labels = _inputs()
    loss_rule.RULE.patch_module(module, current(), ALL_ON)
    flce = _launches(kernels, "fused_linear_cross_entropy")
    gc.collect()
    before = tensors_with_history()
    gc.disable()
    try:
        for _ in range(2):
            model(input_ids=ids, labels=labels).loss.backward()
            model.zero_grad(set_to_none=True)
        after = tensors_with_history()
    finally:
        gc.enable()
    assert _launches(kernels, "fused_linear_cross_entropy") >= flce + 2
    assert after == before, f"{after - before} tensors with autograd history outlived their step"


def test_records_idempotent_and_refusals(kernels):
    import importlib

    llama = _module("llama")
    first = loss_rule.RULE.patch_module(llama, current(), ALL_ON)
    forward = vars(llama.LlamaForCausalLM)["forward"]  # (class access of a wrapt swap binds anew each time)
    second = loss_rule.RULE.patch_module(llama, current(), ALL_ON)
    assert first == second
    assert vars(llama.LlamaForCausalLM)["forward"] is forward
    assert {r.target for r in first} == {"LlamaForCausalLM.loss_function", "LlamaForCausalLM.forward"}
    # other heads of the module (sequence classification, ...) are not touched
    assert "loss_function" not in vars(llama.LlamaForSequenceClassification)

    variants = {}
    for name in ("gemma2", "cohere", "granite"):
        for r in loss_rule.RULE.patch_module(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), current(), ALL_ON):
            if r.kernel == "fused_linear_cross_entropy":
                variants[r.target] = r.variant
    assert variants["Gemma2ForCausalLM.forward"] == "logits: softcap_if_set(config.final_logit_softcapping)"
    assert variants["CohereForCausalLM.forward"] == "logits: scale_mul(logit_scale)"
    assert variants["GraniteForCausalLM.forward"] == "logits: scale_div(config.logits_scaling)"

    refused = {}
    for name in ("roberta", "bamba", "bart", "modernbert_decoder", "xlstm"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for r in loss_rule.RULE.patch_module(mod, current(), ALL_ON):
            refused[(r.target, r.kernel)] = r
    assert "not built as nn.Linear" in refused[("RobertaForCausalLM.forward", "fused_linear_cross_entropy")].reason
    assert "logits used after the loss" in refused[("BambaForCausalLM.forward", "fused_linear_cross_entropy")].reason
    assert "does not call self.loss_function" in refused[("BartForCausalLM.loss_function", "cross_entropy")].reason
    assert "unrecognised logits transformation" in refused[
        ("ModernBertDecoderForCausalLM.forward", "fused_linear_cross_entropy")].reason
    assert "unrecognised" in refused[("xLSTMForCausalLM.forward", "fused_linear_cross_entropy")].reason
    for key in [("RobertaForCausalLM.forward", "fused_linear_cross_entropy"),
                ("BambaForCausalLM.forward", "fused_linear_cross_entropy")]:
        assert not refused[key].patched
    # where only the fused linear CE is refused, the fused CE still serves the loss
    assert refused[("BambaForCausalLM.loss_function", "cross_entropy")].patched


def test_patch_module_never_raises(kernels):
    def broken_enabled(kernel):
        raise RuntimeError("toggle lookup failed")

    records = loss_rule.RULE.patch_module(_module("llama"), current(), broken_enabled)
    assert records and all(not r.patched and "toggle lookup failed" in r.reason for r in records)
    weird = types.ModuleType("not_transformers")
    weird.XForCausalLM = 42
    assert loss_rule.RULE.patch_module(weird, current(), ALL_ON) == []


def test_fallback_when_triton_cannot_run(kernels, monkeypatch, capsys):
    model = _build("llama")
    ids, labels = _inputs()
    ref, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    monkeypatch.setattr(kernels, "triton_can_run", lambda *tensors: False)
    current().reset_runs()  # the fallback notices are once per session
    before = kernels.launch_counts()
    out, grads = _train_step(model, input_ids=ids, labels=labels)
    out, grads = _train_step(model, input_ids=ids, labels=labels)
    assert kernels.launch_counts() == before
    assert out.logits is not None
    assert torch.equal(out.loss, ref.loss)
    for pname, ref_grad in ref_grads.items():
        assert torch.equal(grads[pname], ref_grad), pname
    err = capsys.readouterr().err
    assert err.count("autopatch: fused_linear_cross_entropy:") == 1
    assert err.count("autopatch: cross_entropy:") == 1


def test_float64_model_keeps_original_loss(kernels, capsys, monkeypatch):
    """The kernels take fp32/bf16/fp16; a float64 model (debugging, references) runs the original."""
    current().reset_runs()
    model = _build("llama").double()
    ids, labels = _inputs()
    ref, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    before = kernels.launch_counts()
    out, grads = _train_step(model, input_ids=ids, labels=labels)
    assert kernels.launch_counts() == before and out.logits is not None
    assert torch.equal(out.loss, ref.loss)
    for pname, ref_grad in ref_grads.items():
        assert torch.equal(grads[pname], ref_grad), pname
    err = capsys.readouterr().err
    assert "dtype torch.float64" in err


def test_lm_head_with_hooks_keeps_original_path(kernels, capsys, monkeypatch):
    """An lm_head that is not a plain nn.Linear call (here: a forward hook, as accelerate or FSDP
    add) is run as the model defines it; the loss is still the fused CE on the full logits."""
    current().reset_runs()
    model = _build("llama")
    ids, labels = _inputs()
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    ref, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    flce = _launches(kernels, "fused_linear_cross_entropy")
    out, grads = _train_step(model, input_ids=ids, labels=labels)
    assert _launches(kernels, "fused_linear_cross_entropy") == flce
    assert seen == [(BATCH, SEQ, VOCAB)] * 2 and out.logits is not None
    assert_close(out.loss, ref.loss, FP32, "hooked lm_head loss")
    for pname, ref_grad in ref_grads.items():
        assert_close(grads[pname], ref_grad, FP32, f"hooked lm_head grad {pname}")
    assert "lm_head is not a plain nn.Linear" in capsys.readouterr().err


def test_global_module_hook_keeps_original_lm_head_path(kernels, capsys, monkeypatch):
    """A global forward hook (nn.modules.module.register_module_forward_hook, as profilers and
    activation loggers use) must see lm_head's call too: the fused path, which skips that call, is
    not taken while one is registered, and is taken again once it is removed."""
    current().reset_runs()
    model = _build("llama")
    ids, labels = _inputs()
    ref, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: seen.append(type(mod).__name__) if mod is model.lm_head else None)
    try:
        flce = _launches(kernels, "fused_linear_cross_entropy")
        out, grads = _train_step(model, input_ids=ids, labels=labels)
        assert _launches(kernels, "fused_linear_cross_entropy") == flce
    finally:
        handle.remove()
    assert seen == ["Linear"] and out.logits is not None
    assert_close(out.loss, ref.loss, FP32, "global-hook loss")
    for pname, ref_grad in ref_grads.items():
        assert_close(grads[pname], ref_grad, FP32, f"global-hook grad {pname}")
    assert "lm_head is not a plain nn.Linear" in capsys.readouterr().err
    _train_step(model, input_ids=ids, labels=labels)
    assert _launches(kernels, "fused_linear_cross_entropy") > flce  # the fused path again


# ---------------------------------------------------------------------------------------------
# the source analysis on forwards written here (every branch of the table)

class _Cfg:
    final_logit_softcapping = 2.0
    logits_scaling = 4.0


def _fwd_scale_then_cap(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states) * self.multiplier
    cap = self.config.final_logit_softcapping
    logits = torch.tanh(logits / cap) * cap  # recurrent-gemma style, through a local alias
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    return loss, logits


def _fwd_cap_then_scale(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states)
    if self.config.final_logit_softcapping is not None:
        logits = logits / self.config.final_logit_softcapping
        logits = torch.tanh(logits)
        logits = logits * self.config.final_logit_softcapping
    logits = logits / self.config.logits_scaling
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=3, **kwargs)
    return loss, logits


def _fwd_unknown_op(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states)
    logits = logits.clamp(-5, 5)
    loss = self.loss_function(logits, labels, 3, **kwargs)
    return loss, logits


def _fwd_no_kwargs(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states)
    loss = self.loss_function(logits, labels, 3)
    return loss, logits


def _fwd_loss_on_other(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states)
    loss = self.loss_function(logits.float(), labels, 3, **kwargs)
    return loss, logits


def _fwd_logits_after(self, hidden_states, labels=None, **kwargs):
    logits = self.lm_head(hidden_states)
    loss = self.loss_function(logits, labels, 3, **kwargs)
    if labels is not None:
        loss = loss + logits.mean()
    return loss, logits


def _fwd_tuple_output(self, hidden_states, labels=None, return_dict=True, **kwargs):
    logits = self.lm_head(hidden_states).float()
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, 3, **kwargs)
    if not return_dict:
        output = (logits,) + (hidden_states,)
        return (loss,) + output
    return loss, logits


def test_source_analysis_table():
    ok = analyse_forward(_fwd_scale_then_cap)
    assert ok.ok, ok.reason
    assert ok.variant() == "logits: scale_mul(multiplier), softcap(config.final_logit_softcapping)"
    assert not analyse_forward(_fwd_cap_then_scale).ok
    assert "scaled after the softcap" in analyse_forward(_fwd_cap_then_scale).reason
    assert "logits.clamp" in analyse_forward(_fwd_unknown_op).reason
    assert "**kwargs" in analyse_forward(_fwd_no_kwargs).reason
    assert "as logits" in analyse_forward(_fwd_loss_on_other).reason
    assert "used after the loss" in analyse_forward(_fwd_logits_after).reason
    tuple_ok = analyse_forward(_fwd_tuple_output)
    assert tuple_ok.ok and tuple_ok.variant() == "logits: plain lm_head", tuple_ok.reason


def test_torch_compile_fullgraph(kernels):
    """torch.compile(fullgraph=True) traces a patched model in training (fused linear CE) and in
    eval (fused CE) without graph breaks, with the eager numbers."""
    import torch._dynamo

    model = _build("llama")
    model.config.num_hidden_layers = 1
    model.model.layers = model.model.layers[:1]
    ids, labels = _inputs()
    loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    eager, eager_grads = _train_step(model, input_ids=ids, labels=labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    model.zero_grad(set_to_none=True)
    out = compiled(input_ids=ids, labels=labels)  # fullgraph: any graph break raises
    out.loss.backward()
    assert out.logits is None
    assert_close(out.loss, eager.loss, FP32, "compiled loss")
    for pname, param in model.named_parameters():
        assert_close(param.grad, eager_grads[pname], FP32, f"compiled grad {pname}")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma2", "mixtral"])
def test_gpu_bf16_loss_grads_and_memory(arch, kernels, device):
    """On the GPU in bf16 at a vocabulary where logits dominate memory: patched loss and gradients
    within bf16 tolerance of the original, and a lower peak memory in the training step."""
    _, cls_name, cfg_name, overrides = ARCHS[arch]
    big = dict(COMMON, vocab_size=65536, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    if "head_dim" in overrides:
        overrides = dict(overrides, head_dim=64)
    cfg = getattr(transformers, cfg_name)(**{**big, **overrides})
    torch.manual_seed(0)
    model = getattr(_module(arch), cls_name)(cfg).to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), generator=g).to(device)
    labels = ids.clone()
    labels[:, :16] = -100

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return out, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}, peak

    ref, ref_grads, ref_peak = step()
    loss_rule.RULE.patch_module(_module(arch), current(), ALL_ON)
    out, grads, peak = step()
    assert no_full_logits(out.logits)
    assert_close(out.loss, ref.loss, torch.bfloat16, f"{arch} bf16 loss")
    for pname, ref_grad in ref_grads.items():
        assert_close(grads[pname], ref_grad, torch.bfloat16, f"{arch} bf16 grad {pname}")
    logits_bytes = ids.numel() * cfg.vocab_size * 2
    print(f"{arch}: peak {ref_peak / 2**20:.0f} MiB -> {peak / 2**20:.0f} MiB (bf16 logits alone {logits_bytes / 2**20:.0f} MiB)")
    assert peak < ref_peak - logits_bytes, "the fused path should save at least one bf16 logits tensor"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: the softcap runs on the returned logits
def test_return_logits_setting(arch, kernels, monkeypatch, capsys):
    """AUTOPATCH_RETURN_LOGITS: "true" returns the real (no-grad) logits from a fused training call,
    equal to the plain model's, with the same loss and gradients; "false" returns None; "auto" (the
    default) a LazyLogits whatever is imported (`trl` loaded or not), computed only when read, then equal
    to the plain model's, with one notice. Every mode keeps the loss and gradients."""

    current().reset_runs()  # notices are once per session
    model = _build(arch)
    ids, labels = _inputs()
    ref_out, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    assert loss_rule.RULE.patch_module(_module(arch), current(), ALL_ON)
    for mode, trl_loaded, expect in (("true", False, "real"), ("false", True, None),
                                     ("auto", False, "lazy"), ("auto", True, "lazy")):
        monkeypatch.setattr(current(), "settings", types.SimpleNamespace(return_logits=mode))
        if trl_loaded:
            monkeypatch.setitem(__import__("sys").modules, "trl", types.ModuleType("trl"))
        else:
            monkeypatch.delitem(__import__("sys").modules, "trl", raising=False)
        flce_before = _launches(kernels, "fused_linear_cross_entropy")
        out, grads = _train_step(model, input_ids=ids, labels=labels)
        what = f"{arch} AUTOPATCH_RETURN_LOGITS={mode} trl={'loaded' if trl_loaded else 'absent'}"
        assert _launches(kernels, "fused_linear_cross_entropy") > flce_before, what
        assert_close(out.loss, ref_out.loss, FP32, f"{what}: loss")
        for pname, ref_grad in ref_grads.items():
            assert_close(grads[pname], ref_grad, FP32, f"{what}: grad {pname}")
        if expect is None:
            assert out.logits is None, what
            continue
        assert isinstance(out.logits, LazyLogits) == (expect == "lazy"), (what, type(out.logits))
        if expect == "lazy":
            assert out.logits._value is None and out.logits.shape == ref_out.logits.shape, what
            assert out.logits.dtype == ref_out.logits.dtype, what
            assert out.logits._value is None, f"{what}: metadata reads must not compute the logits"
        assert not out.logits.requires_grad, what
        assert_close(out.logits.float(), ref_out.logits, FP32, f"{what}: logits")
    err = capsys.readouterr().err
    assert err.count("logits were read, so they were computed") == 1, err
    assert "trl is loaded" not in err


def test_return_logits_variable_is_validated():
    from autopatch.config import ConfigError, load_settings

    assert load_settings({}).return_logits == "auto"
    assert load_settings({"AUTOPATCH_RETURN_LOGITS": "1"}).return_logits == "true"
    assert load_settings({"AUTOPATCH_RETURN_LOGITS": "OFF"}).return_logits == "false"
    with pytest.raises(ConfigError, match="AUTOPATCH_RETURN_LOGITS.*auto, true or false"):
        load_settings({"AUTOPATCH_RETURN_LOGITS": "sometimes"})


def test_flce_chunk_setting_reaches_the_kernel(kernels, monkeypatch):
    """FUSED_KERNELS_FLCE_CHUNK_MB (Settings.flce_chunk_mb) is the chunk_mb every fused training call
    passes to fused_linear_cross_entropy; unset, the kernel's default (None); the loss and gradients do
    not depend on it."""
    model = _build("llama")
    ids, labels = _inputs()
    ref_out, ref_grads = _train_step(model, input_ids=ids, labels=labels)
    assert loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON)
    from fused_kernels.ops import fused_linear_cross_entropy as flce
    seen = []
    real = flce.chunk_rows
    monkeypatch.setattr(flce, "chunk_rows", lambda n, v, e, mb=None: seen.append(mb) or real(n, v, e, mb))
    for mb in (None, 1):
        monkeypatch.setattr(current(), "settings", types.SimpleNamespace(flce_chunk_mb=mb))
        seen.clear()
        out, grads = _train_step(model, input_ids=ids, labels=labels)
        assert seen and all(x == (float(mb) if mb else None) for x in seen), (mb, seen)
        assert_close(out.loss, ref_out.loss, FP32, f"chunk_mb={mb}: loss")
        for pname, ref_grad in ref_grads.items():
            assert_close(grads[pname], ref_grad, FP32, f"chunk_mb={mb}: grad {pname}")


def test_flce_chunk_variable_is_validated():
    from autopatch.config import ConfigError, load_settings

    assert load_settings({}).flce_chunk_mb is None
    assert load_settings({"FUSED_KERNELS_FLCE_CHUNK_MB": " 128 "}).flce_chunk_mb == 128
    with pytest.raises(ConfigError, match="FUSED_KERNELS_FLCE_CHUNK_MB.*positive whole number of MiB"):
        load_settings({"FUSED_KERNELS_FLCE_CHUNK_MB": "lots"})


# --- torch.nn.CrossEntropyLoss in modules whose causal LM computes its own loss ------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_cross_entropy_loss_module_matches_torch(kernels, dtype, reduction, label_smoothing):
    """_torch_ce.FusedCrossEntropyLoss against torch.nn.CrossEntropyLoss on the calls it takes (2-D input,
    integer target, no class weights): loss (in the input's dtype) and gradient, with ignored rows and an
    ignore_index of another value; all rows ignored gives torch's NaN for "mean"."""
    from autopatch.rules._torch_ce import FusedCrossEntropyLoss

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 37, generator=gen) * 3).to(dtype)
    for ignore_index in (-100, 5):
        target = torch.randint(0, 37, (12,), generator=gen)
        target[[1, 7]] = ignore_index
        results = []
        for loss_cls in (FusedCrossEntropyLoss, torch.nn.CrossEntropyLoss):
            leaf = logits.clone().requires_grad_(True)
            before = kernels.launch_counts().get("cross_entropy_fwd", 0)
            loss_fn = loss_cls(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
            loss = loss_fn(leaf, target)
            launched = kernels.launch_counts().get("cross_entropy_fwd", 0) - before
            loss.backward(torch.ones_like(loss))
            results.append((loss, leaf.grad, launched))
        (loss, grad, launched), (ref, ref_grad, _) = results
        assert launched == 1, "the fused kernel did not run"
        assert loss.dtype == ref.dtype == dtype and loss.shape == ref.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert_close(loss.float(), ref.float(), dtype, f"loss {reduction} ignore {ignore_index}", tol=tol)
        assert_close(grad.float(), ref_grad.float(), dtype, f"grad {reduction} ignore {ignore_index}", tol=tol)
    all_ignored = torch.full((12,), -100)
    fused = FusedCrossEntropyLoss(reduction=reduction)(logits.float(), all_ignored)
    ref = torch.nn.CrossEntropyLoss(reduction=reduction)(logits.float(), all_ignored)
    assert torch.equal(torch.isnan(fused), torch.isnan(ref)) and torch.equal(fused.nan_to_num(), ref.nan_to_num())


def test_fused_cross_entropy_loss_module_leaves_other_calls_to_torch(kernels):
    """Class weights, a (N, C, d) input, probability targets and float64 go to torch's own forward."""
    from autopatch.rules._torch_ce import FusedCrossEntropyLoss

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 5, generator=gen)
    target = torch.randint(0, 5, (6,), generator=gen)
    calls = [
        (dict(weight=torch.rand(5, generator=gen)), logits, target),
        ({}, torch.randn(6, 5, 3, generator=gen), torch.randint(0, 5, (6, 3), generator=gen)),
        ({}, logits, torch.softmax(torch.randn(6, 5, generator=gen), -1)),
        ({}, logits.double(), target),
    ]
    for kwargs, x, t in calls:
        before = kernels.launch_counts().get("cross_entropy_fwd", 0)
        fused = FusedCrossEntropyLoss(**kwargs)(x, t)
        assert kernels.launch_counts().get("cross_entropy_fwd", 0) == before
        assert torch.equal(fused, torch.nn.CrossEntropyLoss(**kwargs)(x, t))


def test_own_loss_modules_get_the_fused_torch_loss(kernels):
    """Bart's causal LM computes its loss with CrossEntropyLoss(): the module global is rebound (one
    record, idempotent, restored by restore_all); a tiny BartForCausalLM's loss and gradients match the
    unpatched model with the kernel running. Modules without the import get no such record."""
    import importlib

    from autopatch.rules._torch_ce import FusedCrossEntropyLoss

    bart = importlib.import_module("transformers.models.bart.modeling_bart")
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=1, decoder_attention_heads=4,
                                     decoder_ffn_dim=64, encoder_layers=1, encoder_attention_heads=4,
                                     encoder_ffn_dim=64, max_position_embeddings=64, is_decoder=True,
                                     is_encoder_decoder=False, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0)
    torch.manual_seed(0)
    model = bart.BartForCausalLM(config).float()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_ref, grads_ref = step()
    records = [r for r in loss_rule.RULE.patch_module(bart, current(), ALL_ON) if r.target == loss_rule.TORCH_LOSS]
    assert len(records) == 1 and records[0].patched and records[0].kernel == "cross_entropy", records
    assert bart.CrossEntropyLoss is FusedCrossEntropyLoss
    assert [r for r in loss_rule.RULE.patch_module(bart, current(), ALL_ON) if r.target == loss_rule.TORCH_LOSS] == records
    before = kernels.launch_counts().get("cross_entropy_fwd", 0)
    loss, grads = step()
    assert kernels.launch_counts().get("cross_entropy_fwd", 0) > before
    assert_close(loss, loss_ref, FP32, "loss")
    # the key projection's bias has a gradient of 0 in exact arithmetic (softmax ignores a shift): only
    # rounding noise, measured with the whole gradient
    assert_close(torch.cat([grads[n].flatten() for n in grads_ref]),
                 torch.cat([grads_ref[n].flatten() for n in grads_ref]), FP32, "all gradients")
    for name in grads_ref:
        if not name.endswith("k_proj.bias"):
            assert_close(grads[name], grads_ref[name], FP32, f"grad {name}")
    patching.restore_all()
    assert bart.CrossEntropyLoss is torch.nn.CrossEntropyLoss
    assert not [r for r in loss_rule.RULE.patch_module(_module("llama"), current(), ALL_ON) if r.target == loss_rule.TORCH_LOSS]


def test_own_loss_is_recognised_whatever_the_heads():
    """MusicGen computes its own loss (torch's CrossEntropyLoss, one per codebook) over several heads
    (self.lm_heads, no self.lm_head): the analysis still says it never calls loss_function, so the
    module's CrossEntropyLoss is rebound (its numbers: the coverage subset's musicgen row); the fused
    linear CE stays refused. A forward calling both once is still analysed as before."""
    import importlib

    from autopatch.rules._causal_lm_source import analyse_forward

    musicgen = importlib.import_module("transformers.models.musicgen.modeling_musicgen")
    analysis = analyse_forward(loss_rule._original_forward(musicgen.MusicgenForCausalLM))
    assert analysis.computes_own_loss and not analysis.ok, analysis
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    analysis = analyse_forward(loss_rule._original_forward(llama.LlamaForCausalLM))
    assert analysis.ok and not analysis.computes_own_loss
    records = [r for r in loss_rule.RULE.patch_module(musicgen, current(), ALL_ON) if r.target == loss_rule.TORCH_LOSS]
    assert len(records) == 1 and records[0].patched, records
