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


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True,
                  moments: Tensor | None = None) -> Tensor:
    """Normalise ``values`` to zero mean, unit (population) variance over the masked entries; 0 outside the mask.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the scale changes).
    ``moments`` = ``[Σ m x, Σ m x², Σ m]`` (``token_moments``) of a larger batch the statistics are taken over
    instead, e.g. summed over data-parallel ranks (REINFORCE++'s global normalisation, Hu 2025, arXiv 2501.03262,
    eq. 10); a batch with no spread or no token then gives 0.
    """
    mask = mask.to(values.dtype)
    if moments is None:
        mean = masked_mean(values, mask)
        var = masked_mean((values - mean) ** 2, mask)
    else:
        mean = moments[0] / moments[2].clamp(min=1.0)
        var = (moments[1] / moments[2].clamp(min=1.0) - mean * mean).clamp(min=0.0)
        if float(moments[2]) == 0 or float(var) == 0.0:
            return torch.zeros_like(values)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def token_moments(values: Tensor, mask: Tensor) -> Tensor:
    """``[Σ m x, Σ m x², Σ m]`` over the masked entries (what ``masked_whiten(moments=...)`` reads; sum them over
    ranks for the global batch's statistics)."""
    maskf = mask.to(values.dtype)
    return torch.stack([(values * maskf).sum(), (values * values * maskf).sum(), maskf.sum()])
