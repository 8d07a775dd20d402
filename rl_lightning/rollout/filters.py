"""Group filters for dynamic sampling: which prompt groups of a training rollout a step keeps.

``RolloutDataModule(group_filter=..., max_rounds=k)`` rolls out the step's prompts, keeps the groups the filter
accepts, and draws more prompts (the prompt stream's next indices) until the step holds ``prompts_per_step``
accepted groups or ``k`` rounds were drawn (DAPO's dynamic sampling, Yu et al. 2025, arXiv 2503.14476, §3.2:
a group whose responses all get the same reward has zero advantage under group baselines, so it adds nothing
to the gradient but still dilutes the batch). A filter is any ``GroupFilter``; ``RewardSpread`` is the stock one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from rl_lightning.rollout.batch import RolloutBatch


class GroupFilter(ABC):
    """Decides, per group of a rollout batch, whether a training step keeps it."""

    @abstractmethod
    def keep(self, batch: RolloutBatch) -> Tensor:
        """``[N / G]`` bool, one per group (rows ``[g G, (g + 1) G)``): True where the step keeps the group."""


class RewardSpread(GroupFilter):
    """Keep the groups whose rewards are not all equal: ``max - min > min_spread`` (DAPO's filter: drop the groups
    that every response solved or none did).

    Args:
        min_spread: the spread a group must exceed (0: any difference).
    """

    def __init__(self, min_spread: float = 0.0) -> None:
        if min_spread < 0:
            raise ValueError(f"RewardSpread: min_spread must be >= 0, got {min_spread}")
        self.min_spread = min_spread

    def keep(self, batch: RolloutBatch) -> Tensor:
        grouped = batch.rewards.reshape(-1, batch.group_size)
        return (grouped.max(dim=1).values - grouped.min(dim=1).values) > self.min_spread


def group_rows(groups: Tensor, group_size: int) -> Tensor:
    """The row indices ``[len(groups) G]`` of the groups ``groups`` (a 1-D index tensor), in order."""
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)
