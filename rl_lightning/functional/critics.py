"""Critic-side formulas of BPCO, EasyPPO and SAO (docs/algorithms.md, "Shared pieces" and each method's row).

- BPCO (no paper found under that name; its λ is VAPO's, arXiv 2504.05118, its interval DPPO's Binary-TV, Qi et
  al. 2026, arXiv 2602.04879): a bounded value head (``bounded_value``), the length-adaptive GAE decay
  λ_π(L) = 1 - 1/(αL) (``length_adaptive_lambda``) and the divergence clipping interval [1 - ε/p_t, 1 + ε/p_t]
  (``divergence_clip_bounds``).
- EasyPPO (arXiv 2609.36802; reference code ``EasyPPO/EasyPPO``): the noise-weighted critic loss's per-prompt
  weights (``variance_weights``).
- SAO (Hou et al. 2026, arXiv 2607.07508): the token mask w_t = ρ_t 1[1 - ε_ℓ < ρ_t < 1 + ε_h]
  (``band_mask_weights``).

Shapes: per-sequence ``[B]``, per-token ``[B, T]``; groups are contiguous blocks of ``group_size`` rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _float_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype (integers, half precision, float32) computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """BPCO's length-adaptive actor GAE decay (VAPO, arXiv 2504.05118; docs/algorithms.md, BPCO):
    ``λ_π(L) = clamp(1 - 1/(α L), 0, 1)``.

    The rationale (VAPO, arXiv 2504.05118): the effective horizon of GAE is ``Σ_t λ^t = 1/(1 - λ) = α L``, so it
    grows with the response length ``L``. The unclamped formula is negative for ``L < 1/α``,
    hence the clamp to ``[0, 1]``; a row with ``L <= 0`` (no generated token) gets 0, with no division by 0.
    The critic uses ``λ_V = 1`` (not computed here). Reference settings: VAPO α = 0.05; SAO's actor λ is the
    same form with α = 1.5 (docs/algorithms.md, SAO); the default for tiny models is α = 0.5 (λ >= 0 from L = 2,
    docs/algorithms.md, BPCO).
    The result is the ``lam`` tensor ``gae`` accepts.

    Args:
        lengths: ``[B]`` response lengths (model-generated tokens per row), integer or float.
        alpha: α > 0.

    Returns:
        ``[B]`` float32 (float64 for float64 lengths), in ``[0, 1]``.

    Example:
        >>> length_adaptive_lambda(torch.tensor([0, 1, 2, 10]), alpha=0.5)
        tensor([0.0000, 0.0000, 0.0000, 0.8000])   # 1 - 1/(0.5 L): -1, 0, 0.8
    """
    if lengths.dim() != 1:
        raise ValueError(f"length_adaptive_lambda: lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"length_adaptive_lambda: alpha must be a finite number > 0, got {alpha}")
    length = lengths.to(_float_dtype(lengths))
    positive = length > 0
    lam = 1.0 - 1.0 / (alpha * torch.where(positive, length, 1.0))
    return torch.where(positive, lam, 0.0).clamp(0.0, 1.0)


def divergence_clip_bounds(logp_rollout: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """BPCO's divergence clipping interval (DPPO's Binary-TV, Qi et al. 2026, arXiv 2602.04879; docs/algorithms.md):
    ``[1 - ε/p_t, 1 + ε/p_t]`` with ``p_t = exp(logp_rollout)`` the sampled token's rollout probability.

    For the ratio ``ρ = π/p``, ``π - p = p(ρ - 1)``, so ``ρ`` lies in the interval iff ``|π - p| <= ε``: the
    boundaries are an absolute probability change of ε (DPPO's Binary-TV). For ``p < ε`` the lower bound is
    negative (inactive); for rare tokens ``ε/p`` is huge (effectively unclipped), by design. The bounds replace
    PPO's fixed ``(1 - ε_low, 1 + ε_high)`` in the clipped surrogate. Tiny default: ε = 0.1 (docs/algorithms.md,
    BPCO). ``ε/p`` is computed as ``ε · exp(-logp)``; no gradient is meant to flow through the bounds.

    Args:
        logp_rollout: log-probabilities of the sampled tokens under the rollout policy, any shape (``[B, T]``).
        eps: ε > 0, the allowed absolute change of the token's probability.

    Returns:
        ``(low, high)``, each the shape of ``logp_rollout`` (float32, float64 for float64 input).

    Example:
        >>> divergence_clip_bounds(torch.log(torch.tensor([0.5, 0.05])), eps=0.1)
        (tensor([ 0.8000, -1.0000]), tensor([1.2000, 3.0000]))
    """
    if not logp_rollout.is_floating_point():
        raise ValueError(f"divergence_clip_bounds: logp_rollout must be a float tensor, got {logp_rollout.dtype}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"divergence_clip_bounds: eps must be a finite number > 0, got {eps}")
    half_width = eps * torch.exp(-logp_rollout.detach().to(_float_dtype(logp_rollout)))  # ε / p
    return 1.0 - half_width, 1.0 + half_width


def variance_weights(rewards: Tensor, group_size: int, w_min: float, beta: float = 0.5) -> Tensor:
    """EasyPPO's noise-weighted critic loss weights (arXiv 2609.36802; docs/algorithms.md, EasyPPO):
    ``w_x = 1 / max(Var_pop(R_x)^β, w_min)``, normalised to mean 1 over the rows.

    ``Var_pop(R_x)`` is the population variance (1/G) of the rewards of prompt ``x``'s group (a contiguous block
    of ``group_size`` rows); each row gets its prompt's weight, and the weights are divided by their mean, so the
    weighted critic loss ``E[w_x (V(s_{i,t}) - R_i)^2]`` keeps the scale of the plain MSE (and equals it when
    every prompt has the same variance).

    This is the reference's parametrisation (EasyPPO's ``compute_prompt_variance_loss_weights``:
    ``1 / clamp(Var^β, min=w_min)``): the floor is on ``Var^β``, so at β = 1/2 it is the form
    ``1 / max(σ̂_x, ε)`` with ``ε = w_min`` on the standard deviation. The reference's shipped setting
    β = 0.5, ``w_min = 0.25`` is a variance floor of ``0.25² = 0.0625`` (for 0/1 rewards ``σ ≤ 0.5``). A
    zero-variance prompt (e.g. all rollouts equal) gets the largest weight ``1 / w_min``; with ``group_size = 1``
    every variance is 0, so every weight is 1; β = 0 gives ``Var^0 = 1`` and all ones. Their test case: rewards
    ``[0, 1, 0.5, 0.5]``, G = 2, β = 1, ``w_min = 0.01`` give ``[4, 4, 100, 100] / 52``. The weights are
    constants: the rewards are detached.

    Args:
        rewards: ``[B]`` scalar reward (return) per response, groups contiguous.
        group_size: ``G >= 1``, responses per prompt; must divide ``B``.
        w_min: the floor on ``Var^β`` (on the standard deviation at β = 1/2), > 0.
        beta: the exponent β >= 0 (β = 0 gives all ones).

    Returns:
        ``[B]`` weights with mean 1 (float32, float64 for float64 rewards).

    Example:
        >>> variance_weights(torch.tensor([0.0, 1.0, 0.5, 0.5]), 2, w_min=0.01, beta=1.0)
        tensor([0.0769, 0.0769, 1.9231, 1.9231])   # [4, 4, 100, 100] / 52
    """
    if rewards.dim() != 1:
        raise ValueError(f"variance_weights: rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(f"variance_weights: group_size={group_size} must be >= 1 and divide the "
                         f"{rewards.numel()} rewards")
    if not (math.isfinite(w_min) and w_min > 0):
        raise ValueError(f"variance_weights: w_min must be a finite number > 0, got {w_min}")
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"variance_weights: beta must be a finite number >= 0, got {beta}")
    grouped = rewards.detach().to(_float_dtype(rewards)).view(-1, group_size)  # [P, G]
    variance = grouped.var(dim=1, unbiased=False)  # population variance per prompt, [P]
    weights = variance.pow(beta).clamp_min(w_min).reciprocal()
    # every prompt has G rows, so the mean over the prompts is the mean over the rows
    weights = weights / weights.mean()
    return weights.repeat_interleave(group_size)


def band_mask_weights(ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """SAO's token masking (Hou et al. 2026, arXiv 2607.07508; docs/algorithms.md, SAO):
    ``w_t = ρ_t · 1[1 - ε_ℓ < ρ_t < 1 + ε_h]``, with ``ρ_t = π_θ(a_t|s_t) / μ(a_t|s_t)``.

    The indicator is held fixed (no gradient through it, strict bounds) and ``ρ`` keeps its gradient, so the
    actor loss ``-(w_t A_t)`` has gradient ``-1[band] ρ_t A_t ∇log π_θ``: a token outside the band contributes
    exactly zero for either sign of ``A`` (unlike PPO-clip, where an out-of-range token keeps its gradient when
    the unclipped term is the min). The bounds ``1 - ε_ℓ`` and ``1 + ε_h`` are rounded to the dtype of
    ``ratio`` before the comparison, so a ratio equal to a bound in that dtype is outside. ``ratio`` must come
    from plain sampling (T = 1, top-p = 1) or a matching recomputation of μ, else it is wrong.

    Reference settings (the SAO implementations in ``modelscope/twinkle`` and ``LegoX/Lego-RL``): math ε_ℓ = 0.3,
    ε_h = 5.0, i.e. the band (0.7, 6.0); coding/SWE: the band (0.2, 4.0) itself, i.e. ε_ℓ = 0.8, ε_h = 3.0.

    Args:
        ratio: ``ρ`` per token, any shape (``[B, T]``), float; differentiable.
        eps_low: ε_ℓ in ``[0, 1]``.
        eps_high: ε_h >= 0.

    Returns:
        ``w``, the shape and dtype of ``ratio``: ``ρ`` inside the band, 0 outside.

    Example:
        >>> band_mask_weights(torch.tensor([0.5, 0.7, 1.3, 6.0, 7.0]), eps_low=0.3, eps_high=5.0)
        tensor([0.0000, 0.0000, 1.3000, 0.0000, 0.0000])   # fp32(0.7) is the bound itself
    """
    if not ratio.is_floating_point():
        raise ValueError(f"band_mask_weights: ratio must be a float tensor, got {ratio.dtype}")
    if not (0.0 <= eps_low <= 1.0):
        raise ValueError(f"band_mask_weights: eps_low must lie in [0, 1], got {eps_low}")
    if not (math.isfinite(eps_high) and eps_high >= 0):
        raise ValueError(f"band_mask_weights: eps_high must be a finite number >= 0, got {eps_high}")
    low = torch.tensor(1.0 - eps_low, dtype=ratio.dtype, device=ratio.device)
    high = torch.tensor(1.0 + eps_high, dtype=ratio.dtype, device=ratio.device)
    detached = ratio.detach()
    inside = (detached > low) & (detached < high)
    # where (not ratio * indicator): an out-of-band inf/NaN ratio gives 0, not NaN, and its gradient is 0
    return torch.where(inside, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))


def bounded_value(h: Tensor, r_min: float, r_max: float) -> Tensor:
    """BPCO's bounded value head (docs/algorithms.md, BPCO):
    ``V = R_min + (R_max - R_min) · sigmoid(h)``, so ``R_min <= V_φ(s_t) <= R_max``.

    With outcome-only rewards and no discounting (γ = 1, λ_V = 1) the critic fits the observed final reward
    ``L_V = E[(V_φ(s_t) - R)^2]``, never targets built from its own predictions; the bound keeps its predictions
    in the reward range. It is computed as ``torch.lerp`` (so ``sigmoid(h) = 0`` or ``1`` gives
    ``r_min`` or ``r_max`` exactly, the bounds rounded to the dtype of ``h``) and clamped to ``[r_min, r_max]``
    against rounding; the gradient ``(R_max - R_min) sigmoid'(h)`` is finite, and 0 for saturated ``h``.

    Args:
        h: the value head's raw output, any shape.
        r_min, r_max: the reward range, finite, ``r_max > r_min`` (e.g. 0 and 1 for a 0/1 verifier).

    Returns:
        ``V``, the shape and dtype of ``h``, in ``[r_min, r_max]``.

    Example:
        >>> bounded_value(torch.tensor([-1e4, 0.0, 1e4]), 0.0, 1.0)
        tensor([0.0000, 0.5000, 1.0000])
    """
    if not h.is_floating_point():
        raise ValueError(f"bounded_value: h must be a float tensor, got {h.dtype}")
    if not (math.isfinite(r_min) and math.isfinite(r_max) and r_max > r_min):
        raise ValueError(f"bounded_value: need finite r_min < r_max, got r_min={r_min}, r_max={r_max}")
    low = torch.tensor(r_min, dtype=h.dtype, device=h.device)
    high = torch.tensor(r_max, dtype=h.dtype, device=h.device)
    # lerp evaluates r_max - (r_max - r_min)(1 - s) for s >= 1/2, so a saturated head gives the bounds exactly
    return torch.lerp(low, high, torch.sigmoid(h)).clamp(low, high)
