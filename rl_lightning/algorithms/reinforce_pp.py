"""REINFORCE++ (Hu 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage
Normalization", arXiv 2501.03262, eqs. 8-10; docs/algorithms.md, REINFORCE++).

Per generated token, with ``KL_s = log π_old(a_s) - log π_ref(a_s)`` at the sampled tokens (π_ref the frozen
starting policy)::

    A_{i,t} = R_i - β Σ_{s >= t} KL_{i,s}                          (functional.kl_penalized_returns)
    Ã = (A - mean) / sqrt(var + eps)   over every generated token of the global batch
                                                 (functional.masked_whiten, moments summed over the ranks)

then GRPO's clipped surrogate on ``Ã`` (PPO-clip, ``clip_eps_*``). The KL sits in the reward, not in the loss.
``baseline: group_mean`` is REINFORCE++-baseline (same paper): ``R_i`` minus its prompt group's mean reward
before the KL term and the global normalisation (needs ``data.group_size >= 2``); ``none`` (default) is the
single-response REINFORCE++.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from typing_extensions import override

from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.functional import (
    group_advantages, kl_penalized_returns, masked_whiten, token_moments,
)
from rl_lightning.rollout.batch import RolloutBatch


class ReinforcePP(GRPO):
    """REINFORCE++ and REINFORCE++-baseline: token-level KL in the reward, global token normalisation, PPO-clip.

    Args:
        kl_coef: β of the per-token KL in the reward (0: no reference model is loaded and ``A = R``).
        baseline: ``none`` (REINFORCE++) or ``group_mean`` (REINFORCE++-baseline: ``R - mean`` of the group).
        norm_eps: added to the variance of the global normalisation.
        **kwargs: ``GRPO`` arguments (``clip_eps_*``, model, optimizer, ...); ``loss_aggregation`` defaults to
            ``token_mean``. GRPO's ``scale_rewards`` and ``std_eps`` are not used.

    Logged besides GRPO's metrics: ``train/reward_kl`` (token mean of ``KL_s``, before ``β``).
    """

    min_group_size = 1

    def __init__(self, kl_coef: float = 0.01, baseline: Literal["none", "group_mean"] = "none",
                 norm_eps: float = 1e-8, **kwargs: Any) -> None:
        kwargs.setdefault("loss_aggregation", "token_mean")
        super().__init__(**kwargs)
        check_settings(self, [("kl_coef", kl_coef, kl_coef >= 0, "must be >= 0"),
                              ("baseline", baseline, baseline in ("none", "group_mean"),
                               "must be 'none' or 'group_mean'"),
                              ("norm_eps", norm_eps, norm_eps > 0, "must be > 0")])
        self.kl_coef, self.baseline, self.norm_eps = kl_coef, baseline, norm_eps
        self._reference: list[nn.Module] = []  # a list: the frozen copy is not a submodule (not checkpointed)
        self._reward_kl: Tensor | None = None

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        if self.baseline == "group_mean":
            self.require_data_setting(datamodule, "group_size", "the group whose mean reward is the baseline", 2)

    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        """``log π_ref`` at the sampled tokens, from a frozen copy of the starting policy (loaded once)."""
        if not self._reference:
            self._reference.append(self.load_frozen_copy())
        with torch.no_grad():
            return self.token_logprobs(batch, model=self._reference[0])[0]

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        rewards, mask = batch.rewards.float(), batch.loss_mask
        if self.baseline == "group_mean":
            rewards = group_advantages(rewards, batch.group_size, scale=False)
        old = batch.sampler_logprobs.float()
        ref = self.reference_logprobs(batch).float() if self.kl_coef > 0 else old
        kl = (old - ref) * mask
        self._reward_kl = kl.sum() / mask.sum().clamp(min=1)
        returns = kl_penalized_returns(rewards, old, ref, mask, self.kl_coef)
        moments = self.ranks.sum(token_moments(returns, mask))  # the global batch's sums
        return masked_whiten(returns, mask, self.norm_eps, moments=moments)

    @override
    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, Tensor]:
        metrics = super().rollout_metrics(batch)
        if self._reward_kl is not None:
            metrics["train/reward_kl"] = self._reward_kl.detach()
        return metrics
