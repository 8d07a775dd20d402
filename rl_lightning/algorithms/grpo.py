"""GRPO: group-relative advantages with PPO-style clipping (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, §4.1).

``L = -1/G Σ_i 1/|o_i| Σ_t min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1-ε_low, 1+ε_high) A_i)`` with
``A_i = (R_i - μ_G) / (σ_G + eps)`` and ``ρ = π_θ / π_old``, where π_old is the sampler that drew the tokens.
A KL penalty to a reference model is added by the ``KLRegularizer`` callback, not here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput, RLModule
from rl_lightning.algorithms.metrics import clip_metrics
from rl_lightning.algorithms.pg import tis_weighted
from rl_lightning.functional import clip_statistics, clipped_surrogate, group_advantages
from rl_lightning.rollout.batch import RolloutBatch


class GRPO(RLModule):
    """Group Relative Policy Optimization (needs ``data.group_size >= 2``).

    Args:
        clip_eps_low: ε below 1 (ratio floor ``1 - clip_eps_low``).
        clip_eps_high: ε above 1 (ratio ceiling ``1 + clip_eps_high``; DAPO's clip-higher uses 0.28).
        scale_rewards: divide by the group's population std σ_G (GRPO's); ``False`` gives Dr. GRPO's ``R - μ_G``.
        std_eps: added to σ_G; a group with no reward spread gets advantage 0.
        tis_cap: truncated importance sampling for a sampler μ that is not the learner (the decoupled form the
            anchors ship): the ratio is taken against the proximal policy π_prox (the learner before this batch's
            update, ``RLModule.proximal_logprobs``), ``ρ = π_θ / π_prox``, and each token's term is multiplied by
            the detached ``min(π_prox / μ, C)``. ``None`` (default): GRPO's ratio against the sampler,
            ``ρ = π_θ / μ``. Logged: ``train/tis_weight_mean``, ``train/tis_clip_fraction``.
        **kwargs: ``RLModule`` arguments (model, optimizer, iterations, aggregation, ...).
    """

    min_group_size = 2
    #: ``-Σ w · min(ρA, clip(ρ)A)``: a zero-advantage row (a group with no reward spread) adds exactly 0 with zero
    #: gradient, so it is not forwarded (``RLModule.inert_rows``)
    zero_advantage_rows_are_inert = True

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        scale_rewards: bool = True,
        std_eps: float = 1e-6,
        tis_cap: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_settings(self, [("tis_cap", tis_cap, tis_cap is None or tis_cap > 0, "must be > 0 or null"),
                              ("clip_eps_low", clip_eps_low, 0 <= clip_eps_low < 1, "must be in [0, 1)"),
                              ("clip_eps_high", clip_eps_high, clip_eps_high >= 0, "must be >= 0")])
        self.tis_cap = tis_cap
        self.needs_proximal_logprobs = tis_cap is not None
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.scale_rewards = scale_rewards
        self.std_eps = std_eps

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        return group_advantages(batch.rewards, batch.group_size, scale=self.scale_rewards, eps=self.std_eps)

    @override
    def ratio_reference(self, batch: RolloutBatch, out: PolicyOutput) -> Tensor:
        """π_old of the ratio: the sampler's log-probs, or with ``tis_cap`` the proximal policy's."""
        return batch.sampler_logprobs if self.tis_cap is None else self.proximal_logprobs(batch, out)

    @override
    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)``, ``A`` times ``min(π_prox/μ, C)`` with ``tis_cap``."""
        advantages, tis = adv.advantages, {}
        if self.tis_cap is not None:
            advantages, tis = tis_weighted(advantages, self.proximal_logprobs(batch, out), batch, self.tis_cap)
        stats = clip_statistics(ratio, advantages, batch.loss_mask, self.clip_eps_low, self.clip_eps_high,
                                out.logprobs, self.ratio_reference(batch, out).detach())
        objective = clipped_surrogate(ratio, advantages, self.clip_eps_low, self.clip_eps_high)
        return objective, {**tis, **clip_metrics(stats)}
