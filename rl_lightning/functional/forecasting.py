"""CoPE's action forecasting (docs/algorithms.md, CoPE): from the history ``h_t``, predict the recorded action chunk.

For the successful subset ``S_x`` (reward ``>= threshold``) of the rollout group of prompt ``x``::

    L_AF,x = - Σ_{τ∈S_x} Σ_t log p_θ(a_{t:t+K} | h_t) / max(1, |S_x|)        L = L_GRPO + η · E_x[L_AF,x]

``t`` indexes the agent's actions (model turns), ``a_{t:t+K}`` is the concatenation of the recorded ids of
actions ``t .. min(t+K, n)-1`` (truncated at the episode's end, ``n`` actions), scored teacher-forced after
``h_t`` followed by a forecast instruction; ``E_x`` is the mean over all prompts, a prompt without a success
contributing 0. These functions turn that into per-row weights, (context, target) pairs and the loss.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def forecast_weights(rewards: Tensor, group_size: int, threshold: float, num_prompts: float | None = None) -> Tensor:
    """Per-row weight of the forecasting NLL (CoPE): ``w_i = 1[R_i >= thr] / (max(1, |S_x|) · X)``.

    ``|S_x|`` counts the rows of ``i``'s group with ``R >= threshold``; dividing by ``X`` (the number of prompts)
    makes ``Σ_i w_i NLL_i = E_x[L_AF,x]``, the mean over all prompts. A group with no success gets weight 0,
    so it contributes exactly 0 to the loss and its gradient.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` contiguous rows.
        group_size: ``G``.
        threshold: success is ``R >= threshold``.
        num_prompts: ``X``; default ``N / G`` (pass the global count under data parallelism).

    Returns:
        ``[N]`` float weights.

    Example:
        >>> forecast_weights(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 3, threshold=1.0)
        tensor([0.2500, 0.2500, 0.0000, 0.0000, 0.0000, 0.0000])   # |S_1| = 2, X = 2; |S_2| = 0
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"forecast_weights: need [N] rewards with N divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    success = (rewards >= threshold).float().view(-1, group_size)  # [X, G]
    prompts = success.shape[0] if num_prompts is None else num_prompts
    per_group = success / success.sum(dim=1, keepdim=True).clamp(min=1.0)
    return (per_group / prompts).reshape(-1)


def forecast_pairs(
    input_ids: Tensor, attention_mask: Tensor, prompt_length: int, loss_mask: Tensor, turn_index: Tensor | None,
    instruction_ids: Sequence[int], horizon: int, instruction_first: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """The ``(context, target)`` token-id pairs of one row, one per action ``t`` (CoPE).

    ``context = h_t + instruction_ids``, with ``h_t`` every real token (``attention_mask`` 1) before action
    ``t``'s first token: the prompt, earlier actions and observations. ``target = a_t + ... + a_{m-1}``,
    ``m = min(t + horizon, n)``: each action's ids exactly as sampled (its end token included), no
    observations between them. An action is the ids with ``loss_mask`` 1 and one ``turn_index`` value; with
    ``turn_index=None`` (a single-turn response) the whole response is the one action ``t = 0``.

    Args:
        input_ids, attention_mask: ``[P+T]`` the row (left-padded prompt, then the response).
        prompt_length: ``P``.
        loss_mask, turn_index: ``[T]`` the row's response masks (``turn_index`` -1 off actions).
        instruction_ids: the forecast instruction's ids, appended after ``h_t`` (``instruction_first``: put
            before it, as a leading instruction).
        horizon: ``K >= 1``, actions per chunk.

    Returns:
        ``n`` pairs in action order (none for an empty response).
    """
    if horizon < 1:
        raise ValueError(f"forecast_pairs: horizon must be >= 1, got {horizon}")
    sampled = loss_mask.bool()
    turns = torch.zeros_like(loss_mask, dtype=torch.long) if turn_index is None else turn_index.long()
    turns = torch.where(sampled, turns, torch.full_like(turns, -1))
    ids, real = input_ids.tolist(), attention_mask.tolist()
    actions = sorted(set(turns[turns >= 0].tolist()))
    positions = [(turns == a).nonzero().flatten().tolist() for a in actions]
    chunks = [[ids[prompt_length + p] for p in where] for where in positions]
    pairs = []
    for t, where in enumerate(positions):
        start = prompt_length + where[0]
        history = [tok for tok, keep in zip(ids[:start], real[:start]) if keep]
        context = list(instruction_ids) + history if instruction_first else history + list(instruction_ids)
        pairs.append((context, [tok for chunk in chunks[t:t + horizon] for tok in chunk]))
    return pairs


def forecast_loss(logprobs: Tensor, mask: Tensor, pair_weights: Tensor) -> Tensor:
    """``-Σ_p w_p Σ_j mask_{p,j} logprobs_{p,j}``: the weighted forecasting NLL (CoPE).

    With one pair per action and ``w_p`` its row's ``forecast_weights``, this is ``E_x[L_AF,x]``.

    Args:
        logprobs: ``[n, T]`` teacher-forced log-probs of each pair's target ids.
        mask: ``[n, T]`` 1 on target ids.
        pair_weights: ``[n]`` weight of each pair.
    """
    return -(pair_weights.unsqueeze(-1) * logprobs * mask.to(logprobs.dtype)).sum()
