"""Reward shapers: terms a training rollout's rewards get on top of the task's verifier, logged apart from it.

``RolloutDataModule(reward_shapers=[...])`` adds each shaper's ``[N]`` term to the rewards of every *training*
batch (after dynamic sampling has chosen its groups on the task's reward; held-out evaluation is never shaped),
and logs ``train/task_reward`` (the mean before shaping) and each shaper's mean term under its ``metric`` name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor

from rl_lightning.functional.shaping import overlong_penalty
from rl_lightning.rollout.batch import RolloutBatch


class RewardShaper(ABC):
    """One shaping term. ``metric``: the name its batch mean is logged under (document it in docs/metrics.md)."""

    metric: str = "train/shaping"

    def bind(self, datamodule: Any) -> None:
        """Read settings of the data module (called once when it is set up). Default: nothing."""

    @abstractmethod
    def term(self, batch: RolloutBatch) -> Tensor:
        """``[N]`` the term added to each row's reward."""


class OverlongPenalty(RewardShaper):
    """DAPO's soft overlong punishment (``functional.overlong_penalty``) times ``factor``, on each response's
    generated tokens (for an episode: every model token of it).

    Args:
        cache_tokens: ``L_cache``, the length of the punishment interval before the budget.
        max_tokens: ``L_max``; ``None``: the data module's ``max_new_tokens``.
        factor: the term's scale (DAPO: 1).
    """

    metric = "train/overlong_penalty"

    def __init__(self, cache_tokens: int, max_tokens: int | None = None, factor: float = 1.0) -> None:
        if cache_tokens < 1 or (max_tokens is not None and cache_tokens > max_tokens):
            raise ValueError(f"OverlongPenalty: cache_tokens must be in [1, max_tokens], got {cache_tokens} "
                             f"(max_tokens {max_tokens})")
        self.cache_tokens, self.max_tokens, self.factor = cache_tokens, max_tokens, factor

    def bind(self, datamodule: Any) -> None:
        if self.max_tokens is None:
            self.max_tokens = int(datamodule.sampling.max_new_tokens)
        if self.cache_tokens > self.max_tokens:
            raise ValueError(f"OverlongPenalty: cache_tokens={self.cache_tokens} exceeds max_tokens={self.max_tokens} "
                             "(data.init_args.sampling.max_new_tokens)")

    def term(self, batch: RolloutBatch) -> Tensor:
        assert self.max_tokens is not None, "OverlongPenalty.bind was not called"
        penalty = overlong_penalty(batch.loss_mask.sum(dim=1), self.max_tokens, self.cache_tokens)
        return (self.factor * penalty).to(batch.rewards.dtype)
