"""Policy Gradient (REINFORCE, Williams 1992): ``L = -R_i Σ_t log π_θ(a_{i,t} | s_{i,t})``, averaged over responses,
and REINFORCE's baselines (``L = -(R_i - b) log π_θ(o_i)``).

The base of the score-function family: ``REINFORCE`` (an EMA baseline by default), ``RLOO`` (a leave-one-out
baseline), ``FlashREINFORCE``, ``ScoreCentering`` and ``StableReinforce`` (other losses on the same advantages).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput, RLModule
from rl_lightning.algorithms.metrics import TokenMean
from rl_lightning.functional import (
    AggregationMode, baseline_advantages, ema_update, masked_mean, policy_gradient_loss, truncated_importance_weights,
)
from rl_lightning.rollout.batch import RolloutBatch

Baseline = Literal["batch_mean", "ema", "none"]


class PolicyGradient(RLModule):
    """Vanilla policy gradient: every token of response ``i`` is weighted by its reward ``R_i``.

    The per-response loss is a *sum* over tokens (the response's log-prob), so the default aggregation is
    ``seq_mean_token_sum`` (mean over responses of the token sum); the update scales with response length.
    It is an on-policy estimator: one pass per rollout batch (``num_iterations`` must be 1).

    Args:
        loss_aggregation: how per-token terms combine (default ``seq_mean_token_sum``).
        tis_cap: truncated importance sampling against a sampler that is not the learner (a lagged or bf16
            sampler): each token's advantage is multiplied by the detached ``min(π_θ / μ, C)`` with ``C =
            tis_cap`` (``functional.truncated_importance_weights``); ``None`` (default) leaves the loss
            unweighted. Logged: ``train/tis_weight_mean``, ``train/tis_clip_fraction`` (tokens with ``π/μ > C``).
        baseline: ``none`` (default: plain ``A_i = R_i``); ``batch_mean`` -- the mean reward of the current
            rollout batch over all ranks (it includes the response's own reward, a small bias that RLOO removes);
            ``ema`` -- an exponential moving average of the mean rewards of *earlier* batches (independent of the
            current samples; the first batch, with no history, uses its own mean). The EMA is a buffer, so it is
            saved in checkpoints and restored on resume.
        ema_decay: decay of the ``ema`` baseline (0.9 keeps about the last 10 batches).
        **kwargs: ``RLModule`` arguments (model, optimizer, minibatches, ...).
    """

    #: ``-Σ w · A · log π``: a zero-advantage row adds exactly 0 with zero gradient (``RLModule.inert_rows``)
    zero_advantage_rows_are_inert = True

    def __init__(self, loss_aggregation: AggregationMode = "seq_mean_token_sum", tis_cap: float | None = None,
                 baseline: Baseline = "none", ema_decay: float = 0.9, **kwargs: Any) -> None:
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        check_settings(self, [
            ("tis_cap", tis_cap, tis_cap is None or tis_cap > 0, "must be > 0 or null"),
            ("ema_decay", ema_decay, 0.0 <= ema_decay < 1.0, "must be in [0, 1)"),
            ("num_iterations", self.num_iterations, self.num_iterations == 1,
             "must be 1 (an on-policy estimator; use PPO or GRPO for several passes over a batch)")])
        self.tis_cap, self.baseline, self.ema_decay = tis_cap, baseline, ema_decay
        self.register_buffer("reward_ema", torch.zeros(()))
        self.register_buffer("reward_ema_initialised", torch.zeros((), dtype=torch.bool))

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        """``A_i = R_i - b`` with the configured baseline ``b`` (``none``: ``A_i = R_i``)."""
        if self.baseline == "none":
            return batch.rewards
        mean = self.ranks.mean(batch.rewards.float().mean())
        if self.baseline == "batch_mean":
            return baseline_advantages(batch.rewards, mean)
        if not bool(self.reward_ema_initialised):
            self.reward_ema.fill_(mean)
            self.reward_ema_initialised.fill_(True)
        advantages = baseline_advantages(batch.rewards, self.reward_ema.clone())  # b from earlier batches
        self.reward_ema.copy_(ema_update(self.reward_ema, mean, self.ema_decay))  # then fold this batch in
        return advantages

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        advantages, tis = tis_weighted(adv.advantages, out.logprobs, batch, self.tis_cap)
        loss, stats = policy_gradient_loss(out.logprobs, advantages, batch.loss_mask, weights)
        return loss, {**tis, **score_metrics(stats)}


def score_metrics(stats: Any) -> Metrics:
    """The token means of a score-function loss's stats (``logprob_mean``, ``advantage_mean``)."""
    return {"train/logprob_mean": TokenMean(stats.logprob_mean),
            "train/advantage_mean": TokenMean(stats.advantage_mean)}


def tis_weighted(advantages: Tensor, logprobs: Tensor, batch: RolloutBatch,
                 cap: float | None) -> tuple[Tensor, Metrics]:
    """``(advantages x min(π/μ, C), metrics)`` for truncated importance sampling, ``(advantages, {})`` without a
    cap. ``logprobs`` are the learner's (π; detached here), ``batch.sampler_logprobs`` μ's; shared by every
    method with a ``tis_cap`` (PolicyGradient's family, GRPO against its proximal policy)."""
    if cap is None:
        return advantages, {}
    mask = batch.loss_mask
    weight = truncated_importance_weights(logprobs, batch.sampler_logprobs, cap)
    raw = (logprobs.detach().float() - batch.sampler_logprobs.float()).exp()
    return advantages * weight, {"train/tis_weight_mean": TokenMean(masked_mean(weight, mask)),
                                 "train/tis_clip_fraction": TokenMean(masked_mean((raw > cap).float(), mask))}
