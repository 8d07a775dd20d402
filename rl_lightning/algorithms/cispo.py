"""CISPO: REINFORCE with a clipped, detached importance weight on every token (MiniMax 2025, "MiniMax-M1: Scaling
Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585, eqs. 4-5; docs/algorithms.md, CISPO).

    J = (1 / Σ_i |o_i|) Σ_i Σ_t sg(r̂_{i,t}) A_i log π_θ(o_{i,t}),   r̂ = clip(ρ, 1 - ε_low, 1 + ε_high)

with GRPO's group-normalised ``A_i``. PPO's and GRPO's clip zero the gradient of a token whose ratio left the range
(often the rare tokens that open a line of reasoning); CISPO clips the weight and keeps every token's gradient.
The weight's floor is off by default (MiniMax-M1 sets ε_low large) and its ceiling 5 (ε_high 4: Khatri et al. 2025,
"The Art of Scaling RL Compute", arXiv 2510.13786). Aggregation: token mean over the batch (the paper's
``1 / Σ|o_i|``). Its own arguments (``is_eps_low``/``is_eps_high``), not GRPO's ``clip_eps_*``, carry the range,
since GRPO refuses a floor at or below 0.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.algorithms.metrics import TokenMean
from rl_lightning.functional import clipped_is_weight
from rl_lightning.rollout.batch import RolloutBatch


class CISPO(GRPO):
    """Clipped IS-weight Policy Optimization (see the module docstring).

    Args:
        is_eps_low: the weight's floor ``1 - is_eps_low`` (``None``: none).
        is_eps_high: the weight's ceiling ``1 + is_eps_high``.
        **kwargs: ``GRPO`` arguments (``scale_rewards``, model, optimizer, ...); ``loss_aggregation`` defaults
            to ``token_mean``. GRPO's ``clip_eps_*`` are not used.
    """

    #: ``Σ w · sg(r̂) · A · log π``: a row whose advantages are 0 adds exactly 0 with zero gradient
    zero_advantage_rows_are_inert = True

    def __init__(self, is_eps_low: float | None = None, is_eps_high: float = 4.0, **kwargs: Any) -> None:
        kwargs.setdefault("loss_aggregation", "token_mean")
        super().__init__(**kwargs)
        check_settings(self, [("is_eps_low", is_eps_low, is_eps_low is None or 0 <= is_eps_low <= 1,
                               "must be in [0, 1] or null"),
                              ("is_eps_high", is_eps_high, is_eps_high >= 0, "must be >= 0"),
                              ("tis_cap", self.tis_cap, self.tis_cap is None, "must be null (CISPO's weight is it)")])
        self.is_eps_low, self.is_eps_high = is_eps_low, is_eps_high

    @override
    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``sg(r̂) · A · log π`` per token: its gradient is ``r̂ A ∇ log π`` whatever the ratio."""
        weight = clipped_is_weight(ratio, self.is_eps_low, self.is_eps_high)
        mask = batch.loss_mask
        clipped = (weight != ratio.detach()).float() * mask
        count = mask.sum().clamp(min=1.0)
        return weight * adv.advantages * out.logprobs, {
            "train/is_weight_clip_fraction": TokenMean(clipped.sum() / count),
            "train/ratio_mean": TokenMean((ratio.detach() * mask).sum() / count)}
