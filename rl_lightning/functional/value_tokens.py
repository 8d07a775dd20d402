"""A generative critic's value tokens and TEMPO's macro-step targets (TEMPO's generative critic and macro-step
returns, AC2's value token; docs/algorithms.md, TEMPO and AC2).

The critic is the policy itself: after a critic context it emits one token of a fixed grid of ``K`` value tokens
standing for ``K`` evenly spaced values ``v_0 < .. < v_{K-1}`` on ``[R_min, R_max]`` (``value_levels``). Its value
is the expectation of the next-token distribution restricted to the grid ids (``value_from_grid``); it learns by
cross-entropy to the target's nearest bin (``nearest_bin``, ``value_token_ce``: AC2's "rounded group mean"), or
TEMPO's way, as a policy rewarded by accuracy (``accuracy_advantages``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_levels(r_min: float, r_max: float, bins: int = 11, device: torch.device | str | None = None) -> Tensor:
    """``[K]`` the grid's values ``v_k = R_min + k (R_max - R_min) / (K - 1)`` (e.g. 11 bins on [0, 1], 0.1 apart).

    Example:
        >>> value_levels(0.0, 1.0, 3).tolist()
        [0.0, 0.5, 1.0]
    """
    if bins < 2 or not r_min < r_max:
        raise ValueError(f"value_levels: need bins >= 2 and R_min < R_max, got {bins}, [{r_min}, {r_max}]")
    return torch.linspace(r_min, r_max, bins, device=device)


def value_from_grid(logprobs: Tensor, grid: Tensor) -> Tensor:
    """``[C]`` ``V = Σ_k p_k v_k`` with ``p = softmax(logprobs)`` over the ``K`` grid ids only (the value token's
    distribution restricted to the grid and renormalised: TEMPO's generative critic, AC2's value token).

    ``logprobs`` ``[C, K]``: next-token log-probs (or logits) of the grid ids after each context; any constant
    per context cancels. ``grid`` ``[K]``: the values ``v_k``.

    Example:
        >>> value_from_grid(torch.log(torch.tensor([[0.2, 0.2]])), torch.tensor([0.0, 1.0])).tolist()
        [0.5]
    """
    if logprobs.dim() != 2 or logprobs.shape[1] != grid.numel():
        raise ValueError(f"value_from_grid: logprobs {tuple(logprobs.shape)} must be [C, {grid.numel()}]")
    return torch.softmax(logprobs.float(), dim=-1) @ grid.to(logprobs.device).float()


def nearest_bin(target: Tensor, grid: Tensor) -> Tensor:
    """``[C]`` long: the bin of each target on an evenly spaced ``grid`` ``[K]``: ``target`` clipped to
    ``[v_0, v_{K-1}]``, then ``k = floor((t - v_0) / Δ + 1/2)`` -- a target exactly between two bins goes to the
    upper one (round half up; within 1e-6 of a bin's width, so a float32 0.95 counts as the edge). AC2's value
    token target is the group mean rounded this way.

    Example:
        >>> nearest_bin(torch.tensor([-3.0, 0.04, 0.05, 0.95, 2.0]), torch.linspace(0, 1, 11)).tolist()
        [0, 0, 1, 10, 10]
    """
    k = grid.numel()
    if k < 2 or not bool((grid[1:] > grid[:-1]).all()):
        raise ValueError("nearest_bin: the grid must hold >= 2 increasing values")
    lo, hi = float(grid[0]), float(grid[-1])
    position = (target.double().clamp(lo, hi) - lo) / (hi - lo) * (k - 1)
    return torch.floor(position + 0.5 + 1e-6).long().clamp(0, k - 1)  # float32 0.95 -> 9.4999999 is the edge


def value_token_ce(logprobs: Tensor, bins: Tensor) -> Tensor:
    """``[C]`` the cross-entropy ``-log p_{bin}`` of the target bins under the grid-restricted distribution
    (``p = softmax(logprobs)`` over the ``K`` grid ids, as in ``value_from_grid``); ``logprobs`` ``[C, K]``,
    ``bins`` ``[C]`` (``nearest_bin``): AC2 trains its critic with it, the target being the value token of the
    rounded group mean.

    Example:
        >>> value_token_ce(torch.log(torch.tensor([[0.25, 0.75]])), torch.tensor([1])).tolist()  # -log 0.75
        [0.2876820...]
    """
    return -torch.log_softmax(logprobs.float(), dim=-1).gather(-1, bins.long().unsqueeze(-1)).squeeze(-1)


def accuracy_advantages(values: Tensor, targets: Tensor, group_size: int, r_min: float, r_max: float,
                        scale: bool = False, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(rewards, advantages)`` ``[N]`` of a critic's sampled estimates (TEMPO's critic training;
    docs/algorithms.md, TEMPO): ``r = -|V̂ - y| / (R_max - R_min)`` (the write-up's ``-|V̂ - G| / R_max`` when
    ``R_min = 0``), centred within each state's group of ``group_size`` contiguous estimates, ``A = r - mean_G(r)``;
    ``scale`` also divides by the group's population std plus ``eps`` (whether TEMPO uses the std is not published,
    so it is a flag).

    Example:
        >>> accuracy_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0.25, 0.25]), 2, 0.0, 1.0)[1].tolist()
        [0.25, -0.25]
    """
    if values.shape != targets.shape or values.dim() != 1 or values.numel() % group_size:
        raise ValueError(f"accuracy_advantages: values {tuple(values.shape)} and targets {tuple(targets.shape)} "
                         f"must be the same [N] with N divisible by group_size={group_size}")
    rewards = -(values.float() - targets.float()).abs() / (r_max - r_min)
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return rewards, centred.reshape(-1)


def macro_step_returns(segment_rewards: Tensor, terminated: Tensor, end_values: Tensor) -> Tensor:
    """``[N]`` TEMPO's ``G_i = Σ_{h<H} r_{i,h} + V̂(s_{i,H})`` (TEMPO, undiscounted): each branch's summed
    segment reward plus the critic's value of its end state, detached; a terminated branch's end has value 0,
    so its ``end_values`` entry is ignored (it may be NaN: the critic need not be queried there).

    Example:
        >>> macro_step_returns(torch.tensor([0.0, 1.0]), torch.tensor([False, True]),
        ...                    torch.tensor([0.4, float("nan")])).tolist()
        [0.4000000059604645, 1.0]
    """
    if not segment_rewards.shape == terminated.shape == end_values.shape:
        raise ValueError("macro_step_returns: segment_rewards, terminated and end_values must all be [N]")
    bootstrap = torch.where(terminated.bool(), torch.zeros_like(end_values), end_values.detach())
    return segment_rewards.float() + bootstrap.float()


def branch_mean_targets(returns: Tensor, group_size: int) -> Tensor:
    """``[S]`` ``y(s) = (1/n) Σ_i G_i`` over each state's ``n = group_size`` contiguous branches: the target of the
    starting state's value (TEMPO).

    Example:
        >>> branch_mean_targets(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2).tolist()
        [0.5, 1.0]
    """
    if returns.dim() != 1 or returns.numel() % group_size:
        raise ValueError(f"branch_mean_targets: returns {tuple(returns.shape)} not divisible by {group_size}")
    return returns.view(-1, group_size).mean(dim=1)
