"""Argument checks the layers share: a clear InputError before any weight is allocated or launch made."""
from __future__ import annotations

import operator

import torch

from ..fusion.errors import InputError


def positive_ints(owner: str, **values) -> None:
    """Each value an int >= 1 (not a bool, not a float)."""
    for name, v in values.items():
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise InputError(f"{owner}: {name} must be a positive int, got {v!r}")


def float_dtype(owner: str, dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"{owner}: dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float16 "
                         f"or torch.float32), got {dtype!r}")


def hidden_states(owner: str, x, hidden: int) -> None:
    """x: a tensor [..., hidden] of floating-point values."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"{owner}: x must be a tensor [..., {hidden}], got {got}")
    if x.shape[-1] != hidden:
        raise InputError(f"{owner}: x has {x.shape[-1]} features, the layer {hidden}")
    if not x.is_floating_point():
        raise InputError(f"{owner}: x is {x.dtype}; pass the hidden states as a floating-point tensor")
