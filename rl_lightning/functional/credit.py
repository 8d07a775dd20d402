"""Per-action credit from hindsight values: LVRL's anchored credit (no paper or reference code found:
docs/algorithms.md, LVRL) and its broadcast to the tokens of each action.

Shapes: ``N`` rows (groups of ``G`` contiguous rows), ``K`` action steps (turns), ``T`` response tokens. An episode
``b`` has ``T_b`` actions, ``turn_mask [N, K]`` is 1 on its first ``T_b`` steps (left-aligned); ``turn_index
[N, T]`` is the action of every model-generated token, -1 on observations and padding (``RolloutBatch.turns.index``).
``T_b`` counts actions, not tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _steps(turn_mask: Tensor, rows: int, name: str) -> tuple[Tensor, Tensor]:
    """``(steps [N, K] bool, T_b [N])`` of a left-aligned ``turn_mask``, refusing any other."""
    if turn_mask.dim() != 2 or turn_mask.shape[0] != rows:
        raise ValueError(f"{name}: turn_mask must be [N, K] with N = {rows}, got shape {tuple(turn_mask.shape)}")
    steps = turn_mask.bool()
    count = steps.sum(dim=1)
    columns = torch.arange(steps.shape[1], device=steps.device)
    if not torch.equal(steps, columns < count.unsqueeze(1)):
        raise ValueError(f"{name}: turn_mask must be left-aligned (1 on an episode's first T_b steps, then 0)")
    return steps, count


def _group_size_divides(rows: int, group_size: int, name: str) -> None:
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{name}: group_size={group_size} does not divide the {rows} rows")


def _group_mean(rewards: Tensor, group_size: int) -> Tensor:
    """``[N]`` ``R̄_G`` of each row's group, as ``min + mean(R - min)``: exactly ``R`` for a group of equal rewards
    (a plain float mean of ``0.9 x 3`` is not 0.9, and the step std would blow that rounding up)."""
    grouped = rewards.view(-1, group_size)
    low = grouped.amin(dim=1, keepdim=True)
    return (low + (grouped - low).mean(dim=1, keepdim=True)).expand_as(grouped).reshape(-1)


def turn_mask_from_index(turn_index: Tensor) -> Tensor:
    """``[N, K]`` long: 1 on the actions ``0 .. T_b - 1`` of each row, ``T_b = max_j turn_index[b, j] + 1`` (0 for a
    row with no generated token), ``K`` the largest ``T_b`` (at least 1).

    Example:
        >>> turn_mask_from_index(torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1], [-1, -1, -1, -1]]))
        tensor([[1, 1], [1, 0], [0, 0]])
    """
    if turn_index.dim() != 2:
        raise ValueError(f"turn_mask_from_index: turn_index must be [N, T], got shape {tuple(turn_index.shape)}")
    count = (turn_index.amax(dim=1).clamp(min=-1) + 1 if turn_index.shape[1]
             else turn_index.new_zeros(turn_index.shape[0]))
    width = max(int(count.max()) if count.numel() else 0, 1)
    return (torch.arange(width, device=turn_index.device) < count.unsqueeze(1)).long()


def interpolated_values(rewards: Tensor, group_size: int, turn_mask: Tensor) -> Tensor:
    """The linear-interpolation hindsight critic (the tests' oracle and every critic's fallback):
    ``Ṽ_t = R̄_G + (R_b - R̄_G) t / T_b`` at every step ``t < T_b`` (``[N, K]``, 0 elsewhere), so ``anchored_credit``
    gives each of the ``T_b`` actions the same ``(R_b - R̄_G) / T_b``.

    Example:
        >>> interpolated_values(torch.tensor([1.0, 0.0]), 2, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
        tensor([[0.5000, 0.6250, 0.7500, 0.8750], [0.5000, 0.2500, 0.0000, 0.0000]])
    """
    _group_size_divides(rewards.numel(), group_size, "interpolated_values")
    steps, count = _steps(turn_mask, rewards.numel(), "interpolated_values")
    rewards = rewards.float()
    mean = _group_mean(rewards, group_size)  # R̄_G per row
    t = torch.arange(steps.shape[1], device=steps.device, dtype=rewards.dtype)
    fraction = t.unsqueeze(0) / count.clamp(min=1).unsqueeze(1).to(rewards.dtype)  # t / T_b
    values = mean.unsqueeze(1) + (rewards - mean).unsqueeze(1) * fraction
    return torch.where(steps, values, torch.zeros_like(values))


def anchored_credit(values: Tensor, rewards: Tensor, group_size: int, turn_mask: Tensor) -> Tensor:
    """LVRL's anchored credit, unnormalised (docs/algorithms.md, LVRL).

    ``Ṽ_0 = R̄_G`` (the mean reward of the row's group), ``Ṽ_{T_b} = R_b``, the hindsight critic's ``Ṽ_t`` in
    between, and ``Ā_t = Ṽ_{t+1} - Ṽ_t`` for ``t < T_b``, 0 elsewhere. The sum telescopes: ``Σ_t Ā_t = R_b - R̄_G``
    for any critic output (the outcome fixes the total, the critic only its split over the actions; a one-action
    row gets ``R_b - R̄_G`` without reading the critic). A row with no action (``T_b = 0``) gets 0 everywhere.

    Args:
        values: ``[N, K]`` ``Ṽ_t`` for ``0 < t < T_b``; entry 0 and the entries from ``T_b`` on are ignored (they
            may hold anything, NaN included).
        rewards: ``[N]`` the episode's reward ``R_b``.
        group_size: ``G``; ``R̄_G`` is the mean over the group's ``G`` rows (every row, with or without actions).
        turn_mask: ``[N, K]`` 1 on the row's ``T_b`` steps, left-aligned.

    Returns:
        ``[N, K]`` ``Ā_t`` (0 off the steps).

    Example:
        >>> values = torch.tensor([[0.0, 0.8, 0.9], [0.0, 0.1, 0.0]])   # Ṽ_1, Ṽ_2 of row 0; Ṽ_1 of row 1
        >>> anchored_credit(values, torch.tensor([1.0, 0.0]), 2, torch.tensor([[1, 1, 1], [1, 1, 0]]))
        tensor([[ 0.3000,  0.1000,  0.1000], [-0.4000, -0.1000,  0.0000]])   # R̄ = 0.5; rows sum to ±0.5
    """
    n = rewards.numel()
    if rewards.dim() != 1 or values.dim() != 2 or values.shape[0] != n:
        raise ValueError(f"anchored_credit: values must be [N, K] and rewards [N], got {tuple(values.shape)} and "
                         f"{tuple(rewards.shape)}")
    _group_size_divides(n, group_size, "anchored_credit")
    steps, count = _steps(turn_mask, n, "anchored_credit")
    if turn_mask.shape[1] != values.shape[1]:
        raise ValueError(f"anchored_credit: turn_mask {tuple(turn_mask.shape)} and values {tuple(values.shape)} "
                         "must have the same shape")
    dtype = torch.promote_types(values.dtype, torch.promote_types(rewards.dtype, torch.float32))
    values, rewards = values.to(dtype), rewards.to(dtype)
    mean = _group_mean(rewards, group_size)  # R̄_G per row
    k = values.shape[1]
    columns = torch.arange(k + 1, device=values.device).unsqueeze(0)  # t = 0 .. K
    last = count.unsqueeze(1)  # T_b
    inner = torch.cat([values, values.new_zeros(n, 1)], dim=1)
    inner = torch.where((columns > 0) & (columns < last), inner, torch.zeros_like(inner))  # ignored entries -> 0
    anchored = torch.where(columns == 0, mean.unsqueeze(1), inner)  # Ṽ_0 = R̄_G
    anchored = torch.where((columns == last) & (last > 0), rewards.unsqueeze(1), anchored)  # Ṽ_{T_b} = R_b
    credit = anchored[:, 1:] - anchored[:, :-1]  # Ā_t = Ṽ_{t+1} - Ṽ_t
    return torch.where(steps, credit, torch.zeros_like(credit))


def _grouped_steps(credit: Tensor, group_size: int, turn_mask: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """``(credit [B, G*K], steps [B, G*K] bool)``: a group's steps side by side."""
    n = credit.shape[0]
    _group_size_divides(n, group_size, name)
    steps, _ = _steps(turn_mask, n, name)
    if credit.shape != steps.shape:
        raise ValueError(f"{name}: credit {tuple(credit.shape)} and turn_mask {tuple(steps.shape)} must have the "
                         "same shape")
    return credit.reshape(-1, group_size * credit.shape[1]), steps.reshape(-1, group_size * credit.shape[1])


def group_step_std(credit: Tensor, group_size: int, turn_mask: Tensor) -> Tensor:
    """``[N]`` ``σ_G`` of each row's group: the population std of every step ``Ā_t`` of every row of the group
    (``turn_mask``'s entries; 0 for a group with no step). LVRL's group-wide step std.

    Example:
        >>> group_step_std(torch.tensor([[0.25, 0.25], [-0.5, 0.0]]), 2, torch.tensor([[1, 1], [1, 0]]))
        tensor([0.3536, 0.3536])   # steps 0.25, 0.25, -0.5: mean 0, variance 0.125
    """
    grouped, on = _grouped_steps(credit, group_size, turn_mask, "group_step_std")
    count = on.sum(dim=1, keepdim=True).clamp(min=1)
    mean = (grouped * on).sum(dim=1, keepdim=True) / count
    std = (((grouped - mean) ** 2) * on).sum(dim=1) / count.squeeze(1)
    return std.sqrt().repeat_interleave(group_size)


def group_step_normalized(credit: Tensor, group_size: int, turn_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``Ā_t / (σ_G + eps)``: LVRL's step credit divided by the group-wide step standard deviation.

    ``σ_G`` is ``group_step_std``: the population std of every step of the group (the credit is divided, not
    re-centred). A group whose steps are all equal -- which, since its credit sums to 0, means all 0 -- or that has
    no step gets exactly 0, never ``0 / eps``. The sum identity of ``anchored_credit`` holds before this division
    only. With one action per row this is GRPO's ``(R - μ_G) / (σ_G + eps)``.

    Args:
        credit: ``[N, K]`` ``anchored_credit``.
        group_size: ``G``.
        turn_mask: ``[N, K]`` the rows' steps (left-aligned).
        eps: added to ``σ_G``.

    Returns:
        ``[N, K]``, 0 off the steps.

    Example:
        >>> credit = torch.tensor([[0.25, 0.25], [-0.5, 0.0]])   # steps: 2 + 1, mean 0, σ = sqrt(0.125)
        >>> group_step_normalized(credit, 2, torch.tensor([[1, 1], [1, 0]]), eps=0.0)
        tensor([[ 0.7071,  0.7071], [-1.4142,  0.0000]])
    """
    grouped, on = _grouped_steps(credit, group_size, turn_mask, "group_step_normalized")
    std = group_step_std(credit, group_size, turn_mask)[::group_size].unsqueeze(1)  # [B, 1]
    inf = torch.tensor(float("inf"), dtype=grouped.dtype, device=grouped.device)
    low = torch.where(on, grouped, inf).amin(dim=1, keepdim=True)
    constant = low == torch.where(on, grouped, -inf).amax(dim=1, keepdim=True)  # no spread (also: no step)
    scaled = torch.where(on & ~constant, grouped / (std + eps), torch.zeros_like(grouped))
    return scaled.reshape(credit.shape)


def turn_token_advantages(step_adv: Tensor, turn_index: Tensor) -> Tensor:
    """Every token of an action gets its action's advantage (as in LVRL): ``[N, T]`` with token ``j`` of row ``b``
    getting ``step_adv[b, turn_index[b, j]]`` where ``turn_index[b, j] >= 0``, 0 elsewhere (observation tokens and
    padding get none).

    Args:
        step_adv: ``[N, K]`` per-action advantages.
        turn_index: ``[N, T]`` the action of each token, -1 off actions (``RolloutBatch.turns.index``); every value
            must be ``< K``.

    Example:
        >>> turn_token_advantages(torch.tensor([[0.5, -1.0]]), torch.tensor([[0, 0, -1, 1, 1, -1]]))
        tensor([[ 0.5000,  0.5000,  0.0000, -1.0000, -1.0000,  0.0000]])
    """
    if step_adv.dim() != 2 or turn_index.dim() != 2 or step_adv.shape[0] != turn_index.shape[0]:
        raise ValueError(f"turn_token_advantages: step_adv must be [N, K] and turn_index [N, T], got "
                         f"{tuple(step_adv.shape)} and {tuple(turn_index.shape)}")
    on = turn_index >= 0
    if not bool(on.any()):
        return step_adv.new_zeros(turn_index.shape)
    if int(turn_index.max()) >= step_adv.shape[1]:
        raise ValueError(f"turn_token_advantages: turn_index reaches action {int(turn_index.max())}, but step_adv "
                         f"has {step_adv.shape[1]} steps")
    gathered = step_adv.gather(1, turn_index.clamp(min=0).long())
    return torch.where(on, gathered, torch.zeros_like(gathered))
