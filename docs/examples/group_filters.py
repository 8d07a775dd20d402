"""A group filter and a reward shaper of one's own (docs/extending_advanced.md, "Which groups a step trains on")."""

from __future__ import annotations

from torch import Tensor

from rl_lightning.rollout import GroupFilter, RewardShaper, RolloutBatch


class MixedAccuracy(GroupFilter):
    """Keep the groups whose mean reward lies strictly between ``low`` and ``high`` (not all solved, not all
    failed, and not nearly so)."""

    def __init__(self, low: float = 0.0, high: float = 1.0) -> None:
        self.low, self.high = low, high

    def keep(self, batch: RolloutBatch) -> Tensor:
        mean = batch.rewards.reshape(-1, batch.group_size).mean(dim=1)
        return (mean > self.low) & (mean < self.high)


class BrevityBonus(RewardShaper):
    """``bonus`` times the unused share of the token budget: shorter responses earn a little more."""

    metric = "train/brevity_bonus"

    def __init__(self, bonus: float = 0.1) -> None:
        self.bonus, self.budget = bonus, 1

    def bind(self, datamodule) -> None:  # noqa: ANN001
        self.budget = datamodule.sampling.max_new_tokens

    def term(self, batch: RolloutBatch) -> Tensor:
        used = batch.loss_mask.sum(dim=1).to(batch.rewards.dtype) / self.budget
        return self.bonus * (1 - used)
