"""REINFORCE with a baseline (spec 003, §2): ``L = -(R_i - b) log π_θ(o_i)``."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.pg import PolicyGradient
from rl_lightning.functional import baseline_advantages, ema_update
from rl_lightning.rollout.batch import RolloutBatch

Baseline = Literal["batch_mean", "ema", "none"]


class REINFORCE(PolicyGradient):
    """Policy gradient on ``R_i - b``, with the baseline chosen in the config.

    Args:
        baseline: ``batch_mean`` -- the mean reward of the current rollout batch over all ranks (it includes
            the response's own reward, a small bias that RLOO removes); ``ema`` -- an exponential moving
            average of the mean rewards of *earlier* batches (independent of the current samples; the first
            batch, with no history, uses its own mean); ``none`` -- plain policy gradient.
        ema_decay: decay of the ``ema`` baseline (0.9 keeps about the last 10 batches).
        **kwargs: ``PolicyGradient`` / ``RLModule`` arguments.

    The EMA is a registered buffer, so it is saved in checkpoints and restored on resume.
    """

    def __init__(self, baseline: Baseline = "ema", ema_decay: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"REINFORCE: ema_decay must be in [0, 1), got {ema_decay}")
        self.baseline = baseline
        self.ema_decay = ema_decay
        self.register_buffer("reward_ema", torch.zeros(()))
        self.register_buffer("reward_ema_initialised", torch.zeros((), dtype=torch.bool))

    def _global_mean_reward(self, rewards: Tensor) -> Tensor:
        mean = rewards.float().mean()
        if self._trainer is not None and self.trainer.world_size > 1:
            mean = self.trainer.strategy.reduce(mean, reduce_op="mean")
        return mean

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        if self.baseline == "none":
            return batch.rewards
        mean = self._global_mean_reward(batch.rewards)
        if self.baseline == "batch_mean":
            return baseline_advantages(batch.rewards, mean)
        if not bool(self.reward_ema_initialised):
            self.reward_ema.fill_(mean)
            self.reward_ema_initialised.fill_(True)
        advantages = baseline_advantages(batch.rewards, self.reward_ema.clone())  # b from earlier batches
        self.reward_ema.copy_(ema_update(self.reward_ema, mean, self.ema_decay))  # then fold this batch in
        return advantages
