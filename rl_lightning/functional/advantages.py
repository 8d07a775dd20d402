"""Advantage estimators. Shapes: ``B`` prompts, ``G`` responses per prompt, ``N = B*G`` rows, ``T`` tokens.

Groups are contiguous blocks of ``group_size`` rows: rows ``[g*G, (g+1)*G)`` answer the same prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_lightning.functional.masked import masked_whiten


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the {rewards.numel()} rewards")
    return rewards.view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, §4.1.2).

    ``A_i = (R_i - μ_G) / (σ_G + eps)`` with the population standard deviation
    ``σ_G = sqrt(1/G Σ_i (R_i - μ_G)^2)``; ``scale=False`` gives ``A_i = R_i - μ_G`` (Dr. GRPO style).
    A group with no spread (σ_G = 0) gets ``A = 0`` exactly, never NaN.

    Args:
        rewards: ``[N]`` scalar reward per response, groups contiguous.
        group_size: ``G``, responses per prompt.
        scale: divide by ``σ_G + eps``.
        eps: added to ``σ_G``.

    Returns:
        ``[N]`` advantages.

    Example:
        >>> group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 4)   # μ=0.5, σ=0.5
        tensor([ 1.0000,  1.0000, -1.0000, -1.0000])   # (up to eps)
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    mean = grouped.mean(dim=1, keepdim=True)  # μ_G
    centered = grouped - mean
    if scale:
        std = grouped.std(dim=1, unbiased=False, keepdim=True)  # population σ_G
        centered = centered / (std + eps)
    # A constant group carries no signal. Its float mean can differ from R by rounding (e.g. 0.9 x 3), which
    # the division above would blow up into a same-sign advantage, so such groups are set to exactly 0.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [B, 1]
    centered = centered.masked_fill(constant, 0.0)
    return centered.reshape(-1)


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages (Ahmadian et al. 2024, arXiv 2402.14740): ``A_i = R_i - 1/(G-1) Σ_{j≠i} R_j``.

    Equivalently ``G/(G-1) (R_i - μ_G)``; advantages sum to 0 within each group. Needs ``G >= 2``.

    Example:
        >>> leave_one_out_advantages(torch.tensor([1.0, 0.8, 0.2, 0.0]), 4)
        tensor([ 0.6667,  0.4000, -0.4000, -0.6667])
    """
    if group_size < 2:
        raise ValueError(f"leave-one-out advantages need group_size >= 2, got {group_size}")
    grouped = _grouped(rewards, group_size)  # [B, G]
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # b_i
    return (grouped - baseline).reshape(-1)


def batch_centered_advantages(rewards: Tensor, mean: Tensor | float | None = None) -> Tensor:
    """FlashREINFORCE batch-centred advantages (FlashREINFORCE, Hu et al. 2026): ``A_i = R_i - 1/B Σ_j R_j``.

    A batch of one response gets ``A = 0``. ``mean`` replaces ``1/B Σ_j R_j`` when the batch is spread over
    several processes: pass the mean over every rank's rewards (the default is the mean of ``rewards``).

    Example:
        >>> batch_centered_advantages(torch.tensor([1.0, 0.0, 0.5]))
        tensor([ 0.5000, -0.5000,  0.0000])
        >>> batch_centered_advantages(torch.tensor([1.0, 0.0]), mean=0.25)   # the other rank saw [0, 0]
        tensor([ 0.7500, -0.2500])
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    return rewards - (rewards.mean() if mean is None else mean)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked tokens of each row (Schulman et al. 2015, arXiv 1506.02438).

    Walking backwards over the positions where ``mask == 1`` only (unmasked positions, e.g. observation
    tokens of a multi-turn episode, are skipped, so ``t+`` is the next *masked* position)::

        δ_t = r_t + γ V(t+) - V(t)          with V(after the last masked token) = 0
        Â_t = δ_t + γ λ Â(t+)
        returns_t = Â_t + V(t)

    With a contiguous mask this is plain GAE. Rewards at unmasked positions are ignored.

    Args:
        rewards: ``[B, T]`` per-token rewards (an outcome reward sits on the last generated token).
        values: ``[B, T]`` value estimates (treated as constants).
        mask: ``[B, T]`` 1 on model-generated tokens.
        gamma: discount γ.
        lam: λ, a float or a ``[B]`` tensor (one λ per row).

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and zero where ``mask == 0``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]]); v = torch.tensor([[0.5, 0.5, 0.5]]); m = torch.ones(1, 3)
        >>> gae(r, v, m, gamma=1.0, lam=1.0)[0]     # λ=γ=1: Â_t = R - V_t
        tensor([[0.5000, 0.5000, 0.5000]])
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"gae: rewards, values and mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    batch, length = rewards.shape
    rewards, values = rewards.detach(), values.detach()
    maskf = mask.to(values.dtype)
    lam_t = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(batch)  # [B]
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)  # V(t+)
    next_adv = torch.zeros_like(next_value)  # Â(t+)
    for t in reversed(range(length)):
        m = maskf[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_t * next_adv
        # Unmasked positions leave the running (t+) state untouched, which skips them.
        advantages[:, t] = adv * m
        next_adv = torch.where(m > 0, adv, next_adv)
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (advantages + values) * maskf
    return advantages, returns


def baseline_advantages(rewards: Tensor, baseline: Tensor | float) -> Tensor:
    """REINFORCE with a baseline (Williams 1992): ``A_i = R_i - b``; ``b`` is a constant (stop-gradient).

    Example:
        >>> baseline_advantages(torch.tensor([0.9, 0.2]), 0.6)   # b = 0.6: +0.3 and -0.4
        tensor([ 0.3000, -0.4000])
    """
    return rewards - torch.as_tensor(baseline, dtype=rewards.dtype, device=rewards.device).detach()


def ema_update(average: Tensor, value: Tensor, decay: float) -> Tensor:
    """Exponential moving average ``decay * average + (1 - decay) * value`` (REINFORCE's running baseline).

    Example:
        >>> ema_update(torch.tensor(0.5), torch.tensor(1.0), 0.9)
        tensor(0.5500)
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay}")
    return decay * average + (1.0 - decay) * value


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each response's scalar reward on its last generated token: ``r_{i,t} = R_i`` if ``t`` is the last
    position of row ``i`` where ``mask == 1``, else 0 (the per-token reward GAE consumes).

    Rows with an empty mask get no reward.

    Example:
        >>> outcome_token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
        tensor([[0., 1., 0.],
                [0., 0., 2.]])
    """
    counts = mask.long().sum(dim=1, keepdim=True)  # [B, 1]
    last = (mask.long().cumsum(dim=1) == counts) & mask.bool() & (counts > 0)  # the last masked position
    return last.to(rewards.dtype) * rewards.unsqueeze(-1)


def outcome_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor, whiten: bool = True
) -> tuple[Tensor, Tensor]:
    """GAE for outcome rewards, the advantage estimator of PPO (Schulman et al. 2017) and of TRPO's ``gae`` option.

    ``R_i`` is placed on the last generated token (``outcome_token_rewards``), then ``gae`` over the masked
    tokens with ``values`` (the critic at rollout time); with ``whiten`` the advantages are normalised to
    mean 0 / std 1 over the generated tokens (``masked_whiten``). Returns ``(advantages, returns)``, both
    ``[N, T]``; the returns are never whitened.
    """
    advantages, returns = gae(outcome_token_rewards(rewards, mask), values, mask, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def kl_penalized_returns(rewards: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                         beta: float) -> Tensor:
    """REINFORCE++'s token advantages before normalisation (Hu 2025, "REINFORCE++", arXiv 2501.03262, eqs. 8-9;
    docs/algorithms.md, REINFORCE++): the outcome reward at the last token and a per-token KL penalty in the reward,
    summed to the end (γ = 1)::

        A_{i,t} = R_i - β Σ_{s >= t} KL_{i,s},  KL_{i,s} = log π_old(a_s) - log π_ref(a_s)  (k1, at the sampled tokens)

    Args:
        rewards: ``[N]`` outcome rewards (a baseline already subtracted for REINFORCE++-baseline).
        old_logprobs: ``[N, T]`` the sampler's log-probs (π_old); ref_logprobs: ``[N, T]`` the reference's.
        mask: ``[N, T]`` the generated (trainable) tokens; other positions get 0 and add no KL.
        beta: the KL coefficient β (0: ``A_{i,t} = R_i`` on every generated token).

    Example:
        >>> kl_penalized_returns(torch.tensor([1.0]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -2.0]]),
        ...                      torch.ones(1, 2), 0.1)          # KL = [0.5, 1.0]: 1 - 0.1 * [1.5, 1.0]
        tensor([[0.8500, 0.9000]])
    """
    maskf = mask.to(old_logprobs.dtype)
    kl = (old_logprobs - ref_logprobs) * maskf
    to_go = kl.flip(-1).cumsum(-1).flip(-1)  # Σ_{s >= t} KL_s
    return (rewards.to(old_logprobs.dtype).unsqueeze(-1) - beta * to_go) * maskf
