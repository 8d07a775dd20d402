"""PPO with a critic (spec 003, §5): GAE advantages, the clipped surrogate, a (clipped) value loss.

``L = -Σ w · min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â) + c_v · Σ w · ½ max((V-R)², (V_clip-R)²) - c_H · Σ w · H``

with per-token ``Â`` from ``gae`` over the critic's values at rollout time (outcome reward on the last
generated token, ``V = 0`` after it), ``R = Â + V_old``, ``num_iterations`` epochs × ``num_minibatches``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from rl_lightning.algorithms.base import PolicyOutput, RLModule
from rl_lightning.functional import (
    AggregationMode,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    outcome_gae,
)
from rl_lightning.models.value import CriticMode, build_critic
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.generation import position_ids_from_mask


class PPO(RLModule):
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
        vf_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus (0 disables it).
        whiten_advantages: normalise advantages to mean 0, std 1 over the batch's generated tokens.
        loss_aggregation: token aggregation of all three terms (default ``token_mean``).
        **kwargs: ``RLModule`` arguments; ``num_iterations`` is the number of PPO epochs.

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
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        checks = {"gamma": 0.0 <= gamma <= 1.0, "lam": 0.0 <= lam <= 1.0, "clip_eps_low": 0 <= clip_eps_low < 1,
                  "clip_eps_high": clip_eps_high >= 0, "vf_coef": vf_coef >= 0, "entropy_coef": entropy_coef >= 0,
                  "value_clip": value_clip is None or value_clip > 0, "critic_lr": critic_lr is None or critic_lr > 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"PPO: invalid {name}={locals()[name]!r}")
        self.gamma, self.lam = gamma, lam
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.value_clip, self.vf_coef, self.entropy_coef = value_clip, vf_coef, entropy_coef
        self.whiten_advantages = whiten_advantages
        self.critic_lr = critic_lr
        self.critic = build_critic(critic, self.policy, critic_model_name_or_path or self.hparams.model_name_or_path,
                                   self.hparams.dtype)
        self.needs_hidden = critic == "shared"
        self.needs_entropy = entropy_coef > 0

    # ------------------------------------------------------------------ critic plumbing
    @override
    def parameter_groups(self) -> list[dict[str, Any]]:
        groups = super().parameter_groups()
        groups[0].setdefault("name", "policy")  # names give the logged rates theirs: train/lr, train/lr_critic
        critic_group: dict[str, Any] = {"params": list(self.critic.parameters()), "name": "critic"}
        if self.critic_lr is not None:
            critic_group["lr"] = self.critic_lr
        return [*groups, critic_group]

    @override
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*self.policy.parameters(), *self.critic.parameters()]

    def critic_values(self, batch: RolloutBatch, out: PolicyOutput | None) -> Tensor:
        """``[n, T]`` values of ``batch``'s rows (masked), from ``out.hidden`` or the separate critic."""
        values = self.critic.values(
            batch.input_ids, batch.attention_mask, position_ids_from_mask(batch.attention_mask),
            batch.prompt_length, hidden=None if out is None else out.hidden,
        )
        return values.float() * batch.loss_mask

    # ------------------------------------------------------------------ hooks
    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        with torch.no_grad():
            out = self.forward_policy(batch, with_hidden=True) if self.needs_hidden else None
            values = self.critic_values(batch, out)  # V_old, [N, T]
        advantages, returns = outcome_gae(batch.rewards.float(), values, batch.loss_mask, self.gamma, self.lam,
                                          whiten=self.whiten_advantages)
        batch.values, batch.returns = values, returns  # carried into every minibatch by select()
        return advantages

    @override
    def update(self, batch: RolloutBatch, advantages: Tensor, weights: Tensor) -> dict[str, list[Tensor]]:
        stats = super().update(batch, advantages, weights)
        # of the values the advantages came from (V_old) against the returns, over the whole batch's tokens
        stats["train/explained_variance"] = [explained_variance(batch.values, batch.returns, batch.loss_mask)]
        return stats

    @override
    def policy_loss(
        self, batch: RolloutBatch, out: PolicyOutput, advantages: Tensor, weights: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        pg_loss, pg = clipped_policy_loss(out.logprobs, batch.sampler_logprobs, advantages, batch.loss_mask,
                                          weights, self.clip_eps_low, self.clip_eps_high)
        values = self.critic_values(batch, out)
        v_loss, vs = clipped_value_loss(values, batch.values, batch.returns, batch.loss_mask, weights,
                                        self.value_clip)
        loss = pg_loss + self.vf_coef * v_loss
        metrics = {
            "train/policy_loss": pg_loss.detach(), "train/value_loss": v_loss.detach(),
            "train/clip_fraction": pg.clip_fraction, "train/clip_fraction_low": pg.clip_fraction_low,
            "train/clip_fraction_high": pg.clip_fraction_high, "train/approx_kl": pg.approx_kl,
            "train/ratio_mean": pg.ratio_mean, "train/value_clip_fraction": vs.value_clip_fraction,
        }
        if self.entropy_coef > 0:
            entropy = aggregate(out.entropy, weights)
            loss = loss - self.entropy_coef * entropy
            metrics["train/entropy_bonus"] = entropy.detach()
        return loss, metrics
