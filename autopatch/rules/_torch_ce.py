"""`torch.nn.CrossEntropyLoss` for modeling modules that compute their own causal-LM loss with it
(`loss_fct = CrossEntropyLoss(); loss_fct(logits.view(-1, V), labels.view(-1))`: Bart, Marian, MBart,
Pegasus, PLBart, Blenderbot, ... decoders) instead of calling `self.loss_function`.

The loss rule rebinds such a module's global `CrossEntropyLoss` (imported from torch.nn) to
`FusedCrossEntropyLoss`, a subclass whose forward runs fused_kernels.cross_entropy on calls it computes
the same way torch does, and torch's forward on every other call:

  taken     no class weights; input (N, C) in fp32 / bf16 / fp16; integer target (N,); reduction
            "mean", "sum" or "none"; any ignore_index and label_smoothing
  result    torch's semantics: "mean" is the sum over non-ignored rows divided by their count on the
            device (NaN when every row is ignored, as torch gives; no host sync), returned in the
            input's dtype
"""

from __future__ import annotations

import torch

from autopatch.rules._kernels import fallback
from autopatch.session import current

KERNEL = "cross_entropy"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class FusedCrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss through fused_kernels.cross_entropy where the call allows (module
    docstring); isinstance checks against torch.nn.CrossEntropyLoss still hold. `session`: where its
    fallbacks are recorded, set by the loss rule when it rebinds a module's CrossEntropyLoss (a class
    attribute: the class is what the modules' globals name)."""

    session = None

    def _takes(self, input: torch.Tensor, target: torch.Tensor) -> bool:
        return (self.weight is None and self.reduction in ("mean", "sum", "none")
                and isinstance(input, torch.Tensor) and isinstance(target, torch.Tensor)
                and input.dim() == 2 and input.dtype in _FLOATS and target.dim() == 1
                and not target.is_floating_point() and not target.is_complex() and target.shape[0] == input.shape[0])

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self._takes(input, target):
            return super().forward(input, target)
        import fused_kernels as fk  # loaded by the loss rule before it rebinds the class: a dict lookup
        if not fk.triton_can_run(input, target):
            fallback(FusedCrossEntropyLoss.session or current(), KERNEL, f"CrossEntropyLoss got {input.device.type} tensors")
            return super().forward(input, target)
        if self.reduction == "mean":  # torch divides by the non-ignored rows: 0 / 0 = NaN when there are none
            total = fk.cross_entropy(input, target, ignore_index=self.ignore_index, reduction="sum",
                                     label_smoothing=self.label_smoothing)
            loss = total / (target != self.ignore_index).sum()
        else:
            loss = fk.cross_entropy(input, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing)
        return loss.to(input.dtype)


def installed(session) -> type:
    """FusedCrossEntropyLoss, reporting to `session` (what the loss rule binds)."""
    FusedCrossEntropyLoss.session = session
    return FusedCrossEntropyLoss
