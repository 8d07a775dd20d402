"""PPO with a critic (spec 003, §5): GAE advantages, the clipped surrogate, a (clipped) value loss.

``L = -Σ w · min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â) + c_v · Σ w · ½ max((V-R)², (V_clip-R)²) - c_H · Σ w · H``

with per-token ``Â`` from ``gae`` over the critic's values at rollout time (outcome reward on the last
generated token, ``V = 0`` after it), ``R = Â + V_old``, ``num_iterations`` epochs × ``num_minibatches``.
The critic and its schedule are ``ActorCritic``'s; the per-token policy objective is the narrow hook
``policy_objective`` (a method that changes only the surrogate -- a divergence clip, a token mask --
overrides that alone).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.base import PolicyOutput, clip_metrics
from rl_lightning.algorithms.critic import ActorCritic
from rl_lightning.functional import AggregationMode, aggregate, clip_statistics, clipped_surrogate
from rl_lightning.models.value import CriticMode
from rl_lightning.rollout.batch import RolloutBatch


class PPO(ActorCritic):
    """Proximal Policy Optimization with a value model.

    Args:
        critic: ``shared`` -- a value head on the policy backbone; ``separate`` -- its own network,
            initialised from ``critic_model_name_or_path`` (default: the policy's checkpoint).
        critic_model_name_or_path: checkpoint of the separate critic (``None``: ``model_name_or_path``).
        critic_lr: learning rate of the critic's parameters (``None``: the policy optimiser's).
        gamma: discount γ (LLM practice: 1.0).
        lam: GAE λ (LLM practice: 0.95).
        clip_eps_low, clip_eps_high: ratio clip range ``[1 - low, 1 + high]``.
        value_clip: ε_v of the clipped value loss (``None``: plain squared error).
        vf_coef: weight of the value loss (in the joint update, ``critic_updates: 0``).
        entropy_coef: weight of the entropy bonus (0 disables it).
        whiten_advantages: normalise advantages to mean 0, std 1 over the batch's generated tokens.
        loss_aggregation: token aggregation of all three terms (default ``token_mean``).
        **kwargs: ``ActorCritic`` arguments (``value_bounds``, ``critic_updates``, ``critic_minibatches``,
            ``critic_max_grad_norm``) and ``RLModule``'s; ``num_iterations`` is the number of PPO epochs.

    Truncated responses are treated as terminal (``V = 0`` after the last token); their reward is the
    verifier's score of the truncated text.
    """

    def __init__(
        self,
        critic: CriticMode = "shared",
        critic_model_name_or_path: str | None = None,
        critic_lr: float | None = None,
        gamma: float = 1.0,
        lam: float = 0.95,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        value_clip: float | None = 0.2,
        vf_coef: float = 0.5,
        entropy_coef: float = 0.0,
        whiten_advantages: bool = True,
        loss_aggregation: AggregationMode = "token_mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(critic=critic, critic_model_name_or_path=critic_model_name_or_path, critic_lr=critic_lr,
                         value_clip=value_clip, loss_aggregation=loss_aggregation, **kwargs)
        checks = {"gamma": 0.0 <= gamma <= 1.0, "lam": 0.0 <= lam <= 1.0, "clip_eps_low": 0 <= clip_eps_low < 1,
                  "clip_eps_high": clip_eps_high >= 0, "vf_coef": vf_coef >= 0, "entropy_coef": entropy_coef >= 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}: invalid {name}={locals()[name]!r}")
        self.gamma, self.lam = gamma, lam
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.vf_coef, self.entropy_coef = vf_coef, entropy_coef
        self.whiten_advantages = whiten_advantages
        self.needs_entropy = entropy_coef > 0

    # ------------------------------------------------------------------ hooks
    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        return self.gae_advantages(batch, self.gamma, self.lam, self.whiten_advantages)

    @override
    def update(self, batch: RolloutBatch, advantages: Tensor, weights: Tensor) -> dict[str, list[Tensor]]:
        stats = self.critic_metrics(batch)
        if self.critic_updates:  # the critic's own passes first, on the returns fixed at rollout time
            stats.update(self.fit_critic(batch, weights, self.optimizers()))
        return {**stats, **super().update(batch, advantages, weights)}

    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput,
                         advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``[n, T]`` the per-token policy objective to maximise (aggregated by ``policy_loss``) and its
        token-mean metrics. PPO: ``min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)`` with ``ρ = π_θ / π_old`` (the sampler's
        recorded log-probs)."""
        mask = batch.loss_mask
        old = batch.sampler_logprobs.detach()
        ratio = torch.exp((out.logprobs - old) * mask)  # zero log-ratio on padding: exp() stays finite
        stats = clip_statistics(ratio, advantages, mask, self.clip_eps_low, self.clip_eps_high, out.logprobs, old)
        return clipped_surrogate(ratio, advantages, self.clip_eps_low, self.clip_eps_high), clip_metrics(stats)

    @override
    def policy_loss(
        self, batch: RolloutBatch, out: PolicyOutput, advantages: Tensor, weights: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        objective, metrics = self.policy_objective(batch, out, advantages)
        pg_loss = -aggregate(objective * batch.loss_mask, weights)
        loss = pg_loss
        metrics = {"train/policy_loss": pg_loss.detach(), **metrics}
        if self.critic_updates == 0:  # the joint update: the value loss rides on the policy's backward
            v_loss, v_metrics = self.value_loss(batch, self.critic_values(batch, out), weights)
            loss = loss + self.vf_coef * v_loss
            metrics.update(v_metrics)
        if self.entropy_coef > 0:
            entropy = aggregate(out.entropy, weights)
            loss = loss - self.entropy_coef * entropy
            metrics["train/entropy_bonus"] = entropy.detach()
        return loss, metrics
