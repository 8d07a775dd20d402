"""SPO's persistent per-prompt value tracker (Xu & Ding 2025, "Single-stream Policy Optimization", arXiv
2509.13232; reference code ``verl-project/verl-recipe`` ``spo/spo_ray_trainer.py``; docs/algorithms.md, SPO).

A prompt ``x`` keeps a Beta posterior ``(α, β)`` over its success probability; ``v̂(x) = α / (α + β)`` is the
baseline of its next rollout. After each visit the evidence is discounted by ``ρ(x)`` and the outcome added:
``α ← ρα + r``, ``β ← ρβ + (1 - r)``, which is the moving average
``v̂_new = v̂_old + η_x (r - v̂_old)`` with ``η_x = 1 / (ρ N + 1)``, ``N = α + β`` before the update.
``ρ`` shrinks with how far the policy moved since the prompt's last visit (``spo_discount``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def beta_tracker_update(alpha: Tensor, beta: Tensor, reward: Tensor, rho: Tensor | float) -> tuple[Tensor, Tensor]:
    """SPO's tracker update (Xu & Ding 2025): ``(ρα + r, ρβ + (1 - r))``, elementwise.

    With ``N = α + β`` the new mean is ``v̂ + (r - v̂) / (ρN + 1)``: the moving average's ``η_x = 1/(ρN + 1)``.
    ``r`` is the outcome in ``[0, 1]`` (binary in the paper; a fractional reward splits between α and β).

    Example:
        >>> beta_tracker_update(torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([1.0]), 1.0)
        (tensor([1.5000]), tensor([0.5000]))
    """
    reward = torch.as_tensor(reward, dtype=alpha.dtype, device=alpha.device)
    rho = torch.as_tensor(rho, dtype=alpha.dtype, device=alpha.device)
    return rho * alpha + reward, rho * beta + (1.0 - reward)


def tracker_value(alpha: Tensor, beta: Tensor) -> Tensor:
    """``v̂ = α / (α + β)``, the tracker's estimate of a prompt's success probability (SPO)."""
    return alpha / (alpha + beta)


def spo_discount(divergence: Tensor, half_life: float = 0.06, rho_min: float = 0.875,
                 rho_max: float = 0.96) -> Tensor:
    """SPO's evidence discount ``ρ = clamp(2^(-D / D_half), ρ_min, ρ_max)``: the further the policy moved, the
    less older evidence counts (the form and constants are the reference code's).

    ``D`` is the token mean of ``|log π_then - log π_now|`` on the prompt's last stored response (0 on a first
    visit, giving ``ρ_max``). ``D_half``: the divergence that halves the evidence before clamping.
    """
    if half_life <= 0 or not 0 < rho_min <= rho_max <= 1:
        raise ValueError(f"spo_discount: need half_life > 0 and 0 < rho_min <= rho_max <= 1, got {half_life}, "
                         f"{rho_min}, {rho_max}")
    return torch.pow(2.0, -divergence / half_life).clamp(rho_min, rho_max)


def tracker_sampling_weights(value: Tensor, explore: float = 0.05) -> Tensor:
    """SPO's prioritised prompt sampling weights ``w = sqrt(v̂ (1 - v̂)) + ε`` (form and ε = 0.05 from the
    reference code).

    Prompts the policy always or never solves (``v̂`` near 0 or 1) carry little learning signal and are drawn
    less often; ``ε`` keeps every prompt reachable.
    """
    return torch.sqrt((value * (1.0 - value)).clamp(min=0.0)) + explore


def normalized_advantages(advantages: Tensor, mean: Tensor | None = None, std: Tensor | None = None,
                          eps: float = 1e-8) -> Tensor:
    """SPO's batch normalisation ``Ã = (A - mean_B(A)) / (std_B(A) + eps)`` (Xu & Ding 2025),
    with Bessel's std as the reference code uses.

    ``mean``/``std`` may be given (the global batch's under data parallelism). A batch of one (no std) or with
    no spread gets ``Ã = 0``, never NaN.

    Example:
        >>> normalized_advantages(torch.tensor([1.0, 0.0]))      # mean 0.5, Bessel std 0.7071
        tensor([ 0.7071, -0.7071])
    """
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be 1-D [N], got shape {tuple(advantages.shape)}")
    if mean is None:
        mean = advantages.mean()
    if std is None:
        std = advantages.std() if advantages.numel() > 1 else advantages.new_zeros(())
    centered = advantages - mean
    if not bool(torch.isfinite(std)) or float(std) == 0.0:
        return torch.zeros_like(advantages)
    return centered / (std + eps)
