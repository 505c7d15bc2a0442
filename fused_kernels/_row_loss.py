"""The per-row math every cross-entropy path shares (cross_entropy's Triton kernel, cross_entropy_smem's
Gluon kernels, fused_linear_cross_entropy's side statistics), as Triton functions: the capped and scaled
logits z, the row's loss from its log-sum-exp, and the gradient of a block of logits. The derivation is in
fused_kernels/ops/cross_entropy.py's docstring."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def capped(x, logit_scale, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z = softcap · tanh(s·x / softcap) (or s·x) in fp32. tanh(a) = sign(a)·(1 − e)/(1 + e) with
    e = exp(−2|a|): no overflow, and no libdevice call (the interpreter and every Triton have exp).
    Per class one exp and one division: the capped kernels are bound by the GPU's special-function
    units (exp2, reciprocal), so x / softcap is a multiply by the scalar 1 / softcap (two units
    per class instead of three)."""
    z = x.to(tl.float32)
    if HAS_SCALE:
        z = z * logit_scale
    if HAS_SOFTCAP:
        a = z * (1.0 / softcap)
        e = tl.exp(-2.0 * tl.abs(a))
        t = (1.0 - e) / (1.0 + e)
        z = softcap * tl.where(a < 0, -t, t)
    return z


@triton.jit
def dlogits(p, z, cols, y, coef_p, coef_u, coef_y, softcap, HAS_SOFTCAP: tl.constexpr,
             HAS_TARGET: tl.constexpr = True):
    """∂loss/∂x for a block of one row from its softmax p (see the module docstring); the coefficients
    carry the normaliser and logit_scale: coef_p = c·(1 + 2λ·lse), coef_u = c·ε/V, coef_y = c·(1 − ε).
    HAS_TARGET False: a block known not to hold the target (no per-class compare)."""
    d = coef_p * p - coef_u
    if HAS_TARGET:
        d = tl.where(cols == y, d - coef_y, d)
    if HAS_SOFTCAP:
        c = tl.minimum(tl.abs(z) * (1.0 / softcap), 1.0)  # |z| <= softcap; masked lanes (z = -inf) give 0, not NaN
        d = d * (1.0 - c * c)
    return d


@triton.jit
def row_loss(lse, zy, sumz, inv_v, label_smoothing, z_loss, HAS_LS: tl.constexpr):
    """lse − z_y first: the loss may cancel to far below lse (p_y → 1, or V = 1), and each term added
    before that difference would be rounded at lse's scale (ε·(z_y − mean z) likewise, 0 when V = 1)."""
    loss = lse - zy
    if HAS_LS:  # (this grouping: no spills in cross_entropy_smem's 4- and 8-CTA kernels on triton 3.9)
        loss = loss + label_smoothing * zy - (label_smoothing * inv_v) * sumz
    return loss + z_loss * lse * lse
