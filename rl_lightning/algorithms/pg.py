"""Policy Gradient (spec 003, §1): ``L = -R_i Σ_t log π_θ(a_{i,t} | s_{i,t})``, averaged over responses.

The base of the REINFORCE family: ``REINFORCE`` (a baseline) and ``RLOO`` (a leave-one-out baseline)
override only ``compute_advantages``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.base import PolicyOutput, RLModule
from rl_lightning.functional import AggregationMode, policy_gradient_loss
from rl_lightning.rollout.batch import RolloutBatch


class PolicyGradient(RLModule):
    """Vanilla policy gradient: every token of response ``i`` is weighted by its reward ``R_i``.

    The spec writes the per-response loss as a *sum* over tokens, so the default aggregation is
    ``seq_mean_token_sum`` (mean over responses of the token sum); the update scales with response length.
    It is an on-policy estimator: one pass per rollout batch (``num_iterations`` must be 1).

    Args:
        loss_aggregation: how per-token terms combine (spec: ``seq_mean_token_sum``).
        **kwargs: ``RLModule`` arguments (model, optimizer, minibatches, ...).
    """

    #: ``-Σ w · A · log π``: a zero-advantage row adds exactly 0 with zero gradient (``RLModule.inert_rows``)
    zero_advantage_rows_are_inert = True

    def __init__(self, loss_aggregation: AggregationMode = "seq_mean_token_sum", **kwargs: Any) -> None:
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        if self.num_iterations != 1:
            raise ValueError(
                f"{type(self).__name__} is an on-policy estimator: num_iterations must be 1, got "
                f"{self.num_iterations} (use PPO or GRPO for several passes over a batch)"
            )

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        return batch.rewards  # A_i = R_i

    @override
    def policy_loss(
        self, batch: RolloutBatch, out: PolicyOutput, advantages: Tensor, weights: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss, stats = policy_gradient_loss(out.logprobs, advantages, batch.loss_mask, weights)
        return loss, {"train/logprob_mean": stats.logprob_mean, "train/advantage_mean": stats.advantage_mean}
