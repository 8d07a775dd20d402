"""GSPO: GRPO with one importance ratio per response, clipped per response (Zheng et al. 2025, "Group Sequence Policy
Optimization", arXiv 2507.18071, eqs. 5-7; docs/algorithms.md, GSPO).

    J = (1/G) Σ_i min(s_i A_i, clip(s_i, 1 - ε_low, 1 + ε_high) A_i),   s_i = exp((1/|y_i|) Σ_t log(π_θ / π_old))

with GRPO's group-normalised ``A_i``. The ratio is the geometric mean of the response's token ratios
(``functional.sequence_log_ratio``), so one off-policy token cannot swing a response's weight, and a response is
kept or clipped whole. The paper's ranges are tiny because ``s_i`` is a per-token geometric mean: ε_low 3e-4,
ε_high 4e-4. Each response counts once (``loss_aggregation: seq_mean_token_mean``, the only one accepted): the
response's objective is spread over its tokens (``policy_objective`` returns it on every token of the row), so the
base's per-token weights ``1 / (N |y_i|)`` add up to ``1/N`` per response. A row stays whole within a micro-batch
(the planner never splits one), which a sequence-level ratio needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.algorithms.metrics import TokenMean, clip_metrics
from rl_lightning.functional import clip_statistics, clipped_surrogate, sequence_log_ratio
from rl_lightning.rollout.batch import RolloutBatch


class GSPO(GRPO):
    """Group Sequence Policy Optimization (see the module docstring).

    Args:
        clip_eps_low, clip_eps_high: the sequence ratio's clip range ``[1 - ε_low, 1 + ε_high]`` (the paper's
            3e-4 and 4e-4).
        **kwargs: ``GRPO`` arguments (``scale_rewards``, model, optimizer, passes and minibatches, ...); ``tis_cap``
            is refused (the sequence ratio is taken against the sampler).
    """

    def __init__(self, clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4, **kwargs: Any) -> None:
        kwargs.setdefault("loss_aggregation", "seq_mean_token_mean")
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, **kwargs)
        check_settings(self, [
            ("loss_aggregation", self.loss_aggregation, self.loss_aggregation == "seq_mean_token_mean",
             "must be seq_mean_token_mean (each response counts once: GSPO's 1/G mean over responses)"),
            ("tis_cap", self.tis_cap, self.tis_cap is None, "must be null (GSPO's ratio is per response)")])

    @override
    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``min(s A, clip(s) A)`` per response, on every token of its row (``[n, T]``)."""
        mask = batch.loss_mask
        log_s = sequence_log_ratio(out.logprobs, self.ratio_reference(batch, out).detach(), mask)
        s = torch.exp(log_s)  # [n], with gradient
        advantages = adv.advantages[:, 0] if adv.advantages.dim() == 2 else adv.advantages  # one per response
        objective = clipped_surrogate(s, advantages, self.clip_eps_low, self.clip_eps_high)  # [n]
        seq_ratio = s.detach().unsqueeze(1).expand_as(mask)
        stats = clip_statistics(seq_ratio, advantages.unsqueeze(1).expand_as(mask), mask, self.clip_eps_low,
                                self.clip_eps_high, out.logprobs, self.ratio_reference(batch, out).detach())
        return objective.unsqueeze(1).expand_as(mask), {
            **clip_metrics(stats), "train/sequence_log_ratio": TokenMean((log_s.detach().unsqueeze(1) * mask).sum()
                                                                         / mask.sum().clamp(min=1.0))}
