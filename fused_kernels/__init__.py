"""Fused Triton kernels for LLM training. torch + triton only; no transformers import.

Functional API (names fixed; see DESIGN.md):
    rms_norm, rope, swiglu, geglu, cross_entropy, fused_linear_cross_entropy
    (+ glu_linear: the GLU and the down projection, without keeping their product;
     gelu, gelu_linear: a plain MLP's GELU and its second projection, without keeping gelu(h);
     moe_experts: a mixture-of-experts layer's experts, routing to weighted combine)
Every op has forward and backward kernels, is registered as a torch.library custom op with a fake
implementation (so torch.compile(fullgraph=True) traces it) and runs where Triton runs: CUDA, or the
CPU under TRITON_INTERPRET=1. Which kernel and launch shape an op runs is decided in one place,
plan(call, device) in its fused_kernels.ops.<op>_config, which returns a fused_kernels._dispatch.Plan;
the GPU primitives several ops share live in fused_kernels._gpu.
"""

from fused_kernels._utils import interpreter_on, launch_counts, reset_launch_counts, triton_can_run
from fused_kernels.ops.rms_norm import rms_norm
from fused_kernels.ops.layer_norm import layer_norm
from fused_kernels.ops.rope import rope
from fused_kernels.ops.glu import geglu, glu_linear, swiglu
from fused_kernels.ops.gelu import gelu, gelu_linear
from fused_kernels.ops.cross_entropy import cross_entropy
from fused_kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from fused_kernels.ops.moe_experts import moe_experts

__all__ = [
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "glu_linear",
    "gelu",
    "gelu_linear",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "moe_experts",
    "triton_can_run",
    "interpreter_on",
    "launch_counts",
    "reset_launch_counts",
]
