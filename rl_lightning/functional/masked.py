"""Masked reductions over per-token tensors ``[B, T]`` with a ``mask`` that is 1 on counted tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements when ``dim`` is None)."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(values * mask) / sum(mask)``; rows with an empty mask give 0 instead of NaN.

    Example:
        >>> masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
        tensor(1.5000)
    """
    mask = mask.to(values.dtype)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Normalise ``values`` to zero mean, unit (population) variance over the masked entries; 0 outside the mask.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the scale changes).
    """
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask
