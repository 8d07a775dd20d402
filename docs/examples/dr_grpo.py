"""Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025, arXiv 2503.20783) as a GRPO subclass.

GRPO with its two length/difficulty biases removed:

* advantages ``A_i = R_i - mean_G(R)``: no division by the group's reward std;
* a constant normaliser: ``L = Σ_{i,t} ℓ_{i,t} / (N · L_max)`` with ``L_max = data.sampling.max_new_tokens``,
  instead of GRPO's ``1/|o_i|`` per response. Not validated at scale.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms import GRPO
from rl_lightning.functional import group_advantages
from rl_lightning.rollout import RolloutBatch


class DrGRPO(GRPO):
    """GRPO Done Right: ``R - mean_G`` advantages, token losses weighted ``mask / (N · L_max)``.

    Args:
        **kwargs: ``GRPO`` arguments (clipping, model, optimizer, ...); the advantage scaling and the
            loss aggregation are fixed by the method.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scale_rewards=False, loss_aggregation="seq_mean_token_sum", **kwargs)
        self.max_length: int | None = None  # L_max, read from the data module at setup

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        super().check_datamodule(datamodule)  # GRPO: group_size >= 2
        self.max_length = int(datamodule.sampling.max_new_tokens)

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        """``A_i = R_i - mean_G(R)`` (``[N]``): the group mean as baseline, no std scaling."""
        return group_advantages(batch.rewards, batch.group_size, scale=False)

    @override
    def loss_weights(self, batch: RolloutBatch) -> Tensor:
        """``mask / (N · L_max)``: the base's ``seq_mean_token_sum`` weights ``mask / N`` divided by ``L_max``.

        The base computes ``N`` over the whole rollout batch (summed over ranks under DDP, and scaled for
        DDP's gradient averaging), so only the constant ``L_max`` is added here.
        """
        if self.max_length is None:
            raise RuntimeError("DrGRPO: L_max is unknown; fit it with a data module that has max_new_tokens")
        return super().loss_weights(batch) / self.max_length
