"""RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740; Kool et al. 2019):
``L = -1/G Σ_i A_i Σ_t log π_θ(a_{i,t}|s_{i,t})`` with ``A_i = R_i - mean_{j≠i} R_j``."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.pg import PolicyGradient
from rl_lightning.functional import leave_one_out_advantages
from rl_lightning.rollout.batch import RolloutBatch


class RLOO(PolicyGradient):
    """REINFORCE Leave-One-Out: each response's baseline is the mean reward of the *other* responses to its
    prompt. No value network. Advantages are constants in the update. Needs ``data.group_size >= 2``."""

    min_group_size = 2

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        return leave_one_out_advantages(batch.rewards, batch.group_size)
