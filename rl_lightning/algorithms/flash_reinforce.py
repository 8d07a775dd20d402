"""FlashREINFORCE (Hu et al. 2026, "FlashREINFORCE: Critic-free single-rollout asynchronous RL for agentic
language models"; reference code ``yifanzhang-pro/FlashREINFORCE``; docs/algorithms.md): no critic, no groups.

``L = 1/B Σ_i m_i 1/T_i Σ_t ℓ_{i,t}`` with ``ℓ_{i,t} = -sg(w_{i,t}) A_i log π_θ(a_{i,t} | s_{i,t})``:

* ``A_i = R_i - 1/B Σ_j R_j``, the mean over the whole rollout batch (every rank's rows);
* ``w = exp(clamp(log π_θ - log μ, -30, 30))``, the importance ratio of the learner to the sampler μ that drew
  the tokens, detached and unclipped (the guard on the log-ratio is the reference code's);
* ``m_i = 1[1/T_i Σ_t d_{i,t} <= δ]`` with ``d`` the per-token Bernoulli KL between μ and π_θ
  (``functional.bernoulli_kl``, ``functional.trajectory_gate``), measured on the learner's log-probs at
  update time. ``B`` and ``T_i`` are the original counts: a filtered trajectory still counts in ``B``.

One update per fresh batch: ``num_iterations`` and ``num_minibatches`` must be 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.metrics import Summed, TokenMean
from rl_lightning.algorithms.pg import PolicyGradient
from rl_lightning.functional import (
    AggregationMode,
    batch_centered_advantages,
    bernoulli_kl,
    masked_mean,
    policy_gradient_loss,
    trajectory_gate,
)
from rl_lightning.rollout.batch import RolloutBatch

#: bound on ``log π_θ - log μ`` before the importance ratio is exponentiated
LOG_RATIO_BOUND = 30.0


class FlashREINFORCE(PolicyGradient):
    """Batch-centred REINFORCE with a detached importance ratio and a per-trajectory trust gate.

    The intended setting is one response per prompt (``data.group_size: 1``) over many independent prompts;
    a larger ``group_size`` is accepted and the baseline stays the mean over the whole batch (not per group).
    The gate only filters anything when the sampler differs from the learner (a lagged sampler,
    ``data.sampling.sync_interval > 1``, or numerical mismatch of an inference engine): on-policy ``d = 0``.

    Logged besides the base metrics: ``train/trajectory_keep_fraction`` (rows kept out of every row of the
    step, on every rank), ``train/bernoulli_kl`` (token mean of ``d``), ``train/ratio_mean`` and
    ``train/advantage_mean`` (token means over every generated token, kept or not) and ``train/logprob_mean``.
    Rows with zero advantage are not forwarded (``skip_inert_rows``): the token means are over the others, and
    such a row counts as kept.

    Args:
        delta: the gate's threshold δ on the token-mean Bernoulli KL (``inf`` switches the gate off).
        loss_aggregation: must be ``seq_mean_token_mean``, FlashREINFORCE's equal trajectory weight.
        **kwargs: ``RLModule`` arguments (model, optimizer, ``micro_batch_size``, ...).
    """


    def __init__(self, delta: float = 5e-3, loss_aggregation: AggregationMode = "seq_mean_token_mean",
                 **kwargs: Any) -> None:
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        check_settings(self, [
            ("delta", delta, delta > 0, "must be > 0"),
            ("loss_aggregation", loss_aggregation, loss_aggregation == "seq_mean_token_mean",
             "must be seq_mean_token_mean (FlashREINFORCE's equal trajectory weight, 1/B Σ_i 1/T_i Σ_t)"),
            ("num_minibatches", self.num_minibatches, self.num_minibatches == 1,
             "must be 1 (one update per fresh batch)"),
            ("tis_cap", self.tis_cap, self.tis_cap is None,
             "must be null (its own importance ratio is unclipped, with the trajectory gate as the trust region)")])
        self.delta = float(delta)

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        rewards = batch.rewards.float()
        if self.ranks.world_size == 1:
            return batch_centered_advantages(rewards)
        totals = self.ranks.sum(torch.stack([rewards.sum(),
                                             torch.tensor(float(rewards.numel()), device=rewards.device)]))
        return batch_centered_advantages(rewards, totals[0] / totals[1])  # [Σ R, B] over every rank

    @override
    def inert_row_metrics(self, batch: RolloutBatch, rows: Tensor, weights: Tensor) -> dict[str, Tensor]:
        """A zero-advantage row skipped unforwarded counts as kept: its gate is not measured, and could not change
        the update (a row's aggregation weights sum to its share of the step)."""
        return {"train/trajectory_keep_fraction": (weights.sum(dim=1) * rows.to(weights.dtype)).sum()}

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        mask, advantages = batch.loss_mask, adv.advantages
        learner = out.logprobs.detach().float()
        sampler = batch.sampler_logprobs.float()
        d = bernoulli_kl(sampler, learner)
        gate = trajectory_gate(d, mask, self.delta)  # [n]
        log_ratio = ((learner - sampler) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = log_ratio.exp()
        gated = weights * gate.unsqueeze(-1)
        loss, stats = policy_gradient_loss(out.logprobs, advantages * ratio, mask, gated)
        return loss, {  # a row's weights sum to its share of the step: gate x weights summed is a row fraction
            "train/trajectory_keep_fraction": Summed((gate * weights.sum(dim=1)).sum()),
            "train/bernoulli_kl": TokenMean(masked_mean(d, mask)),
            "train/ratio_mean": TokenMean(masked_mean(ratio, mask)),
            "train/advantage_mean": TokenMean(masked_mean(advantages.expand_as(ratio), mask)),
            "train/logprob_mean": TokenMean(stats.logprob_mean),
        }
