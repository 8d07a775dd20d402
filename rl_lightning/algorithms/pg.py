"""Policy Gradient (spec 003, §1): ``L = -R_i Σ_t log π_θ(a_{i,t} | s_{i,t})``, averaged over responses.

The base of the REINFORCE family: ``REINFORCE`` (a baseline) and ``RLOO`` (a leave-one-out baseline)
override only ``compute_advantages``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.base import PolicyOutput, RLModule
from rl_lightning.functional import AggregationMode, masked_mean, policy_gradient_loss, truncated_importance_weights
from rl_lightning.rollout.batch import RolloutBatch


class PolicyGradient(RLModule):
    """Vanilla policy gradient: every token of response ``i`` is weighted by its reward ``R_i``.

    The spec writes the per-response loss as a *sum* over tokens, so the default aggregation is
    ``seq_mean_token_sum`` (mean over responses of the token sum); the update scales with response length.
    It is an on-policy estimator: one pass per rollout batch (``num_iterations`` must be 1).

    Args:
        loss_aggregation: how per-token terms combine (spec: ``seq_mean_token_sum``).
        tis_cap: truncated importance sampling against a sampler that is not the learner (a lagged or bf16
            sampler): each token's advantage is multiplied by the detached ``min(π_θ / μ, C)`` with ``C =
            tis_cap`` (``functional.truncated_importance_weights``); ``None`` (default) leaves the loss as the spec
            writes it. Logged: ``train/tis_weight_mean``, ``train/tis_clip_fraction`` (tokens with ``π/μ > C``).
        **kwargs: ``RLModule`` arguments (model, optimizer, minibatches, ...).
    """

    #: ``-Σ w · A · log π``: a zero-advantage row adds exactly 0 with zero gradient (``RLModule.inert_rows``)
    zero_advantage_rows_are_inert = True
    token_mean_metrics = RLModule.token_mean_metrics | {"train/tis_weight_mean", "train/tis_clip_fraction"}

    def __init__(self, loss_aggregation: AggregationMode = "seq_mean_token_sum", tis_cap: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        if tis_cap is not None and not tis_cap > 0:
            raise ValueError(f"{type(self).__name__}: tis_cap must be > 0 or null, got {tis_cap}")
        self.tis_cap = tis_cap
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
        advantages, tis = tis_weighted(advantages, out.logprobs, batch, self.tis_cap)
        loss, stats = policy_gradient_loss(out.logprobs, advantages, batch.loss_mask, weights)
        return loss, {**tis, "train/logprob_mean": stats.logprob_mean, "train/advantage_mean": stats.advantage_mean}


def tis_weighted(advantages: Tensor, logprobs: Tensor, batch: RolloutBatch,
                 cap: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """``(advantages x min(π/μ, C), metrics)`` for truncated importance sampling, ``(advantages, {})`` without a
    cap. ``logprobs`` are the learner's (π; detached here), ``batch.sampler_logprobs`` μ's; shared by every
    method with a ``tis_cap`` (PolicyGradient's family, GRPO against its proximal policy)."""
    if cap is None:
        return advantages, {}
    mask = batch.loss_mask
    weight = truncated_importance_weights(logprobs, batch.sampler_logprobs, cap)
    raw = (logprobs.detach().float() - batch.sampler_logprobs.float()).exp()
    return advantages * weight, {"train/tis_weight_mean": masked_mean(weight, mask),
                                 "train/tis_clip_fraction": masked_mean((raw > cap).float(), mask)}
