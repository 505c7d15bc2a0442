"""The vision_attention rule: Qwen2-VL-style towers under SDPA run each run of equal-length windows as one
SDPA batch. Tiny Qwen2-VL and Qwen2.5-VL heads (dev/coverage_matrix.py's builders, SDPA attention),
patched vs unpatched in fp32: the loss and every gradient, vision tower included, within 1e-6; windows
of several lengths (Qwen2.5-VL's windows cut by the image border, two image sizes); fewer SDPA calls;
the loop's random draws under dropout; what is left alone and why; FUSED_KERNELS=all alone in a fresh
process."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import modeling, verdict_of

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "coverage_matrix", Path(__file__).resolve().parents[1] / "dev" / "coverage_matrix.py")
coverage_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_matrix)

from autopatch import report  # noqa: E402
from autopatch.rules import vision_attention as rule  # noqa: E402
from autopatch.session import current  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_patches")
IMAGE, START, END = coverage_matrix.IMAGE, coverage_matrix.START, coverage_matrix.END
KERNEL = "vision_attention"


def _uneven_qwen2_5_vl():
    """Qwen2.5-VL with 2 x 2 merge-unit windows over a 6 x 6 and a 4 x 4 patch grid: window lengths 16, 8,
    8, 4 in the first image, 16 in the second; image token counts 9 and 4."""
    _, cls_name, cfg, _ = coverage_matrix._qwen2_5_vl()
    cfg.vision_config.window_size = 8
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 80, (2, 14), generator=g)
    ids[0, 1], ids[0, 2:11], ids[0, 11] = START, IMAGE, END
    ids[1, 1], ids[1, 2:6], ids[1, 6] = START, IMAGE, END
    inputs = dict(input_ids=ids, pixel_values=torch.randn(36 + 16, 24, generator=g),
                  image_grid_thw=torch.tensor([[1, 6, 6], [1, 4, 4]]), mm_token_type_ids=(ids == IMAGE).int())
    return "qwen2_5_vl", cls_name, cfg, inputs


BUILDERS = {"qwen2_vl": coverage_matrix._qwen2_vl, "qwen2_5_vl": coverage_matrix._qwen2_5_vl,
            "qwen2_5_vl uneven windows": _uneven_qwen2_5_vl}


def _build(name, attn="sdpa"):
    model_dir, cls_name, cfg, inputs = BUILDERS[name]()
    cfg._attn_implementation = attn
    for sub in cfg.sub_configs:
        getattr(cfg, sub)._attn_implementation = attn
    torch.manual_seed(0)
    module = modeling(model_dir)
    model = getattr(module, cls_name)(cfg).float()
    labels = inputs["input_ids"].clone()
    labels[labels >= IMAGE] = -100
    return module, model, dict(inputs, labels=labels)


class _CountSDPA:
    """Counts torch's SDPA calls and the batch size of each."""

    def __init__(self, monkeypatch):
        self.batches = []
        original = torch.nn.functional.scaled_dot_product_attention

        def counted(query, *args, **kwargs):
            self.batches.append(query.shape[0])
            return original(query, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tower_block_count(model) -> int:
    return len(model.model.visual.blocks)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_windows_batched_same_loss_and_gradients(name, monkeypatch):
    module, model, inputs = _build(name)
    sdpa = _CountSDPA(monkeypatch)
    loss0, grads0 = _step(model, inputs)
    plain_calls = len(sdpa.batches)

    records = rule.RULE.patch_module(module, current(), lambda kernel: True)
    attention = [r for r in records if r.target.endswith("VisionAttention.forward")]
    assert len(attention) == 1 and attention[0].patched, records
    current().reset_runs()
    current().add(records)
    sdpa.batches.clear()
    loss1, grads1 = _step(model, inputs)

    assert torch.isfinite(loss1) and loss1.item() != 0.0
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    vision = [n for n in grads0 if ".visual." in f".{n}"]
    assert vision and set(grads1) == set(grads0)
    for n in grads0:
        assert grads0[n].abs().sum() > 0 or n not in vision, f"{n}: a zero gradient proves nothing"
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-6, atol=1e-7, msg=n)
    # one call per tower block in the forward (windows of one length) or per run of equal lengths
    assert len(sdpa.batches) < plain_calls
    assert max(sdpa.batches) > 1, "windows went to SDPA as one batch"
    assert report.runs()[KERNEL]["calls"] == _tower_block_count(model)


def test_uneven_windows_are_grouped_by_length():
    cu = torch.tensor([0, 16, 24, 32, 36, 52], dtype=torch.int32)
    assert rule.window_runs(cu) == [(0, 1, 16), (16, 2, 8), (32, 1, 4), (36, 1, 16)]


def test_dropout_keeps_the_loops_random_draws():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    module = torch.nn.Module()
    module.num_key_value_groups = 1
    torch.manual_seed(5)
    loop = torch.cat([sdpa_attention_forward(module, a, b, c, None, dropout=0.5, scaling=0.3, is_causal=False)[0]
                      for a, b, c in zip(q.split(4, 2), k.split(4, 2), v.split(4, 2))], dim=1)
    torch.manual_seed(5)
    got, _ = rule.window_attention(sdpa_attention_forward, count=False)(
        module, q, k, v, attention_mask=None, dropout=0.5, scaling=0.3, is_causal=False, cu_seq_lens_q=cu,
        cu_seq_lens_k=cu)
    assert loop.abs().sum() > 0
    torch.testing.assert_close(got, loop, rtol=0, atol=0)


def test_a_call_without_cu_seqlens_gets_plain_sdpa():
    """Should another attention look the interface up while a patched forward runs (a thread), it gets
    transformers' SDPA: the same output as the registered function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 1, True
    want, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.3)
    got, _ = rule.window_attention(sdpa_attention_forward, count=False)(module, q, k, v, None, dropout=0.0,
                                                                        scaling=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_data_parallel_replica_runs_the_loop():
    module, model, inputs = _build("qwen2_5_vl")
    current().reset_runs()
    current().add(rule.RULE.patch_module(module, current(), lambda kernel: True))
    for block in model.model.visual.blocks:
        block.attn._is_replica = True
    _step(model, inputs)
    assert report.runs()[KERNEL]["calls"] == 0


def test_eager_and_the_text_decoder_are_untouched(monkeypatch):
    module, model, inputs = _build("qwen2_5_vl", attn="eager")
    loss0, grads0 = _step(model, inputs)
    records = rule.RULE.patch_module(module, current(), lambda kernel: True)
    current().reset_runs()
    current().add(records)
    loss1, grads1 = _step(model, inputs)
    assert loss1.item() == loss0.item()
    assert report.runs()[KERNEL]["calls"] == 0, "eager attention keeps its own loop"
    # the text decoder's look-up gets transformers' sdpa function, not the window attention
    assert module.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is module.ALL_ATTENTION_FUNCTIONS._registry["sdpa"]
    assert module.is_flash_attention_requested(model.config.vision_config) is False


def test_patches_while_a_model_is_built_under_another_default_device():
    """The hooks patch while the user's code builds the model, e.g. under `with torch.device("cuda"):`;
    the rule's probe runs on the CPU whatever the default device (here meta, which computes nothing)."""
    rule._numbers_agree.cache_clear()
    with torch.device("meta"):
        records = rule.RULE.patch_module(modeling("qwen2_5_vl"), current(), lambda kernel: True)
    assert verdict_of(records, "Qwen2_5_VLVisionAttention.forward").patched, records


def test_disabled_and_idempotent():
    module = modeling("qwen2_5_vl")
    off = verdict_of(rule.RULE.patch_module(module, current(), lambda kernel: False), "Qwen2_5_VLVisionAttention.forward")
    assert not off.patched and off.reason == "kernel vision_attention disabled"  # the template's wording
    first = rule.RULE.patch_module(module, current(), lambda kernel: True)
    second = rule.RULE.patch_module(module, current(), lambda kernel: True)
    assert first == second and verdict_of(first, "Qwen2_5_VLVisionAttention.forward").patched


_LOOP = '''
def forward(self, hidden_states, cu_seqlens, **kwargs):
    q = k = v = hidden_states
    attention_interface = None
    if is_flash_attention_requested(self.config):
        attn_output, _ = attention_interface(self, q, k, v, attention_mask=None, scaling=self.scaling,
                                             cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                             max_length_q=4, max_length_k=4, is_causal=False, **kwargs)
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        splits = [torch.split(tensor, lengths.tolist(), dim=2) for tensor in (q, k, v)]
        attn_outputs = [attention_interface(self, q, k, v, attention_mask=None, scaling=self.scaling, is_causal=False, **kwargs)[0]
                        for q, k, v in zip(*splits)]
        attn_output = torch.cat(attn_outputs, dim=1)
    return attn_output
'''


@pytest.mark.parametrize("change, why", [
    (None, None),
    (("dim=2) for tensor", "dim=1) for tensor"), "the other branch is not the split loop"),
    (("scaling=self.scaling, is_causal=False, **kwargs)[0]", "scaling=2.0, is_causal=False, **kwargs)[0]"),
     "the other branch is not the split loop"),
    (("cu_seq_lens_k=cu_seqlens", "cu_seq_lens_k=other"), "one cu_seqlens for queries and keys"),
    (("attn_output = torch.cat(attn_outputs, dim=1)", "attn_output = torch.cat(attn_outputs, dim=0)"),
     "the other branch is not the split loop"),
])
def test_structure_decides(change, why, tmp_path, monkeypatch):
    source = _LOOP if change is None else _LOOP.replace(*change)
    assert source != _LOOP or change is None
    path = tmp_path / "fake_vision_attention.py"
    path.write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("fake_vision_attention", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    form, got = rule.branch_form(fake.forward)
    if why is None:
        assert form == "comprehension" and got == ""
    else:
        assert form is None and why in got


_WEIGHTS_LOOP = _LOOP.replace(
    "attn_output, _ = attention_interface(self, q, k, v, attention_mask=None",
    "attn_output, attn_weights = attention_interface(self, q, k, v, attention_mask=None").replace(
    """        attn_outputs = [attention_interface(self, q, k, v, attention_mask=None, scaling=self.scaling, is_causal=False, **kwargs)[0]
                        for q, k, v in zip(*splits)]
""", """        attn_outputs, attn_weights = [], []
        for q, k, v in zip(*splits):
            attn_output, attn_weight = attention_interface(self, q, k, v, attention_mask=None, scaling=self.scaling, is_causal=False, **kwargs)
            attn_outputs.append(attn_output)
            attn_weights.append(attn_weight)
""")


@pytest.mark.parametrize("source, form", [(_LOOP, "comprehension"), (_WEIGHTS_LOOP, "weights"),
                                          (_WEIGHTS_LOOP.replace("attn_output, attn_weights = attention_interface",
                                                                 "attn_output, other = attention_interface"), None)])
def test_the_loop_forms(source, form, tmp_path):
    assert source.count("attn_weights") == {"comprehension": 0, "weights": 3, None: 2}[form]  # the edits took
    path = tmp_path / "fake_forms.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("fake_forms", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    got, why = rule.branch_form(fake.forward)
    assert got == form, why


def test_weights_per_window_are_listed():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 8, 10, 12], dtype=torch.int32)
    module = torch.nn.Module()
    module.num_key_value_groups = 1
    out, weights = rule.window_attention(sdpa_attention_forward, count=False, weights_per_window=True)(
        module, q, k, v, None, dropout=0.0, scaling=0.3, is_causal=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert weights == [None] * 4 and out.shape == (1, 12, 2, 8)


def test_paddleocr_vl_keeps_its_attention_weights_list():
    """PaddleOCR-VL's loop also collects each image's attention weights: patched, its attention still
    returns a list of one entry per image (None each under SDPA), and the step's numbers are the loop's."""
    archs = coverage_matrix.select(coverage_matrix.image_text_to_text_architectures(), ["PaddleOCRVLForConditionalGeneration"])
    model, inputs = coverage_matrix.build_generic_vlm(archs[0], attn="sdpa")
    module = modeling("paddleocr_vl")
    attention = next(m for m in model.modules() if type(m).__name__ == "PaddleOCRVisionAttention")
    seen = []
    attention.register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    loss0, grads0 = _step(model, inputs)
    verdict = verdict_of(rule.RULE.patch_module(module, current(), lambda kernel: True), "PaddleOCRVisionAttention.forward")
    assert verdict.patched and "weights listed" in verdict.variant, verdict
    loss1, grads1 = _step(model, inputs)
    plain, patched = seen[0], seen[-1]
    assert isinstance(plain, list) and plain and patched == plain
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.gpu
def test_gpu_bf16_qwen2_5_vl_tower():
    """On the GPU in bf16 (flash / cuDNN SDPA): the patched step's loss and vision gradients within 1e-2 of
    the loop's."""
    module, model, inputs = _build("qwen2_5_vl uneven windows")
    model = model.cuda().to(torch.bfloat16)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    loss0, grads0 = _step(model, inputs)
    rule.RULE.patch_module(module, current(), lambda kernel: True)
    loss1, grads1 = _step(model, inputs)
    assert torch.isfinite(loss1)
    torch.testing.assert_close(loss1.float(), loss0.float(), rtol=1e-2, atol=0)
    for n in grads0:
        if ".visual." in f".{n}" and grads0[n].float().norm() > 0:
            err = (grads1[n].float() - grads0[n].float()).norm() / grads0[n].float().norm()
            assert err < 1e-2, f"{n}: {err:.2e}"


@pytest.mark.slow
def test_compiled_tower_same_numbers():
    """torch.compile over the patched tower (the window lengths' host read breaks the graph there, as
    the loop's does): the loss and every gradient as the eager loop's, and the batched attention ran."""
    module, model, inputs = _build("qwen2_5_vl uneven windows")
    loss0, grads0 = _step(model, inputs)
    records = rule.RULE.patch_module(module, current(), lambda kernel: True)
    current().reset_runs()
    current().add(records)
    torch._dynamo.reset()
    model.model.visual = torch.compile(model.model.visual)
    loss1, grads1 = _step(model, inputs)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n.replace("visual.", "visual._orig_mod.")], grads0[n], rtol=1e-5,
                                   atol=1e-7, msg=n)
    assert report.runs()[KERNEL]["calls"] >= _tower_block_count(model)


_ENV_SCRIPT = '''
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("t", sys.argv[1])
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
module, model, inputs = t._build("qwen2_5_vl uneven windows")
loss, grads = t._step(model, inputs)
import autopatch
from autopatch import report
rows = [r.as_dict() for r in autopatch.applied() if r.kernel == "vision_attention"]
print(json.dumps({"loss": loss.item(), "records": rows, "runs": report.runs().get("vision_attention")}))
'''


@pytest.mark.slow
def test_from_the_environment_alone(tmp_path):
    """FUSED_KERNELS=all in a fresh process that imports nothing from autopatch before the model: the hooks
    patch the tower's attention, it runs, and the loss is the one with vision_attention turned off."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]

    def run(kernels):
        env = {k: v for k, v in os.environ.items() if k != "FUSED_KERNELS" and not k.startswith("AUTOPATCH_")}
        env.update(FUSED_KERNELS=kernels, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(repo), str(repo / "tests")]))
        proc = subprocess.run([sys.executable, "-c", _ENV_SCRIPT, str(Path(__file__).resolve())], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    on, off = run("all"), run("all,-vision_attention")
    assert [r["patched"] for r in on["records"]] == [True] and on["runs"]["calls"] > 0, on
    assert not any(r["patched"] for r in off["records"]), off
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6) and on["loss"] > 0
