"""PPO with a critic (Schulman et al. 2017, arXiv 1707.06347): GAE advantages, the clipped surrogate, a (clipped)
value loss.

``L = -Σ w · min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â) + c_v · Σ w · ½ max((V-R)², (V_clip-R)²) - c_H · Σ w · H``

with per-token ``Â`` from ``gae`` over the critic's values at rollout time (outcome reward on the last
generated token, ``V = 0`` after it), ``R = Â + V_old``, ``num_iterations`` epochs × ``num_minibatches``.
The critic and its schedule are a ``CriticLearner`` the method holds; the per-token surrogate is the narrow hook
``policy_objective`` (a method that changes only the surrogate -- a divergence clip, a token mask -- overrides
that alone); the value loss and the entropy bonus are its ``extra_losses``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput, RLModule
from rl_lightning.algorithms.critic import CriticLearner
from rl_lightning.algorithms.metrics import Summed, clip_metrics
from rl_lightning.functional import AggregationMode, aggregate, clip_statistics, clipped_surrogate
from rl_lightning.models.adapters import actor_parameters
from rl_lightning.models.value import CriticMode
from rl_lightning.rollout.batch import RolloutBatch


class PPO(RLModule):
    """Proximal Policy Optimization with a value model.

    Args:
        critic: ``shared`` -- a value head on the policy backbone; ``separate`` -- its own network,
            initialised from ``critic_model_name_or_path`` (default: the policy's checkpoint); ``adapter`` -- LoRA
            adapters of its own on the LoRA policy's frozen base, and a head (needs ``lora``; no second model).
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
        value_bounds, critic_updates, critic_minibatches, critic_max_grad_norm, critic_reference: the critic's
            (``CriticLearner``: a bounded head, critic-only passes before the actor update, their minibatches
            and clip, a reference text only the critic reads).
        **kwargs: ``RLModule`` arguments; ``num_iterations`` is the number of PPO epochs.

    Truncated responses are treated as terminal (``V = 0`` after the last token); their reward is the
    verifier's score of the truncated text.
    """

    def __init__(
        self, critic: CriticMode = "shared", critic_model_name_or_path: str | None = None,
        critic_lr: float | None = None, gamma: float = 1.0, lam: float = 0.95, clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2, value_clip: float | None = 0.2, vf_coef: float = 0.5, entropy_coef: float = 0.0,
        whiten_advantages: bool = True, loss_aggregation: AggregationMode = "token_mean",
        value_bounds: tuple[float, float] | None = None, critic_updates: int = 0, critic_minibatches: int = 1,
        critic_max_grad_norm: float | None = None, critic_reference: str | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(loss_aggregation=loss_aggregation, **kwargs)
        self.critic_learner = CriticLearner(self, critic, critic_model_name_or_path, critic_lr, value_bounds,
                                            value_clip, critic_updates, critic_minibatches, critic_max_grad_norm,
                                            critic_reference)
        self.needs_hidden = self.critic_learner.reads_policy_hidden
        check_settings(self, [("gamma", gamma, 0.0 <= gamma <= 1.0, "must be in [0, 1]"),
                              ("lam", lam, 0.0 <= lam <= 1.0, "must be in [0, 1]"),
                              ("clip_eps_low", clip_eps_low, 0 <= clip_eps_low < 1, "must be in [0, 1)"),
                              ("clip_eps_high", clip_eps_high, clip_eps_high >= 0, "must be >= 0"),
                              ("vf_coef", vf_coef, vf_coef >= 0, "must be >= 0"),
                              ("entropy_coef", entropy_coef, entropy_coef >= 0, "must be >= 0")])
        self.gamma, self.lam = gamma, lam
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.vf_coef, self.entropy_coef = vf_coef, entropy_coef
        self.whiten_advantages = whiten_advantages
        self.needs_entropy = entropy_coef > 0

    @override
    def parameter_groups(self) -> list[dict[str, Any]]:
        groups = super().parameter_groups()
        groups[0].setdefault("name", "policy")  # names give the logged rates theirs: train/lr, train/lr_critic
        return [*groups, self.critic_learner.parameter_group()]

    @override
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*actor_parameters(self.policy), *self.critic_learner.parameters()]

    # ------------------------------------------------------------------ hooks
    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        return self.critic_learner.gae(batch, self.gamma, self.lam, self.whiten_advantages)

    @override
    def before_update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        """``train/explained_variance``, then the critic's own passes on the returns fixed at rollout time."""
        stats = self.critic_learner.metrics(batch, adv)
        if self.critic_learner.updates:
            stats.update(self.critic_learner.fit(batch, adv, weights, self.optimizers()))
        return stats

    @override
    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)`` with ``ρ = π_θ / π_old`` (the sampler's recorded log-probs)."""
        old = batch.sampler_logprobs.detach()
        stats = clip_statistics(ratio, adv.advantages, batch.loss_mask, self.clip_eps_low, self.clip_eps_high,
                                out.logprobs, old)
        return clipped_surrogate(ratio, adv.advantages, self.clip_eps_low, self.clip_eps_high), clip_metrics(stats)

    @override
    def extra_losses(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                     weights: Tensor) -> list[tuple[Tensor, Metrics]]:
        """``c_v`` x the value loss (in the joint update, ``critic_updates: 0``) and ``-c_H`` x the entropy bonus."""
        terms = []
        if self.critic_learner.updates == 0:  # the joint update: the value loss rides on the policy's backward
            v_loss, v_metrics = self.critic_learner.loss(batch, self.critic_learner.values(batch, out), adv, weights)
            terms.append((self.vf_coef * v_loss, v_metrics))
        if self.entropy_coef > 0:
            entropy = aggregate(out.entropy, weights)
            terms.append((-(self.entropy_coef * entropy), {"train/entropy_bonus": Summed(entropy.detach())}))
        return terms
