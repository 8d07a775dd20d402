"""Per-token policy objectives and explicit loss aggregation (PPO: Schulman et al. 2017, arXiv 1707.06347;
GRPO: Shao et al. 2024, arXiv 2402.03300).

The loss is built along its independent axes: a ratio, a per-token objective (``clipped_surrogate``), then an
aggregation by precomputed per-token weights (``aggregation_weights``). Weights are computed once per rollout
batch, so summing ``(objective * weights)`` over any split of the rows (minibatches, micro-batches, devices)
gives exactly the full-batch loss.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rl_lightning.functional.kl import kl_estimate

AggregationMode = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "token_sum",
                          "seq_mean_token_sum_norm"]


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO/GRPO per-token clipped objective, to be *maximised* (PPO: Schulman et al. 2017, eq. 7;
    GRPO: Shao et al. 2024, eq. 3).

    ``min(ρ A, clip(ρ, 1 - eps_low, 1 + eps_high) A)``

    Args:
        ratio: ``[B, T]`` ``ρ = π_θ / π_old`` per token.
        advantages: ``[B, T]`` (or broadcastable, e.g. ``[B, 1]``), treated as constants.
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]`` (equal for symmetric PPO).

    Example:
        >>> clipped_surrogate(torch.tensor([1.5, 0.6, 1.0]), torch.tensor([1.0, -1.0, 2.0]), 0.2, 0.2)
        tensor([ 1.2000, -0.8000,  2.0000])   # min(1.5,1.2); min(-0.6,-0.8); unclipped
    """
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.minimum(unclipped, clipped)


def aggregation_weights(mask: Tensor, mode: AggregationMode, num_sequences: int | None = None,
                        num_tokens: float | None = None, norm_length: float | None = None) -> Tensor:
    """Per-token weights ``w`` such that the aggregated loss is ``Σ_{i,t} w_{i,t} ℓ_{i,t}``.

    Modes (``T_i`` = number of masked tokens of row ``i``, ``N`` = number of rows)::

        seq_mean_token_mean  w = 1 / (N T_i)      (1/N) Σ_i (1/T_i) Σ_t ℓ    -- GRPO as DeepSeekMath's eq. 3 writes it
        token_mean           w = 1 / Σ_i T_i      Σ_{i,t} ℓ / Σ_i T_i        -- DAPO / TRL "dapo"
        seq_mean_token_sum   w = 1 / N            (1/N) Σ_i Σ_t ℓ            -- PG / RLOO: a response's log-prob
        token_sum            w = 1                Σ_{i,t} ℓ                  -- Tinker's built-in losses
        seq_mean_token_sum_norm  w = 1 / (N L)    (1/N) Σ_i Σ_t ℓ / L        -- Dr. GRPO (Liu et al. 2025,
                                                                             arXiv 2503.20783, eq. 3): L a constant

    ``num_sequences`` / ``num_tokens`` override ``N`` / ``Σ T_i`` (pass the global values under data
    parallelism so the normaliser is the whole batch's). Rows with no masked token get weight 0.
    ``norm_length`` is ``L`` of ``seq_mean_token_sum_norm`` (the generation budget, the same for every batch, so
    that no response's tokens weigh more for being in a short response or a short batch); only that mode reads it.

    Returns:
        ``[B, T]`` weights, zero where ``mask == 0``.

    Example:
        >>> m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        >>> aggregation_weights(m, "seq_mean_token_mean")
        tensor([[0.2500, 0.2500],
                [0.5000, 0.0000]])
    """
    maskf = mask.to(torch.float32)
    n = float(maskf.shape[0] if num_sequences is None else num_sequences)
    if mode == "seq_mean_token_mean":
        lengths = maskf.sum(dim=1, keepdim=True)  # T_i
        return maskf / (lengths.clamp(min=1.0) * n)
    if mode == "token_mean":
        total = maskf.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return maskf / total.clamp(min=1.0)
    if mode == "seq_mean_token_sum":
        return maskf / n
    if mode == "token_sum":
        return maskf
    if mode == "seq_mean_token_sum_norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"aggregation seq_mean_token_sum_norm needs norm_length > 0 (the constant L), "
                             f"got {norm_length}")
        return maskf / (n * float(norm_length))
    raise ValueError(f"unknown aggregation mode {mode!r}")


def aggregate(per_token: Tensor, weights: Tensor) -> Tensor:
    """``Σ_{i,t} weights * per_token`` -- the one aggregation every loss uses (see ``aggregation_weights``)."""
    return (per_token * weights).sum()


class PolicyLossStats(NamedTuple):
    """Detached diagnostics of a clipped policy loss (token means over the masked tokens)."""

    clip_fraction: Tensor  # tokens where the clipped branch was taken (either side)
    clip_fraction_low: Tensor  # ρ < 1 - eps_low with A < 0
    clip_fraction_high: Tensor  # ρ > 1 + eps_high with A > 0
    ratio_mean: Tensor
    approx_kl: Tensor  # k3 estimate of KL(π_old || π_θ) over the tokens


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, PolicyLossStats]:
    """``-Σ w · min(ρA, clip(ρ) A)`` with ``ρ = exp(logprobs - old_logprobs)`` (PPO, GRPO).

    Args:
        logprobs: ``[B, T]`` learner log-probs of the generated tokens (carry the gradient).
        old_logprobs: ``[B, T]`` π_old log-probs (the sampler's), constants.
        advantages: ``[B, T]``, ``[B, 1]`` or ``[B]`` (one per row), constants.
        mask, weights: ``[B, T]``; ``weights`` from ``aggregation_weights`` on the whole rollout batch.

    Returns:
        ``(loss, stats)``.
    """
    old_logprobs = old_logprobs.detach()
    if advantages.dim() == 1:  # one advantage per row: broadcast over tokens, not over rows
        advantages = advantages.unsqueeze(-1)
    log_ratio = (logprobs - old_logprobs) * mask  # zero on padding, so exp() stays finite there
    ratio = torch.exp(log_ratio)  # [B, T]
    objective = clipped_surrogate(ratio, advantages, eps_low, eps_high)  # [B, T]
    loss = -aggregate(objective, weights)
    return loss, clip_statistics(ratio, advantages, mask, eps_low, eps_high, logprobs, old_logprobs)


@torch.no_grad()
def clip_statistics(ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                    logprobs: Tensor, old_logprobs: Tensor) -> PolicyLossStats:
    """The clip diagnostics of PPO/GRPO's clipped surrogate: token means over ``mask`` of where the clipped
    branch of ``clipped_surrogate`` wins (below: ``ρ < 1 - eps_low`` with ``A < 0``; above: ``ρ > 1 + eps_high``
    with ``A > 0``), the mean ratio and the k3 estimate of KL(π_old ‖ π_θ); detached."""
    adv = (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages).expand_as(ratio)
    maskb = mask.bool()
    low = (ratio < 1.0 - eps_low) & (adv < 0) & maskb
    high = (ratio > 1.0 + eps_high) & (adv > 0) & maskb
    count = mask.sum().clamp(min=1.0)
    return PolicyLossStats(
        clip_fraction=(low | high).sum() / count,
        clip_fraction_low=low.sum() / count,
        clip_fraction_high=high.sum() / count,
        ratio_mean=(ratio * mask).sum() / count,
        approx_kl=(kl_estimate(old_logprobs.detach(), logprobs.detach(), "k3") * mask).sum() / count,
    )


class PolicyGradientStats(NamedTuple):
    """Detached diagnostics of ``policy_gradient_loss``."""

    logprob_mean: Tensor  # mean log-prob of the generated tokens
    advantage_mean: Tensor  # token-mean advantage


def policy_gradient_loss(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor
) -> tuple[Tensor, PolicyGradientStats]:
    """The REINFORCE surrogate ``-Σ_{i,t} w_{i,t} · sg(A_{i,t}) · log π_θ(a_{i,t} | s_{i,t})``.

    With ``A_i = R_i`` and ``w = 1/N`` (``seq_mean_token_sum``) this is the policy gradient (REINFORCE, Williams
    1992: ``L = -R_i Σ_t log π``) averaged over responses; with ``A_i = R_i - b`` it is REINFORCE with a baseline;
    with leave-one-out ``A_i`` it is RLOO (Ahmadian et al. 2024, arXiv 2402.14740: ``-1/G Σ_i A_i Σ_t log π``).
    Advantages are constants: no gradient flows into them.

    Args:
        logprobs: ``[B, T]`` learner log-probs (carry the gradient).
        advantages: ``[B, T]``, ``[B, 1]`` or ``[B]``.
        mask, weights: ``[B, T]``; ``weights`` from ``aggregation_weights`` on the whole rollout batch.

    Example:
        >>> lp = torch.tensor([[-1.0, -2.0]]); m = torch.ones(1, 2)
        >>> policy_gradient_loss(lp, torch.tensor([0.5]), m, aggregation_weights(m, "seq_mean_token_sum"))[0]
        tensor(1.5000)   # -(0.5 * (-1) + 0.5 * (-2))
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach()
    loss = -aggregate(advantages * logprobs * mask, weights)
    with torch.no_grad():
        count = mask.sum().clamp(min=1.0)
        stats = PolicyGradientStats(
            logprob_mean=(logprobs * mask).sum() / count,
            advantage_mean=(advantages.expand_as(mask) * mask).sum() / count,
        )
    return loss, stats


class ValueLossStats(NamedTuple):
    """Detached diagnostics of ``clipped_value_loss``."""

    value_clip_fraction: Tensor  # tokens where the clipped branch was larger


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over the masked tokens (1 = perfect, <= 0 = no better
    than predicting the mean). Returns 0 when the returns have no variance."""
    m = mask.to(values.dtype)
    count = m.sum().clamp(min=1.0)

    def var(x: Tensor) -> Tensor:
        mean = (x * m).sum() / count
        return (((x - mean) ** 2) * m).sum() / count

    total = var(returns)
    return torch.where(total > 0, 1.0 - var(returns - values) / total.clamp(min=1e-12), torch.zeros_like(total))


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, weights: Tensor, clip_range: float | None
) -> tuple[Tensor, ValueLossStats]:
    """PPO value loss (Schulman et al. 2017; Huang et al. 2024, "The N+ implementation details of RLHF with PPO",
    arXiv 2403.17031):

    ``Σ w · ½ max((V - R)², (V_old + clip(V - V_old, -ε_v, ε_v) - R)²)`` with ``R`` the GAE returns;
    ``clip_range=None`` gives the plain ``Σ w · ½ (V - R)²``.

    Example:
        >>> m = torch.ones(1, 1); w = m
        >>> clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), m, w, 0.2)[0]
        tensor(0.3200)   # unclipped 0; clipped: V_old + 0.2 = 0.2 -> ½ (0.8)² = 0.32 is the max
    """
    returns, old_values = returns.detach(), old_values.detach()
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_wins = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    loss = aggregate(per_token, weights)
    with torch.no_grad():
        count = mask.sum().clamp(min=1.0)
        stats = ValueLossStats(
            value_clip_fraction=(clipped_wins & mask.bool()).sum() / count,
        )
    return loss, stats


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` the length-normalised log importance ratio of each response (GSPO: Zheng et al. 2025, "Group
    Sequence Policy Optimization", arXiv 2507.18071, eq. 7; docs/algorithms.md, GSPO):

        log s_i = (1 / |y_i|) Σ_t (log π_θ(y_{i,t}) - log π_old(y_{i,t})),   s_i = exp(log s_i)

    the log of the geometric mean of the token ratios over the masked tokens. A row with no masked token gets 0
    (``s_i = 1``). The gradient flows through ``logprobs``.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[2.0, 0.5, 9.0]]))  # token ratios 2 and 0.5 (the third is padding)
        >>> sequence_log_ratio(lp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
        tensor([0.])
    """
    diff = (logprobs - old_logprobs) * mask
    return diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


def clipped_is_weight(ratio: Tensor, eps_low: float | None, eps_high: float) -> Tensor:
    """CISPO's importance weight (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, eq. 5; docs/algorithms.md, CISPO):

        r̂ = sg(clip(ρ, 1 - ε_low, 1 + ε_high))

    detached, so a token whose ratio is clipped keeps its gradient ``r̂ · A · ∇ log π`` (PPO's clip zeroes it).
    ``eps_low=None``: no floor (MiniMax-M1 sets ε_low large; the weight only stops at 0).

    Example:
        >>> import torch
        >>> clipped_is_weight(torch.tensor([0.1, 1.0, 9.0]), None, 4.0)
        tensor([0.1000, 1.0000, 5.0000])
    """
    low = None if eps_low is None else 1.0 - eps_low
    return ratio.detach().clamp(min=low, max=1.0 + eps_high)
