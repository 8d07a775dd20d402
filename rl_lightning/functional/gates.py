"""FlashREINFORCE's trajectory filter (Hu et al. 2026, "FlashREINFORCE: Critic-free single-rollout asynchronous
RL for agentic language models"; reference code ``yifanzhang-pro/FlashREINFORCE``; docs/algorithms.md).

Per sampled token, the KL between two Bernoulli distributions {this token, any other token} under the rollout
policy (probability ``p``) and the current policy (``q``); a trajectory is kept when the mean over its
model-generated tokens is at most δ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: probabilities are clamped to ``[PROB_EPS, 1 - PROB_EPS]`` before the Bernoulli KL (the reference code's bounds)
PROB_EPS = 1e-6
_LOG_LOW, _LOG_HIGH = math.log(PROB_EPS), math.log1p(-PROB_EPS)


def bernoulli_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """Per-token Bernoulli KL (FlashREINFORCE's filter): ``d = p log(p/q) + (1-p) log((1-p)/(1-q))``.

    ``p = exp(logp)`` is the rollout (sampler) probability of the sampled token and ``q = exp(logq)`` the
    current policy's, at the same history. It is the KL from the sampler to the current policy of the two-way
    partition {the sampled token, every other token}, so by the data-processing inequality it is a lower bound
    of the full-vocabulary KL(μ ‖ π) at that state.

    Both probabilities are clamped to ``[1e-6, 1 - 1e-6]`` first (as the FlashREINFORCE reference code does): a
    confident token whose fp32 log-prob rounds to 0 under one policy would otherwise give ``log(1-q) = -inf``.
    ``1 - p`` is computed as ``-expm1(log p)``, so it stays accurate near ``p = 1``. The result is finite and
    ``>= 0`` (rounding below 0 is cut at 0), and 0 iff ``p = q`` within the clamp range. It is computed in
    float32 (float64 inputs stay float64); no gradient is meant to flow through it.

    Args:
        logp, logq: log-probabilities of the sampled tokens, the same shape (e.g. ``[B, T]``).

    Returns:
        ``d``, the shape of the inputs.

    Example:
        >>> bernoulli_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
        tensor([0.1438])   # 0.5 log 2 + 0.5 log(2/3)
    """
    if logp.shape != logq.shape:
        raise ValueError(f"bernoulli_kl: logp {tuple(logp.shape)} and logq {tuple(logq.shape)} differ in shape")
    dtype = torch.float64 if torch.float64 in (logp.dtype, logq.dtype) else torch.float32
    lp = logp.to(dtype).clamp(_LOG_LOW, _LOG_HIGH)
    lq = logq.to(dtype).clamp(_LOG_LOW, _LOG_HIGH)
    rest_p, rest_q = -torch.expm1(lp), -torch.expm1(lq)  # 1 - p, 1 - q
    d = lp.exp() * (lp - lq) + rest_p * (rest_p.log() - rest_q.log())
    return d.clamp_min(0.0)


def trajectory_gate(d: Tensor, mask: Tensor, delta: float) -> Tensor:
    """FlashREINFORCE's trajectory gate (Hu et al. 2026): ``m = 1[1/T Σ_t d_t <= δ]``.

    ``T`` counts the model-generated tokens of the row (``mask == 1``); values of ``d`` outside the mask are
    ignored (even NaN). A row with no generated token gets ``m = 0``.

    Args:
        d: ``[B, T]`` per-token divergences (``bernoulli_kl``).
        mask: ``[B, T]`` 1 on model-generated tokens.
        delta: the threshold δ (a row whose mean equals δ is kept).

    Returns:
        ``[B]`` float, 1 for kept rows and 0 for filtered ones.

    Example:
        >>> trajectory_gate(torch.tensor([[0.0, 0.2], [0.1, 9.0], [0.0, 0.0]]),
        ...                 torch.tensor([[1, 1], [1, 0], [0, 0]]), delta=0.1)
        tensor([1., 1., 0.])   # means 0.1, 0.1; the last row is empty
    """
    if d.shape != mask.shape or d.dim() != 2:
        raise ValueError(f"trajectory_gate: need d and mask of one [B, T] shape, got {tuple(d.shape)}, "
                         f"{tuple(mask.shape)}")
    dtype = d.dtype if d.is_floating_point() else torch.float32
    keep = mask.bool()
    lengths = keep.sum(dim=1)
    mean = torch.where(keep, d.to(dtype), 0.0).sum(dim=1) / lengths.clamp(min=1)
    return ((lengths > 0) & (mean <= delta)).to(dtype)
