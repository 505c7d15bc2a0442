"""Every op on tensors just past 2**31 elements, on the GPU: forward and backward against float64
references computed chunk by chunk on the GPU (so that they fit), the rows whose elements lie past 2**31
checked on their own and the last row alone, the op's outputs poisoned with NaN first.

Each case holds 8-24 GiB of bf16 tensors (an H100's 80 GB is enough for any one of them) and frees them
before the next. The widths pick each op's paths on an H100/H200: RMSNorm 4096 (one Triton kernel each
way), 16384 (cluster backward), 20480 (chunked forward, split backward), 65536 (cluster forward and
backward); LayerNorm 4096 (whole rows), 16384 (cluster backward), 20480 (chunked both ways, dw/db from
their own kernel); cross entropy's planned path (shared memory at V = 128256) and its Triton kernel;
the GLU's row-view and flat paths. The failure message names the planned path.

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_wide_offsets_gpu.py -v -s
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F

import fused_kernels
from fused_kernels._gpu import device_facts
from fused_kernels.ops import cross_entropy as ce_module
from fused_kernels.ops import cross_entropy_config as ce_cfg
from fused_kernels.ops import gelu as gelu_module
from fused_kernels.ops import glu as glu_module
from fused_kernels.ops import layer_norm as ln_module
from fused_kernels.ops import layer_norm_config as ln_cfg
from fused_kernels.ops import rms_norm as rms_module
from fused_kernels.ops import rms_norm_config as rms_cfg
from fused_kernels.ops import rope as rope_module
from helpers import REL_TOL, poison_, poisoned_outputs

BOUNDARY = 2**31  # the first element index a 32-bit offset cannot reach
PAST = 64  # rows past the boundary in every case
BF16 = torch.bfloat16
TOL = REL_TOL[BF16]
LOSS_TOL = REL_TOL[torch.float32]
CHUNK_ELEMENTS = 2**26  # elements per reference chunk: 512 MiB in float64


@pytest.fixture(autouse=True)
def _fresh_memory():
    """Each case starts from freed memory and a fixed seed, and prints its peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    yield
    gc.collect()
    if torch.cuda.is_available():
        print(f"\n  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        torch.cuda.empty_cache()


def rows_past(row_elements: int) -> tuple[int, int]:
    """(rows, first row holding an element at or past 2**31) for rows of row_elements: PAST rows beyond it."""
    first_far = BOUNDARY // row_elements
    return first_far + PAST, first_far


def randn(*shape, device, scale=1.0):
    """Random bf16 values made on the device (no float32 copy of the whole tensor)."""
    t = torch.randn(shape, dtype=BF16, device=device)
    return t.mul_(scale) if scale != 1.0 else t


def check_rows(outputs: dict, reference, n_rows: int, first_far: int, chunk_rows: int, tol=TOL, where=""):
    """Each output (dim 0 = rows) against reference(start, end) -> {name: float64 rows start..end, ...} (called
    once per chunk, in order), chunk by chunk: the relative error over all rows, over the rows from first_far
    on (past 2**31) and of the last row, each within tol (a number, or one per output name). A NaN or inf
    anywhere fails, naming its first row."""
    sums = {name: {"rows past 2**31": [0.0, 0.0], "last row": [0.0, 0.0], "all rows": [0.0, 0.0]} for name in outputs}
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        refs = reference(start, end)
        for name, out in outputs.items():
            got = out[start:end].double().reshape(end - start, -1)
            ref = refs[name].reshape(end - start, -1)
            finite = torch.isfinite(got).all(1)
            if not bool(finite.all()):
                row = start + int((~finite).nonzero()[0])
                raise AssertionError(f"{name}: row {row} of {n_rows} holds NaN/inf (never written?){where}")
            err, norm = (got - ref).pow(2).sum(1), ref.pow(2).sum(1)
            parts = [("all rows", 0)] + ([("rows past 2**31", max(first_far - start, 0))] if end > first_far else [])
            parts += [("last row", end - start - 1)] if end == n_rows else []
            for part, lo in parts:
                sums[name][part][0] += err[lo:].sum().item()
                sums[name][part][1] += norm[lo:].sum().item()
        del refs
    for name, parts in sums.items():
        for part, (err, norm) in parts.items():
            rel = math.sqrt(err / norm) if norm else math.sqrt(err)
            bound = tol[name] if isinstance(tol, dict) else tol
            assert rel <= bound, f"{name}, {part}: relative error {rel:.3e} > {bound:.0e} ({n_rows} rows){where}"


def assert_rel(name, got, ref, tol=TOL, where=""):
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), f"{name} holds NaN/inf{where}"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= tol, f"{name}: relative error {rel:.3e} > {tol:.0e}{where}"


def chunk_of(row_elements: int) -> int:
    return max(1, CHUNK_ELEMENTS // row_elements)


# --- RMSNorm ------------------------------------------------------------------------------------------------

def check_rms_norm(device, n_cols: int, n_rows: int, first_far: int):
    facts = device_facts(device)
    paths = [rms_cfg.plan(rms_cfg.Call(n_rows, n_cols, BF16, BF16, d, dy_dtype=BF16), facts).path
             for d in ("forward", "backward")]
    where = f" [rms_norm {n_rows} x {n_cols} bf16, planned forward {paths[0]}, backward {paths[1]}]"
    x = randn(n_rows, n_cols, device=device, scale=2.0)
    w = randn(n_cols, device=device, scale=0.3).add_(1.0)
    dy = randn(n_rows, n_cols, device=device)
    x_in, w_in = x.detach().requires_grad_(True), w.clone().requires_grad_(True)
    with poisoned_outputs(rms_module):
        y = fused_kernels.rms_norm(x_in, w_in, eps=1e-6)  # casting "llama"
        y.backward(dy)
    w64 = w.double().requires_grad_(True)

    def reference(start, end):
        x64 = x[start:end].double().requires_grad_(True)
        xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = w64 * xhat.to(BF16).double()  # LlamaRMSNorm rounds xhat to x's dtype before the weight
        ref.backward(dy[start:end].double())
        return {"y": ref.detach(), "dx": x64.grad}

    check_rows({"y": y, "dx": x_in.grad}, reference, n_rows, first_far, chunk_of(n_cols), where=where)
    assert_rel("dw", w_in.grad, w64.grad, where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [4096, 16384, 20480, 65536])
def test_rms_norm_past_2_31(n_cols):
    check_rms_norm("cuda", n_cols, *rows_past(n_cols))


# --- LayerNorm ----------------------------------------------------------------------------------------------

def check_layer_norm(device, n_cols: int, n_rows: int, first_far: int):
    facts = device_facts(device)
    paths = [ln_cfg.plan(ln_cfg.Call(n_rows, n_cols, BF16, d, weight_dtype=BF16, dy_dtype=BF16, aligned=True),
                         facts).path for d in ("forward", "backward")]
    where = f" [layer_norm {n_rows} x {n_cols} bf16, planned forward {paths[0]}, backward {paths[1]}]"
    x = randn(n_rows, n_cols, device=device, scale=2.0)
    w = randn(n_cols, device=device, scale=0.3).add_(1.0)
    b = randn(n_cols, device=device, scale=0.5)
    dy = randn(n_rows, n_cols, device=device)
    x_in, w_in, b_in = x.detach().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with poisoned_outputs(ln_module):
        y = fused_kernels.layer_norm(x_in, w_in, b_in, 1e-5)
        y.backward(dy)
    w64, b64 = w.double().requires_grad_(True), b.double().requires_grad_(True)

    def reference(start, end):
        x64 = x[start:end].double().requires_grad_(True)
        ref = F.layer_norm(x64, (n_cols,), w64, b64, 1e-5)
        ref.backward(dy[start:end].double())
        return {"y": ref.detach(), "dx": x64.grad}

    check_rows({"y": y, "dx": x_in.grad}, reference, n_rows, first_far, chunk_of(n_cols), where=where)
    assert_rel("dweight", w_in.grad, w64.grad, where=where)
    assert_rel("dbias", b_in.grad, b64.grad, where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [4096, 16384, 20480])
def test_layer_norm_past_2_31(n_cols):
    check_layer_norm("cuda", n_cols, *rows_past(n_cols))


# --- RoPE ---------------------------------------------------------------------------------------------------

def _rope_reference(x64, cos64, sin64):
    """transformers' apply_rotary_pos_emb (half rotation) on (tokens, heads, head_dim) rows."""
    half = x64.shape[-1] // 2
    rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    return x64 * cos64[:, None, :] + rotated * sin64[:, None, :]


def check_rope(device, n_tokens: int, first_far: int, q_heads: int, k_heads: int, head_dim: int):
    """q, k as HF passes them: (1, heads, seq, head_dim) views of (1, seq, heads, head_dim) projections;
    cos / sin (1, seq, head_dim). q has n_tokens · q_heads · head_dim elements, its last tokens past 2**31."""
    where = f" [rope {n_tokens} tokens, {q_heads}/{k_heads} heads of {head_dim}, bf16]"

    def heads_view(t):  # (1, seq, heads, d) -> (1, heads, seq, d)
        return t.transpose(1, 2)

    q = randn(1, n_tokens, q_heads, head_dim, device=device)
    k = randn(1, n_tokens, k_heads, head_dim, device=device)
    angles = torch.arange(n_tokens, device=device, dtype=torch.float32)[:, None] * torch.logspace(
        0, -4, head_dim // 2, device=device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)[None]
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    del angles
    dq_out = randn(1, n_tokens, q_heads, head_dim, device=device)
    dk_out = randn(1, n_tokens, k_heads, head_dim, device=device)
    q_in, k_in = heads_view(q).detach().requires_grad_(True), heads_view(k).detach().requires_grad_(True)
    with poisoned_outputs(rope_module):
        q_out, k_out = fused_kernels.rope(q_in, k_in, cos, sin, 1)
        torch.autograd.backward((q_out, k_out), (heads_view(dq_out), heads_view(dk_out)))

    def tokens(t):  # (1, heads, seq, d) -> (seq, heads, d) rows of tokens
        return t[0].transpose(0, 1)

    def reference(start, end):
        c, s = cos[0, start:end].double(), sin[0, start:end].double()
        out = {}
        for name, x, dy in (("q", q, dq_out), ("k", k, dk_out)):
            x64 = x[0, start:end].double().requires_grad_(True)
            ref = _rope_reference(x64, c, s)
            ref.backward(dy[0, start:end].double())
            out[f"{name}_out"], out[f"d{name}"] = ref.detach(), x64.grad
        return out

    outputs = {"q_out": tokens(q_out), "k_out": tokens(k_out), "dq": tokens(q_in.grad), "dk": tokens(k_in.grad)}
    check_rows(outputs, reference, n_tokens, first_far, chunk_of(q_heads * head_dim), where=where)


@pytest.mark.gpu
def test_rope_past_2_31():
    """Llama-3-8B heads (32 q, 8 k, head_dim 128) over 512K + 64 tokens: q 4 GiB."""
    n_tokens, first_far = rows_past(32 * 128)
    check_rope("cuda", n_tokens, first_far, 32, 8, 128)


# --- SwiGLU / GeGLU -----------------------------------------------------------------------------------------

def check_glu(device, op: str, layout: str, n_cols: int):
    """`layout` "halves": gate and up the halves of one gate_up projection (row views, offsets up to 2·2**31);
    "contiguous": two tensors of their own (one flat row each)."""
    if layout == "halves":
        n_rows, _ = rows_past(n_cols)
        first_far = BOUNDARY // (2 * n_cols)  # the row stride is 2 · n_cols
        gate_up = randn(n_rows, 2 * n_cols, device=device)
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        n_rows, first_far = rows_past(n_cols)
        gate, up = randn(n_rows, n_cols, device=device), randn(n_rows, n_cols, device=device)
    where = f" [{op} {n_rows} x {n_cols} bf16, {layout}]"
    dout = randn(n_rows, n_cols, device=device)
    gate_in, up_in = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
    with poisoned_outputs(glu_module, "_empty_output"):
        out = getattr(fused_kernels, op)(gate_in, up_in)
        out.backward(dout)

    def reference(start, end):
        g64 = gate[start:end].double().requires_grad_(True)
        u64 = up[start:end].double().requires_grad_(True)
        act = F.silu(g64) if op == "swiglu" else F.gelu(g64, approximate="tanh")
        ref = act * u64
        ref.backward(dout[start:end].double())
        return {"out": ref.detach(), "dgate": g64.grad, "dup": u64.grad}

    check_rows({"out": out, "dgate": gate_in.grad, "dup": up_in.grad}, reference, n_rows, first_far,
               chunk_of(n_cols), where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("op,layout", [("swiglu", "halves"), ("geglu", "contiguous")])
def test_glu_past_2_31(op, layout):
    check_glu("cuda", op, layout, 8192)


# --- GELU ---------------------------------------------------------------------------------------------------

def check_gelu(device, n_cols: int, n_rows: int, first_far: int):
    where = f" [gelu {n_rows} x {n_cols} bf16, contiguous]"
    x = randn(n_rows, n_cols, device=device, scale=2.0)
    dout = randn(n_rows, n_cols, device=device)
    x_in = x.detach().requires_grad_(True)
    with poisoned_outputs(gelu_module):
        out = fused_kernels.gelu(x_in, "tanh")
        out.backward(dout)

    def reference(start, end):
        x64 = x[start:end].double().requires_grad_(True)
        ref = F.gelu(x64, approximate="tanh")
        ref.backward(dout[start:end].double())
        return {"out": ref.detach(), "dx": x64.grad}

    check_rows({"out": out, "dx": x_in.grad}, reference, n_rows, first_far, chunk_of(n_cols), where=where)


@pytest.mark.gpu
def test_gelu_past_2_31():
    check_gelu("cuda", 8192, *rows_past(8192))


# --- cross entropy ------------------------------------------------------------------------------------------

def _targets(n_rows: int, v: int, device) -> torch.Tensor:
    """Class indices with about 10 % ignored (-100), never the last row."""
    target = torch.randint(0, v, (n_rows,), device=device)
    target[torch.rand(n_rows, device=device) < 0.1] = -100
    target[-1] = v - 1
    return target


def _ce_rows(z64, target, coef):
    """(per-row loss, ∂/∂z scaled by coef (one value per row)) of float64 logits rows; 0 where ignored."""
    valid = target != -100
    lse = torch.logsumexp(z64, dim=-1)
    picked = z64.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    grad = torch.softmax(z64, dim=-1)
    grad.scatter_add_(1, target.clamp(min=0)[:, None], -torch.ones_like(lse)[:, None])
    return loss, grad.mul_((coef * valid)[:, None])


def check_cross_entropy(device, v: int, n_rows: int, first_far: int, path: str, reduction: str):
    """`path` "planned": plan()'s choice; "triton": the Triton kernel with LAUNCH_TABLE's shape for v.
    reduction "mean" with an upstream gradient of 0.5 (the backward scales the whole gradient in place),
    or "none" with one upstream value per row (scaled row by row)."""
    force = ce_cfg.launch_config(v) if path == "triton" else None
    planned = ce_cfg.plan(ce_cfg.Call(n_rows, v, BF16, BF16, True), device_facts(device)) if force is None else None
    where = f" [cross_entropy {n_rows} x {v} bf16, {reduction}, path {planned.path if planned else 'triton (forced)'}]"
    logits = randn(n_rows, v, device=device, scale=2.0)
    target = _targets(n_rows, v, device)
    n_valid = int((target != -100).sum())
    upstream = torch.rand(n_rows, device=device) + 0.5 if reduction == "none" else torch.tensor(0.5, device=device)
    x_in = logits.detach().requires_grad_(True)
    old = dict(ce_module._CONFIG)
    ce_module._CONFIG.update(poison=True, force=force)
    try:
        loss = fused_kernels.cross_entropy(x_in, target, reduction=reduction)
        loss.backward(upstream)
    finally:
        ce_module._CONFIG.update(old)
    coef = upstream.double() if reduction == "none" else torch.full((n_rows,), 0.5 / n_valid, device=device,
                                                                     dtype=torch.float64)
    total = [0.0]

    def reference(start, end):
        rows_loss, grad = _ce_rows(logits[start:end].double(), target[start:end], coef[start:end])
        total[0] += rows_loss.sum().item()
        return {"dlogits": grad, "loss": rows_loss}

    outputs = {"dlogits": x_in.grad, **({"loss": loss} if reduction == "none" else {})}
    check_rows(outputs, reference, n_rows, first_far, chunk_of(v), tol={"dlogits": TOL, "loss": LOSS_TOL}, where=where)
    if reduction == "mean":
        ref = total[0] / n_valid
        assert abs(loss.item() - ref) <= LOSS_TOL * abs(ref), f"loss {loss.item()} vs {ref}{where}"


@pytest.mark.gpu
@pytest.mark.parametrize("path,reduction", [("planned", "mean"), ("triton", "none")])
def test_cross_entropy_past_2_31(path, reduction):
    """Llama-3's vocabulary: 16808 rows of 128256 classes, logits and their gradient 4 GiB each."""
    check_cross_entropy("cuda", 128256, *rows_past(128256), path, reduction)


# --- fused linear cross entropy -----------------------------------------------------------------------------

def check_fused_linear_cross_entropy(device, v: int, hidden_size: int, n_rows: int, first_far: int):
    """One logits chunk of all n_rows tokens (chunk_mb large enough), so the cross-entropy kernel and the
    entropy statistic's kernel run over a chunk of more than 2**31 elements; loss, grad hidden, grad weight."""
    chunk_mb = math.ceil(n_rows * v * 2 / 2**20) + 16
    where = f" [fused_linear_cross_entropy {n_rows} tokens, H {hidden_size}, V {v} bf16, one chunk of {chunk_mb} MiB]"
    hidden = randn(n_rows, hidden_size, device=device)
    weight = randn(v, hidden_size, device=device, scale=2.0 / math.sqrt(hidden_size))
    target = _targets(n_rows, v, device)
    n_valid = int((target != -100).sum())
    h_in, w_in = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    stats = {"token_loss": None, "entropy": None}
    old = dict(ce_module._CONFIG)
    ce_module._CONFIG.update(poison=True)
    try:
        loss = fused_kernels.fused_linear_cross_entropy(h_in, w_in, target, chunk_mb=chunk_mb, stats=stats)
        loss.backward()
    finally:
        ce_module._CONFIG.update(old)
    w64 = weight.double()
    grad_w = torch.zeros_like(w64)
    coef = torch.full((n_rows,), 1.0 / n_valid, device=device, dtype=torch.float64)

    def reference(start, end):
        h64 = hidden[start:end].double()
        z64 = (h64 @ w64.t()).to(BF16).double()  # the op's logits are a bf16 GEMM output, as lm_head's are
        rows_loss, g = _ce_rows(z64, target[start:end], coef[start:end])
        grad_w.addmm_(g.t(), h64)
        entropy = -(torch.softmax(z64, dim=-1) * torch.log_softmax(z64, dim=-1)).sum(-1)
        entropy = torch.where(target[start:end] != -100, entropy, torch.zeros_like(entropy))
        return {"grad hidden": g @ w64, "token loss": rows_loss, "entropy": entropy}

    # token losses and entropies: fp32 sums over the same bf16 logits as the reference's
    outputs = {"grad hidden": h_in.grad, "token loss": stats["token_loss"], "entropy": stats["entropy"]}
    check_rows(outputs, reference, n_rows, first_far, chunk_of(v),
               tol={"grad hidden": TOL, "token loss": 1e-4, "entropy": 1e-4}, where=where)
    assert_rel("grad weight", w_in.grad, grad_w, where=where)
    ref = stats["token_loss"].double().sum().item() / n_valid
    assert abs(loss.item() - ref) <= LOSS_TOL * abs(ref), f"loss {loss.item()} vs its token losses {ref}{where}"


@pytest.mark.gpu
def test_fused_linear_cross_entropy_past_2_31():
    """16808 tokens x 128256 classes in one chunk (4 GiB of logits); hidden size 256 keeps the GEMMs short."""
    check_fused_linear_cross_entropy("cuda", 128256, 256, *rows_past(128256))
