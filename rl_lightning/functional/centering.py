"""Off-policy corrections for a sampler ``q`` that is not the learner ``p`` (Score Centering: Marek & Ryabinin
2026, arXiv 2609.20807; StableReinforce; TIS; docs/algorithms.md): score centering with the sampler's top-k head,
its Monte-Carlo form with auxiliary draws, and truncated importance sampling.

At a prefix ``s`` with score ``ψ_a = ∇ log p_a``, the off-policy update ``E_q[A ψ]`` contains the drift
``E_q[A] E_q[ψ]``, which is not zero when ``q != p`` (on-policy ``E_p[ψ] = 0``). Subtracting the sampler's mean
score ``c(s) = Σ_a q_a ψ_a`` leaves ``Cov_q(A, ψ)``. Every coefficient here is held fixed (no gradient): only
the learner's log-probs carry it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_lightning.functional.losses import PolicyGradientStats, aggregate
from rl_lightning.functional.masked import masked_mean

#: the clamp on ``1 - Σ_H q`` and ``1 - Σ_H p`` (the reference's 1e-6): a head covering the whole vocabulary
#: would make the tail ratio 0 / 0
TAIL_EPS = 1e-6


def _f(x: Tensor) -> Tensor:
    """``x`` in at least float32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _finite(logp: Tensor) -> Tensor:
    """``logp`` with ``-inf`` replaced by 0 (through ``where``, so no NaN gradient): ids off a top-p support have
    probability 0 and pass no gradient."""
    return torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))


def tail_ratio(learner_head_logprobs: Tensor, sampler_head_logprobs: Tensor, eps: float = TAIL_EPS) -> Tensor:
    """The tail ratio of top-k score centering (Marek & Ryabinin 2026, arXiv 2609.20807)::

        ρ = max(1 - Σ_{a∈H} q_a, eps) / max(1 - Σ_{a∈H} p_a, eps)

    The tokens outside the sampler's head ``H`` are assigned ``q̂_a = ρ p_a`` (the sampler's leftover mass
    spread as the learner spreads its own). Detached.

    Args:
        learner_head_logprobs: ``[..., k]`` full-vocabulary log-probs ``log p_a`` of the head ids.
        sampler_head_logprobs: ``[..., k]`` the sampler's full-vocabulary log-probs ``log q_a`` of the same ids.

    Returns:
        ``[...]`` the ratio.
    """
    if learner_head_logprobs.shape != sampler_head_logprobs.shape:
        raise ValueError(f"tail_ratio: head shapes differ: {tuple(learner_head_logprobs.shape)} vs "
                         f"{tuple(sampler_head_logprobs.shape)}")
    with torch.no_grad():
        p_head = _f(learner_head_logprobs).exp().sum(-1)
        q_head = _f(sampler_head_logprobs).exp().sum(-1)
        return (1.0 - q_head).clamp_min(eps) / (1.0 - p_head).clamp_min(eps)


def truncated_importance_weights(logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS; docs/algorithms.md, TIS): the detached per-token weight ``min(p / q, C)``.

    Args:
        logprobs: ``[N, T]`` learner log-probs of the sampled tokens.
        sampler_logprobs: ``[N, T]`` the sampler's log-probs of the same tokens.
        cap: ``C > 0``; ``inf`` gives the plain importance ratio.
    """
    if not cap > 0:
        raise ValueError(f"truncated_importance_weights: cap must be > 0, got {cap}")
    with torch.no_grad():
        return (_f(logprobs) - _f(sampler_logprobs)).exp().clamp(max=cap)


def score_centering_coefficients(
    learner_head_logprobs: Tensor, sampler_head_logprobs: Tensor, cap: float | None = None, eps: float = TAIL_EPS,
) -> Tensor:
    """The fixed coefficients ``r_a`` of the head in ``ĉ(s) = Σ_{a∈H} r_a ψ_a`` (Marek & Ryabinin 2026)::

        w ≡ 1:                 r_a = q_a - ρ p_a
        w_a = f(p_a / q_a):    r_a = q_a w_a - ρ_w p_a,   ρ_w = ρ f(1 / ρ)

    with ``f(x) = min(x, C)`` (``cap``). The second form centres ``w ψ``: the tail, ``q̂ = ρ p``, has weight
    ``f(p / q̂) = f(1/ρ)``, and ``Σ_a p_a ψ_a = 0`` turns the tail's sum into minus the head's. ``ρ`` is
    ``tail_ratio``. Ids with ``q_a = 0`` (outside the sampler's top-p support) or ``p_a = 0`` get ``r_a = q_a w_a``
    resp. ``-ρ_w p_a`` with the missing term 0. Detached.

    Returns:
        ``[..., k]`` the coefficients.
    """
    with torch.no_grad():
        p = _f(learner_head_logprobs).exp()
        q = _f(sampler_head_logprobs).exp()
        rho = tail_ratio(learner_head_logprobs, sampler_head_logprobs, eps).unsqueeze(-1)
        if cap is None:
            return q - rho * p
        if not cap > 0:
            raise ValueError(f"score_centering_coefficients: cap must be > 0 or None, got {cap}")
        ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), torch.zeros_like(p))
        rho_w = rho * (1.0 / rho).clamp(max=cap)
        return q * ratio.clamp(max=cap) - rho_w * p


def score_centered_loss(
    logprobs: Tensor,
    head_logprobs: Tensor,
    sampler_logprobs: Tensor,
    sampler_head_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    cap: float | None = None,
    eps: float = TAIL_EPS,
) -> tuple[Tensor, PolicyGradientStats]:
    """Top-k score-centred REINFORCE loss (Marek & Ryabinin 2026; the form of the reference implementation,
    ``vllm-project/vime`` ``vime/utils/score_centering.py``)::

        ℓ_t = -sg(A_t) [ sg(w_a) log p_a - Σ_{v∈H} sg(r_v) log p_v ]

    ``a`` the sampled token, ``H`` the sampler's recorded top-k ids at the position,
    ``r = score_centering_coefficients`` (``w ≡ 1`` when ``cap`` is None, else ``w = min(p/q, C)``, the
    importance-weighted variant). Aggregated with ``weights`` (``aggregate``).

    With the whole vocabulary as the head and ``w ≡ 1``, the logit gradient per position is ``-A (e_a - q)``,
    whatever ``p`` is; on-policy (``p = q``) the correction has expectation zero.

    Args:
        logprobs: ``[N, T]`` learner log-probs of the sampled tokens (carrying the gradient).
        head_logprobs: ``[N, T, k]`` learner log-probs at the sampler's head ids (carrying the gradient).
        sampler_logprobs: ``[N, T]`` the sampler's log-probs of the sampled tokens.
        sampler_head_logprobs: ``[N, T, k]`` the sampler's log-probs at its head ids (full-vocabulary normalised).
        advantages: ``[N, 1]`` or ``[N, T]``, detached.
        mask: ``[N, T]`` 1 on generated tokens.
        weights: ``[N, T]`` aggregation weights.
    """
    if head_logprobs.shape != sampler_head_logprobs.shape or head_logprobs.shape[:2] != logprobs.shape:
        raise ValueError(f"score_centered_loss: head log-probs {tuple(head_logprobs.shape)} and sampler head "
                         f"{tuple(sampler_head_logprobs.shape)} must both be [N, T, k] for logprobs "
                         f"{tuple(logprobs.shape)}")
    m = _f(mask)
    head = _finite(_f(head_logprobs))
    coefficients = score_centering_coefficients(head_logprobs, sampler_head_logprobs, cap, eps) * m.unsqueeze(-1)
    if cap is None:
        w = torch.ones_like(_f(logprobs))
    else:
        w = truncated_importance_weights(logprobs, sampler_logprobs, cap)
    adv = _f(advantages.detach())
    centred = w * _f(logprobs) - (coefficients * head).sum(-1)
    loss = aggregate(-adv * centred * m, weights)
    stats = PolicyGradientStats(logprob_mean=masked_mean(_f(logprobs.detach()), m),
                                advantage_mean=masked_mean(adv.expand_as(logprobs), m))
    return loss, stats


def mc_centered_loss(
    logprobs: Tensor, aux_logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor,
) -> tuple[Tensor, PolicyGradientStats]:
    """REINFORCE with Monte-Carlo score centring (StableReinforce; docs/algorithms.md)::

        ℓ_t = -sg(A_t) [ log p(a_t | s_t) - 1/K Σ_k log p(u_k | s_t) ],     u_k ~ q(·|s_t) independent of a_t

    ``1/K Σ_k ∇ log p(u_k)`` is an unbiased estimate of the sampler's mean score ``c(s)``; per position the logit
    gradient is ``-A (e_a - 1/K Σ_k e_{u_k})``: zero outside ``{a} ∪ {u_k}`` (the dense ``-p`` cancels), and its
    expectation over the draws is the exact centred ``-A (e_a - q)``.

    Args:
        logprobs: ``[N, T]`` learner log-probs of the sampled tokens (carrying the gradient).
        aux_logprobs: ``[N, T, K]`` learner log-probs at the recorded auxiliary draws (carrying the gradient).
        advantages, mask, weights: as ``score_centered_loss``.
    """
    if aux_logprobs.dim() != 3 or aux_logprobs.shape[:2] != logprobs.shape or aux_logprobs.shape[-1] < 1:
        raise ValueError(f"mc_centered_loss: aux_logprobs must be [N, T, K >= 1] for logprobs "
                         f"{tuple(logprobs.shape)}, got {tuple(aux_logprobs.shape)}")
    m = _f(mask)
    aux = _finite(_f(aux_logprobs))
    adv = _f(advantages.detach())
    centred = _f(logprobs) - aux.mean(-1)
    loss = aggregate(-adv * centred * m, weights)
    stats = PolicyGradientStats(logprob_mean=masked_mean(_f(logprobs.detach()), m),
                                advantage_mean=masked_mean(adv.expand_as(logprobs), m))
    return loss, stats


def head_mass(head_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Token mean of ``Σ_{a∈H} exp(log p_a)``: how much of a distribution the recorded head covers (a metric)."""
    mass = _f(head_logprobs.detach()).exp().sum(-1)
    return masked_mean(torch.where(torch.isfinite(mass), mass, torch.zeros_like(mass)), _f(mask))


__all__ = [
    "TAIL_EPS", "head_mass", "mc_centered_loss", "score_centered_loss", "score_centering_coefficients",
    "tail_ratio", "truncated_importance_weights",
]
