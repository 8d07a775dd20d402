"""A sequence-level objective from outside the package: GSPO's (Zheng et al. 2025, arXiv 2507.18071, eq. 7)."""

from __future__ import annotations

import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.functional import clipped_surrogate, sequence_log_ratio


class SequenceClipGRPO(GRPO):
    """GRPO whose ratio is one per response, ``s_i = exp(mean_t log(π_θ / π_old))``, clipped per response."""

    def __init__(self, clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4, **kwargs) -> None:  # noqa: ANN003
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, **kwargs)

    def policy_objective(self, batch, out, ratio, adv):  # noqa: ANN001, ANN201
        old = self.ratio_reference(batch, out).detach()
        s = torch.exp(sequence_log_ratio(out.logprobs, old, batch.loss_mask))  # [n]: a row is whole here
        per_row = clipped_surrogate(s, adv.advantages[:, 0], self.clip_eps_low, self.clip_eps_high)
        return per_row.unsqueeze(1).expand_as(ratio), {}  # [n, T]: each token of a row carries the row's value
