"""Activations shared by the GLU, GELU-MLP and MoE-experts kernels: act(g) and act'(g) in fp32, selected by a
constexpr (SILU, GELU_TANH, GELU_ERF, GELU_QUICK). The math is in fused_kernels/glu.py's docstring;
GELU_QUICK (CLIP's quick_gelu) is g σ(1.702 g), derivative σ(1.702 g) (1 + 1.702 g (1 − σ(1.702 g)))."""

from __future__ import annotations

import triton
import triton.language as tl

SILU = 0
GELU_TANH = 1
GELU_ERF = 2
GELU_QUICK = 3
GELU_APPROXIMATE = {"tanh": GELU_TANH, "none": GELU_ERF}  # torch's gelu(approximate=...) -> selector

# Constants are written as literals inside the kernels: √(2/π) = 0.7978845608028654,
# 2√(2/π) = 1.5957691216057308, 1/√2 = 0.7071067811865476, 1/√(2π) = 0.3989422804014327,
# the GELU-tanh cubic coefficient 0.044715 and 3 × 0.044715 = 0.134145.


@triton.jit
def gate_act(g, ACT: tl.constexpr):
    """act(g) in fp32."""
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = g * tl.sigmoid((g + 0.044715 * g * g * g) * 1.5957691216057308)
    elif ACT == 3:
        a = g * tl.sigmoid(1.702 * g)
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    return a


@triton.jit
def gate_act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32, sharing the sigmoid / erf between the two."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        g2 = g * g
        s = tl.sigmoid((g + 0.044715 * g * g2) * 1.5957691216057308)
        a = g * s
        da = s + g * (2.0 * s * (1.0 - s)) * ((1.0 + 0.134145 * g2) * 0.7978845608028654)
    elif ACT == 3:
        s = tl.sigmoid(1.702 * g)
        a = g * s
        da = s * (1.0 + 1.702 * g * (1.0 - s))
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * (tl.exp(-0.5 * g * g) * 0.3989422804014327)
    return a, da
