"""LazyLogits: what a fused training call returns in the logits slot under AUTOPATCH_RETURN_LOGITS=auto
(autopatch.rules._flce_call): a tensor of the logits' shape and dtype with no storage, computed on the
first read that needs values."""

from __future__ import annotations

import torch


class LazyLogits(torch.Tensor):
    """The logits of a fused training call, computed only when read.

    A tensor subclass with the logits' shape, dtype and device but no storage. Metadata reads (shape,
    dtype, device, size(), dim(), requires_grad) and repr() compute nothing; any other use (an op, a
    method, indexing) computes the real logits once (`compute`: lm_head over the call's final hidden
    states, then the forward's scale and softcap; with a graph when grad is enabled, so a loss built on
    them back-propagates as on the plain model's; autopatch.rules._flce_call says so once on stderr),
    and runs on them.
    `materialize()` gives them as a plain tensor. Holding a LazyLogits keeps the final hidden states
    (and their graph) alive, as the plain model's logits would keep theirs."""

    @staticmethod
    def __new__(cls, shape, dtype, device, compute):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t._compute = compute
        t._value = None
        return t

    def materialize(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._compute()
            self._compute = None
        return self._value

    def __repr__(self, *, tensor_contents=None):
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, computed={self._value is not None})"

    def _lazy_cast(self, dtype):
        """A LazyLogits of another dtype over the same computation (accelerate's mixed-precision wrapper
        calls .float() on every bf16 tensor of an output; that alone must not compute the logits)."""
        if dtype == self.dtype:
            return self
        return LazyLogits(self.shape, dtype, self.device, lambda: self.materialize().to(dtype))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LAZY_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.detach and len(args) == 1 and not kwargs and args[0]._value is None:
            # DeepSpeed ZeRO-3 passes every output tensor of a module through an autograd function
            # whose forward is `outputs.detach()`; that alone must not compute the logits (it would
            # run lm_head inside DeepSpeed's hook)
            parent = args[0]
            return LazyLogits(parent.shape, parent.dtype, parent.device, lambda: parent.materialize().detach())
        if func in _LAZY_CASTS and isinstance(args[0], LazyLogits) and args[0]._value is None:
            dtype = _cast_dtype(func, args[1:], kwargs)
            if dtype is not None:
                return args[0]._lazy_cast(dtype)
        from torch.utils._pytree import tree_map

        def real(x):
            return x.materialize() if isinstance(x, LazyLogits) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only by code below torch functions (C++ callers); __torch_function__ handles Python's
        from torch.utils._pytree import tree_map

        def real(x):
            return x.materialize().detach() if isinstance(x, LazyLogits) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))


_LAZY_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
               torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64, torch.Tensor.to: None}


def _cast_dtype(func, args, kwargs):
    """The dtype a cast asks for, or None when it does more than change the dtype (a device, a copy,
    a memory format: then the logits are computed)."""
    fixed = _LAZY_CASTS[func]
    if fixed is not None:
        return fixed if not args and not kwargs else None
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype):
        return args[0]
    if not args and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    return None


_LAZY_METADATA = {torch.Tensor.size, torch.Tensor.dim} | {
    getattr(torch.Tensor, name).__get__
    for name in ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf", "grad_fn",
                 "is_sparse", "is_quantized", "is_meta", "is_nested")
}
