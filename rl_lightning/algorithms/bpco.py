"""BPCO (no paper found under this name; its λ(L) is VAPO's, arXiv 2504.05118, its clip DPPO's Binary-TV, Qi et al.
2026, arXiv 2602.04879; docs/algorithms.md, BPCO): PPO whose critic is grounded in observed outcomes and whose clip
bounds an absolute probability change.

* **Grounded, bounded critic**: ``R_min <= V(s_t) <= R_max`` (the bounded head of ``CriticLearner``:
  ``V = R_min + (R_max - R_min) sigmoid(h)``), fitted to the observed final reward, ``L_V = E[(V(s_t) - R)^2]``
  (``λ_V = 1``: the target at every token is the discounted reward-to-go, ``R`` with ``γ = 1``; never a target
  built from the critic's own predictions);
* **length-adaptive actor GAE**: ``λ_π(L) = clamp(1 - 1/(α L), 0, 1)`` per response of ``L`` generated tokens
  (``functional.length_adaptive_lambda``: ``Σ_t λ^t = 1/(1-λ) = αL``), raw advantages (no division by the batch
  std);
* **divergence clipping**: the ratio ``ρ = π_θ/μ`` is clipped to ``[1 - ε/p_t, 1 + ε/p_t]``, ``p_t = μ(a_t|s_t)``
  the rollout probability of the sampled token (``functional.divergence_clip_bounds``): the boundaries are an
  absolute probability change ``|π_θ - μ| = ε``; in PPO's min form, so past the boundary in the advantage's
  direction the token's gradient is zero. Only ``policy_objective`` changes; the value loss and the entropy
  bonus are PPO's.

BPCO's optional reference answers or rubrics, which enter only the critic: ``critic: separate`` with
``critic_reference: "answer: {answer}\n"`` (``CriticLearner``: the critic reads the filled template before each
prompt; the policy never sees it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.critic import GAE_LAMBDA
from rl_lightning.algorithms.metrics import clip_metrics
from rl_lightning.algorithms.ppo import PPO
from rl_lightning.functional import clip_statistics, divergence_clip_bounds, masked_whiten
from rl_lightning.rollout.batch import RolloutBatch


class BPCO(PPO):
    """Bounded-value PPO with length-adaptive GAE and divergence clipping (see the module docstring).

    Args:
        alpha: α of ``λ_π(L) = 1 - 1/(α L)`` (the default for tiny models, 0.5: λ >= 0 from L = 2; VAPO's 0.05 suits
            thousand-token responses).
        divergence_eps: ε, the largest absolute change of a sampled token's probability the clip lets pay off.
        value_bounds: ``[R_min, R_max]`` of the bounded value head (the verifier's reward range).
        value_clip: ε_v of the value loss (default ``None``: BPCO's plain ``(V - R)^2``).
        whiten_advantages: default ``False``: BPCO keeps raw GAE advantages.
        **kwargs: ``PPO`` arguments (``clip_eps_low``/``clip_eps_high`` play no part: the divergence interval
            replaces them).

    Logs ``train/lambda_mean`` (the mean ``λ_π`` of the batch's responses) besides PPO's metrics; the clip
    fractions count the tokens past the divergence interval.
    """

    def __init__(self, alpha: float = 0.5, divergence_eps: float = 0.1,
                 value_bounds: tuple[float, float] | None = (0.0, 1.0), value_clip: float | None = None,
                 whiten_advantages: bool = False, **kwargs: Any) -> None:
        super().__init__(value_bounds=value_bounds, value_clip=value_clip, whiten_advantages=whiten_advantages,
                         **kwargs)
        check_settings(self, [("alpha", alpha, alpha > 0, "must be > 0"),
                              ("divergence_eps", divergence_eps, divergence_eps > 0, "must be > 0")])
        self.alpha, self.divergence_eps = float(alpha), float(divergence_eps)

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        adv = self.critic_learner.length_adaptive(batch, self.alpha, self.gamma)
        if self.whiten_advantages:  # opt-in; BPCO keeps raw advantages
            adv = replace(adv, advantages=masked_whiten(adv.advantages, batch.loss_mask))
        return adv

    @override
    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``min(ρA, clip(ρ, 1 - ε/p, 1 + ε/p)A)`` with ``p = μ(a_t|s_t)`` (``divergence_clip_bounds``)."""
        mask, old = batch.loss_mask, batch.sampler_logprobs.detach()
        low, high = divergence_clip_bounds(old, self.divergence_eps)  # [1 - ε/p, 1 + ε/p]
        advantages = adv.advantages.detach()
        objective = torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
        metrics = clip_metrics(clip_statistics(ratio, advantages, mask, 1.0 - low, high - 1.0, out.logprobs, old))
        if GAE_LAMBDA in adv.rows:
            metrics["train/lambda_mean"] = adv.rows[GAE_LAMBDA].float().mean()
        return objective, metrics
